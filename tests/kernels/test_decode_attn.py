"""One-token decode attention (kernels.decode_attn_triton) vs the torch reference the runtime compiles, and a
known answer for both."""
import pytest
import torch

from kernels import decode_attn_triton as T
from kernels import reference as R
from tests.kernels.kernel_support import INTERPRETED, grid, grid_of, rel_err, rnd, TOL

F32, F16, BF16 = torch.float32, torch.float16, torch.bfloat16
HD, L = 16, 48
# The kernel rounds its intermediates to the activation dtype where the reference does (normed and rotated q/k,
# scores). Triton's interpreter converts fp32 to bf16 by truncation, not to nearest as the GPU does, so there
# bf16 results drift about twice as far from the reference (2e-2 measured, against 1e-2 between the reference
# and an fp64 evaluation of it).
# On an H200 the compiled kernel's exp and its fp32 accumulation order differ from torch's attention that the
# reference runs there: 8 of the full grid's cases went past the interpreter's bounds on 2026-12-02, with
# differences of 3.4e-3 (fp16) and 1.1e-2 to 1.4e-2 (bf16) among those read, hence 5e-3 and 2e-2 on a GPU.
ATTN_TOL = {**TOL, F16: TOL[F16] if INTERPRETED else 5e-3, BF16: 4e-2 if INTERPRETED else 2e-2}


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


# in the interpreter: every dtype with every family (RoPE, q/k norms and the window) and every head layout, every
# family with every head layout and every position (empty history, inside and past the window), each GQA ratio and
# batch (tests/kernels/kernel_support.py)
@grid("dtype,heads,pos,family,compact,batch",
      [[F32, F16, BF16], [(4, 4), (4, 2), (4, 1)], [0, 5, 37], ["opt", "llama", "gemma"], [None, "fixed", "padded"],
       [1, 2]],
      cover=["dtype*family", "dtype*compact", "family*compact", "family*pos", "heads", "batch"])
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


SPLIT_CASES = [(37, "llama", None), (37, "gemma", "padded"), (0, "opt", "fixed"), (20, "gemma", None)]


# in the interpreter: every dtype, split count (the combine's padded lanes) and case at least once
@grid_of("dtype,nsplit,pos,family,compact", [(dt, n, *c) for dt in (F32, F16, BF16) for n in (2, 3, 5)
                                             for c in SPLIT_CASES],
         cover=["dtype", "nsplit", "pos*family*compact"])
def test_split_cache_matches_reference(dtype, nsplit, pos, family, compact, device, gen, poison):
    """Flash-decoding: the cached positions split over programs and combined in a second launch give the
    reference's result (splits past pos attend to nothing; with the window, splits start at its first
    position); not the bits of one split (another summation order), but the same bits on every call."""
    (q, k, v, kc, vc, p), extra = _case(gen, dtype, device, 2, 4, 2, pos, family, compact)
    want = R.decode_attention(q, k, v, kc.clone(), vc.clone(), p, **extra)
    outs = [T.decode_attention(q, k, v, kc.clone(), vc.clone(), p, **extra, config={"BLOCK_N": 16, "nsplit": nsplit})
            for _ in range(2)]
    assert rel_err(outs[0], want) < ATTN_TOL[dtype], rel_err(outs[0], want)
    assert torch.equal(outs[0], outs[1])
    if "q_count" in extra:
        assert torch.count_nonzero(outs[0].view(2, -1, HD)[:, int(extra["q_count"]):]) == 0


def _attention_by_definition(q, k, v, k_cache, v_cache, pos, cos_t=None, sin_t=None, q_norm=None, k_norm=None,
                             eps=1e-6, window=None, q_idx=None, q_count=None, n_heads=None, valid=None):
    """Decode attention written from its definition, one (token, query slot) at a time in fp64: slot j's head
    (q_idx[j], or j) reads KV head head // (H / KV); its query and the new key are normed (x / rms(x) * w) and
    rotated (x cos + rot_half(x) sin at pos); it attends over the positions t <= pos inside the window
    (t > pos - window) whose (KV head, t) entry is ``valid``, position pos from the new key and value, the others
    from the caches; slots past q_count are 0. Nothing is written."""
    f64 = lambda t: None if t is None else t.detach().double().cpu()        # noqa: E731
    q, k, v, kc, vc = f64(q), f64(k), f64(v), f64(k_cache), f64(v_cache)
    B, S, hd = q.shape
    G = (n_heads or S) // k.shape[1]
    p, half = int(pos), hd // 2

    def prep(x, w):
        if w is not None:
            x = x / (x.pow(2).mean() + eps).sqrt() * f64(w)
        if cos_t is not None:
            x = x * f64(cos_t)[p] + torch.cat([-x[half:], x[:half]]) * f64(sin_t)[p]
        return x

    out = torch.zeros(B, S, hd, dtype=torch.float64)
    for b in range(B):
        for j in range(S if q_count is None else int(q_count)):
            g = (j if q_idx is None else int(q_idx[j])) // G
            qx = prep(q[b, j], q_norm)
            ts = [t for t in range(p + 1)
                  if (window is None or t > p - window) and (valid is None or bool(valid[b, g, t]))]
            keys = torch.stack([prep(k[b, g], k_norm) if t == p else kc[b, g, t] for t in ts])
            vals = torch.stack([v[b, g] if t == p else vc[b, g, t] for t in ts])
            out[b, j] = torch.softmax(keys @ qx, dim=0) @ vals
    return out.reshape(B, S * hd)


def _active_mask(gen, B, KV, pos, H, q_idx, q_count, device):
    """kv_mode "active"'s mask [B, KV, L] as the runtime builds it (KVCache.mark_written): earlier positions
    written for a random part of the (KV head, position) entries; at pos exactly the KV heads the active query
    heads need."""
    valid = torch.rand(B, KV, L, generator=gen) < 0.6
    heads = range(H) if q_idx is None else q_idx[: H if q_count is None else int(q_count)].tolist()
    at_pos = torch.zeros(KV, dtype=torch.bool)
    at_pos[[h // (H // KV) for h in heads]] = True
    valid[:, :, pos] = at_pos
    valid[:, :, pos + 1:] = False
    return valid.to(device)


@pytest.mark.parametrize("pos", [5, 37])
@pytest.mark.parametrize("family", ["opt", "llama", "gemma"])
@pytest.mark.parametrize("compact", [None, "fixed", "padded"])
def test_active_kv_mode_matches_the_definition(pos, family, compact, device, gen):
    """kv_mode "active" (``valid``: only the KV heads the active query heads need are written each step, the rest
    masked out of later attention): the reference in fp64 and in fp32 against the definition; the Triton and CPU
    ops, which hand ``valid`` to the reference, give its bits in every dtype (the reference's own fp16/bf16 rounding
    of the scores is what the Triton kernel is checked against above); the cache written at pos for every KV head."""
    from kernels import cpu

    H, KV = 4, 2
    (q, k, v, kc, vc, p), extra = _case(gen, F32, device, 2, H, KV, pos, family, compact)
    extra["valid"] = _active_mask(gen, 2, KV, pos, H, extra.get("q_idx"), extra.get("q_count"), device)
    want = _attention_by_definition(q, k, v, kc, vc, p, **extra)
    assert torch.isfinite(want).all()
    kc64, vc64 = kc.double(), vc.double()
    got = R.decode_attention(q.double(), k.double(), v.double(), kc64, vc64, p, **extra)
    assert rel_err(got, want) < 1e-6, rel_err(got, want)         # the reference's scores and norms are fp32
    assert torch.equal(vc64[:, :, pos], v.double()) and rel_err(kc64[:, :, :pos], kc[:, :, :pos]) == 0
    backends = [T.decode_attention] + ([cpu.decode_attention] if device == "cpu" else [])
    for dtype in (F32, F16, BF16):
        ins = lambda: (q.to(dtype), k.to(dtype), v.to(dtype), kc.to(dtype), vc.to(dtype), p)     # noqa: E731
        r = ins()
        ref = R.decode_attention(*r, **extra)
        if dtype == F32:
            assert rel_err(ref, want) < TOL[F32], rel_err(ref, want)
        for fn in backends:
            a = ins()
            assert torch.equal(fn(*a, **extra), ref) and torch.equal(a[3], r[3]) and torch.equal(a[4], r[4])


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("window", [None, 4])
@pytest.mark.parametrize("masked", [False, True])
def test_equal_scores_average_the_values(impl, window, masked, device):
    """q = 0 makes every score 0, so the output is the plain mean of the values at the attended positions: the
    cached ones inside the window and the new one at pos; with kv_mode "active"'s mask, only the written ones."""
    B, H, KV, pos = 1, 2, 1, 9
    g = torch.Generator().manual_seed(0)
    vc = torch.randn(B, KV, L, HD, generator=g, dtype=torch.float64).float().to(device)
    kc = torch.randn(B, KV, L, HD, generator=g).to(device)
    v = torch.randn(B, KV, HD, generator=g).to(device)
    q = torch.zeros(B, H, HD, device=device)
    keep = torch.ones(L, dtype=torch.bool)
    if masked:
        keep[[2, 6, 7]] = False                             # never written for this KV head
    fn = R.decode_attention if impl == "reference" else T.decode_attention
    out = fn(q, torch.randn(B, KV, HD, generator=g).to(device), v, kc, vc, torch.tensor([pos], device=device),
             window=window, valid=keep.view(1, 1, L).to(device) if masked else None).view(B, H, HD)
    lo = 0 if window is None else pos - window + 1
    rows = [t for t in range(lo, pos) if keep[t]]
    want = torch.cat([vc[0, 0, rows], v[0]], dim=0).double().mean(0)
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
    assert got.dtype == F32 and rel_err(got, want) < TOL[F32], rel_err(got, want)
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
