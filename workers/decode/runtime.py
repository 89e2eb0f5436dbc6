"""A compact decode runtime (gpt-fast style) that runs dense or with a :class:`SparsityPlan` applied.

    rt = DecodeRuntime.from_hf(model)                      # copies the weights (workers.decode.weights)
    rt = DecodeRuntime.from_config(config, dtype, device)  # random weights of the real shapes
    rt.set_plan(plan, overlap=True)                        # None: dense
    rt.setup(batch=1, max_len=160)                         # static KV cache
    logits = rt.prefill(prompt_ids)                        # dense, eager; writes the cache
    tokens = rt.decode(n)                                  # greedy; one-token step, CUDA graph on CUDA
    tokens = rt.generate(prompt_ids, n)                    # setup (when needed) + prefill + decode

The parts, each in its own module of workers/decode: ``weights`` (HF model -> frozen per-layer weight structs),
``kv_cache`` (static cache + position counter), ``plan`` (a SparsityPlan compiled for these weights; keep-all
parts dropped, so a plan at s = 0 runs the dense step), ``select`` (active sets: predictor GEMVs, top-k or
threshold rule, side-stream look-ahead), ``blocks`` (dense / sparse projections, FFN variants, head-sparse
attention), ``glue`` (norms, RoPE + attention; compiled on CUDA), ``stats`` (realized sparsity).

Every setting a benchmark varies is a keyword of the constructor (and of ``from_hf`` / ``from_config``), and
:meth:`configure` changes it later: ``ffn_dense`` ("auto" | "torch"), ``compile`` (torch.compile of the glue on
CUDA), ``use_graph`` (one CUDA graph per step), ``select_impl`` ("auto" | "torch" | "triton"), ``cpu_rows``
(CPU dense products through the row kernels; None: matmuls until :meth:`pick_cpu_dense` times both),
``input_path`` ("auto" | "mask" | "local": the input-sparse kernel, kernels.ops.INPUT_PATHS), ``glue``
("torch": the torch norms and decode attention, compiled on CUDA; "kernel": RoPE, the cache write and the
attention of every (active) head in one kernels.ops call (one Triton launch on CUDA, one native call on the
CPU), and on the CPU the norms natively too; "auto": "kernel" on the CPU and CUDA, "torch" elsewhere),
``o_proj`` ("auto" | "torch" | "kernel": the dense O projection, workers.decode.blocks).
``set_plan`` takes ``overlap`` (side-stream look-ahead on CUDA) and ``kv_mode`` ("exact": K/V of every head,
the semantics of workers.sparsity.sparse_exec; "active": only the KV heads the active query heads need, skipped
entries masked out of later attention -- Deja Vu's saving without its "recompute later", an approximation).
Public handles: ``weights``, ``blocks``, ``selector``, ``sparse_plan``, ``cache``, ``counters``.

Decode step (one token per sequence): embedding -> per layer [norm, QKV, RoPE + cache write + attention over
the static cache (masked to the filled positions and the sliding window), O, add+norm, FFN, add+norm] -> argmax.
The step reads the cache's device position counter and writes the next token into its own input buffer, so
repeated replays need no host sync. On CUDA the whole step is captured in one CUDA graph.
"""
from __future__ import annotations

import time

import torch

from kernels.configs import use_dense
from kernels.reference import rot_half
from workers.decode import weights as weights_mod
from workers.decode.blocks import Blocks
from workers.decode.glue import EAGER, attn_prefill, check_glue, glue_fns, norm, resolve_glue
from workers.decode.kv_cache import KVCache
from workers.decode.plan import RuntimePlan
from workers.decode.select import ActiveSetSelector, Lookahead
from workers.decode.stats import Counters, realized_sparsity
from workers.decode.weights import ModelWeights

KV_MODES = ("exact", "active")
# At batch > 1 a layer with an FFN predictor pays, besides the FFN on the union, its predictor and one top-k per
# token; the kernel crossover (kernels.configs.use_dense) counts only the FFN kernels. End to end on an H200
# (Llama-2-7B, batch 4, random Deja Vu r = 256), sparse against dense: 0.95-0.98x at union sparsity 0.32,
# 0.99-1.04x at 0.41, 1.10x at 0.52. Below this union sparsity such a layer runs dense.
SPARSE_FROM_UNION = 0.45


def faster_dense_with_predictor(batch: int, kept: int, n: int, gated: bool = True) -> bool:
    """Whether a predicted FFN layer whose batch union keeps ``kept`` of ``n`` neurons is faster run dense (its
    predictor dropped): the kernel crossover, and from batch 2 also a union sparsity below SPARSE_FROM_UNION."""
    return use_dense(batch, kept, n, gated=gated) or (batch > 1 and 1.0 - kept / n < SPARSE_FROM_UNION)


class DecodeRuntime:
    def __init__(self, weights: ModelWeights, *, ffn_dense: str = "auto", compile: bool = True,
                 use_graph: bool = True, select_impl: str = "auto", cpu_rows: bool | None = None,
                 count_inputs: bool = True, input_path: str = "auto", glue: str = "auto", o_proj: str = "auto"):
        self.weights = weights
        self.glue = check_glue(glue)
        self.blocks = Blocks(weights, ffn_dense=ffn_dense, cpu_rows=cpu_rows, count_inputs=count_inputs,
                             input_path=input_path, o_proj=o_proj)
        self.selector = ActiveSetSelector(select_impl)
        self.compile, self.use_graph = compile, use_graph
        self.overlap, self.kv_mode = True, "exact"
        self.sparse_plan = RuntimePlan()
        self.cache: KVCache | None = None
        self.counters = Counters(len(weights.layers), weights.device)
        self._fns = self._graph = self._side = None
        self._keep: list = []

    @classmethod
    def from_hf(cls, model, dtype: torch.dtype | None = None, device=None, **options) -> "DecodeRuntime":
        return cls(weights_mod.from_hf(model, dtype, device), **options)

    @classmethod
    def from_gguf(cls, model, gguf, activations: str = "fp32", **options) -> "DecodeRuntime":
        """CPU, every projection kept in the quantized blocks of ``gguf``, the file ``model`` was loaded from
        (workers.decode.quant_weights; dense plans only); ``activations`` "fp32" or "q8" (approximate)."""
        from workers.decode.quant_weights import from_gguf

        return cls(from_gguf(model, gguf, activations=activations), **options)

    @classmethod
    def from_config(cls, config, dtype=torch.float16, device="cuda", seed: int = 0, **options) -> "DecodeRuntime":
        """Random weights of the real shapes (an HF model is built on ``device`` and copied)."""
        return cls(weights_mod.from_config(config, dtype, device, seed), **options)

    def configure(self, *, ffn_dense: str | None = None, compile: bool | None = None, use_graph: bool | None = None,
                  select_impl: str | None = None, cpu_rows: bool | None = None,
                  count_inputs: bool | None = None, input_path: str | None = None,
                  glue: str | None = None, o_proj: str | None = None) -> "DecodeRuntime":
        """Change constructor settings (those given); drops the compiled glue and any captured graph."""
        if glue is not None:
            self.glue = check_glue(glue)
        if ffn_dense is not None:
            b = self.blocks
            self.blocks = Blocks(self.weights, ffn_dense=ffn_dense, cpu_rows=b.cpu_rows,
                                 count_inputs=b.count_inputs, input_path=b.input_path, o_proj=b.o_proj)
        if o_proj is not None:
            self.blocks.o_proj = o_proj
        if input_path is not None:
            self.input_path = input_path
        if count_inputs is not None:
            self.blocks.count_inputs = count_inputs
        if select_impl is not None:
            self.selector = ActiveSetSelector(select_impl)
        if cpu_rows is not None:
            self.blocks.cpu_rows = cpu_rows
        self.compile = self.compile if compile is None else compile
        self.use_graph = self.use_graph if use_graph is None else use_graph
        self._fns = self._graph = None
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
        self._graph = None

    @property
    def input_path(self) -> str:
        return self.blocks.input_path

    @input_path.setter
    def input_path(self, value: str):
        """Switch the input-sparse kernel path without dropping the compiled glue (the graph is recaptured)."""
        self.blocks.input_path = value
        self._graph = None

    @property
    def select_impl(self) -> str:
        return self.selector.impl

    def weight_bytes(self) -> int:
        """Bytes of weights one dense decode step reads (layers + final norm + LM head)."""
        return self.weights.weight_bytes()

    def realized_sparsity(self) -> dict:
        """Mean sparsity over the decode steps so far (workers.decode.stats)."""
        return realized_sparsity(self.sparse_plan, self.weights, self.counters, self.batch)

    def densify_slow_ffn(self, faster_dense=None) -> list[int]:
        """At batch > 1 the FFN reads the union of the batch's active sets, which can be nearly every neuron.
        For every layer whose mean union over the decode steps so far is one at which the dense FFN is faster
        (``faster_dense(batch, kept, D)``; default on CUDA: :func:`faster_dense_with_predictor`, the kernels'
        crossover and the end-to-end one measured with the predictor; elsewhere nothing is switched), drop the
        layer's FFN predictor: from the next step that layer runs the dense FFN and skips its predictor. Reads the
        counters (one host sync). Returns the layers switched; ``set_plan`` restores the plan."""
        if faster_dense is None:
            if self.device.type != "cuda":
                return []
            gated = self.gated

            def faster_dense(batch, kept, n):
                return faster_dense_with_predictor(batch, kept, n, gated=gated)
        rp, steps = self.sparse_plan, self.counters.steps
        if self.batch <= 1 or steps == 0 or not rp.mlp:
            return []
        kept = (self.counters.mlp.cpu() / steps).tolist()
        D = self.dims.D
        out = sorted(l for l in rp.mlp if faster_dense(self.batch, max(1, round(kept[l])), D))
        for l in out:
            rp.drop_ffn(l)
        if out:
            self._graph = None
        return out

    # ------------------------------------------------------------------ plan and cache
    def set_plan(self, plan=None, *, overlap: bool = True, kv_mode: str = "exact") -> "DecodeRuntime":
        """Use ``plan`` (None: dense). Predictors are copied to the runtime's device and dtype; a plan with
        nothing left to skip (every layer at s = 0) runs the dense step."""
        if kv_mode not in KV_MODES:
            raise ValueError(f"kv_mode must be one of {KV_MODES}")
        if plan is not None and self.weights.quantized:
            raise NotImplementedError("sparsity plans over quantized weights are not supported yet: dense only")
        if kv_mode != self.kv_mode:
            self.cache = None                      # the cache layout changes: setup() again
        self.sparse_plan = RuntimePlan.build(plan, self.weights)
        self.overlap, self.kv_mode = overlap, kv_mode
        self._graph = None
        return self

    def setup(self, batch: int, max_len: int) -> None:
        """Allocate the static KV cache and the step's buffers (and drop any captured graph)."""
        w, dev = self.weights, self.weights.device
        self.cache = KVCache(len(w.layers), batch, max_len, w.dims.n_kv_heads, w.dims.head_dim, dtype=w.dtype,
                             device=dev, track_valid=self.kv_mode == "active")
        self.tok = torch.zeros(batch, dtype=torch.long, device=dev)
        self.out_tokens = torch.zeros(batch, max_len, dtype=torch.long, device=dev)
        self.counters.reset()
        self._graph = None

    # ------------------------------------------------------------------ prefill (dense, eager)
    @torch.no_grad()
    def prefill(self, ids: torch.Tensor) -> torch.Tensor:
        """Dense forward of the prompts ``ids`` [B, T] (B == setup's batch); fills the cache; returns the last
        position's logits [B, V] and sets the step's input token (greedy) and position."""
        B, Tn = ids.shape
        cache, w, b = self.cache, self.weights, self.blocks
        assert cache is not None and B == cache.batch and Tn < cache.max_len, \
            "setup(batch, max_len) first; prompt must fit"
        H, KV, hd = w.dims.n_heads, w.dims.n_kv_heads, w.dims.head_dim
        ids = ids.to(w.device)
        x = b.embed(ids, torch.arange(Tn, device=w.device)[None, :])
        nk, eps = w.norm_kind, w.eps
        for l, L in enumerate(w.layers):
            h = norm(x, L.n1, L.n1b, nk, eps)
            qkv = b.linear(h, L.w_qkv, L.b_qkv)
            q = qkv[..., : H * hd].view(B, Tn, H, hd).transpose(1, 2)
            k = qkv[..., H * hd: (H + KV) * hd].view(B, Tn, KV, hd).transpose(1, 2)
            v = qkv[..., (H + KV) * hd:].view(B, Tn, KV, hd).transpose(1, 2)
            if L.qn is not None:
                q, k = norm(q, L.qn, None, "rms1p", eps), norm(k, L.kn, None, "rms1p", eps)
            if L.rope is not None:
                cos, sin = (t[:Tn].to(q.dtype) for t in L.rope)
                q = q * cos + rot_half(q) * sin
                k = k * cos + rot_half(k) * sin
            cache.write_prompt(l, k, v)
            o = b.linear_t(attn_prefill(q, k, v, L.window), L.w_o_t, L.b_o)
            if L.post_attn is not None:
                o = norm(o, L.post_attn, None, nk, eps)
            x = x + o
            h = norm(x, L.n2, L.n2b, nk, eps)
            y = b.ffn_dense_(L, h.reshape(B * Tn, -1), EAGER["act_mul"]).reshape(B, Tn, -1)
            if L.post_ffn is not None:
                y = norm(y, L.post_ffn, None, nk, eps)
            x = x + y
        logits = b.logits(norm(x[:, -1], w.final_norm, w.final_norm_b, nk, w.final_eps))
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
        nk, eps, nl = w.norm_kind, w.eps, len(w.layers)
        side = self._side if (w.device.type == "cuda" and self.overlap and self.sparse) else None
        sets = Lookahead(self.selector, rp.mlp, rp.heads, w.dims.D, w.dims.n_heads, side, self._keep)
        x = b.embed(self.tok, cache.pos)
        prev_x = x
        h = fns["norm"](x, w.layers[0].n1, w.layers[0].n1b, nk, eps)
        for l, L in enumerate(w.layers):
            sets.layer_start(l, nl, x)      # look-ahead for l+1 (from x entering l), residual for l
            hp = rp.heads.get(l)
            if hp is None:
                o = self._attn(l, L, h, rp.in_attn.get(l), fns)
            else:
                q_idx, q_count = sets.get("attn", l, x if hp.input_kind == "residual" or l == 0 else prev_x)
                o = b.sparse_attn(L, l, h, q_idx, q_count, cache, fns["attn"])
                if q_count is not None:
                    self.counters.heads[l] += q_count[0]
            if L.post_attn is not None:
                o = fns["norm"](o, L.post_attn, None, nk, eps)
            x_in = x
            x, h = fns["add_norm"](x, o, L.n2, L.n2b, nk, eps)
            y = self._ffn(l, L, h, x_in, prev_x, sets, fns)
            if L.post_ffn is not None:
                y = fns["norm"](y, L.post_ffn, None, nk, eps)
            prev_x = x_in
            if l + 1 < nl:
                nxt = w.layers[l + 1]
                x, h = fns["add_norm"](x, y, nxt.n1, nxt.n1b, nk, eps)
            else:
                x, h = fns["add_norm"](x, y, w.final_norm, w.final_norm_b, nk, w.final_eps)
        sets.join()
        logits = b.logits(h)
        nxt_tok = logits.argmax(-1)
        self.out_tokens.index_copy_(1, cache.pos, nxt_tok[:, None])
        self.tok.copy_(nxt_tok)
        cache.pos.add_(1)
        return logits if keep_logits else None

    def _attn(self, l, L, h, ia, fns):
        """Dense attention of layer ``l`` (input sparsity on QKV / O where the plan has it)."""
        b, cache, dims = self.blocks, self.cache, self.weights.dims
        H, KV, hd, B = dims.n_heads, dims.n_kv_heads, dims.head_dim, h.shape[0]
        ia = ia or {}
        if "qkv" in ia:
            qkv = b.in_linear(h, L.w_qkv_t, ia["qkv"], self._counts(l, ia["qkv"]), L.b_qkv)
        else:
            qkv = b.linear(h, L.w_qkv, L.b_qkv)
        q = qkv[:, : H * hd].view(B, H, hd)
        k = qkv[:, H * hd: (H + KV) * hd].view(B, KV, hd)
        v = qkv[:, (H + KV) * hd:].view(B, KV, hd)
        a = fns["attn"](q, k, v, cache.k[l], cache.v[l], cache.pos, *(L.rope or (None, None)), L.qn, L.kn,
                        self.weights.eps, L.window)
        if "o" in ia:
            return b.in_linear(a, L.w_o_t, ia["o"], self._counts(l, ia["o"]), L.b_o)
        return b.out_dense(L, a)

    def _ffn(self, l, L, h, x_in, prev_x, sets, fns):
        """Layer ``l``'s FFN: dense, input-sparse, gate-threshold or on the predictor's active set."""
        b, rp, c = self.blocks, self.sparse_plan, self.counters
        mp = rp.mlp.get(l)
        if mp is None:
            ifn = rp.in_ffn.get(l)
            if ifn is None:
                return b.ffn_dense_(L, h, fns["act_mul"])
            return b.ffn_input_sparse(L, h, ifn, c.inputs[l], fns["act_mul"])
        if l in rp.thr_ffn:
            return b.ffn_threshold(L, h, rp.thr_ffn[l], c.mlp[l])
        kind = mp.input_kind
        idx, count = sets.get("mlp", l, h if kind == "ffn_in" else (x_in if kind == "residual" or l == 0 else prev_x))
        if count is not None:
            c.mlp[l] += count[0]
        return b.sparse_ffn(L, h, idx, count, rp.seq_thr.get(l), rp.seq_w.get(l))

    def _counts(self, l: int, group):
        return group.counts(self.counters.inputs[l])

    # ------------------------------------------------------------------ driving
    def _capture(self):
        """Warm up (Triton compiles, glue compiles) on a side stream, restore the state, capture one step."""
        self._side = torch.cuda.Stream()
        pos, tok = self.pos.clone(), self.tok.clone()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._keep = []
                self._step()
                self.pos.copy_(pos)
                self.tok.copy_(tok)
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        self._keep = []      # tensors shared across streams stay alive as long as the graph
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self._step()
        self._graph, self._graph_keep = g, self._keep
        self.pos.copy_(pos)
        self.tok.copy_(tok)
        self.counters.reset()

    @torch.no_grad()
    def step(self, keep_logits: bool = False):
        """One decode token for every sequence (greedy). Returns logits only when ``keep_logits`` (eager)."""
        if self.device.type == "cuda" and self.use_graph and not keep_logits:
            if self._graph is None:
                steps = self.counters.steps
                self._capture()
                self.counters.steps = steps
            self._graph.replay()
            out = None
        else:
            if self._side is None and self.device.type == "cuda":
                self._side = torch.cuda.Stream()
            self._keep = []
            out = self._step(keep_logits)
            self._keep = []
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

    @torch.no_grad()
    def pick_cpu_dense(self, steps: int = 4, rounds: int = 3) -> bool:
        """On the CPU: time dense decode steps through torch matmuls and through the row kernels, alternately,
        and keep the faster for every dense product (``cpu_rows``). Which one wins depends on the CPU (caches,
        MKL's GEMV); the dense baseline of a latency row must be the fastest dense we can run. Returns
        ``cpu_rows``. The plan is restored; the KV cache is dropped (setup() again before decoding)."""
        if self.device.type != "cpu":
            return self.cpu_rows
        plan, overlap, kv_mode = self.plan, self.overlap, self.kv_mode
        self.set_plan(None)
        self.setup(1, steps + 2)
        ids = torch.zeros(1, 1, dtype=torch.long)
        best = {False: [], True: []}
        for r in range(rounds + 1):
            for rows in ((False, True) if r % 2 == 0 else (True, False)):
                self.cpu_rows = rows
                self.prefill(ids)
                t0 = time.perf_counter()
                for _ in range(steps):
                    self.step()
                if r:                      # round 0 warms both paths up
                    best[rows].append(time.perf_counter() - t0)
        self.cpu_rows = min(best[True]) < min(best[False])
        self.set_plan(plan, overlap=overlap, kv_mode=kv_mode)
        self.cache = None
        return self.cpu_rows
