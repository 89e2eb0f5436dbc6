"""Head-sparse attention projections (GQA) vs the reference."""
import pytest
import torch

from kernels import attn_triton as T
from kernels import reference as R
from tests.kernels.kernel_support import grid, rel_err, rnd, TOL, up

D_MODEL, HD = 72, 12  # 6 query heads of 12 -> q dim 72


def _q_heads(gen, n_heads, s, mode, device):
    k = int(round((1 - s) * n_heads))
    perm = torch.randperm(n_heads, generator=gen)
    if mode == "fixed":
        return perm[:k].to(torch.int32).to(device), None
    idx = torch.cat([perm[:k], torch.full((2,), 10**6)]).to(torch.int32).to(device)
    return idx, torch.tensor([k], dtype=torch.int32, device=device)


@pytest.mark.parametrize("n_heads,n_kv", [(6, 6), (6, 2), (6, 1)])
@pytest.mark.parametrize("s", [0.0, 0.5, 1.0])
@pytest.mark.parametrize("mode", ["fixed", "padded"])
def test_kv_heads_for(n_heads, n_kv, s, mode, device, gen, poison):
    q_idx, q_count = _q_heads(gen, n_heads, s, mode, device)
    got = T.kv_heads_for(q_idx, q_count, n_heads, n_kv)
    ref = R.kv_heads_for(q_idx, q_count, n_heads, n_kv)
    for g, r in zip(got, ref):
        assert torch.equal(g.cpu(), r.cpu()), (got, ref)
    # each active query head's slot points at its own kv head
    kq = int(q_count) if q_count is not None else q_idx.shape[0]
    for j in range(kq):
        assert int(got[0][int(got[2][j])]) == int(q_idx[j]) // (n_heads // n_kv)


F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16


# in the interpreter (tests/kernels/kernel_support.py): every dtype with each head layout (MHA, GQA) and each
# batch shape (batch 3 adds the bias), every sparsity (0.5 and 1.0 with a padded index buffer) at least once
@grid("dtype,heads,s,batch", [[F32, F16, BF16], [(6, 6), (6, 2)], [0.0, 0.5, 0.9, 1.0], [1, 3]],
      cover=["dtype*heads", "dtype*batch", "s"])
def test_head_sparse_qkv_and_out(dtype, heads, s, batch, device, gen, poison):
    n_heads, n_kv = heads
    mode = "padded" if s in (0.5, 1.0) else "fixed"
    w_qkv = rnd(((n_heads + 2 * n_kv) * HD, D_MODEL), gen, dtype, device, D_MODEL**-0.5)
    bias = rnd(((n_heads + 2 * n_kv) * HD,), gen, dtype, device) if batch == 3 else None
    w_o_t = rnd((n_heads * HD, D_MODEL), gen, dtype, device, (n_heads * HD) ** -0.5)
    x = rnd((batch, D_MODEL), gen, dtype, device)
    q_idx, q_count = _q_heads(gen, n_heads, s, mode, device)
    kv_idx, kv_count, _ = R.kv_heads_for(q_idx, q_count, n_heads, n_kv)
    got = T.head_sparse_qkv(x, w_qkv, q_idx, q_count, kv_idx, kv_count, n_heads, n_kv, HD, bias)
    ref = R.head_sparse_qkv(up(x), up(w_qkv), q_idx, q_count, kv_idx, kv_count, n_heads, n_kv, HD, up(bias))
    for g, r, name in zip(got, ref, "qkv"):
        assert g.shape == r.shape
        err = rel_err(g, r)
        assert err <= TOL[dtype], f"{name}: {err}"
    attn = rnd((batch, q_idx.shape[0], HD), gen, dtype, device)
    y = T.head_sparse_out(attn, w_o_t, q_idx, q_count, HD)
    ry = R.head_sparse_out(up(attn), up(w_o_t), q_idx, q_count, HD)
    err = rel_err(y, ry)
    assert err <= TOL[dtype], f"out: {err}"
