"""What counting the realized sparsity costs a scoring forward: one sparse setting's forward with
``stats.counting`` on (what a perplexity unit runs: a reduction per swapped part per forward) and off (what every
task unit runs since: ``workers.units.Units.evaluate``), interleaved in one process, on the same tokens. The
logits of both are compared as well: they must be equal.

    python -m benchmarks.eval_counting --device cpu --settings teal:0.5,threshold:0.5 --batch 16 --seq-len 128 \\
        --threads 2 --repeats 9 --json eval_counting_cpu.json

Feeds: BENCHMARKS.md, "Scoring and evaluation cost".
"""
from __future__ import annotations

import argparse
import sys

import torch

from benchmarks.eval_cost import _id, _setting
from benchmarks.harness import command_line, device_line, time_cpu, write_results
from workers.sparsity.bundle import apply_bundle, load_bundle
from workers.units import Units, bundle_dir


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.eval_counting", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--device", default="cpu")
    p.add_argument("--settings", default="teal:0.5,threshold:0.5", help="method:sparsity[:rank][:option=value],...")
    p.add_argument("--batch", type=int, default=16, help="sequences per forward")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--calib-tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=9, help="interleaved rounds (median reported)")
    p.add_argument("--json", default=None, help="result file (a bare name goes under benchmarks/results/)")
    a = p.parse_args(argv)
    try:
        settings = [_setting(s) for s in a.settings.split(",") if s]
    except ValueError as e:
        p.error(str(e))
    if not settings or a.batch < 1 or a.seq_len < 2 or a.repeats < 1:
        p.error("give at least one setting, --batch >= 1, --seq-len >= 2 and --repeats >= 1")
    torch.set_num_threads(a.threads)
    print(device_line(a.device), flush=True)
    units = Units(device=a.device)
    lm = units.lm(a.model)
    data = {"source": "lambada", "calib_tokens": a.calib_tokens, "metric_tokens": 1024, "seq_len": 512}
    base = {"model": a.model, "model_fp": lm.fingerprint, "data": data, "threads": a.threads, "seed": 0}
    ids = torch.randint(0, lm.model.config.vocab_size, (a.batch, a.seq_len),
                        generator=torch.Generator().manual_seed(0)).to(a.device)
    cuda = a.device.startswith("cuda")
    rows = []
    for st in settings:
        cfg = {**base, **st, "attn_sparsity": None}
        units.run("fit", _id(cfg), cfg)
        bundle = load_bundle(bundle_dir(_id(cfg)))
        with torch.no_grad(), apply_bundle(lm.model, bundle, check_model=False, mode="masked") as applied:
            def forward(counting: bool):
                def run():
                    applied.stats.counting = counting
                    out = lm.model(input_ids=ids).logits
                    if cuda:
                        torch.cuda.synchronize()
                    return out
                return run

            cmp = time_cpu({"counting": forward(True), "not counting": forward(False)}, repeats=a.repeats,
                           warmup=1, unit="ms")
        same = torch.equal(cmp.outputs["counting"], cmp.outputs["not counting"])
        label = f"{st['method']} s={st['sparsity']}"
        print(f"{label}: {a.batch}x{a.seq_len} tokens per forward, logits equal: {same}\n{cmp.table()}", flush=True)
        rows.append({"setting": label, "counting_ms": cmp.timings["counting"].median,
                     "not_counting_ms": cmp.timings["not counting"].median,
                     "speedup": cmp.ratio("not counting"), "logits_equal": same})
        if not same:
            print(f"{label}: the logits differ with counting off", file=sys.stderr)
            return 1
    if a.json:
        path = write_results(a.json, [], command=command_line("benchmarks.eval_counting"), device=a.device,
                             meta={"model": a.model, "threads": a.threads, "batch": a.batch, "seq_len": a.seq_len},
                             sections={"settings": rows})
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
