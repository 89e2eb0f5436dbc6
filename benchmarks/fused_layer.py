"""The input-sparse decoder layer with and without the fusions around its projections, per layer, batch 1.

    python -m benchmarks.fused_layer [--shape llama2-7b] [--sparsities 0.4,0.5,0.7] [--dtype fp16] [--reps 30]
    python -m benchmarks.fused_layer --smoke     # CPU, a tiny shape, the interpreter: checks the script runs

Every layer of the shape gets random weights (W_qkvᵀ, W_oᵀ, W_gate|upᵀ, W_downᵀ, the two RMS-norm weights) and
thresholds calibrated so each projection's input is ``s`` sparse on the values that flow through the chain. Two
chains per layer, all layers in one CUDA graph (``benchmarks.harness.time_graph``; µs per layer):

* unfused (the runtime's step today): RMS norm, QKV, O, add + norm, gate|up, act(gate)·up, down, add + norm;
* fused: QKV with the norm in its prologue, O with the residual add in its epilogue, gate|up with the norm in
  its prologue, down with act(gate)·up in its prologue and the residual add in its epilogue.

Attention sits between QKV and O in a real step; it is the same in both chains and left out (O reads a fixed
vector). Each part is also timed alone (one call per layer, each on its own layer's weights). The two chains'
outputs are compared (relative error) and the fused chain replayed twice for bit-identical output. Writes
``benchmarks/results/<--json>`` (default ``fused_layer_<shape>_<dtype>.json``).

Feeds: BENCHMARKS.md, "GPU kernels against cuBLAS and TEAL's kernel (one H200)".
"""
from __future__ import annotations

import argparse

import torch

from benchmarks.harness import Row, command_line, device_line, device_name, time_graph, write_results
from kernels import ops
from kernels.common import Prologue
from workers.decode.glue import act_mul
from workers.decode.shapes import attn_shape, ffn_shape

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
SMOKE = dict(d=64, D=96, H=4, KV=2, layers=2)


class Layer:
    """One layer's random weights (transposed [in, out], as the input-sparse kernels read them) and thresholds."""

    def __init__(self, d, D, H, KV, hd, dtype, dev, g):
        def rnd(*shape, scale=1.0):
            return (torch.randn(*shape, generator=g) * scale).to(dtype).to(dev)

        self.qkv_sizes = (H * hd, KV * hd, KV * hd)
        self.w_qkv_t = rnd(d, sum(self.qkv_sizes), scale=d**-0.5)
        self.w_o_t = rnd(H * hd, d, scale=(H * hd)**-0.5)
        self.w_gu_t = rnd(d, 2 * D, scale=d**-0.5)
        self.w_down_t = rnd(D, d, scale=D**-0.5)
        self.n1 = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(dev)
        self.n2 = (1 + 0.1 * torch.randn(d, generator=g)).to(dtype).to(dev)
        self.thr = {}

    def nbytes_read(self, s: float) -> float:
        es = self.w_o_t.element_size()
        return (1 - s) * es * sum(w.numel() for w in (self.w_qkv_t, self.w_o_t, self.w_gu_t, self.w_down_t))


def _thr(v, s, n=1, dev=None):
    t = torch.quantile(v.float().abs().flatten().cpu(), s).item()
    return torch.full((n,), t, dtype=torch.float32, device=dev or v.device)


def calibrate(layers, x, a, s, eps, act):
    """Each projection's threshold: the s-quantile of |its input| as the (dense) chain computes it."""
    for L in layers:
        h = ops.rms_norm(x, L.n1, eps)
        L.thr["qkv"] = _thr(h, s, 3)
        L.thr["o"] = _thr(a, s)
        x = x + a @ L.w_o_t
        h2 = ops.rms_norm(x, L.n2, eps)
        L.thr["gu"] = _thr(h2, s, 2)
        m = act_mul(h2 @ L.w_gu_t, act)
        L.thr["down"] = _thr(m, s)
        x = x + m @ L.w_down_t


def chains(layers, x0, a, eps, act, add_norm, act_mul, path):
    """(unfused, fused) callables running every layer once; each returns the residual stream after the last."""
    isl = ops.backend(x0).input_sparse_linear_segments
    D = layers[0].w_down_t.shape[0]

    def unfused():
        x = x0
        h = ops.rms_norm(x, layers[0].n1, eps)
        for i, L in enumerate(layers):
            isl(h, L.w_qkv_t, L.thr["qkv"], L.qkv_sizes, config={"path": path})
            o = isl(a, L.w_o_t, L.thr["o"], (L.w_o_t.shape[1],), config={"path": path})
            x, h = add_norm(x, o, L.n2, eps)
            gu = isl(h, L.w_gu_t, L.thr["gu"], (D, D), config={"path": path})
            y = isl(act_mul(gu, act), L.w_down_t, L.thr["down"], (L.w_down_t.shape[1],), config={"path": path})
            nxt = layers[i + 1].n1 if i + 1 < len(layers) else L.n1
            x, h = add_norm(x, y, nxt, eps)
        return x

    def fused():
        x = x0
        for L in layers:
            isl(x, L.w_qkv_t, L.thr["qkv"], L.qkv_sizes, config={"path": path}, prologue=Prologue("rms", L.n1, eps))
            x = isl(a, L.w_o_t, L.thr["o"], (L.w_o_t.shape[1],), config={"path": path}, residual=x)
            gu = isl(x, L.w_gu_t, L.thr["gu"], (D, D), config={"path": path}, prologue=Prologue("rms", L.n2, eps))
            x = isl(gu, L.w_down_t, L.thr["down"], (L.w_down_t.shape[1],), config={"path": path},
                    prologue=Prologue("act_mul", act=act), residual=x)
        return x

    return unfused, fused


def parts(layers, x, a, eps, act, add_norm, act_mul):
    """{part: one call per layer}: each projection alone, plain and fused, and the glue the fusions remove."""
    isl = ops.backend(x).input_sparse_linear_segments
    D = layers[0].w_down_t.shape[0]
    d = x.shape[1]
    gu0 = torch.randn(1, 2 * D, device=x.device, dtype=x.dtype)
    m0 = act_mul(gu0, act)
    norm = Prologue("rms", layers[0].n1, eps)
    return {
        "rms norm": [lambda L=L: ops.rms_norm(x, L.n1, eps) for L in layers],
        "add + norm": [lambda L=L: add_norm(x, x, L.n2, eps) for L in layers],
        "act(gate)*up": [lambda: act_mul(gu0, act) for _ in layers],
        "qkv": [lambda L=L: isl(x, L.w_qkv_t, L.thr["qkv"], L.qkv_sizes) for L in layers],
        "qkv + norm prologue": [lambda L=L: isl(x, L.w_qkv_t, L.thr["qkv"], L.qkv_sizes,
                                                prologue=norm._replace(weight=L.n1)) for L in layers],
        "o": [lambda L=L: isl(a, L.w_o_t, L.thr["o"], (d,)) for L in layers],
        "o + residual": [lambda L=L: isl(a, L.w_o_t, L.thr["o"], (d,), residual=x) for L in layers],
        "gate|up": [lambda L=L: isl(x, L.w_gu_t, L.thr["gu"], (D, D)) for L in layers],
        "gate|up + norm prologue": [lambda L=L: isl(x, L.w_gu_t, L.thr["gu"], (D, D),
                                                    prologue=norm._replace(weight=L.n2)) for L in layers],
        "down": [lambda L=L: isl(m0, L.w_down_t, L.thr["down"], (d,)) for L in layers],
        "down + act*up prologue + residual": [
            lambda L=L: isl(gu0, L.w_down_t, L.thr["down"], (d,), prologue=Prologue("act_mul", act=act),
                            residual=x) for L in layers],
    }


def _glue(dev):
    if dev.type == "cuda":      # the runtime's glue on CUDA: the compiled torch add + norm and act·mul
        from workers.decode.glue import glue_fns

        fns = glue_fns(True, "torch")
        return (lambda x, y, w, eps: fns["add_norm"](x, y, w, None, "rms", eps)), fns["act_mul"]
    return (lambda x, y, w, eps: ops.add_rms_norm(x, y, w, eps)), act_mul


@torch.no_grad()
def run(shape: str, dtype: torch.dtype, sparsities, reps: int, device: str, smoke: bool, path: str,
        n_layers: int | None = None):
    """Rows and a summary per sparsity; ``n_layers``: that many layers instead of the shape's (the smoke's 2)."""
    layers_given = n_layers
    dev = torch.device(device)
    if smoke:
        d, D, H, KV, n_layers = SMOKE["d"], SMOKE["D"], SMOKE["H"], SMOKE["KV"], SMOKE["layers"]
        act, eps = "silu", 1e-5
    else:
        from workers.decode.shapes import shape_entry

        d, D, _, act = ffn_shape(shape)
        _, H, KV, _ = attn_shape(shape)
        kw = shape_entry(shape)[1]
        n_layers, eps = kw["num_hidden_layers"], kw.get("rms_norm_eps", 1e-5)
    n_layers = layers_given or n_layers
    shape = "tiny" if smoke else shape          # what the rows name
    hd = d // H
    g = torch.Generator().manual_seed(0)
    layers = [Layer(d, D, H, KV, hd, dtype, dev, g) for _ in range(n_layers)]
    x = torch.randn(1, d, generator=g).to(dtype).to(dev)
    a = torch.randn(1, H * hd, generator=g).to(dtype).to(dev)
    add_norm, act_mul = _glue(dev)
    warmup = 0 if smoke else 3          # the interpreter compiles nothing: nothing to warm
    rows, summary = [], []
    for s in sparsities:
        calibrate(layers, x, a, s, eps, act)
        unfused, fused = chains(layers, x, a, eps, act, add_norm, act_mul, path)
        yu, yf = unfused(), fused()
        err = ((yf.float() - yu.float()).norm() / yu.float().norm()).item()
        same = torch.equal(fused(), yf)
        timed = {}
        for name, fn in (("layer, unfused", unfused), ("layer, fused", fused)):
            t = time_graph(fn, reps=reps, warmup=warmup, per_replay=n_layers, device=device)
            timed[name] = t.median
            rows.append(Row.measured("fused_layer", name, t, nbytes=layers[0].nbytes_read(s), shape=shape,
                                     dtype=str(dtype), extra=dict(s=s, rel_err=err, repeat_identical=same)))
        for name, calls in parts(layers, x, a, eps, act, add_norm, act_mul).items():
            t = time_graph(lambda calls=calls: [c() for c in calls], reps=reps, warmup=warmup, per_replay=n_layers,
                           device=device)
            timed[name] = t.median
            rows.append(Row.measured("fused_layer", name, t, shape=shape, dtype=str(dtype), extra=dict(s=s)))
        summary.append((s, timed, err, same))
    return rows, summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.fused_layer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama2-7b")
    ap.add_argument("--dtype", default="fp16", choices=sorted(DTYPES))
    ap.add_argument("--sparsities", default="0.4,0.5,0.7")
    ap.add_argument("--path", default="local", choices=("local", "tile"), help="the input-sparse kernel path")
    ap.add_argument("--reps", type=int, default=None, help="timed replays (default 30; --smoke 2)")
    ap.add_argument("--layers", type=int, default=None, help="layers (default the shape's; --smoke 2)")
    ap.add_argument("--json", default=None, help="result file (default fused_layer_<shape>_<dtype>.json; --smoke "
                                                 "writes only where given)")
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny shape (the interpreter): checks the script")
    args = ap.parse_args(argv)
    if (args.reps is not None and args.reps < 1) or (args.layers is not None and args.layers < 1):
        ap.error("--reps and --layers must be >= 1")
    try:
        sparsities = [float(v) for v in args.sparsities.split(",")]
    except ValueError:
        ap.error(f"--sparsities must be comma-separated numbers, got {args.sparsities!r}")
    if not all(0.0 <= s < 1.0 for s in sparsities):
        ap.error("--sparsities must lie in [0, 1)")
    device = "cpu" if args.smoke else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        ap.error("needs a CUDA GPU (or --smoke)")
    print(device_line(device), flush=True)
    reps = args.reps or (2 if args.smoke else 30)
    rows, summary = run(args.shape, DTYPES[args.dtype], sparsities, reps, device, args.smoke, args.path, args.layers)
    print(f"{args.shape} {args.dtype}, batch 1, µs per layer ({device_name(device)}; path {args.path})")
    for s, timed, err, same in summary:
        u, f = timed["layer, unfused"], timed["layer, fused"]
        print(f"s={s}: layer unfused {u:.2f}, fused {f:.2f} ({u / f:.3f}x; rel err {err:.2e}, "
              f"repeat identical {same})")
        for name, v in timed.items():
            if not name.startswith("layer"):
                print(f"    {name:38s} {v:8.2f}")
    if not args.smoke or args.json:
        out = write_results(args.json or f"fused_layer_{args.shape}_{args.dtype}.json", rows,
                            command=command_line("benchmarks.fused_layer"), device=device,
                            meta=dict(shape="tiny" if args.smoke else args.shape, path=args.path, reps=reps))
        print("wrote", out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
