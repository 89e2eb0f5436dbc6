"""CPU sparse FFN ops against the fastest dense FFN we can run here, SmolLM2-135M shapes (d=576, D=1536, 30 layers);
SmolLM2 decode and perplexity evaluation, dense vs sparse, on the CPU.

    python -m benchmarks.cpu_ops [--threads 2] [--repeats 30] [--weights random|real] [--json NAME]
        [--out-sparsity 0.3,0.5,0.7] [--in-sparsity 0.25,0.4,0.5,0.7]
    python -m benchmarks.cpu_ops --decode [--repeats 5] [--gen 16]     # end-to-end decode ms/token
    python -m benchmarks.cpu_ops --decode --weights real --threads 1 \
        --methods threshold:0.3,threshold:0.5,teal:0.25,teal:0.35,teal:0.5 [--calib-tokens 2048] [--ppl-tokens 2048]
    python -m benchmarks.cpu_ops --eval [--tokens 2048]                 # perplexity evaluation seconds
    python -m benchmarks.cpu_ops --shape tiny --repeats 1     # random weights of a tiny shape: checks the script

``--model REF`` (default smollm2-135m) is the model whose real weights ``--weights real``, ``--decode --weights
real`` and ``--eval`` read; ``--shape`` (default smollm2-135m) the shape of the random weights.

One call = one batch-1 FFN pass over all 30 layers (every layer its own weights, 318 MB fp32: nothing stays in the
32 MB L3). Dense candidates: ``F.linear`` x3 (gate, up, down as [out, in]); one ``F.linear`` on gate|up
concatenated; ``torch.mv``; ``x @ Wᵀ`` over [in, out] copies; MKL mixed (the faster layout per matrix:
gate|up as [in, out], down as [out, in]); ``embedding_bag`` at full density over Wᵀ; the CPU kernels of
kernels.cpu at full density (``cpu_dense``); bf16 weights with ``F.linear`` (with its error vs fp32). Sparse:
output sparsity (random active neurons, k = (1 - s)·D) through kernels.cpu (rows read in place), its torch-
primitive fallback (index_select + F.linear, embedding_bag) and the index_select path of kernels.npu (what the
CPU ran before); input sparsity on all three matrices (threshold at the s-quantile of |x| and of |h|) through
kernels.cpu.input_sparse_linear and its embedding_bag fallback. All callables are timed interleaved
(benchmarks.harness.time_cpu: each round runs each once, alternating order) with a fixed thread count;
median and IQR in µs per pass, GB/s on the bytes actually read, and the ratio to the fastest dense candidate.

``--decode --methods METHOD:S[:KEY=VALUE+...],...``: instead of the fixed-set / Deja Vu rows, plans fitted for real
(``workers.sparsity.fit.fit_setting``, uniform allocation) on a calibration cache of ``--calib-tokens`` lambada
tokens, decoded from a held-out text prompt, each with its realized sparsity (FFN neurons, or for input sparsity
the decoder weight bytes skipped) and, with ``--ppl-tokens N``, its held-out perplexity (sparse_exec, masked).

Writes ``benchmarks/results/cpu_ops.json`` (or ``--json NAME``). Other processes on a shared machine make the
numbers noisier (see the IQR).

Feeds: BENCHMARKS.md, "CPU kernels: the GGUF's quantized blocks and the fp32 rows" and "Input-sparse and sparse decode
on the CPU".
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F

from benchmarks.harness import Row, Timing, command_line, copy_bandwidth, device_line, time_cpu, write_results
from kernels import cpu as K
from kernels import npu as NPU

D_MODEL, D_FF, N_LAYERS = 576, 1536, 30
# the random weights' shapes: (d, D, layers); "tiny" checks the script (its timings mean nothing)
SHAPES = {"smollm2-135m": (D_MODEL, D_FF, N_LAYERS), "tiny": (64, 160, 2)}


def _floats(s: str) -> list[float]:
    vals = [float(v) for v in s.split(",") if v.strip()]
    if not vals or any(not 0.0 <= v < 1.0 for v in vals):
        raise argparse.ArgumentTypeError(f"sparsities must be in [0, 1): {s!r}")
    return vals


def layer_weights(kind: str, seed: int = 0, model_ref: str = "smollm2-135m", shape: str = "smollm2-135m"
                  ) -> list[dict]:
    """Per layer: gate, up [D, d], down [d, D] (fp32), either the real weights of ``model_ref`` (default
    SmolLM2-135M) or random ones of ``shape`` (``SHAPES``)."""
    if kind == "real":
        from workers.loading.adapters import adapter_for
        from workers.loading.models import load_model

        model = load_model(model_ref).model
        ad = adapter_for(model)
        out = []
        for _, layer in ad.iter_layers(model):
            w = ad.ffn_weights(layer)
            out.append(dict(gate=w["gate"].float().contiguous(), up=w["up"].float().contiguous(),
                            down=w["down"].float().contiguous()))
        return out
    g = torch.Generator().manual_seed(seed)
    d, D, n = SHAPES[shape]
    return [dict(gate=torch.randn(D, d, generator=g) / d ** 0.5,
                 up=torch.randn(D, d, generator=g) / d ** 0.5,
                 down=torch.randn(d, D, generator=g) / D ** 0.5) for _ in range(n)]


def prepare(layers: list[dict]) -> list[dict]:
    """Every layout a candidate reads, made once (the timing reads only its own)."""
    out = []
    for w in layers:
        gu = torch.cat([w["gate"], w["up"]])
        out.append(dict(gate=w["gate"], up=w["up"], down=w["down"], gu=gu, gu_t=gu.t().contiguous(),
                        down_t=w["down"].t().contiguous(), gu16=gu.bfloat16(), down16=w["down"].bfloat16()))
    return out


def candidates(L: list[dict], x: torch.Tensor, out_s: list[float], in_s: list[float], seed: int = 0):
    """{name: (callable, bytes read per pass, kind)}; every callable returns the last layer's output."""
    D, d = L[0]["gate"].shape
    n_layers = len(L)
    xv = x[0]
    full = torch.arange(D)
    fid = torch.arange(d)
    off0 = torch.zeros(1, dtype=torch.long)
    dense_bytes = n_layers * 3 * d * D * 4

    def silu_mul(gu):
        return F.silu(gu[..., :D]) * gu[..., D:]

    def f_linear3():
        for w in L:
            y = F.linear(F.silu(F.linear(x, w["gate"])) * F.linear(x, w["up"]), w["down"])
        return y

    def f_linear_gu():
        for w in L:
            y = F.linear(silu_mul(F.linear(x, w["gu"])), w["down"])
        return y

    def f_mv():
        for w in L:
            y = torch.mv(w["down"], silu_mul(torch.mv(w["gu"], xv)))
        return y[None]

    def f_matmul_t():
        for w in L:
            y = silu_mul(x @ w["gu_t"]) @ w["down_t"]
        return y

    def f_mkl_mixed():
        for w in L:
            y = F.linear(silu_mul(x @ w["gu_t"]), w["down"])
        return y

    def f_bag():
        for w in L:
            h = silu_mul(F.embedding_bag(fid, w["gu_t"], off0, per_sample_weights=xv, mode="sum"))
            y = F.embedding_bag(full, w["down_t"], off0, per_sample_weights=h[0], mode="sum")
        return y

    def f_cpu_dense():
        for w in L:
            y = K.dense_ffn(x, w["gate"], w["up"], w["down_t"], "silu")
        return y

    x16 = x.bfloat16()

    def f_bf16():
        for w in L:
            y = F.linear(silu_mul(F.linear(x16, w["gu16"])), w["down16"])
        return y.float()

    fns = {"dense F.linear x3": (f_linear3, dense_bytes, "dense"),
           "dense F.linear gate|up": (f_linear_gu, dense_bytes, "dense"),
           "dense torch.mv": (f_mv, dense_bytes, "dense"),
           "dense x @ W^T": (f_matmul_t, dense_bytes, "dense"),
           "dense mkl mixed": (f_mkl_mixed, dense_bytes, "dense"),
           "dense embedding_bag": (f_bag, dense_bytes, "dense"),
           "dense cpu kernels": (f_cpu_dense, dense_bytes, "dense"),
           "dense bf16 F.linear": (f_bf16, dense_bytes // 2, "dense-bf16")}

    g = torch.Generator().manual_seed(seed)
    for s in out_s:
        k = int(round(D * (1 - s)))
        idx = torch.randperm(D, generator=g)[:k].sort().values.to(torch.int32)
        nb = n_layers * 3 * k * d * 4

        def f_out(idx=idx):
            for w in L:
                y = K.sparse_ffn(x, w["gate"], w["up"], w["down_t"], idx, None, "silu")
            return y

        def f_out_torch(idx=idx):
            os.environ["CTXSPARSE_CPU_NATIVE"] = "0"
            try:
                for w in L:
                    y = K.sparse_ffn(x, w["gate"], w["up"], w["down_t"], idx, None, "silu")
            finally:
                os.environ.pop("CTXSPARSE_CPU_NATIVE")
            return y

        def f_out_index(idx=idx):
            for w in L:
                y = NPU.sparse_ffn(x, w["gate"], w["up"], w["down_t"], idx, None, "silu")
            return y

        fns[f"out s={s} cpu kernels"] = (f_out, nb, "out")
        fns[f"out s={s} torch prims"] = (f_out_torch, nb, "out")
        fns[f"out s={s} index_select"] = (f_out_index, nb, "out")

    # input sparsity: thresholds at the s-quantile of |x| and of |h| (h from the dense layer 0)
    h0 = silu_mul(x @ L[0]["gu_t"])
    for s in in_s:
        tx = float(torch.quantile(x.abs(), s)) if s > 0 else -1.0
        th = float(torch.quantile(h0.abs(), s)) if s > 0 else -1.0
        kx = int((x.abs() > tx).sum())
        nb = n_layers * (kx * 2 * D + int(round(D * (1 - s))) * d) * 4

        def f_in(tx=tx, th=th):
            for w in L:
                y = K.input_sparse_linear(silu_mul(K.input_sparse_linear(x, w["gu_t"], tx)), w["down_t"], th)
            return y

        def f_in_torch(tx=tx, th=th):
            os.environ["CTXSPARSE_CPU_NATIVE"] = "0"
            try:
                for w in L:
                    y = K.input_sparse_linear(silu_mul(K.input_sparse_linear(x, w["gu_t"], tx)), w["down_t"], th)
            finally:
                os.environ.pop("CTXSPARSE_CPU_NATIVE")
            return y

        fns[f"in s={s} cpu kernels"] = (f_in, nb, "in")
        fns[f"in s={s} embedding_bag"] = (f_in_torch, nb, "in")
    return fns


def fixed_set_predictor(D: int, k: int, seed: int):
    """A predictor whose scores are a fixed random vector: the top-k costs what it costs, nothing else (the
    sparse FFN's own ceiling in the decode table)."""
    from workers.sparsity.predictors.base import MLPPredictor

    class FixedSet(MLPPredictor):
        method = "fixed"

        def __init__(self):
            super().__init__("ffn_in", "topk", k, D)
            self.s = torch.rand(D, generator=torch.Generator().manual_seed(seed))

        def scores(self, x):
            return self.s.expand(x.shape[0], -1)

    return FixedSet()


SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                     rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
# the decode table's random model of each shape (SHAPES)
MODEL_SHAPES = {"smollm2-135m": SMOLLM2_SHAPE,
                "tiny": dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)}


def _methods(s: str) -> list[tuple[str, float, dict]]:
    """METHOD:S[:KEY=VALUE+KEY=VALUE...],... -> [(method, s, options)] (option values parsed as JSON where they
    parse, else strings)."""
    out = []
    for part in (p for p in s.split(",") if p.strip()):
        name, _, rest = part.partition(":")
        sp, _, opts = rest.partition(":")
        try:
            v = float(sp)
        except ValueError:
            raise argparse.ArgumentTypeError(f"methods are METHOD:SPARSITY[:KEY=VALUE+...], got {part!r}") from None
        if not name or not 0.0 <= v < 1.0:
            raise argparse.ArgumentTypeError(f"methods are METHOD:SPARSITY with sparsity in [0, 1), got {part!r}")
        options = {}
        for kv in (o for o in opts.split("+") if o):
            key, eq, val = kv.partition("=")
            if not key or not eq:
                raise argparse.ArgumentTypeError(f"method options are KEY=VALUE joined by '+', got {kv!r}")
            try:
                options[key] = json.loads(val)
            except ValueError:
                options[key] = val
        out.append((name.strip(), v, options))
    if not out:
        raise argparse.ArgumentTypeError("no methods given")
    return out


def _setting(m: str, sp: float, options: dict) -> str:
    opts = " ".join(f"{k}={v}" for k, v in sorted(options.items()))
    return f"{m} s={sp}" + (f" {opts}" if opts else "")


def _head(options: dict) -> tuple[dict | None, dict]:
    """(the predicted head of a method's options, ``head=RANK/K`` or ``head=RANK/K/SCREEN``; the other options)."""
    options = dict(options)
    spec = options.pop("head", None)
    if spec is None:
        return None, options
    parts = str(spec).split("/")
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts[:2]):
        raise argparse.ArgumentTypeError(f"head=RANK/K[/SCREEN], got head={spec}")
    return ({"rank": int(parts[0]), "candidates": int(parts[1]), **({"screen": parts[2]} if len(parts) == 3 else {})},
            options)


def fitted_plans(lm, methods: list[tuple[str, float, dict]], calib_tokens: int) -> dict:
    """{"METHOD s=S [options]": plan} fitted on ``calib_tokens`` lambada calibration tokens (uniform allocation).
    An option ``head=RANK/K[/SCREEN]`` adds the predicted output head (``dense:0:head=64/2048``: the head alone)."""
    from workers.loading.data import token_windows
    from workers.sparsity.capture import FINAL, capture_activations, sweep_components
    from workers.sparsity.fit import fit_setting
    from workers.sparsity.predictors.base import CAPTURES, FitContext
    from workers.names import DENSE

    toks = token_windows(lm.tokenizer, "lambada", "calib", calib_tokens, 512)
    heads = [_head(o) for _, _, o in methods]        # (head, the method's own options) each
    # input thresholds need the gate's and the inputs' histograms only; predictors the residual stream and more
    inputs_only = all(m in ("teal", "wina", DENSE) for m, _, _ in methods)
    extra = [FINAL] if any(h for h, _ in heads) else []
    components = ("gate", "inhist", *extra) if inputs_only else sweep_components(
        [c for m, _, _ in methods for c in CAPTURES.get(m, ())] + extra)
    cache = capture_activations(lm, toks, components=components, progress=False)
    ctx = FitContext(lm, cache, list(range(lm.dims.n_layers)))
    return {_setting(m, sp, o): fit_setting(ctx, m, sp, options=own, head=h).plan
            for (m, sp, o), (h, own) in zip(methods, heads)}


def plan_perplexity(lm, plans: dict, tokens: int) -> dict:
    """Held-out lambada perplexity of the dense model (key None) and of each plan (sparse_exec, masked)."""
    from workers.evals.perplexity import perplexity
    from workers.loading.data import token_windows
    from workers.sparsity.sparse_exec import apply_sparsity

    toks = token_windows(lm.tokenizer, "lambada", "heldout", tokens, 512)
    out = {None: perplexity(lm.model, toks).ppl}
    for n, plan in plans.items():
        with apply_sparsity(lm.model, plan, input_mode="masked", mode="masked"):
            out[n] = perplexity(lm.model, toks).ppl
    return out


def decode_table(repeats: int, gen: int, prompt: int, sparsities: list[float], ranks: list[int],
                 weights: str = "real", dense_rows: bool = False, methods: list[tuple[str, float]] | None = None,
                 calib_tokens: int = 2048, ppl_tokens: int = 0, model_ref: str = "smollm2-135m",
                 shape: str = "smollm2-135m") -> list[Row]:
    """SmolLM2-135M (fp32) batch-1 greedy decode: every setting's steps timed one by one, the settings interleaved
    round by round in this process; median ms/token and IQR over all steps of all rounds. Dense three ways (torch
    matmuls; kernels.cpu's row kernels over every row; the row kernels with the torch glue instead of the native
    norms and attention); the sparse settings run their sparse FFN through
    kernels.cpu and the other projections the way ``dense_rows`` says. ``methods``: fitted plans instead (see the
    module doc), decoded from a held-out text prompt."""
    from workers.decode.latency import random_plan
    from workers.decode.runtime import DecodeRuntime
    from workers.decode.weights import random_hf_model
    from workers.loading.models import load_model
    from workers.sparsity.predictors.base import SparsityPlan, k_for

    lm = None
    if weights == "real":
        lm = load_model(model_ref)
        model = lm.model
        label = model_ref
    elif methods:
        raise ValueError("--methods fits plans on the real weights: use --weights real")
    else:                        # random weights of SmolLM2-135M's shapes (same bytes, same timing)
        import transformers as tf

        model = random_hf_model(tf.LlamaConfig(**MODEL_SHAPES[shape]), torch.float32, "cpu")
        label = shape
    rt = DecodeRuntime.from_hf(model)
    D, nl = rt.dims.D, len(rt.layers)
    # (plan, cpu_rows, glue): the runtime's default glue on the CPU is the native norms and attention ("auto");
    # "torch glue" rows are the same step with the torch functions, to show what the native glue saves
    settings = {"dense torch matmul": (None, False, "auto"), "dense cpu kernels": (None, True, "auto"),
                "dense cpu kernels torch glue": (None, True, "torch")}
    ppl = {}
    if methods:
        plans = fitted_plans(lm, methods, calib_tokens)
        for n, plan in plans.items():
            settings[n] = (plan, dense_rows, "auto")
        if ppl_tokens:
            ppl = plan_perplexity(lm, plans, ppl_tokens)
        sparsities = []
    for s in sparsities:      # the other projections as in the dense path chosen by dense_rows
        settings[f"mlp s={s} fixed set"] = (SparsityPlan(mlp={l: fixed_set_predictor(D, k_for(s, D), l)
                                                                  for l in range(nl)}), dense_rows, "auto")
        for r in ranks:
            settings[f"mlp s={s} dejavu r={r}"] = (random_plan(model, s, None, rank=r, seed=1), dense_rows, "auto")
    if methods:               # input sparsity depends on the text: a held-out prompt, not random ids
        from workers.loading.data import token_windows

        ids = token_windows(lm.tokenizer, "lambada", "heldout", 1024, 512).windows[:1, :prompt]
    else:
        ids = torch.randint(0, rt.vocab, (1, prompt), generator=torch.Generator().manual_seed(0))
    times: dict[str, list[float]] = {n: [] for n in settings}
    sparsity = {}
    names = list(settings)
    for r in range(repeats + 1):                         # round 0 warms up
        for n in (names if r % 2 == 0 else names[::-1]):
            plan, rows_k, glue = settings[n]
            if glue != rt.glue:
                rt.configure(glue=glue)
            rt.configure(cpu_rows=rows_k)
            rt.set_plan(plan)
            rt.setup(1, prompt + gen)
            rt.prefill(ids)
            for _ in range(gen - 1):
                t0 = time.perf_counter()
                rt.step()
                if r:
                    times[n].append((time.perf_counter() - t0) * 1e3)
            sp = rt.realized_sparsity()
            sparsity[n] = sp.get("weights", sp.get("mlp"))
    base = min((n for n in names if n.startswith("dense")), key=lambda n: statistics.median(times[n]))
    rows = []
    print(f"decode: {label} ({weights} weights) fp32 batch 1, prompt {prompt}, {gen - 1} steps x {repeats} "
          f"rounds, {torch.get_num_threads()} threads; fastest dense: {base}")
    print(f"{'setting':<28}{'ms/token':>10}{'IQR':>8}{'x dense':>9}{'sparsity':>10}" + (f"{'ppl':>9}{'vs dense':>10}"
                                                                                    if ppl else ""))
    for n in names:
        t = Timing.of(times[n], "ms")
        ratio = statistics.median(times[base]) / t.median
        rows.append(Row.measured("cpu_decode", n, t, shape=label, dtype="fp32", batch=1, device="cpu",
                                 extra=dict(iqr=t.iqr, vs_fastest_dense=ratio, fastest_dense=base,
                                            realized_sparsity=sparsity[n], prompt_len=prompt, gen_len=gen,
                                            repeats=repeats, threads=torch.get_num_threads(),
                                            ppl=ppl.get(n if settings[n][0] is not None else None), ppl_dense=ppl.get(None))))
        sp = f"{sparsity[n]:10.3f}" if sparsity[n] is not None else " " * 10
        pp = ""
        if ppl:
            v = ppl[n] if settings[n][0] is not None else ppl[None]
            pp = f"{v:9.3f}{100 * (v / ppl[None] - 1):+9.1f}%"
        print(f"{n:<28}{t.median:>10.2f}{t.iqr:>8.2f}{ratio:>8.2f}x{sp}{pp}")
    print("sparsity: FFN neurons not computed; for input sparsity, decoder projection weight bytes not read")
    return rows


def eval_table(tokens: int, sparsity: float, repeats: int, model_ref: str = "smollm2-135m") -> list[Row]:
    """Perplexity of SmolLM2-135M on ``tokens`` held-out tokens: dense, and the oracle MLP plan at ``sparsity``
    through sparse_exec in its two modes (token-sparse kernels; masked dense), interleaved; seconds each."""
    from workers.evals.perplexity import perplexity
    from workers.loading.data import token_windows
    from workers.loading.models import load_model
    from workers.sparsity.predictors.base import SparsityPlan, k_for
    from workers.methods.oracle.predictor import OracleMLP
    from workers.sparsity.sparse_exec import apply_sparsity

    lm = load_model(model_ref)
    ad, dims = lm.adapter, lm.dims
    toks = token_windows(lm.tokenizer, "lambada", "heldout", tokens, 512)
    layers = ad.decoder_layers(lm.model)
    plan = SparsityPlan(mlp={l: OracleMLP(ad.ffn_weights(layers[l]), ad.act_name(lm.model.config),
                                          k_for(sparsity, dims.D)) for l in range(dims.n_layers)}, dense_gate=True)
    ppl = {}

    def run(mode):
        def f():
            if mode is None:
                ppl["dense"] = perplexity(lm.model, toks).ppl
                return
            with apply_sparsity(lm.model, plan, mode=mode) as applied:
                ppl[mode] = perplexity(lm.model, toks).ppl
                ppl[mode + " sparsity"] = applied.stats.mlp_sparsity()
        return f

    cmp = time_cpu({"dense": run(None), f"oracle s={sparsity} kernel": run("kernel"),
                    f"oracle s={sparsity} masked": run("masked")}, repeats=repeats, unit="s")
    print(f"eval: {model_ref} perplexity on {toks.windows.numel()} tokens (windows of 512), "
          f"{torch.get_num_threads()} threads, {repeats} rounds")
    print(cmp.table())
    print(f"ppl dense {ppl['dense']:.4f}; kernel {ppl['kernel']:.4f}; masked {ppl['masked']:.4f} "
          f"(mlp sparsity {ppl['masked sparsity']:.3f})")
    rows = []
    for n, t in cmp.timings.items():
        mode = n.rsplit(" ", 1)[-1] if n != "dense" else "dense"
        rows.append(Row.measured("cpu_eval", n, t, shape=model_ref, dtype="fp32", batch=None, device="cpu",
                                 extra=dict(tokens=int(toks.windows.numel()), ppl=ppl[mode] if mode != "dense"
                                            else ppl["dense"], iqr=t.iqr, vs_dense=1 / cmp.ratio(n),
                                            threads=torch.get_num_threads())))
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.cpu_ops", description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=None, help="rounds (ops 30, decode 5, eval 2)")
    ap.add_argument("--decode", action="store_true", help="end-to-end SmolLM2 decode instead of the ops")
    ap.add_argument("--eval", action="store_true", help="perplexity evaluation time instead of the ops")
    ap.add_argument("--gen", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--ranks", default="64,256", help="Deja Vu predictor ranks in the decode table")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--dense-rows", action="store_true",
                    help="decode: sparse settings run their dense projections through the row kernels")
    ap.add_argument("--weights", choices=("random", "real"), default="random")
    ap.add_argument("--model", default="smollm2-135m", help="the model whose real weights are read (--weights real, "
                                                            "--eval)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m",
                    help="the random weights' shape (tiny: a check of the script)")
    ap.add_argument("--methods", type=_methods, default=None,
                    help="decode: fitted plans METHOD:SPARSITY,... (e.g. threshold:0.5,teal:0.35) instead of the "
                         "fixed-set / Deja Vu rows (needs --weights real)")
    ap.add_argument("--calib-tokens", type=int, default=2048, help="decode --methods: calibration tokens")
    ap.add_argument("--ppl-tokens", type=int, default=0, help="decode --methods: held-out perplexity tokens (0: none)")
    ap.add_argument("--out-sparsity", type=_floats, default=[0.3, 0.5, 0.7])
    ap.add_argument("--in-sparsity", type=_floats, default=[0.25, 0.4, 0.5, 0.7])
    ap.add_argument("--json", default="cpu_ops")
    args = ap.parse_args(argv)
    if args.threads < 1 or (args.repeats is not None and args.repeats < 1) or args.gen < 2 or args.tokens < 512:
        ap.error("--threads/--repeats must be >= 1, --gen >= 2, --tokens >= 512")
    if args.methods and (not args.decode or args.weights != "real"):
        ap.error("--methods needs --decode and --weights real")
    if args.calib_tokens < 512 or args.ppl_tokens < 0:
        ap.error("--calib-tokens must be >= 512 and --ppl-tokens >= 0")
    torch.set_num_threads(args.threads)
    print(device_line("cpu"), flush=True)
    if args.decode or args.eval:
        with torch.no_grad():
            if args.decode:
                ranks = [int(r) for r in args.ranks.split(",") if r]
                rows = decode_table(args.repeats or 5, args.gen, args.prompt, [0.5, 0.7], ranks, args.weights,
                                    args.dense_rows, args.methods, args.calib_tokens, args.ppl_tokens, args.model,
                                    args.shape)
            else:
                rows = eval_table(args.tokens, 0.5, args.repeats or 2, args.model)
        name = args.json if args.json != "cpu_ops" else ("cpu_decode" if args.decode else "cpu_eval")
        print(f"wrote {write_results(name, rows, command=command_line('benchmarks.cpu_ops'), device='cpu')}")
        return 0
    args.repeats = args.repeats or 30
    if not K.native_available():
        print("note: no C compiler found; kernels.cpu runs its torch-primitive fallback")
    L = prepare(layer_weights(args.weights, model_ref=args.model, shape=args.shape))
    d, D = L[0]["gate"].shape[1], L[0]["gate"].shape[0]
    label = f"{args.model if args.weights == 'real' else args.shape} ffn x{len(L)}"
    x = torch.randn(1, d, generator=torch.Generator().manual_seed(1))
    fns = candidates(L, x, args.out_sparsity, args.in_sparsity)
    with torch.no_grad():
        cmp = time_cpu({n: f for n, (f, _, _) in fns.items()}, repeats=args.repeats, warmup=2, unit="us")
    copy_bw = copy_bandwidth(1 << 28, reps=10, device="cpu")
    ref = fns["dense F.linear x3"][0]().double()
    dense = [n for n, (_, _, kind) in fns.items() if kind == "dense"]
    fastest = min(dense, key=lambda n: cmp.timings[n].median)
    base = cmp.timings[fastest].median
    rows = []
    print(f"{label} (d={d}, D={D}): threads={args.threads} repeats={args.repeats} weights={args.weights} "
          f"copy bandwidth {copy_bw:.1f} GB/s (read+write); fastest fp32 dense: {fastest}")
    print(f"{'callable':<30}{'us/pass':>10}{'IQR':>9}{'GB/s':>7}{'x dense':>9}{'max rel err':>13}")
    for n, (f, nbytes, kind) in fns.items():
        t = cmp.timings[n]
        out = cmp.outputs[n].double()
        err = float((out - ref).abs().max() / ref.abs().max()) if kind.startswith("dense") else None
        row = Row.measured("cpu_ops", n, t, nbytes=nbytes, copy_bw_gbps=copy_bw, shape=label,
                           dtype="bf16" if "bf16" in kind else "fp32", batch=1, device="cpu",
                           extra=dict(kind=kind, iqr=t.iqr, vs_fastest_dense=base / t.median,
                                      fastest_dense=fastest, threads=args.threads, weights=args.weights,
                                      native=K.native_available(), rel_err_vs_fp32=err))
        rows.append(row)
        e = f"{err:13.1e}" if err is not None else ""
        print(f"{n:<30}{t.median:>10.0f}{t.iqr:>9.0f}{row.gbps:>7.1f}{base / t.median:>8.2f}x{e}")
    path = write_results(args.json, rows, command=command_line("benchmarks.cpu_ops"), device="cpu",
                         meta=dict(copy_bw_gbps=copy_bw, fastest_dense=fastest))
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
