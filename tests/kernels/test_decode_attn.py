"""One-token decode attention (kernels.decode_attn_triton) vs the torch reference the runtime compiles, and a
known answer for both."""
import pytest
import torch

from kernels import decode_attn_triton as T
from kernels import reference as R
from tests.kernels.kernel_support import INTERPRETED, grid, in_default, rel_err, rnd, TOL

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
HD, L = 16, 48
# The kernel rounds its intermediates to the activation dtype where the reference does (normed and rotated q/k,
# scores). Triton's interpreter converts fp32 to bf16 by truncation, not to nearest as the GPU does, so there
# bf16 results drift about twice as far from the reference (2e-2 measured, against 1e-2 between the reference
# and an fp64 evaluation of it).
ATTN_TOL = {**TOL, BF16: 4e-2 if INTERPRETED else TOL[BF16]}


def _rope_tables(n, hd, base=10000.0):
    inv = base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
    ang = torch.arange(n, dtype=torch.float64)[:, None] * inv[None, :]
    ang = torch.cat([ang, ang], dim=1)
    return ang.cos().float(), ang.sin().float()


def _case(gen, dtype, device, B, H, KV, pos, family, compact):
    """Inputs for one call: a cache filled with random history (positions < pos), the new q/k/v, the family's
    extras (RoPE tables; Gemma: q/k norm weights and a sliding window), optionally a compact head set."""
    q = rnd((B, H, HD), gen, dtype, device)
    k, v = rnd((B, KV, HD), gen, dtype, device), rnd((B, KV, HD), gen, dtype, device)
    kc, vc = rnd((B, KV, L, HD), gen, dtype, device), rnd((B, KV, L, HD), gen, dtype, device)
    extra = {}
    if family in ("llama", "gemma"):
        cos, sin = _rope_tables(L, HD)
        extra.update(cos_t=cos.to(device), sin_t=sin.to(device))
    if family == "gemma":
        extra.update(q_norm=(1 + 0.3 * torch.randn(HD, generator=gen)).to(device) * HD ** -0.5,
                     k_norm=(1 + 0.3 * torch.randn(HD, generator=gen)).to(device), window=7)
    if compact == "fixed":
        heads = torch.randperm(H, generator=gen)[: H // 2].sort().values
        q = q[:, heads].contiguous()
        extra.update(q_idx=heads.to(torch.int32).to(device), n_heads=H)
    elif compact == "padded":
        n = max(1, H // 2)
        heads = torch.randperm(H, generator=gen)[:n]
        q = torch.cat([q[:, heads], rnd((B, 2, HD), gen, dtype, device)], dim=1)
        extra.update(q_idx=torch.cat([heads, torch.tensor([10**6, 7])]).to(torch.int32).to(device),
                     q_count=torch.tensor([n], dtype=torch.int32, device=device), n_heads=H)
    return (q, k, v, kc, vc, torch.tensor([pos], device=device)), extra


@grid("dtype,heads,pos,family,compact,batch",
      [[F32, F16, BF16], [(4, 4), (4, 2), (4, 1)], [0, 5, 37], ["opt", "llama", "gemma"], [None, "fixed", "padded"],
       [1, 2]],
      in_default((F32, (4, 2), 37, "llama", None, 2), (F16, (4, 4), 5, "gemma", "padded", 1),
                 (BF16, (4, 1), 37, "gemma", "fixed", 1), (F16, (4, 2), 0, "opt", "padded", 2),
                 (F32, (4, 1), 37, "gemma", None, 1)))
def test_matches_reference(dtype, heads, pos, family, compact, batch, device, gen, poison):
    H, KV = heads
    (q, k, v, kc, vc, p), extra = _case(gen, dtype, device, batch, H, KV, pos, family, compact)
    kc2, vc2 = kc.clone(), vc.clone()
    want = R.decode_attention(q, k, v, kc2, vc2, p, **extra)
    got = T.decode_attention(q, k, v, kc, vc, p, **extra, config={"BLOCK_N": 16})   # several blocks of history
    assert got.shape == want.shape == (batch, q.shape[1] * HD)
    assert rel_err(got, want) < ATTN_TOL[dtype], rel_err(got, want)
    # the cache: position pos written with the reference's normed, rotated key (to one rounding), the rest kept
    assert rel_err(kc[:, :, pos], kc2[:, :, pos]) < (1e-6 if dtype == F32 else ATTN_TOL[dtype] / 2)
    assert torch.equal(vc, vc2)
    keep = torch.ones(L, dtype=torch.bool)
    keep[pos] = False
    assert torch.equal(kc[:, :, keep.to(device)], kc2[:, :, keep.to(device)])
    if "q_count" in extra:   # slots past the count are zeros
        n = int(extra["q_count"])
        assert torch.count_nonzero(got.view(batch, -1, HD)[:, n:]) == 0


@pytest.mark.parametrize("nsplit", [2, 3, 5])
@pytest.mark.parametrize("pos,family,compact", [(37, "llama", None), (37, "gemma", "padded"), (0, "opt", "fixed"),
                                                (20, "gemma", None)])
def test_split_cache_matches_reference(nsplit, pos, family, compact, device, gen, poison):
    """Flash-decoding: the cached positions split over programs and combined in a second launch give the
    reference's result (splits past pos attend to nothing; with the window, splits start at its first
    position); not the bits of one split (another summation order), but the same bits on every call."""
    (q, k, v, kc, vc, p), extra = _case(gen, F16, device, 2, 4, 2, pos, family, compact)
    want = R.decode_attention(q, k, v, kc.clone(), vc.clone(), p, **extra)
    outs = [T.decode_attention(q, k, v, kc.clone(), vc.clone(), p, **extra, config={"BLOCK_N": 16, "nsplit": nsplit})
            for _ in range(2)]
    assert rel_err(outs[0], want) < ATTN_TOL[F16], rel_err(outs[0], want)
    assert torch.equal(outs[0], outs[1])
    if "q_count" in extra:
        assert torch.count_nonzero(outs[0].view(2, -1, HD)[:, int(extra["q_count"]):]) == 0


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("window", [None, 4])
def test_equal_scores_average_the_values(impl, window, device):
    """q = 0 makes every score 0, so the output is the plain mean of the values at the attended positions: the
    cached ones inside the window and the new one at pos."""
    B, H, KV, pos = 1, 2, 1, 9
    g = torch.Generator().manual_seed(0)
    vc = torch.randn(B, KV, L, HD, generator=g, dtype=torch.float64).float().to(device)
    kc = torch.randn(B, KV, L, HD, generator=g).to(device)
    v = torch.randn(B, KV, HD, generator=g).to(device)
    q = torch.zeros(B, H, HD, device=device)
    fn = R.decode_attention if impl == "reference" else T.decode_attention
    out = fn(q, torch.randn(B, KV, HD, generator=g).to(device), v, kc, vc, torch.tensor([pos], device=device),
             window=window).view(B, H, HD)
    lo = 0 if window is None else pos - window + 1
    want = torch.cat([vc[0, 0, lo:pos], v[0]], dim=0).double().mean(0)
    for h in range(H):
        torch.testing.assert_close(out[0, h].double().cpu(), want.cpu(), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(vc[0, 0, pos], v[0, 0])


def test_compact_heads_need_n_heads(device):
    q = torch.zeros(1, 2, HD, device=device)
    kv = torch.zeros(1, 1, HD, device=device)
    cache = torch.zeros(1, 1, L, HD, device=device)
    for fn in (R.decode_attention, T.decode_attention):
        with pytest.raises(ValueError, match="n_heads"):
            fn(q, kv, kv, cache, cache.clone(), torch.tensor([0], device=device),
               q_idx=torch.tensor([0, 1], dtype=torch.int32, device=device))


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("pos", [0, 37])
@pytest.mark.parametrize("family", ["opt", "llama", "gemma"])
@pytest.mark.parametrize("compact", [None, "fixed", "padded"])
@pytest.mark.parametrize("batch", [1, 2])
def test_cpu_native_matches_reference_in_fp64(heads, pos, family, compact, batch, gen):
    """The CPU backend's one native call (fp32) against the reference evaluated in fp64 on the same inputs: the
    output, the key and value written at pos, and nothing else of the cache touched."""
    from kernels import cpu

    assert cpu.native_available(), "the C compiler of this machine should build kernels/cpu_native.c"
    H, KV = heads
    (q, k, v, kc, vc, p), extra = _case(gen, F32, "cpu", batch, H, KV, pos, family, compact)
    kc64, vc64 = kc.double(), vc.double()
    want = R.decode_attention(q.double(), k.double(), v.double(), kc64, vc64, p, **extra)
    got = cpu.decode_attention(q, k, v, kc, vc, p, **extra)
    assert got.dtype == F32 and rel_err(got, want) < 1e-5, rel_err(got, want)
    assert rel_err(kc, kc64) < 1e-6 and torch.equal(vc, vc64.float())
    if "q_count" in extra:
        assert torch.count_nonzero(got.view(batch, -1, HD)[:, int(extra["q_count"]):]) == 0


def test_cpu_native_rejects_a_head_outside_the_range(gen):
    from kernels import cpu

    (q, k, v, kc, vc, p), extra = _case(gen, F32, "cpu", 1, 4, 2, 5, "llama", "fixed")
    extra["q_idx"] = torch.tensor([1, 4], dtype=torch.int32)
    kc0 = kc.clone()
    with pytest.raises(IndexError, match="outside"):
        cpu.decode_attention(q, k, v, kc, vc, p, **extra)
    assert torch.equal(kc, kc0)       # checked before anything is written


@pytest.mark.parametrize("one_plus", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_cpu_native_rms_norms_match_reference(one_plus, batch, gen):
    from kernels import cpu

    x, y = rnd((batch, 72), gen, F32, "cpu"), rnd((batch, 72), gen, F32, "cpu")
    w = 1 + 0.3 * rnd((72,), gen, F32, "cpu")
    want_x, want_h = R.add_rms_norm(x.double(), y.double(), w.double(), 1e-6, one_plus)
    x0 = x.clone()
    got_x, got_h = cpu.add_rms_norm(x, y, w, 1e-6, one_plus)
    assert rel_err(got_x, want_x) < 1e-7 and rel_err(got_h, want_h) < 1e-6
    assert rel_err(cpu.rms_norm(x, w, 1e-6, one_plus), R.rms_norm(x.double(), w.double(), 1e-6, one_plus)) < 1e-6
    assert torch.equal(x, x0)                 # the residual entering the layer is kept (the step reuses it)



def test_splits_for_known_answers(monkeypatch):
    """132 SMs (an H200), hd 128 (tiles of 128 positions): four programs per SM, whole tiles, no empty split."""
    monkeypatch.setattr(T.C, "sm_count", lambda t: 132)
    t = torch.zeros(1)
    assert T.splits_for(1, 32, 192, t, 128) == 1          # a short cache: one launch
    assert T.splits_for(1, 32, 1088, t, 128) == 9         # 16 wanted, 128 positions each at least
    assert T.splits_for(1, 32, 4160, t, 128) == 11        # 16 wanted: 260 -> 384 positions (3 tiles) each
    assert T.splits_for(8, 32, 1088, t, 128) == 2         # wide batch: 2 wanted
    assert T.splits_for(64, 32, 4160, t, 128) == 1
    for B, S, L in ((1, 32, 1088), (1, 16, 4160), (1, 8, 777), (2, 40, 3000)):
        n = T.splits_for(B, S, L, t, 128)
        chunk = -(-(-(-L // n)) // 128) * 128              # decode_attention's chunk for n splits
        assert (n - 1) * chunk < L, (B, S, L, n)           # the last split holds positions
