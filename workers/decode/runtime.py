"""A compact decode runtime (gpt-fast style) that runs dense or with a :class:`SparsityPlan` applied.

    rt = DecodeRuntime.from_hf(model)                      # copies the weights (workers.decode.weights)
    rt = DecodeRuntime.from_config(config, dtype, device)  # random weights of the real shapes
    rt.set_plan(plan, overlap=True)                        # None: dense (a plan part may fold into the weights)
    rt.setup(batch=1, max_len=160)                         # static KV cache
    logits = rt.prefill(prompt_ids)                        # dense, eager; writes the cache
    tokens = rt.decode(n)                                  # greedy; one-token step, CUDA graph on CUDA
    tokens = rt.generate(prompt_ids, n)                    # setup (when needed) + prefill + decode

The parts, each in its own module of workers/decode: ``weights`` (HF model -> frozen per-layer weight structs),
``kv_cache`` (static cache + position counter), ``plan`` (a SparsityPlan compiled for these weights; keep-all
parts dropped, so a plan at s = 0 runs the dense step; a plan part's runtime form, workers.methods.<method>.runtime,
may run over its own copy of the weights, LaRoSA's with its rotations folded in), ``select`` (active sets:
predictor GEMVs, top-k or threshold rule, side-stream look-ahead), ``layer`` (the decoder layer, one function for
the prefill and the step), ``blocks`` (dense / sparse projections, FFN variants, head-sparse attention),
``glue`` (norms, RoPE + attention; compiled on CUDA), ``graph`` (the step's CUDA graph), ``stats`` (realized
sparsity), ``timing`` (interleaved timing and the benchmark policy: ``pick_cpu_dense``, ``densify_slow_ffn``).

Every setting a benchmark varies is a keyword of the constructor (and of ``from_hf`` / ``from_config``), and
:meth:`configure` changes it later: ``ffn_dense`` ("auto" | "torch"), ``compile`` (torch.compile of the glue on
CUDA), ``use_graph`` (one CUDA graph per step), ``select_impl`` ("auto" | "torch" | "triton"), ``cpu_rows``
(CPU dense products through the row kernels; None: matmuls until ``timing.pick_cpu_dense`` times both),
``input_path`` ("auto" | "mask" | "local": the input-sparse kernel, kernels.ops.INPUT_PATHS), ``glue``
("torch": the torch norms and decode attention, compiled on CUDA; "kernel": RoPE, the cache write and the
attention of every (active) head in one kernels.ops call (one Triton launch on CUDA, one native call on the
CPU), and on the CPU the norms natively too; "auto": "kernel" on the CPU and CUDA, "torch" elsewhere),
``o_proj`` ("auto" | "torch" | "kernel": the dense O projection, workers.decode.blocks), ``fuse`` (a layer
input-sparse on every projection runs with its norms, act(gate)·up and residual adds fused into the kernels:
CUDA, batch 1, workers.decode.layer).
``set_plan`` takes ``overlap`` (side-stream look-ahead on CUDA) and ``kv_mode`` ("exact": K/V of every head,
the semantics of workers.sparsity.sparse_exec; "active": only the KV heads the active query heads need, skipped
entries masked out of later attention -- Deja Vu's saving without its "recompute later", an approximation).
Public handles: ``weights``, ``blocks``, ``selector``, ``sparse_plan``, ``cache``, ``counters``.

Decode step (one token per sequence): embedding -> per layer [norm, QKV, RoPE + cache write + attention over
the static cache (masked to the filled positions and the sliding window), O, add+norm, FFN, add+norm] -> argmax
(workers.decode.layer). The step reads the cache's device position counter and writes the next token into its
own input buffer, so repeated replays need no host sync. On CUDA the whole step is captured in one CUDA graph.
"""
from __future__ import annotations

import torch

from workers.decode import weights as weights_mod
from workers.decode.blocks import Blocks
from workers.decode.glue import EAGER, check_glue, glue_fns, resolve_glue
from workers.decode.graph import StepGraph
from workers.decode.kv_cache import KVCache
from workers.decode.layer import Prompt, Step, forward
from workers.decode.plan import RuntimePlan
from workers.decode.select import ActiveSetSelector, Lookahead
from workers.decode.stats import Counters, realized_sparsity
from workers.decode.weights import ModelWeights

KV_MODES = ("exact", "active")


def runs_on_blocks(plan) -> bool:
    """Whether a runtime over GGUF blocks (``from_gguf``) takes ``plan``: dense, input sparsity, FFN and head
    predictors (Deja Vu, SVD, gate thresholds: the active rows of the blocks), and the parts that run there
    (R-Sparse's low-rank terms); not LaRoSA's, whose rotations fold into float weights."""
    return plan is None or all(p.blocks_refused is None for p in plan.parts)


class DecodeRuntime:
    def __init__(self, weights: ModelWeights, *, ffn_dense: str = "auto", compile: bool = True,
                 use_graph: bool = True, select_impl: str = "auto", cpu_rows: bool | None = None,
                 count_inputs: bool = True, input_path: str = "auto", glue: str = "auto", o_proj: str = "auto",
                 fuse: bool = True):
        self.weights = self.base_weights = weights
        self._folded = None                        # (plan parts, the weights they fold into): the last ones set
        self.glue = check_glue(glue)
        self.blocks = Blocks(weights, ffn_dense=ffn_dense, cpu_rows=cpu_rows, count_inputs=count_inputs, fuse=fuse,
                             input_path=input_path, o_proj=o_proj)
        self.selector = ActiveSetSelector(select_impl)
        self.compile, self.use_graph = compile, use_graph
        self.overlap, self.kv_mode = True, "exact"
        self.sparse_plan = RuntimePlan()
        self.cache: KVCache | None = None
        self.counters = Counters(len(weights.layers), weights.device)
        self._fns = None
        self._graph = StepGraph()

    @classmethod
    def from_hf(cls, model, dtype: torch.dtype | None = None, device=None, **options) -> "DecodeRuntime":
        return cls(weights_mod.from_hf(model, dtype, device), **options)

    @classmethod
    def from_gguf(cls, model, gguf, activations: str = "fp32", **options) -> "DecodeRuntime":
        """CPU, every projection kept in the quantized blocks of ``gguf``, the file ``model`` was loaded from
        (workers.decode.quant_weights; dense, input-sparsity or predictor plans); ``activations`` "fp32" or "q8"
        (approximate)."""
        from workers.decode.quant_weights import from_gguf

        return cls(from_gguf(model, gguf, activations=activations), **options)

    @classmethod
    def from_config(cls, config, dtype=torch.float16, device="cuda", seed: int = 0, **options) -> "DecodeRuntime":
        """Random weights of the real shapes (an HF model is built on ``device`` and copied)."""
        return cls(weights_mod.from_config(config, dtype, device, seed), **options)

    def configure(self, *, ffn_dense: str | None = None, compile: bool | None = None, use_graph: bool | None = None,
                  select_impl: str | None = None, cpu_rows: bool | None = None,
                  count_inputs: bool | None = None, input_path: str | None = None, fuse: bool | None = None,
                  glue: str | None = None, o_proj: str | None = None) -> "DecodeRuntime":
        """Change constructor settings (those given); drops the compiled glue and any captured graph."""
        if glue is not None:
            self.glue = check_glue(glue)
        if ffn_dense is not None:
            b = self.blocks
            self.blocks = Blocks(self.weights, ffn_dense=ffn_dense, cpu_rows=b.cpu_rows,
                                 count_inputs=b.count_inputs, input_path=b.input_path, o_proj=b.o_proj,
                                 fuse=b.fuse)
        if o_proj is not None:
            self.blocks.o_proj = o_proj
        if input_path is not None:
            self.input_path = input_path
        if count_inputs is not None:
            self.blocks.count_inputs = count_inputs
        if fuse is not None:
            self.blocks.fuse = fuse
        if select_impl is not None:
            self.selector = ActiveSetSelector(select_impl)
        if cpu_rows is not None:
            self.blocks.cpu_rows = cpu_rows
        self.compile = self.compile if compile is None else compile
        self.use_graph = self.use_graph if use_graph is None else use_graph
        self._fns = None
        self._graph.drop()
        return self

    # ------------------------------------------------------------------ views
    device = property(lambda self: self.weights.device)
    dtype = property(lambda self: self.weights.dtype)
    dims = property(lambda self: self.weights.dims)
    layers = property(lambda self: self.weights.layers)
    vocab = property(lambda self: self.weights.vocab)
    gated = property(lambda self: self.weights.gated)
    lm_head = property(lambda self: self.weights.lm_head)
    plan = property(lambda self: self.sparse_plan.plan, doc="the SparsityPlan as given to set_plan (None: dense)")
    mlp_pred = property(lambda self: self.sparse_plan.mlp, doc="{layer: FFN predictor} the step runs")
    head_pred = property(lambda self: self.sparse_plan.heads, doc="{layer: head predictor} the step runs")
    thr_ffn = property(lambda self: self.sparse_plan.thr_ffn, doc="{layer: gate threshold} fast-path layers")
    sparse = property(lambda self: bool(self.sparse_plan.mlp or self.sparse_plan.heads))
    input_sparse = property(lambda self: bool(self.sparse_plan.in_attn or self.sparse_plan.in_ffn))
    batch = property(lambda self: self.cache.batch if self.cache is not None else 0)
    pos = property(lambda self: self.cache.pos)
    steps = property(lambda self: self.counters.steps)

    @property
    def cpu_rows(self):
        return self.blocks.cpu_rows

    @cpu_rows.setter
    def cpu_rows(self, value):
        self.blocks.cpu_rows = value
        self._graph.drop()

    @property
    def input_path(self) -> str:
        return self.blocks.input_path

    @input_path.setter
    def input_path(self, value: str):
        """Switch the input-sparse kernel path without dropping the compiled glue (the graph is recaptured)."""
        self.blocks.input_path = value
        self._graph.drop()

    @property
    def select_impl(self) -> str:
        return self.selector.impl

    def weight_bytes(self) -> int:
        """Bytes of weights one dense decode step reads (layers + final norm + LM head)."""
        return self.weights.weight_bytes()

    def realized_sparsity(self) -> dict:
        """Mean sparsity over the decode steps so far (workers.decode.stats)."""
        return realized_sparsity(self.sparse_plan, self.weights, self.counters, self.batch)

    def drop_ffn(self, layers) -> None:
        """The FFN of each of ``layers`` runs dense from the next step on, its predictor skipped (what
        ``timing.densify_slow_ffn`` decides); ``set_plan`` restores the plan."""
        for l in layers:
            self.sparse_plan.drop_ffn(l)
        if layers:
            self._graph.drop()

    # ------------------------------------------------------------------ plan and cache
    def set_plan(self, plan=None, *, overlap: bool = True, kv_mode: str = "exact") -> "DecodeRuntime":
        """Use ``plan`` (None: dense). Predictors are copied to the runtime's device and dtype; a plan with
        nothing left to skip (every layer at s = 0) runs the dense step."""
        if kv_mode not in KV_MODES:
            raise ValueError(f"kv_mode must be one of {KV_MODES}")
        if self.weights.quantized and not runs_on_blocks(plan):
            why = "; ".join(p.blocks_refused for p in plan.parts if p.blocks_refused is not None)
            raise NotImplementedError("over a GGUF's blocks the runtime runs dense, input-sparsity (with low-rank "
                                      f"terms) and predictor plans; {why}: load the model with from_hf")
        if kv_mode != self.kv_mode:
            self.cache = None                      # the cache layout changes: setup() again
        weights = self._part_weights(() if plan is None else tuple(plan.parts))
        if weights is not self.weights:            # a part folded into the weights runs on its own copy
            b = self.blocks
            self.weights = weights
            self.blocks = Blocks(weights, ffn_dense=b.ffn_dense, cpu_rows=b.cpu_rows, count_inputs=b.count_inputs,
                                 input_path=b.input_path, o_proj=b.o_proj, fuse=b.fuse)
        self.sparse_plan = RuntimePlan.build(plan, self.weights)
        self.overlap, self.kv_mode = overlap, kv_mode
        self._graph.drop()
        return self

    def _part_weights(self, parts: tuple):
        """The weights ``parts`` run over (each part's ``runtime_weights`` in turn), folded once for the same
        parts again (timing rounds)."""
        if self._folded is not None and len(self._folded[0]) == len(parts) \
                and all(a is b for a, b in zip(self._folded[0], parts)):
            return self._folded[1]
        weights = self.base_weights
        for part in parts:
            weights = part.runtime_weights(weights)
        if weights is not self.base_weights:
            self._folded = (parts, weights)
        return weights

    def setup(self, batch: int, max_len: int) -> None:
        """Allocate the static KV cache and the step's buffers (and drop any captured graph)."""
        w, dev = self.weights, self.weights.device
        self.cache = KVCache(len(w.layers), batch, max_len, w.dims.n_kv_heads, w.dims.head_dim, dtype=w.dtype,
                             device=dev, track_valid=self.kv_mode == "active")
        self.tok = torch.zeros(batch, dtype=torch.long, device=dev)
        self.out_tokens = torch.zeros(batch, max_len, dtype=torch.long, device=dev)
        self.counters.reset()
        self._graph.drop()

    # ------------------------------------------------------------------ prefill (dense, eager)
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Dense forward of the prompts ``ids`` [B, T] (B == setup's batch); fills the cache; returns the last
        position's logits [B, V] and sets the step's input token (greedy) and position."""
        B, Tn = ids.shape
        cache, w, b = self.cache, self.weights, self.blocks
        assert cache is not None and B == cache.batch and Tn < cache.max_len, \
            "setup(batch, max_len) first; prompt must fit"
        ids = ids.to(w.device)
        x = b.embed(ids, torch.arange(Tn, device=w.device)[None, :])
        logits = b.logits(forward(w, x, EAGER, Prompt(b, cache))[:, -1])
        self.tok.copy_(logits.argmax(-1))
        cache.pos.fill_(Tn)
        self.out_tokens.zero_()
        self.counters.reset()
        return logits

    # ------------------------------------------------------------------ the one-token step
    def _glue(self) -> dict:
        if self._fns is None:
            on_cuda = self.device.type == "cuda"
            self._fns = glue_fns(self.compile and on_cuda, resolve_glue(self.glue, self.device.type))
        return self._fns

    def _step(self, keep_logits: bool = False):
        w, b, rp, cache = self.weights, self.blocks, self.sparse_plan, self.cache
        fns = self._glue()
        side = self._graph.side if (w.device.type == "cuda" and self.overlap and self.sparse) else None
        sets = Lookahead(self.selector, rp.mlp, rp.heads, w.dims.D, w.dims.n_heads, side, self._graph.keep)
        h = forward(w, b.embed(self.tok, cache.pos), fns, Step(b, rp, cache, self.counters, sets, fns))
        sets.join()
        if rp.head is not None:         # a predicted head: the screen, the top K, the candidates' exact rows
            nxt_tok, logits = rp.head(b, h, keep_logits)
        else:
            logits = b.logits(h)
            nxt_tok = logits.argmax(-1)
        self.out_tokens.index_copy_(1, cache.pos, nxt_tok[:, None])
        self.tok.copy_(nxt_tok)
        cache.pos.add_(1)
        return logits if keep_logits else None

    # ------------------------------------------------------------------ driving
    @torch.no_grad()
    def step(self, keep_logits: bool = False):
        """One decode token for every sequence (greedy). Returns logits only when ``keep_logits`` (eager)."""
        cuda = self.device.type == "cuda"
        out = None
        if cuda and self.use_graph and not keep_logits:
            if self._graph.graph is None:
                steps = self.counters.steps
                self._graph.capture(self._step, (self.pos, self.tok))
                self.counters.reset()
                self.counters.steps = steps
            self._graph.graph.replay()
        else:
            out = self._graph.eager(self._step, keep_logits, cuda=cuda)
        self.counters.steps += 1
        return out

    @torch.no_grad()
    def decode(self, n: int) -> torch.Tensor:
        """``n`` greedy tokens after ``prefill``: [B, n] (the first is prefill's argmax)."""
        start = int(self.pos)
        first = self.tok.clone()
        for _ in range(n - 1):
            self.step()
        return torch.cat([first[:, None], self.out_tokens[:, start: start + n - 1]], 1)

    @torch.no_grad()
    def generate(self, ids: torch.Tensor, n: int) -> torch.Tensor:
        """``n`` greedy tokens after the prompts ``ids`` [B, T] (the KV cache is set up when it does not fit)."""
        if self.cache is None or not self.cache.fits(ids.shape[0], ids.shape[1] + n):
            self.setup(ids.shape[0], ids.shape[1] + n)
        self.prefill(ids)
        return self.decode(n)
