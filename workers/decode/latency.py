"""Decode latency rows: our runtime (dense / sparse), Hugging Face ``generate`` and llama.cpp, as plain dicts.

    rows = bench_decode(model, plan, device="cuda", batch=1, prompt_len=128, gen_len=64)
    rows = bench_llama_cpp(model, gguf, prompt_len=64, gen_len=16)     # CPU; llama-cpp-python installed

Each row has exactly the fields of ``db.schemas.LatencyRow`` that a worker fills (device_type, accelerator_name,
batch, prompt_len, gen_len, p50_ms_per_token, p90_ms_per_token, tokens_per_s, realized_sparsity, runtime, threads:
torch's thread count while timing, weights: what the decode read, cpu_flags / isa: the CPU build it was timed
under (:func:`cpu_build`; None off the CPU), and for a row timed alternately with our dense decode speedup_min /
speedup_max, the lowest and highest per-repeat speedup over it);
``detail=True`` adds measurement details under keys the store does not take (strip them before a LatencyRow).
No Ray, no DB imports: the GPU benchmark script runs this module on a machine without either.

Per-token times: our runtime times every decode step with device events around each graph replay (no host
sync inside the loop; CPU: a host clock; ``workers.decode.timing.step_times``); HF ``generate`` with a logits
processor that synchronizes and reads the clock once per generated token. p50/p90 are over all decode tokens of
all repeats; tokens/s = batch · 1000 / p50. The first generated token comes from the prefill and is not a decode step.

Shape-only models (7B class, random weights of the real shapes; GPU): :func:`shape_model`; a random Deja Vu
style plan with a given MLP / head sparsity for them: :func:`random_plan` (what sparsity a method realizes comes
from the real small models; these rows measure the runtime at that sparsity).
"""
from __future__ import annotations

import math
import time
import weakref

import torch

from workers.sparsity.predictors.base import SparsityPlan, k_for
from workers.decode.runtime import DecodeRuntime, runs_on_blocks
from workers.decode.shapes import shape_entry
from workers.decode.timing import densify_slow_ffn, interleaved, pick_cpu_dense, step_times
from workers.decode.weights import random_hf_model
from workers.names import RUNTIME_DENSE, RUNTIME_DENSE_PAIRED, RUNTIME_HF, RUNTIME_LLAMA_CPP, RUNTIME_SPARSE


def shape_config(name: str):
    import transformers as tf

    family, kw = shape_entry(name)
    cls = {"llama": tf.LlamaConfig, "mistral": tf.MistralConfig, "qwen2": tf.Qwen2Config, "opt": tf.OPTConfig}[family]
    return cls(**kw)


def shape_model(name: str, dtype=torch.float16, device="cuda", seed: int = 0):
    """An HF model of a 7B-class shape with random weights (``name`` in ``workers.decode.shapes.SHAPES``), on
    ``device``."""
    return random_hf_model(shape_config(name), dtype, device, seed)


def random_plan(model_or_config, mlp_sparsity: float | None, head_sparsity: float | None = None, *,
                rank: int = 256, input_kind: str = "lookahead", seed: int = 0, layers=None,
                mlp_rule: str = "topk") -> SparsityPlan:
    """Deja Vu predictors (rank ``rank``, top-k) with random weights for every layer (or ``layers``): the
    predictor GEMVs, top-k and kernels cost what a fitted plan costs; the chosen sets are arbitrary.
    ``mlp_rule="positive"``: the FFN predictors keep the neurons whose score is > 0 (the SVD predictors' rule: no
    top-k, a compaction), about half of them for these random scores whatever ``mlp_sparsity`` says."""
    from workers.loading.adapters import adapter_for
    from workers.methods.dejavu.predictor import DejaVuHeadPredictor, DejaVuMLPPredictor

    cfg = getattr(model_or_config, "config", model_or_config)
    dims = adapter_for(cfg).dims(cfg)
    g = torch.Generator().manual_seed(seed)
    plan = SparsityPlan()
    for l in (layers if layers is not None else range(dims.n_layers)):
        if mlp_sparsity is not None:
            p = DejaVuMLPPredictor(dims.d, min(rank, dims.d), dims.D, k_for(mlp_sparsity, dims.D), input_kind)
            p.reset_random(g)
            if mlp_rule != "topk":
                p.rule, p.k = mlp_rule, None
            plan.mlp[l] = p
        if head_sparsity is not None:
            h = DejaVuHeadPredictor(dims.d, min(rank, dims.d), dims.n_heads, k_for(head_sparsity, dims.n_heads),
                                    input_kind)
            h.reset_random(g)
            plan.attn[l] = h
        plan.info[l] = {"target_sparsity": mlp_sparsity, "head_sparsity": head_sparsity}
    return plan


@torch.no_grad()
def calibrated_input_plan(model, sparsity: float, n_tokens: int = 256, seed: int = 0,
                          score: str = "abs") -> SparsityPlan:
    """Input sparsity on every projection of every layer at ``sparsity``: per (layer, projection) the quantile of
    that projection's input score (``abs``: TEAL's |x|; ``wina``: |x_i|·‖W[:, i]‖) over one prefill of
    ``n_tokens`` random tokens. For random-weight shapes, where no calibration cache exists: the thresholds
    realize ``sparsity`` on inputs like the decode's."""
    from workers.loading.adapters import adapter_for
    from workers.sparsity.input_sparse import column_norms, input_score, projection_modules

    if score not in ("abs", "wina"):
        raise ValueError(f"score must be 'abs' or 'wina', got {score!r}")
    ad = adapter_for(model)
    found: dict[tuple[int, str], torch.Tensor] = {}
    hooks = []
    for l, layer in ad.iter_layers(model):
        for proj, mod in projection_modules(ad, layer).items():
            scale = column_norms(mod) if score == "wina" else None

            def pre(_m, args, l=l, proj=proj, scale=scale):
                x = input_score(args[0].float(), scale).flatten()
                x = x[::-(-x.numel() // 2 ** 24)]                  # torch.quantile takes at most 2^24 values
                found[(l, proj)] = torch.quantile(x, sparsity)
            hooks.append(mod.register_forward_pre_hook(pre))
    try:
        g = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, model.config.vocab_size, (1, n_tokens), generator=g).to(next(model.parameters()).device)
        model(input_ids=ids, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    plan = SparsityPlan(input_score=score)
    for (l, proj), t in found.items():
        plan.inputs.setdefault(l, {})[proj] = float(t)
    return plan


# ------------------------------------------------------------------------------------------------------------
def accelerator_name(device) -> str:
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    if dev.type == "npu":  # pragma: no cover - Ascend only
        return str(torch.npu.get_device_name(dev))
    from kernels.isa import cpu_model

    return cpu_model()


def cpu_build(device) -> dict:
    """``cpu_flags`` and ``isa`` of a latency row timed on ``device``: on the CPU, :func:`kernels.isa.cpu_info`'s
    flags of interest and the instruction set the native kernels are built for, or ``"fallback"`` where they did
    not build (no compiler, ``CTXSPARSE_CPU_NATIVE=0``: the torch primitives ran); both None on a GPU/NPU. Every
    row of a CPU unit carries its process's build, the baselines' too (llama.cpp and Hugging Face rows are timed
    beside or against that build's decode)."""
    if torch.device(device).type != "cpu":
        return {"cpu_flags": None, "isa": None}
    from kernels import cpu as cpu_kernels
    from kernels.isa import cpu_info

    info = cpu_info()
    # native_available(): whether the library the decode called was built (kernels.native.native_status() says the
    # same of it, but also builds kernels.cpu_quant, seconds on a cold cache, which a float decode never loads)
    return {"cpu_flags": info["cpu_flags"], "isa": info["isa"] if cpu_kernels.native_available() else "fallback"}


def _pct(xs, q):
    xs = sorted(xs)
    if not xs:
        return float("nan")
    i = (len(xs) - 1) * q
    lo, hi = math.floor(i), math.ceil(i)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def _row(device, batch, prompt_len, gen_len, times_ms, runtime, sparsity, extra, spread=None, weights=None):
    p50 = _pct(times_ms, 0.5)
    row = dict(device_type=torch.device(device).type, accelerator_name=accelerator_name(device), batch=batch,
               prompt_len=prompt_len, gen_len=gen_len, p50_ms_per_token=p50, p90_ms_per_token=_pct(times_ms, 0.9),
               tokens_per_s=batch * 1000.0 / p50 if p50 > 0 else 0.0, realized_sparsity=sparsity, runtime=runtime,
               threads=torch.get_num_threads(), weights=weights, **cpu_build(device))
    if spread is not None:
        row.update(speedup_min=spread[0], speedup_max=spread[1])
    if extra is not None:
        row.update(extra)
    return row


def speedup_spread(dense_runs: list[list[float]], runs: list[list[float]]) -> tuple[float, float] | None:
    """(lowest, highest) per-repeat speedup of ``runs`` over ``dense_runs``, timed alternately with them: repeat i's
    median dense step over its own median step (each run a list of per-step ms). None without repeats."""
    ratios = []
    for d, x in zip(dense_runs, runs):
        if not d or not x or _pct(x, 0.5) <= 0:
            return None
        ratios.append(_pct(d, 0.5) / _pct(x, 0.5))
    return (min(ratios), max(ratios)) if ratios else None


_RUNTIMES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def runtime_for(model, device=None, gguf=None) -> DecodeRuntime:
    """The decode runtime built from ``model`` (cached per model object and ``gguf``; weights copied once): its
    own float weights, or with ``gguf`` (the file ``model`` was loaded from; CPU) the file's quantized blocks."""
    if isinstance(model, DecodeRuntime):
        return model
    per = _RUNTIMES.setdefault(model, {})
    key = None if gguf is None else str(gguf)
    rt = per.get(key)
    if rt is None or (device is not None and rt.device != torch.device(device)):
        if key is not None and torch.device(device or "cpu").type != "cpu":
            raise ValueError("the GGUF's quantized blocks decode on the CPU only")
        rt = DecodeRuntime.from_hf(model, device=device) if key is None else DecodeRuntime.from_gguf(model, key)
        per[key] = rt
    return rt


def weights_name(rt: DecodeRuntime) -> str:
    """What a latency row's decode read: "gguf:" and the projections' block formats (the quantized runtime), or
    the float dtype ("fp32", "fp16", "bf16")."""
    w = rt.weights
    if w.quantized:
        fmts = sorted({f for L in w.layers for q in (L.w_qkv, L.w_o_t, L.w_gate, L.w_up, L.w_down_t)
                       if q is not None for f in q.formats})
        return "gguf:" + "+".join(fmts)
    return dtype_name(w.dtype)


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}.get(dtype, str(dtype))


@torch.no_grad()
def bench_decode(model, plan: SparsityPlan | None = None, *, device="cpu", batch: int = 1, prompt_len: int = 128,
                 gen_len: int = 32, runtime: str = "ctxsparse", repeats: int = 3, warmup: int = 1,
                 overlap: bool = True, kv_mode: str = "exact", seed: int = 0, detail: bool = False,
                 vocab: int | None = None, paired: bool | None = None, hf_cache: str = "dynamic",
                 hf_compile: bool = False, gguf=None) -> list[dict]:
    """Time greedy decoding of ``gen_len`` tokens after a ``prompt_len`` random prompt, ``batch`` sequences.

    ``model``: an HF causal LM (or a :class:`DecodeRuntime` for ``runtime="ctxsparse"``). ``runtime``:
    ``"ctxsparse"`` (our runtime; row runtime ``ctxsparse-dense`` without a plan, ``ctxsparse-sparse`` with
    one) or ``"hf-generate"`` (the plan is ignored: HF runs dense). For HF, ``hf_cache``: "dynamic" (its default
    cache) or "static" (``cache_implementation="static"``: a preallocated cache, the one HF can compile), and
    ``hf_compile``: ``torch.compile`` of the decode forward (HF's own ``CompileConfig``, mode "reduce-overhead";
    needs the static cache); without it compiling is disabled (HF would otherwise compile a static-cache decode
    on CUDA by itself). With ``detail`` the row says which (``hf_cache``, ``hf_compile``).

    ``paired`` (default: on the CPU, with a plan): dense and sparse decode the same prompts alternately in this
    process (the order flips every repeat), and a second row ``ctxsparse-dense-paired`` carries the dense times;
    the sparse row's ``speedup_min`` / ``speedup_max`` are the lowest and highest per-repeat speedup
    (:func:`speedup_spread`).
    The ratio of the two rows is what to trust on a shared machine, where the absolute times of two latency units
    run minutes apart can drift by more than the difference between settings.

    ``gguf`` (CPU; the file ``model`` was loaded from): dense decodes the file's quantized blocks (the fastest
    dense path a CPU user has), and so does the plan where the quantized runtime takes it (``runs_on_blocks``:
    input sparsity, R-Sparse's, FFN and head predictors); LaRoSA's plan runs over the float weights, still paired with the
    quantized dense. Each row's ``weights`` says what it read (:func:`weights_name`).

    At batch > 1 (unpaired) the warm-up's realized unions decide, per layer, whether the FFN runs dense from then
    on (``timing.densify_slow_ffn``; ``dense_ffn_layers`` in the detail lists them).
    """
    device = torch.device(device)
    if gen_len < 2:
        raise ValueError("gen_len must be >= 2 (the first token comes from the prefill)")
    g = torch.Generator().manual_seed(seed)
    if runtime == RUNTIME_HF:
        return [_bench_hf(model, device, batch, prompt_len, gen_len, repeats, warmup, g, detail, vocab, hf_cache,
                          hf_compile)]
    if runtime != "ctxsparse":
        raise ValueError(f"runtime must be 'ctxsparse' or {RUNTIME_HF!r}, got {runtime!r}")
    if paired is None:
        paired = plan is not None and device.type == "cpu"
    if paired and plan is None:
        raise ValueError("paired timing needs a sparse plan (dense is the other half of the pair)")
    if gguf is not None and device.type != "cpu":
        raise ValueError("gguf: the quantized blocks decode on the CPU only")
    return _bench_ours(model, plan, device, batch, prompt_len, gen_len, repeats, warmup, g, detail, vocab,
                       paired=paired, overlap=overlap, kv_mode=kv_mode, gguf=gguf)


def _ours_runtimes(model, plan, device: torch.device, gguf) -> tuple[DecodeRuntime, DecodeRuntime]:
    """The runtimes :func:`bench_decode` times dense and ``plan`` on, each on its fastest dense path here."""
    rt_dense = runtime_for(model, device, gguf)
    rt_plan = rt_dense if gguf is None or runs_on_blocks(plan) else runtime_for(model, device)
    for r_ in {id(rt_dense): rt_dense, id(rt_plan): rt_plan}.values():
        if device.type == "cpu" and r_.cpu_rows is None and not r_.weights.quantized:
            pick_cpu_dense(r_)       # the fastest dense path here, for the dense and the sparse runs alike
    return rt_dense, rt_plan


def _bench_ours(model, plan, device, batch, prompt_len, gen_len, repeats, warmup, g, detail, vocab, *, paired,
                overlap, kv_mode, gguf) -> list[dict]:
    """:func:`bench_decode`'s rows of our runtime: ``plan``'s, and with ``paired`` the dense timed alternately."""
    rt_dense, rt_plan = _ours_runtimes(model, plan, device, gguf)
    V = vocab or rt_dense.vocab
    plans = [plan, None] if paired else [plan]
    runtimes = {id(plan): rt_plan if plan is not None else rt_dense, id(None): rt_dense}
    prompts = [torch.randint(0, V, (batch, prompt_len), generator=g) for _ in range(warmup + repeats)]
    sparsities: dict = {id(p): [] for p in plans}
    densified: list[int] = []
    # accelerators: the warm-up repeats count active inputs (realized sparsity), the timed ones do not
    counted = device.type != "cuda" or plan is None or not _input_sparse(plan)

    def run(p, r: int):
        """Round r of plan p: prefill one prompt (timed on the host, device synchronized) and decode it."""
        rt = runtimes[id(p)]
        count = counted or r < max(warmup, 1)
        if rt.blocks.count_inputs != count:
            rt.configure(count_inputs=count)
        if paired or r == 0:
            rt.set_plan(p, overlap=overlap, kv_mode=kv_mode)
            rt.setup(batch, prompt_len + gen_len)
        _sync(device)
        t0 = time.perf_counter()
        rt.prefill(prompts[r])
        _sync(device)
        prefill_ms = (time.perf_counter() - t0) * 1e3
        ts = step_times(rt, gen_len - 1)
        if count and (r >= warmup or rt.sparse_plan.inputs):   # input plans on accelerators: the warm-up counts
            sparsities[id(p)].append(rt.realized_sparsity())
        if p is not None and not paired and batch > 1 and r == warmup - 1:
            densified.extend(densify_slow_ffn(rt))   # layers whose union the warm-up showed faster dense
        return prefill_ms, ts

    runs = interleaved(plans, repeats, run, warmup)
    rows = []
    for i, (p, run_p) in enumerate(zip(plans, runs)):
        times = [t for _, ts in run_p for t in ts]
        sp = _realized_sparsity(p, sparsities[id(p)]) if p is not None else None
        extra = None
        if detail:
            heads = [s["heads"] for s in sparsities[id(p)] if "heads" in s]
            extra = dict(prefill_ms=_pct([ms for ms, _ in run_p], 0.5), mean_ms_per_token=sum(times) / len(times),
                         head_sparsity=(sum(heads) / len(heads)) if heads else None, overlap=overlap,
                         kv_mode=kv_mode, repeats=repeats, weight_bytes=runtimes[id(p)].weight_bytes(),
                         dense_ffn_layers=densified if p is not None else None)
        name = RUNTIME_SPARSE if p is not None else RUNTIME_DENSE_PAIRED if paired else RUNTIME_DENSE
        spread = (speedup_spread([ts for _, ts in runs[1]], [ts for _, ts in run_p])
                  if paired and i == 0 else None)
        rows.append(_row(device, batch, prompt_len, gen_len, times, name, sp, extra, spread,
                         weights_name(runtimes[id(p)])))
    return rows


def _realized_sparsity(plan, samples: list[dict]) -> float | None:
    """The mean realized sparsity of ``plan`` over ``samples``: with input sparsity (alone or with predictors) the
    fraction of decoder weight bytes skipped, else the FFN's."""
    key = "weights" if _input_sparse(plan) else "mlp"
    vals = [s[key] for s in samples if key in s]
    return float(sum(vals) / len(vals)) if vals else None


def _input_sparse(plan) -> bool:
    """Whether ``plan`` skips input channels (TEAL / WINA thresholds, or a part that does: LaRoSA's top-k,
    R-Sparse's thresholds)."""
    return bool(plan.inputs) or any("inputs" in p.reports for p in plan.parts)


@torch.no_grad()
def bench_llama_cpp(model, gguf, *, prompt_len: int = 128, gen_len: int = 32, repeats: int = 3, warmup: int = 1,
                    seed: int = 0, detail: bool = False, ours_quantized: bool = True) -> list[dict]:
    """llama.cpp on ``gguf`` (the file ``model`` was loaded from) and our dense decode of ``model``, alternately on
    the same random prompts in this process (batch 1, on the CPU, both at torch's thread count; the order flips every
    repeat): a ``llama.cpp`` row, whose ``speedup_min`` / ``speedup_max`` are the spread of its per-repeat speedup
    over our dense, and the ``ctxsparse-dense-paired`` row of that dense. Both decode ``gen_len - 1`` greedy steps
    after the prompt's prefill. Our dense decodes the same file's quantized blocks (``ours_quantized``; else the
    float weights). Without llama-cpp-python: RuntimeError with the one line of
    ``workers.decode.llama_cpp.llama_cpp_missing``."""
    from workers.decode.llama_cpp import LlamaCppRunner, llama_cpp_missing

    why = llama_cpp_missing()
    if why:
        raise RuntimeError(why)
    if gen_len < 2:
        raise ValueError("gen_len must be >= 2 (the first token comes from the prefill)")
    device = torch.device("cpu")
    rt = runtime_for(model, device, gguf if ours_quantized else None)
    if rt.cpu_rows is None and not rt.weights.quantized:
        pick_cpu_dense(rt)           # our dense baseline is the fastest dense we can run here
    rt.set_plan(None)
    rt.setup(1, prompt_len + gen_len)
    llama = LlamaCppRunner(gguf, torch.get_num_threads(), prompt_len + gen_len + 8)
    try:
        g = torch.Generator().manual_seed(seed)
        V = min(rt.vocab, llama.n_vocab)
        prompts = [torch.randint(0, V, (1, prompt_len), generator=g) for _ in range(warmup + repeats)]

        def run(arm: str, r: int) -> list[float]:
            if arm == RUNTIME_LLAMA_CPP:
                return llama.step_times(prompts[r][0].tolist(), gen_len - 1)[0]
            rt.prefill(prompts[r])
            return step_times(rt, gen_len - 1)
        llama_runs, dense_runs = interleaved([RUNTIME_LLAMA_CPP, RUNTIME_DENSE_PAIRED], repeats, run, warmup)
        evals = llama.decode_evals()
    finally:
        llama.close()
    rows = []
    for name, runs in ((RUNTIME_LLAMA_CPP, llama_runs), (RUNTIME_DENSE_PAIRED, dense_runs)):
        times = [t for ts in runs for t in ts]
        extra = dict(mean_ms_per_token=sum(times) / len(times), repeats=repeats) if detail else None
        if detail and name == RUNTIME_LLAMA_CPP:
            extra.update(gguf=str(gguf), llama_decode_evals=evals)     # llama.cpp's own count of its steps
        spread = speedup_spread(dense_runs, runs) if name == RUNTIME_LLAMA_CPP else None
        rows.append(_row(device, 1, prompt_len, gen_len, times, name, None, extra, spread,
                         "gguf:llama.cpp" if name == RUNTIME_LLAMA_CPP else weights_name(rt)))
    return rows


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def hf_generate_kwargs(device, cache: str = "dynamic", compile: bool = False) -> dict:
    """``generate`` keywords of an HF baseline: its cache ("dynamic" | "static") and whether the decode forward is
    compiled (static cache only; on the CPU HF compiles only when told to compile on every device)."""
    from transformers import CompileConfig

    if cache not in ("dynamic", "static"):
        raise ValueError(f"hf_cache must be 'dynamic' or 'static', got {cache!r}")
    if compile and cache != "static":
        raise ValueError("hf_compile needs hf_cache='static' (HF compiles the decode forward over a static cache)")
    kw: dict = {"disable_compile": not compile}
    if cache == "static":
        kw["cache_implementation"] = "static"
    if compile:
        cc = CompileConfig(fullgraph=False, mode="reduce-overhead")
        if torch.device(device).type != "cuda":
            cc._compile_all_devices = True       # HF's documented switch for compiling off the accelerators
        kw["compile_config"] = cc
    return kw


def _bench_hf(model, device, batch, prompt_len, gen_len, repeats, warmup, g, detail, vocab, hf_cache="dynamic",
              hf_compile=False):
    from transformers import LogitsProcessor, LogitsProcessorList

    cuda = device.type == "cuda"
    gen_kw = hf_generate_kwargs(device, hf_cache, hf_compile)

    class _Clock(LogitsProcessor):
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores):
            if cuda:
                torch.cuda.synchronize()
            self.t.append(time.perf_counter())
            return scores

    V = vocab or model.config.vocab_size
    model = model.to(device)
    times = []
    for r in range(warmup + repeats):
        ids = torch.randint(0, V, (batch, prompt_len), generator=g).to(device)
        clock = _Clock()
        model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=gen_len, min_new_tokens=gen_len,
                       do_sample=False, logits_processor=LogitsProcessorList([clock]), pad_token_id=0, **gen_kw)
        if r >= warmup:
            times.extend((b - a) * 1e3 for a, b in zip(clock.t, clock.t[1:]))
    extra = (dict(mean_ms_per_token=sum(times) / len(times), repeats=repeats, hf_cache=hf_cache,
                  hf_compile=hf_compile) if detail else None)
    return _row(device, batch, prompt_len, gen_len, times, RUNTIME_HF, None, extra,
                weights=dtype_name(next(model.parameters()).dtype))


# ------------------------------------------------------------------------------------------------------------
def decode_bytes(rt: DecodeRuntime, mlp_sparsity: float = 0.0, head_sparsity: float = 0.0, rank: int = 0,
                 context: int = 0, kv_mode: str = "exact", head_rank: int | None = None,
                 input_sparsity: float = 0.0) -> dict:
    """Bytes one batch-1 decode step must read: weights (the sparse fraction of the FFN and of the attention
    projections), predictor weights (rank-``rank`` Deja Vu: r·(d + D) per layer, r·(d + H) for heads) and the
    KV cache of ``context`` positions. ``kv_mode="exact"`` reads K/V projections dense. ``input_sparsity``: the
    fraction of every projection's input channels skipped (TEAL-style plans: that fraction of each weight)."""
    dims = rt.dims
    es = rt.lm_head.element_size()
    d, D, H, KV, hd, nl = dims.d, dims.D, dims.n_heads, dims.n_kv_heads, dims.head_dim, len(rt.layers)
    ffn = (3 if rt.gated else 2) * d * D * (1 - mlp_sparsity)
    q_o = 2 * H * hd * d * (1 - head_sparsity)
    kv_frac = (1 - head_sparsity) if kv_mode == "active" else 1.0
    kv = 2 * KV * hd * d * kv_frac
    pred = (rank * (d + D) if mlp_sparsity > 0 else 0) + ((head_rank or rank) * (d + H) if head_sparsity > 0 else 0)
    weights = nl * (ffn + q_o + kv) * (1 - input_sparsity) * es + rt.lm_head.numel() * es
    return dict(weights=weights, predictor=nl * pred * es, kv_cache=nl * 2 * KV * hd * context * es,
                total=weights + nl * pred * es + nl * 2 * KV * hd * context * es)
