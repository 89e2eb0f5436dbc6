"""Dispatcher, Ascend index path (on CPU tensors), nn.Module drop-ins, import hygiene."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kernels
from kernels import configs, modules, npu, ops
from kernels import reference as R
from tests.kernels.kernel_support import D_FF, D_MODEL, ffn_weights, make_idx, ON_GPU, rel_err, rnd, up

REPO = Path(__file__).resolve().parents[2]


def test_import_kernels_needs_only_torch():
    code = ("import sys, kernels, kernels.ops, kernels.npu, kernels.modules; "
            "bad = [m for m in ('triton', 'ray', 'pydantic', 'sqlalchemy', 'torch_npu') if m in sys.modules]; "
            "print(bad); sys.exit(1 if bad else 0)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_dispatch_by_device(monkeypatch):
    monkeypatch.delenv("CTXSPARSE_KERNELS", raising=False)
    assert ops.backend_name(torch.zeros(1)) == "cpu"
    monkeypatch.setenv("CTXSPARSE_KERNELS", "npu")
    assert ops.backend(torch.zeros(1)) is npu
    monkeypatch.setenv("CTXSPARSE_KERNELS", "bogus")
    with pytest.raises(ValueError):
        ops.backend_name(torch.zeros(1))
    if ON_GPU:
        monkeypatch.delenv("CTXSPARSE_KERNELS")
        assert ops.backend_name(torch.zeros(1, device="cuda")) == "triton"


def test_op_table_one_rule(monkeypatch):
    """Every op of ops.OPS is a function of kernels.ops and of the reference, and its Triton module has it; an op
    runs the backend's own function where the backend has one and the reference's where it has none."""
    import importlib
    import inspect

    from kernels import cpu

    public = {n for n, f in vars(ops).items() if inspect.isfunction(f) and f.__module__ == ops.__name__
              and not n.startswith("_")}
    assert set(ops.OPS) <= public and set(ops.OPS) <= set(vars(R))
    for name, mod in ops.OPS.items():
        if mod is not None:
            assert callable(getattr(importlib.import_module(f"kernels.{mod}"), name)), name
    monkeypatch.delenv("CTXSPARSE_KERNELS", raising=False)
    x = torch.zeros(1)
    assert ops._op(x, "sparse_ffn") is cpu.sparse_ffn and ops._op(x, "compact") is R.compact
    assert ops._op(x, "topk_select") is R.topk_select
    monkeypatch.setenv("CTXSPARSE_KERNELS", "npu")
    assert ops._op(x, "gather_down") is npu.gather_down and ops._op(x, "decode_attention") is R.decode_attention
    monkeypatch.setenv("CTXSPARSE_KERNELS", "triton")
    assert ops._op(x, "dense_ffn") is R.dense_ffn
    assert ops._op(x, "topk_select") is importlib.import_module("kernels.select_triton").topk_select


def test_topk_select_op():
    """The top-k op: the reference's indices (ascending, ties to the lowest index) on the CPU; ``multi`` is a
    Triton choice, refused elsewhere."""
    s = torch.tensor([[0.5, 2.0, -1.0, 2.0, 0.1, 3.0]])
    assert ops.topk_select(s, 3).tolist() == [[1, 3, 5]] and ops.topk_select(s, 3).dtype == torch.int32
    with pytest.raises(ValueError, match="Triton kernel choice"):
        ops.topk_select(s, 3, multi=False)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("s", [0.0, 0.5, 1.0])
def test_npu_index_path_matches_reference(dtype, s, gen):
    dev = "cpu"
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # computes in the model dtype (h rounded once more)
    wg, wu, wdt = ffn_weights(gen, dtype, dev)
    x = rnd((3, D_MODEL), gen, dtype, dev)
    idx, count = make_idx(gen, D_FF, s, "padded", dev)
    ref = R.sparse_ffn(up(x), up(wg), up(wu), up(wdt), idx, count, "silu")
    assert rel_err(npu.sparse_ffn(x, wg, wu, wdt, idx, count, "silu"), ref) <= tol
    thr = 0.05
    ref = R.sparse_ffn(up(x), up(wg), up(wu), up(wdt), idx, count, "silu", threshold=thr)
    assert rel_err(npu.sparse_ffn(x, wg, wu, wdt, idx, count, "silu", threshold=thr), ref) <= tol
    b1, b2 = rnd((D_FF,), gen, dtype, dev), rnd((D_MODEL,), gen, dtype, dev)
    ref = R.sparse_mlp(up(x), up(wg), up(b1), up(wdt), up(b2), idx, count)
    assert rel_err(npu.sparse_mlp(x, wg, b1, wdt, b2, idx, count), ref) <= tol


def test_dense_fallback_is_the_same_function(monkeypatch, gen):
    monkeypatch.setenv("CTXSPARSE_KERNELS", "reference")
    wg, wu, wdt = ffn_weights(gen, torch.float32, "cpu")
    x = rnd((2, D_MODEL), gen, torch.float32, "cpu")
    idx, count = make_idx(gen, D_FF, 0.1, "padded", "cpu")  # s=0.1 -> dense per the table
    assert configs.use_dense(2, idx.shape[0], D_FF)
    y_dense = ops.sparse_ffn(x, wg, wu, wdt, idx, count)
    y_sparse = ops.sparse_ffn(x, wg, wu, wdt, idx, count, allow_dense=False)
    assert rel_err(y_dense, y_sparse.double()) < 1e-5


def test_modules_match_dense_linears(gen):
    torch.manual_seed(gen.initial_seed())
    dev = "cuda" if ON_GPU else "cpu"
    gate, upp, down = (torch.nn.Linear(D_MODEL, D_FF, bias=False), torch.nn.Linear(D_MODEL, D_FF, bias=False),
                       torch.nn.Linear(D_FF, D_MODEL, bias=False))
    m = modules.SparseGatedMLP.from_linears(gate, upp, down, "silu").to(dev)
    x = torch.randn(2, 3, D_MODEL, device=dev)
    idx = torch.arange(D_FF, device=dev, dtype=torch.int32)
    with torch.no_grad():
        want = down.to(dev)(torch.nn.functional.silu(gate.to(dev)(x)) * upp.to(dev)(x))
        got = m(x, idx)
    assert got.shape == want.shape and rel_err(got, want) < 1e-4
    fc1, fc2 = torch.nn.Linear(D_MODEL, D_FF), torch.nn.Linear(D_FF, D_MODEL)
    mm = modules.SparseMLP.from_linears(fc1, fc2).to(dev)
    with torch.no_grad():
        want = fc2.to(dev)(torch.relu(fc1.to(dev)(x[0])))
        got = mm(x[0], idx)
    assert rel_err(got, want) < 1e-4
    nh, nkv, hd = 6, 3, 12
    q, k, v, o = (torch.nn.Linear(D_MODEL, nh * hd), torch.nn.Linear(D_MODEL, nkv * hd),
                  torch.nn.Linear(D_MODEL, nkv * hd), torch.nn.Linear(nh * hd, D_MODEL))
    qkv = modules.HeadSparseQKV.from_linears(q, k, v, nh, nkv).to(dev)
    out = modules.HeadSparseOut.from_linear(o, nh).to(dev)
    q_idx = torch.tensor([4, 0, 1], dtype=torch.int32, device=dev)  # kv heads 2 and 0
    with torch.no_grad():
        xx = x[0]  # [3, d]
        qq, kk, vv, kv_idx, kv_count, kv_slot = qkv(xx, q_idx)
        full_q = q.to(dev)(xx).view(3, nh, hd)
        full_k = k.to(dev)(xx).view(3, nkv, hd)
        assert rel_err(qq, full_q[:, [4, 0, 1]]) < 1e-4
        assert int(kv_count) == 2 and kv_idx[:2].tolist() == [0, 2] and kv_slot.tolist() == [1, 0, 0]
        assert rel_err(kk[:, :2], full_k[:, [0, 2]]) < 1e-4 and (kk[:, 2:] == 0).all()
        attn = torch.randn(3, 3, hd, device=dev)
        full = torch.zeros(3, nh, hd, device=dev)
        full[:, [4, 0, 1]] = attn
        assert rel_err(out(attn, q_idx), o.to(dev)(full.reshape(3, -1))) < 1e-4


@pytest.mark.grid      # a check only a GPU can show: out of the default suite, skipped by make test-all on a CPU
@pytest.mark.skipif(not ON_GPU, reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("threshold", [None, 0.02])
def test_cuda_graph_capture_and_replay_with_new_sets(threshold, gen):
    from kernels import ffn_triton as T

    dtype, dev = torch.float16, "cuda"
    d, n = 256, 1000
    wg, wu, wdt = ffn_weights(gen, dtype, dev, d, n)
    x = rnd((1, d), gen, dtype, dev)
    idx, count = make_idx(gen, n, 0.5, "padded", dev)
    static = [x.clone(), idx.clone(), count.clone()]
    T.sparse_ffn(*static[:1], wg, wu, wdt, static[1], static[2], threshold=threshold)  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = T.sparse_ffn(static[0], wg, wu, wdt, static[1], static[2], threshold=threshold)
    for s in (0.5, 0.9, 0.0):
        x2 = rnd((1, d), gen, dtype, dev)
        i2, c2 = make_idx(gen, n, s, "padded", dev)
        static[0].copy_(x2)
        static[1][: i2.shape[0]].copy_(i2[: static[1].shape[0]])
        static[2].copy_(torch.clamp(c2, max=static[1].shape[0]))
        g.replay()
        want = T.sparse_ffn(static[0], wg, wu, wdt, static[1], static[2], threshold=threshold)
        assert torch.equal(y, want)
