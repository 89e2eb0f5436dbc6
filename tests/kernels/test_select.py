"""kernels.select_triton.topk_select (Triton; interpreted on CPU) vs torch.topk and the reference."""
import pytest
import torch

from kernels import reference as ref
from tests.kernels.kernel_support import grid


def _sel(scores, k, **kw):
    from kernels.select_triton import topk_select

    return topk_select(scores, k, **kw)


# in the interpreter (tests/kernels/kernel_support.py): every dtype (16- and 32-bit keys) with both radix widths,
# every size at least once
@grid("dtype,nk,bits", [[torch.float16, torch.bfloat16, torch.float32],
                        [(1, 1), (7, 3), (32, 16), (300, 150), (1000, 100), (2500, 2499)], [1, 2]],
      cover=["dtype*bits", "nk"])
def test_matches_topk(device, gen, dtype, nk, bits):
    n, k = nk
    # distinct values: distinct finite positive bit patterns, half of them negated (no ties)
    pats = (torch.randperm(0x7AFF, generator=gen)[:n] + 1).to(torch.int16)
    v = pats.view(torch.bfloat16 if dtype == torch.bfloat16 else torch.float16)
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0)
    s = (v.float() * sign).to(dtype).to(device)
    assert s.float().unique().numel() == n
    idx = _sel(s, k, bits=bits)
    assert idx.dtype == torch.int32 and idx.shape == (k,)
    want = torch.topk(s.float(), k).indices.sort().values.to(torch.int32)
    assert torch.equal(idx.cpu(), want.cpu())


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_rows_and_random_values(device, gen, dtype):
    s = torch.randn(3, 777, generator=gen).to(dtype).to(device)
    idx = _sel(s, 200)
    assert idx.shape == (3, 200)
    assert torch.equal(idx.cpu(), ref.topk_select(s, 200).cpu())
    for b in range(3):   # the chosen values are the top-k values (as a multiset, ties aside)
        got = s[b].float().index_select(0, idx[b].long()).sort().values
        assert torch.equal(got.cpu(), torch.topk(s[b].float(), 200).values.sort().values.cpu())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_ties_lowest_index_first(device, gen, dtype):
    s = torch.randint(-3, 4, (513,), generator=gen).to(dtype)
    s[::7] = -0.0
    s[1::11] = 0.0
    s = s.to(device)
    for k in (1, 50, 256, 400, 513):
        assert torch.equal(_sel(s, k).cpu(), ref.topk_select(s, k).cpu()), k


def test_negative_and_extreme_values(device):
    s = torch.tensor([-float("inf"), -1e4, -1.0, -0.5, 0.0, 1e-7, 0.5, 6e4, float("inf")], dtype=torch.float16)
    s = s[torch.randperm(9, generator=torch.Generator().manual_seed(0))].to(device)
    for k in range(1, 10):
        assert torch.equal(_sel(s, k).cpu(), ref.topk_select(s, k).cpu()), k


def test_out_buffer_and_checks(device):
    s = torch.randn(2, 64).to(device)
    out = torch.full((2, 10), -1, dtype=torch.int32, device=device)
    assert _sel(s, 10, out=out) is out and torch.equal(out.cpu(), ref.topk_select(s, 10).cpu())
    with pytest.raises(AssertionError):
        _sel(s, 65)
    with pytest.raises(AssertionError):
        _sel(s.long(), 3)


# the multi-CTA select (three launches over chunks of the row): several chunks, a partial last chunk, batch rows
@pytest.mark.parametrize("dtype,ks", [(torch.float16, (1, 256, 700, 1499)), (torch.bfloat16, (2, 255, 1500))],
                         ids=["float16", "bfloat16"])
def test_multi_cta_matches_the_reference(device, gen, dtype, ks):
    s = torch.randn(3, 1500, generator=gen).to(dtype).to(device)    # 6 chunks of 256, the last one 220 long
    for k in ks:
        idx = _sel(s, k, multi=True, chunk=256)
        assert idx.shape == (3, k) and idx.dtype == torch.int32
        assert torch.equal(idx.cpu(), ref.topk_select(s, k).cpu()), k


def test_multi_cta_ties_span_chunks(device, gen):
    """Few distinct values: the k-th value's ties fill several chunks and only the lowest-index ones are taken,
    which needs the counts of the chunks before each one; -0.0 counts as +0.0."""
    s = torch.randint(-2, 3, (1100,), generator=gen).to(torch.float16)
    s[::5] = -0.0
    s = s.to(device)
    for k in (1, 100, 300, 550, 800, 1099, 1100):
        assert torch.equal(_sel(s, k, multi=True, chunk=256).cpu(), ref.topk_select(s, k).cpu()), k


def test_multi_cta_is_the_default_for_long_16_bit_rows(device, gen, monkeypatch):
    import kernels.select_triton as st

    calls = []
    monkeypatch.setattr(st, "_multi", lambda *a: calls.append(a[0].shape))
    s16 = torch.randn(st.MULTI_MIN_N, generator=gen).to(torch.float16).to(device)
    st.topk_select(s16, 10)
    st.topk_select(s16[: st.MULTI_MIN_N - 1], 10)                  # shorter: the one-CTA kernel
    st.topk_select(s16.float(), 10)                                # fp32 keys: the one-CTA kernel
    assert calls == [(1, st.MULTI_MIN_N)]
    with pytest.raises(AssertionError, match="fp16/bf16"):
        st.topk_select(s16.float(), 10, multi=True)


def _by_the_tie_rule(s, k):
    """The selection as the kernel documents it, from the values alone: every entry above the k-th largest value
    and, of the entries equal to it, the lowest indices (-0.0 equal to +0.0), in ascending index order."""
    v = s.float().cpu()
    v = torch.where(v == 0, torch.zeros(()), v)
    kth = v.sort(descending=True).values[k - 1]
    above = (v > kth).nonzero().flatten()
    ties = (v == kth).nonzero().flatten()[: k - above.numel()]
    return torch.cat([above, ties]).sort().values.to(torch.int32)


# the multi-CTA select as decode runs it: the default dispatch (16-bit rows of MULTI_MIN_N entries or more), chunks of
# MULTI_CHUNK; five chunks, the last one partial. Row 0 has fp16/bf16's natural ties, row 1 few distinct values, so
# the k-th value's ties span every chunk. About 0.5 s a call in the interpreter.
@pytest.mark.parametrize("dtype,ks", [(torch.float16, (1, 1024, 2277, 4500)), (torch.bfloat16, (37, 3000, 4499))],
                         ids=["float16", "bfloat16"])
def test_multi_cta_at_production_settings(device, gen, dtype, ks):
    import kernels.select_triton as st

    assert (st.MULTI_CHUNK, st.MULTI_MIN_N) == (1024, 4096)      # the settings this test stands for
    n = st.MULTI_MIN_N + 404
    s = torch.stack([torch.randn(n, generator=gen), torch.randint(-2, 3, (n,), generator=gen).float()]).to(dtype)
    s[1, ::5] = -0.0
    s = s.to(device)
    for k in ks:
        idx = _sel(s, k).cpu()
        assert idx.shape == (2, k) and idx.dtype == torch.int32
        for b in range(2):
            assert torch.equal(idx[b], _by_the_tie_rule(s[b], k)), (b, k)
        assert torch.equal(idx, ref.topk_select(s, k).cpu()), k


# ---- topk_threshold: each row's k-th largest |x| as the input-sparse kernels' threshold ----
def _thr(x, k, nseg=1):
    from kernels.select_triton import topk_threshold

    return topk_threshold(x, k, nseg)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("nk", [(8, 1), (576, 403), (1536, 922), (3000, 1)])
def test_threshold_keeps_the_top_k(device, gen, dtype, nk):
    n, k = nk
    x = torch.randn(2, n, generator=gen).to(dtype)
    x[1, :3] = 0.0
    x[1, 3] = -0.0
    x = x.to(device)
    t = _thr(x, k, 3)
    assert t.dtype == torch.float32 and t.shape == (2, 3)
    assert torch.equal(t.cpu(), ref.topk_threshold(x, k, 3).cpu())
    a = x.abs().float().cpu()
    kept = a > t[:, :1].cpu()
    kth = torch.topk(a, k, dim=1).values[:, -1:]
    # exactly the entries >= the k-th largest |x|: k of them, more only where the k-th value is tied
    assert torch.equal(kept, a >= kth)
    if dtype == torch.float32:          # distinct values: exactly k per row
        assert (kept.sum(1) == k).all()


def test_threshold_ties_and_zero_kth(device):
    x = torch.tensor([[0.0, -2.0, 2.0, 1.0, -0.0, 0.0, 0.5, -1.0]]).to(device)
    for k, kept in ((1, 2), (2, 2), (3, 4), (5, 5), (6, 8), (8, 8)):   # the tied k-th value keeps its ties
        t = _thr(x, k)
        assert torch.equal(t.cpu(), ref.topk_threshold(x, k).cpu()), k
        assert int((x.abs().cpu() > t.cpu()).sum()) == kept, k
    assert float(_thr(x, 8)) == -1.0                               # the k-th largest is 0: keep everything
