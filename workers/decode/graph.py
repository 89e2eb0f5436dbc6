"""The decode step on CUDA: the step captured in one CUDA graph, the side stream its look-ahead predictors run on,
and the tensors the two streams share.

    g = StepGraph()
    g.capture(step, state)     # warm-up steps on a side stream, ``state`` restored, one step captured
    g.graph.replay()
    out = g.eager(step, *args) # a step run eagerly (the side stream made on first use)
    g.drop()                   # settings changed: the next replay captures again
"""
from __future__ import annotations

import torch


class StepGraph:
    def __init__(self):
        self.graph = None     # the captured step (None: capture before the next replay)
        self.side = None      # the look-ahead side stream (CUDA)
        self.keep = []        # tensors the running step shares across the streams

    def drop(self) -> None:
        self.graph = None

    def capture(self, step, state) -> None:
        """Warm up (Triton compiles, glue compiles) on a side stream, restore ``state`` (the tensors a step
        advances: position, input token), capture one ``step()``, restore ``state`` again."""
        self.side = torch.cuda.Stream()
        saved = [t.clone() for t in state]

        def restore():
            for t, v in zip(state, saved):
                t.copy_(v)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self.keep = []
                step()
                restore()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        self.keep = []      # tensors shared across streams stay alive as long as the graph
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            step()
        self.graph, self._graph_keep = g, self.keep
        restore()

    def eager(self, step, *args, cuda: bool):
        """``step(*args)`` run eagerly; on CUDA with the side stream (made on first use)."""
        if self.side is None and cuda:
            self.side = torch.cuda.Stream()
        self.keep = []
        out = step(*args)
        self.keep = []
        return out
