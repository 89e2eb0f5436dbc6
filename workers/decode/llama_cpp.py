"""llama.cpp's greedy decode on a GGUF file, through llama-cpp-python: what a CPU user runs instead of us.

    reason = llama_cpp_missing()                   # None when llama-cpp-python imports; else one line saying why
    runner = LlamaCppRunner(gguf, threads=2, n_ctx=128)
    ms, tokens = runner.step_times(ids, gen)        # per decode step, after a prefill of ids
    seconds, tokens, own_ms = runner.run(ids, gen)  # the whole decode (benchmarks.cpu_peer)

llama-cpp-python is not a dependency of the project (``make llama-cpp`` builds it: about 6 minutes of two cores);
everything here that needs it imports it when called. Each decode step is one ``eval`` of the previous token and
an argmax over the last logits, the step our runtime takes (llama.cpp quantizes the activations to 8 bits per
block and multiplies in integers: its tokens may differ from the fp32 model's). No Ray, no DB.
"""
from __future__ import annotations

import time

import numpy as np

INSTALL_HINT = "`make llama-cpp` builds it (llama-cpp-python, about 6 minutes)"


def llama_cpp_missing() -> str | None:
    """Why llama.cpp cannot be timed here (one line), or None when ``llama_cpp`` imports."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as e:       # not installed, or its shared library does not load
        what = "is not installed" if getattr(e, "name", None) == "llama_cpp" else f"does not import ({e})"
        return f"llama-cpp-python {what}: {INSTALL_HINT}"
    return None


class LlamaCppRunner:
    """llama.cpp's greedy batch-1 decode of one GGUF at ``threads`` threads (one context of ``n_ctx`` positions)."""

    def __init__(self, gguf, threads: int, n_ctx: int):
        import llama_cpp

        self.lib = llama_cpp
        self.threads = int(threads)
        self.llm = llama_cpp.Llama(model_path=str(gguf), n_ctx=n_ctx, n_batch=n_ctx, n_threads=self.threads,
                                   n_threads_batch=self.threads, logits_all=False, verbose=False)
        self.n_vocab = self.llm.n_vocab()

    def _logits(self) -> np.ndarray:
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,))

    def _argmax(self) -> int:
        return int(self._logits().argmax())

    def nll(self, ids: list[int], prompt: int) -> float:
        """Mean negative log-likelihood of ids[prompt:], each predicted by one decode step."""
        llm = self.llm
        llm.reset()
        llm.eval(ids[:prompt])
        tot = 0.0
        for t in range(prompt, len(ids)):
            if t > prompt:
                llm.eval([ids[t - 1]])
            x = self._logits().astype(np.float64)
            m = x.max()
            tot += float(m + np.log(np.exp(x - m).sum()) - x[ids[t]])
        return tot / (len(ids) - prompt)

    def _prefill(self, ids: list[int]) -> list[int]:
        self.llm.reset()
        self.llm.eval(list(ids))
        return [self._argmax()]

    def step_times(self, ids: list[int], gen: int) -> tuple[list[float], list[int]]:
        """Prefill ``ids``, then ``gen`` greedy decode steps: (ms of each step, the tokens: the prefill's argmax
        first)."""
        toks, ms = self._prefill(ids), []
        for _ in range(gen):
            t0 = time.perf_counter()
            self.llm.eval([toks[-1]])
            toks.append(self._argmax())
            ms.append((time.perf_counter() - t0) * 1e3)
        return ms, toks

    def run(self, ids: list[int], gen: int) -> tuple[float, list[int], float | None]:
        """(seconds for ``gen`` decode steps, the greedy tokens (the prompt's argmax first), llama.cpp's own eval
        ms per token (``llama_perf``) or None)."""
        toks = self._prefill(ids)
        perf = getattr(self.lib, "llama_perf_context_reset", None)
        if perf is not None:
            perf(self.llm.ctx)
        t0 = time.perf_counter()
        for _ in range(gen):
            self.llm.eval([toks[-1]])
            toks.append(self._argmax())
        dt = time.perf_counter() - t0
        own = None
        if perf is not None:
            p = self.lib.llama_perf_context(self.llm.ctx)
            own = p.t_eval_ms / p.n_eval if p.n_eval else None
        return dt, toks, own

    def decode_evals(self) -> int | None:
        """One-token evals (decode steps) llama.cpp itself has counted on this context (``llama_perf``), or None
        where the binding lacks the counter."""
        perf = getattr(self.lib, "llama_perf_context", None)
        return None if perf is None else int(perf(self.llm.ctx).n_eval)

    def close(self) -> None:
        """Free the model (before interpreter shutdown: llama-cpp-python's ``__del__`` fails there)."""
        self.llm.close()
