"""A scoring forward's top-k mask: one Triton pass (``kernels.topk_mask_triton``) against ``torch.topk``, a zeroed
mask and a scatter (``base.torch_topk_mask``, what ran before), side by side on the shapes of a 32,768-token
forward's FFN activations; and, as a third way, each row's k-th largest by ``torch.kthvalue`` and one compare
(the same set without ties).

    python -m benchmarks.topk_mask --device cuda --json topk_mask.json

For each width (SmolLM2's FFN 1,536, Gemma-3-270M's 2,048) and kept fraction k / n: µs per mask (a CUDA graph's
replays, median, p10, p90; the order of the ways reversed from one shape to the next), the bytes the one pass must
move (the float32 scores read, one byte of mask written per entry) over that time against the measured copy
bandwidth, each way's ratio to ``torch.topk``, and whether the masks are equal (random normal scores: no ties).

Feeds: BENCHMARKS.md, "GPU kernels against cuBLAS and TEAL's kernel (one H200)".
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

from benchmarks.harness import Row, copy_bandwidth, device_line, time_graph, write_results


def _masks():
    from kernels.topk_mask_triton import topk_mask
    from workers.sparsity.predictors.base import torch_topk_mask

    def kthvalue_mask(s, k):
        return s >= s.kthvalue(s.shape[1] - k + 1, dim=1, keepdim=True).values

    return {"torch_topk": torch_topk_mask, "one_pass": topk_mask, "kthvalue": kthvalue_mask}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.topk_mask", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=32768, help="rows: tokens of one scoring forward")
    ap.add_argument("--widths", default="1536,2048", help="comma list of row widths (FFN neurons)")
    ap.add_argument("--keep", default="0.7,0.5,0.3", help="comma list of kept fractions k / n (1 - sparsity)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--json", default=None, help="result file (a bare name goes under benchmarks/results/)")
    a = ap.parse_args(argv)
    widths = [int(w) for w in a.widths.split(",")]
    keeps = [float(k) for k in a.keep.split(",")]
    if a.tokens < 1 or any(w < 1 for w in widths) or any(not 0 < k <= 1 for k in keeps):
        ap.error("--tokens and --widths take positive numbers, --keep fractions in (0, 1]")
    dev = torch.device(a.device)
    if dev.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        ap.error(f"the one-pass kernel runs on CUDA, or on {a.device} under TRITON_INTERPRET=1 (Triton's interpreter)")
    print(device_line(a.device), flush=True)
    bw = copy_bandwidth(device=a.device) if dev.type == "cuda" else None
    masks = _masks()
    rows, i = [], 0
    gen = torch.Generator(device=dev).manual_seed(0)
    for n in widths:
        s = torch.randn(a.tokens, n, generator=gen, device=dev)
        for keep in keeps:
            k = max(1, round(keep * n))
            order = list(masks) if i % 2 == 0 else list(masks)[::-1]
            i += 1
            times = {name: time_graph(lambda f=masks[name]: f(s, k), reps=a.reps, device=a.device) for name in order}
            want = masks["torch_topk"](s, k)
            line = f"{a.tokens}x{n} k={k:<5}"
            for name, t in times.items():
                equal = torch.equal(masks[name](s, k), want)
                ratio = times["torch_topk"].median / t.median
                rows.append(Row.measured("topk_mask", name, t, nbytes=a.tokens * n * 5, copy_bw_gbps=bw,
                                         shape=f"{a.tokens}x{n}", dtype="fp32", batch=a.tokens, device=a.device,
                                         extra={"k": k, "keep": keep, "equal": equal,
                                                "x_torch_topk": float(f"{ratio:.4g}")}))
                line += f"  {name} {t.median:9.1f} us ({ratio:4.2f}x{'' if equal else ', NOT EQUAL'})"
            print(line, flush=True)
    if bw:
        print(f"copy bandwidth {bw:.0f} GB/s (read + written)")
    if a.json:
        print(f"wrote {write_results(a.json, rows, device=a.device, meta={'copy_bw_gbps': bw})}")
    return 0 if all(r.extra["equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
