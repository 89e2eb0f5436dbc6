"""Parts of the decode runtime's tests that run the Triton kernels in Triton's interpreter, in a fresh process
(TRITON_INTERPRET must be set before triton is imported): ``python -m tests.workers.decode.interpreted_parts PART...``
prints ``RESULTS {part: "OK" or its traceback}``. tests/workers/decode/test_runtime.py reads them; the process
starts when collection ends (tests/probe_support.py)."""
import collections
import json
import os
import sys
import traceback

import torch

from kernels import ops
from tests.workers.tiny_model_support import runtime_logits, tiny_model
from workers.decode.latency import calibrated_input_plan, random_plan
from workers.decode.runtime import DecodeRuntime


def spy_triton(names):
    # calls of the Triton backend's ops (the namespace kernels.ops dispatches to under CTXSPARSE_KERNELS=triton)
    os.environ["CTXSPARSE_KERNELS"] = "triton"
    ns, calls = ops.backend(torch.zeros(1)), collections.Counter()
    for n in names:
        f = getattr(ns, n)
        setattr(ns, n, lambda *a, _f=f, _n=n, **k: (calls.update([_n]), _f(*a, **k))[1])
    return calls


def attention():
    os.environ["CTXSPARSE_KERNELS"] = "triton"   # every kernels.ops call in Triton (dense steps: only attention)
    for family, heads in (("llama", False), ("gemma3", False), ("opt", False), ("llama", True)):   # qwen2: sparse_step
        m = tiny_model(family)
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(5))
        plan = random_plan(m, 0.0, 0.5, rank=8) if heads else None
        out = {}
        for glue in ("torch", "kernel"):
            rt = DecodeRuntime.from_hf(m, glue=glue).set_plan(plan)
            rt.setup(2, 24)
            rt.prefill(ids)
            out[glue] = torch.stack([rt.step(keep_logits=True) for _ in range(3 if heads else 6)])
        torch.testing.assert_close(out["kernel"], out["torch"], atol=1e-4, rtol=1e-3), family
    for family in ("llama", "opt"):          # the dense O projection through the down kernel (opt: with its bias)
        m = tiny_model(family)
        ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(6))
        out = {o: runtime_logits(m, ids, 3, o_proj=o) for o in ("torch", "kernel")}
        torch.testing.assert_close(out["kernel"], out["torch"], atol=1e-4, rtol=1e-3), family


def sparse_step():
    m = tiny_model("qwen2")                  # QKV with a bias, GQA
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(5))
    rt = DecodeRuntime.from_hf(m).set_plan(random_plan(m, 0.5, 0.5, rank=8))
    rt.setup(1, 12)
    calls = spy_triton(("sparse_ffn", "head_sparse_qkv", "head_sparse_out", "decode_attention"))
    out, seen = {}, {}
    for backend in ("reference", "triton"):
        os.environ["CTXSPARSE_KERNELS"] = backend
        calls.clear()
        rt.prefill(ids)
        out[backend] = torch.stack([rt.step(keep_logits=True) for _ in range(2)])
        seen[backend] = dict(calls)
        assert rt.realized_sparsity() == {"mlp": 0.5, "heads": 0.5}, (backend, rt.realized_sparsity())
    want = dict.fromkeys(("sparse_ffn", "head_sparse_qkv", "head_sparse_out", "decode_attention"), 4)
    assert seen == {"reference": {}, "triton": want}, seen       # 2 steps x 2 layers, each op in Triton
    torch.testing.assert_close(out["triton"], out["reference"], atol=1e-4, rtol=1e-3)
    s = torch.randn(2, 50, generator=torch.Generator().manual_seed(6))
    for impl in ("auto", "triton"):          # the Triton select: ascending top-k indices of every row
        rt.configure(select_impl=impl)
        assert torch.equal(rt.selector.topk(s, 20), torch.topk(s, 20).indices.sort().values.int())
    rt = DecodeRuntime.from_hf(m).set_plan(calibrated_input_plan(m, 0.5, n_tokens=32))
    rt.setup(1, 12)
    calls, got = spy_triton(("input_sparse_linear_segments",)), {}
    # against the CPU default (its own branch of the runtime's input-sparse product, checked against sparse_exec)
    for backend, path in (("cpu", "auto"), ("triton", "mask"), ("triton", "local")):
        os.environ["CTXSPARSE_KERNELS"] = backend
        calls.clear()
        rt.configure(input_path=path)
        rt.prefill(ids)
        got[path] = (rt.step(keep_logits=True), rt.realized_sparsity())
        assert calls["input_sparse_linear_segments"] == (8 if backend == "triton" else 0), (path, calls)
    for path in ("mask", "local"):      # input sparsity on every projection (4 groups a layer) through either path
        torch.testing.assert_close(got[path][0], got["auto"][0], atol=1e-4, rtol=1e-3)
        # the inputs counted alike (a few entries at a threshold may flip with the last bits: 5e-3 of the weights)
        assert all(abs(got[path][1][k] - v) < 5e-3 for k, v in got["auto"][1].items()), (path, got)


def rotated_step():
    # LaRoSA and R-Sparse shape plans (benchmarks.shape_plans) through the Triton kernels against the CPU default's
    from benchmarks.shape_plans import rank_shape_plan, rotated_shape_plan

    m = tiny_model("qwen2")
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(5))
    # one token: LaRoSA's k-th value as the input-sparse kernels' threshold; two: each token's top-k and the
    # union's rows by the down kernel
    for make, B, ops_ in ((rotated_shape_plan, 1, ("topk_threshold", "input_sparse_linear_segments")),
                          (rotated_shape_plan, 2, ("topk_select", "gather_down")),
                          (rank_shape_plan, 1, ("input_sparse_linear_segments",))):
        rt = DecodeRuntime.from_hf(m).set_plan(make(m, 0.3))
        rt.setup(B, 12)
        calls, got = spy_triton(ops_), {}
        for backend in ("cpu", "triton"):
            os.environ["CTXSPARSE_KERNELS"] = backend
            calls.clear()
            rt.prefill(ids[:B])
            got[backend] = (rt.step(keep_logits=True), rt.realized_sparsity())
            assert all(calls[o] == (8 if backend == "triton" else 0) for o in ops_), (make.__name__, B, calls)
        torch.testing.assert_close(got["triton"][0], got["cpu"][0], atol=1e-4, rtol=1e-3)
        assert abs(got["triton"][1]["weights"] - got["cpu"][1]["weights"]) < 5e-3, got
        assert abs(got["cpu"][1]["weights"] - 0.3) < 0.06, got


if __name__ == "__main__":
    torch.set_num_threads(1)
    results = {}
    for name in sys.argv[1:]:
        try:
            globals()[name]()
            results[name] = "OK"
        except BaseException:
            results[name] = traceback.format_exc()
        os.environ.pop("CTXSPARSE_KERNELS", None)
    print("RESULTS " + json.dumps(results))
