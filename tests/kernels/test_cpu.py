"""kernels.cpu (the CPU backend) against the torch reference in fp64: every op, batch 1 and several tokens,
fixed and padded index buffers, nothing / everything active; the compiled row kernels, in every instruction-set
build ``CTXSPARSE_TEST_ISAS`` chooses (tests/kernels/isa_support.py), and the torch-primitive fallback alike; the
input-sparse kernel's thread team at 4 and 8 threads."""
import pytest
import torch

from kernels import cpu as K
from kernels import ops
from kernels import reference as R
from kernels.token_sparse import reference_token_sparse_ffn
from tests.kernels import isa_support
from tests.kernels.kernel_support import D_FF, D_MODEL, ffn_weights, make_idx, rel_err, rnd, up

TOL = 1e-5
pytestmark = pytest.mark.every_isa          # each test taking ``path`` runs on every chosen build


def pytest_generate_tests(metafunc):
    if "path" in metafunc.fixturenames:
        metafunc.parametrize("path", [*isa_support.selected(), "torch"], indirect=True)


@pytest.fixture
def path(request, monkeypatch):
    """Run each test on the compiled kernels, once per instruction-set build (native, avx2, scalar: loaded and
    checked), and on the fallback (CTXSPARSE_CPU_NATIVE=0)."""
    if request.param == "torch":
        monkeypatch.setenv("CTXSPARSE_CPU_NATIVE", "0")
        yield "torch"
        return
    monkeypatch.delenv("CTXSPARSE_CPU_NATIVE", raising=False)
    with isa_support.build(request.param):
        assert K.native_available(), "the C compiler of this machine should build kernels/cpu_native.c"
        yield request.param


def _idx(gen, s, mode, n=D_FF):
    if s == 1.0:      # nothing active
        if mode == "fixed":
            return torch.zeros(0, dtype=torch.int32), None
        return torch.full((7,), 10**6, dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    return make_idx(gen, n, s, mode, "cpu")


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("s,mode", [(0.0, "fixed"), (0.5, "fixed"), (0.7, "padded"), (1.0, "padded"),
                                    (1.0, "fixed")])
def test_ffn_ops_match_reference(path, batch, s, mode, gen):
    wg, wu, wdt = ffn_weights(gen, torch.float32, "cpu")
    x = rnd((batch, D_MODEL), gen, torch.float32, "cpu")
    idx, count = _idx(gen, s, mode)
    want = R.gated_gather_gemv(up(x), up(wg), up(wu), idx, count, "silu")
    assert rel_err(K.gated_gather_gemv(x, wg, wu, idx, count, "silu"), want) <= TOL
    b1, b2 = rnd((D_FF,), gen, torch.float32, "cpu"), rnd((D_MODEL,), gen, torch.float32, "cpu")
    sc = rnd((batch, idx.shape[0]), gen, torch.float32, "cpu")
    want = R.gather_gemv(up(x), up(wu), idx, count, "gelu", up(b1), up(sc))
    assert rel_err(K.gather_gemv(x, wu, idx, count, "gelu", b1, sc), want) <= TOL
    h = rnd((batch, idx.shape[0]), gen, torch.float32, "cpu")
    want = R.gather_down(up(h), up(wdt), idx, count, up(b2))
    assert rel_err(K.gather_down(h, wdt, idx, count, b2), want) <= TOL
    for thr in (None, 0.05):
        want = R.sparse_ffn(up(x), up(wg), up(wu), up(wdt), idx, count, "silu", thr)
        got = K.sparse_ffn(x, wg, wu, wdt, idx, count, "silu", thr)
        assert got.dtype == torch.float32 and got.shape == (batch, D_MODEL)
        assert rel_err(got, want) <= TOL
    for act in ("relu", "gelu_tanh"):
        want = R.sparse_mlp(up(x), up(wu), up(b1), up(wdt), up(b2), idx, count, act)
        assert rel_err(K.sparse_mlp(x, wu, b1, wdt, b2, idx, count, act), want) <= TOL
    if s == 1.0:      # nothing active: exact zeros (plus the bias)
        assert torch.equal(K.sparse_ffn(x, wg, wu, wdt, idx, count), torch.zeros(batch, D_MODEL))
        assert torch.allclose(K.sparse_mlp(x, wu, b1, wdt, b2, idx, count), b2.expand(batch, -1))


@pytest.mark.parametrize("batch", [1, 2, 9])
def test_dense_ffn_and_projections(path, batch, gen):
    wg, wu, wdt = ffn_weights(gen, torch.float32, "cpu")
    x = rnd((batch, D_MODEL), gen, torch.float32, "cpu")
    mask = torch.rand(D_FF, generator=gen) < 0.6
    for m in (None, mask):
        want = R.dense_ffn(up(x), up(wg), up(wu), up(wdt), "silu", m)
        assert rel_err(K.dense_ffn(x, wg, wu, wdt, "silu", m), want) <= TOL
        b1, b2 = rnd((D_FF,), gen, torch.float32, "cpu"), rnd((D_MODEL,), gen, torch.float32, "cpu")
        want = R.dense_mlp(up(x), up(wu), up(b1), up(wdt), up(b2), "relu", m)
        assert rel_err(K.dense_mlp(x, wu, b1, wdt, b2, "relu", m), want) <= TOL
    b = rnd((D_FF,), gen, torch.float32, "cpu")
    assert rel_err(K.linear(x, wg, b), up(x) @ up(wg).T + up(b)) <= TOL
    h = rnd((batch, D_FF), gen, torch.float32, "cpu")
    assert rel_err(K.linear_t(h, wdt, b[:D_MODEL]), up(h) @ up(wdt) + up(b[:D_MODEL])) <= TOL


@pytest.mark.parametrize("batch", [1, 3])
def test_head_ops_match_reference(path, batch, gen):
    H, KV, hd, d = 8, 2, 16, 48
    w_qkv = rnd(((H + 2 * KV) * hd, d), gen, torch.float32, "cpu")
    bias = rnd(((H + 2 * KV) * hd,), gen, torch.float32, "cpu")
    w_o_t = rnd((H * hd, d), gen, torch.float32, "cpu")
    x = rnd((batch, d), gen, torch.float32, "cpu")
    q_idx = torch.tensor([6, 1, 3, 99], dtype=torch.int32)
    q_count = torch.tensor([3], dtype=torch.int32)
    kv_idx, kv_count, _ = R.kv_heads_for(q_idx, q_count, H, KV)
    got = K.head_sparse_qkv(x, w_qkv, q_idx, q_count, kv_idx, kv_count, H, KV, hd, bias)
    want = R.head_sparse_qkv(up(x), up(w_qkv), q_idx, q_count, kv_idx, kv_count, H, KV, hd, up(bias))
    for g_, w_ in zip(got, want):
        assert g_.shape == w_.shape and rel_err(g_, w_) <= TOL
    a = rnd((batch, 4, hd), gen, torch.float32, "cpu")
    want = R.head_sparse_out(up(a), up(w_o_t), q_idx, q_count, hd, up(bias[:d]))
    assert rel_err(K.head_sparse_out(a, w_o_t, q_idx, q_count, hd, bias[:d]), want) <= TOL


@pytest.mark.parametrize("batch", [1, 4])
def test_input_sparse_linear(path, batch, gen):
    n_in, n_out = 150, 70
    x = rnd((batch, n_in), gen, torch.float32, "cpu")
    w_t = rnd((n_in, n_out), gen, torch.float32, "cpu")
    bias = rnd((n_out,), gen, torch.float32, "cpu")
    for t in (0.0, 0.7, torch.tensor(1.3)):
        want = R.input_sparse_linear(up(x), up(w_t), t, up(bias))
        assert rel_err(K.input_sparse_linear(x, w_t, t, bias), want) <= TOL
        assert rel_err(K.input_sparse_linear(x, w_t, t), up(x) * (up(x).abs() > float(t)) @ up(w_t)) <= TOL
    assert torch.equal(K.input_sparse_linear(x, w_t, 1e9), torch.zeros(batch, n_out))           # nothing active
    assert torch.allclose(K.input_sparse_linear(x, w_t, 1e9, bias), bias.expand(batch, -1))
    assert rel_err(K.input_sparse_linear(x, w_t, -1.0), up(x) @ up(w_t)) <= TOL                   # all active
    # segments: column blocks of one Wᵀ, each with its own threshold (strided rows, read in place)
    sizes, thr = [30, 25, 15], torch.tensor([0.2, 0.9, 0.0])
    want = R.input_sparse_linear_segments(up(x), up(w_t), thr, sizes, up(bias))
    assert rel_err(K.input_sparse_linear_segments(x, w_t, thr, sizes, bias), want) <= TOL
    # dispatch: a CPU tensor goes to this backend
    assert rel_err(ops.input_sparse_linear(x, w_t, 0.7), R.input_sparse_linear(up(x), up(w_t), 0.7)) <= TOL


@pytest.mark.parametrize("gated", [True, False])
def test_token_sparse_ffn_per_token_sets(path, gated, gen):
    T = 6
    wg, wu, wdt = ffn_weights(gen, torch.float32, "cpu")
    x = rnd((T, D_MODEL), gen, torch.float32, "cpu")
    mask = torch.rand(T, D_FF, generator=gen) < 0.4
    mask[2] = False                         # a token with nothing selected
    mask[4] = True                          # a token with everything selected
    b_up = None if gated else rnd((D_FF,), gen, torch.float32, "cpu")
    b_down = None if gated else rnd((D_MODEL,), gen, torch.float32, "cpu")
    kw = dict(w_gate=wg if gated else None, b_up=b_up, b_down=b_down)
    for ft in (None, 0.1):
        y, n1, n2 = K.token_sparse_ffn(x, wu, wdt, mask, "silu" if gated else "relu", filter_threshold=ft, **kw)
        want, w1, w2 = reference_token_sparse_ffn(up(x), up(wu), up(wdt), mask, "silu" if gated else "relu",
                                                  w_gate=up(kw["w_gate"]), b_up=up(b_up), b_down=up(b_down),
                                                  filter_threshold=ft)
        assert (n1, n2) == (w1, w2) and rel_err(y, want) <= TOL
    assert torch.equal(y[2], b_down if b_down is not None else torch.zeros(D_MODEL))


def test_native_reads_rows_in_place(monkeypatch, gen):
    """The compiled path never gathers rows into a copy (no index_select / embedding / advanced indexing)."""
    monkeypatch.delenv("CTXSPARSE_CPU_NATIVE", raising=False)
    wg, wu, wdt = ffn_weights(gen, torch.float32, "cpu")
    x = rnd((2, D_MODEL), gen, torch.float32, "cpu")
    idx, count = make_idx(gen, D_FF, 0.5, "padded", "cpu")
    want = R.sparse_ffn(up(x), up(wg), up(wu), up(wdt), idx, count)
    want_thr = R.sparse_ffn(up(x), up(wg), up(wu), up(wdt), idx, count, threshold=0.05)

    def boom(*a, **k):
        raise AssertionError("gathered copy")

    monkeypatch.setattr(torch.Tensor, "index_select", boom)
    monkeypatch.setattr(torch, "index_select", boom)
    monkeypatch.setattr(torch.nn.functional, "embedding", boom)
    assert rel_err(K.sparse_ffn(x, wg, wu, wdt, idx, count), want) <= TOL
    assert rel_err(K.sparse_ffn(x, wg, wu, wdt, idx, count, threshold=0.05), want_thr) <= TOL


def test_bad_index_is_an_error(path, gen):
    wg, wu, wdt = ffn_weights(gen, torch.float32, "cpu")
    x = rnd((1, D_MODEL), gen, torch.float32, "cpu")
    bad = torch.tensor([0, D_FF], dtype=torch.int32)
    with pytest.raises(IndexError):
        K.sparse_ffn(x, wg, wu, wdt, bad)
    with pytest.raises(ValueError):
        K.input_sparse_linear(x, wdt, 0.1)          # wrong shape: [D, d] is not [d, out]


def test_fp64_and_bf16_use_the_torch_path(gen):
    wg, wu, wdt = ffn_weights(gen, torch.float64, "cpu")
    x = rnd((2, D_MODEL), gen, torch.float64, "cpu")
    idx, count = make_idx(gen, D_FF, 0.5, "padded", "cpu")
    assert rel_err(K.sparse_ffn(x, wg, wu, wdt, idx, count), R.sparse_ffn(x, wg, wu, wdt, idx, count)) <= 1e-12
    b = [t.bfloat16() for t in (x, wg, wu, wdt)]
    y = K.sparse_ffn(*b, idx, count)
    assert y.dtype == torch.bfloat16 and rel_err(y, R.sparse_ffn(x, wg, wu, wdt, idx, count)) <= 2e-2


def test_dispatch_cpu_backend(monkeypatch):
    monkeypatch.delenv("CTXSPARSE_KERNELS", raising=False)
    assert ops.backend_name(torch.zeros(1)) == "cpu" and ops.backend(torch.zeros(1)) is K
    monkeypatch.setenv("CTXSPARSE_KERNELS", "reference")
    assert ops.backend(torch.zeros(1)) is R


@pytest.mark.parametrize("batch", [1, 3])
def test_topk_threshold_is_the_reference(path, batch, gen):
    """Each row's k-th largest |x| as the input-sparse threshold (the C quickselect and the fallback): the
    reference's value on distinct values, ties, zeros and a row of zeros, for every k of a short row and a few of a
    long one; |x| > t keeps exactly the entries >= the k-th largest."""
    rows = [torch.randn(batch, 37, generator=gen), torch.randint(-3, 4, (batch, 37), generator=gen).float(),
            torch.zeros(batch, 37)]
    for x in rows:
        for k in range(1, 38):
            t = K.topk_threshold(x, k, 3)
            assert t.shape == (batch, 3) and torch.equal(t, R.topk_threshold(x, k, 3)), k
            kth = x.abs().topk(k, dim=1).values[:, -1:]
            assert torch.equal(x.abs() > t[:, :1], x.abs() >= kth), k
    x = torch.randn(batch, 1536, generator=gen)
    for k in (1, 614, 1535):
        t = K.topk_threshold(x, k)
        assert torch.equal(t, R.topk_threshold(x, k)) and ((x.abs() > t).sum(1) == k).all(), k
    with pytest.raises(ValueError, match="k=0"):
        K.topk_threshold(x, 0)


@pytest.mark.parametrize("batch", [1, 3])
def test_topk_index_is_the_reference_set(path, batch, gen):
    """Each row's k largest as a set, ties at the k-th value by lowest index (the predicted head's candidates): the
    C selection's sampled threshold and its fallback over the whole row (k near n, every value tied, a row whose
    largest values all sit between the sample's points), and the reference, on distinct values and on ties."""
    def same(x, k):
        got = K.topk_index(x, k)
        assert got.shape == (x.shape[0], k) and torch.equal(got.sort(1).values, R.topk_index(x, k)), k
    for x in (torch.randn(batch, 49152, generator=gen), torch.randint(-4, 5, (batch, 5000), generator=gen).float(),
              torch.zeros(batch, 4096)):
        for k in (1, 7, 1024, 2048, x.shape[1] - 1, x.shape[1]):
            same(x, k)
    spikes = torch.randn(batch, 32768, generator=gen)
    spikes[:, 0::16] += 100.0         # the sample (every 16th) sees only these: its threshold is above the 4,000th
    same(spikes, 4000)                # largest, and the selection runs over the whole row
    x = torch.randn(batch, 37, generator=gen)
    for k in range(1, 38):
        same(x, k)
    with pytest.raises(ValueError, match="k=0"):
        K.topk_index(x, 0)


@pytest.mark.parametrize("batch", [1, 3])
def test_head_screen_is_the_reference(path, batch, gen):
    """The screen's int8 tiles (16 vocabulary rows each, a scale per row) against the fp64 sum over the same
    codes: within fp32 summation of r terms; the codes' values are the per-row quantization of S."""
    s = torch.randn(4096, 64, generator=gen)
    hs = R.HeadScreen.of(s)
    assert hs.codes.shape == (256, 64, 16) and hs.nbytes == 4096 * 64 + 4096 * 4
    deq = hs.dequantize()
    assert torch.allclose(deq, s, atol=float(s.abs().amax(1).max()) / 254 + 1e-7)
    assert torch.equal(R.HeadScreen.of(deq).codes, hs.codes)
    z = torch.randn(batch, 64, generator=gen)
    got, want = K.head_screen(z, hs), R.head_screen(z, hs)
    terms = (z.abs().double() @ hs.dequantize().abs().double().t())
    assert bool(((got.double() - want.double()).abs() <= 64 * 2 ** -24 * terms + 1e-30).all())
    with pytest.raises(ValueError, match="multiple of 16"):
        R.HeadScreen.of(torch.randn(100, 8))


@pytest.mark.parametrize("batch", [1, 3])
def test_input_sparse_segments_on_each_tokens_top_k(path, batch, gen):
    """``topk``: every segment keeps each token's own k largest |x_i| (the threshold found in the kernel): the
    reference product on the top-k mask, and k inputs counted per token and segment."""
    n_in, sizes = 150, [30, 25, 15]
    x = rnd((batch, n_in), gen, torch.float32, "cpu")
    w_t = rnd((n_in, sum(sizes)), gen, torch.float32, "cpu")
    bias = rnd((sum(sizes),), gen, torch.float32, "cpu")
    for k in (1, 60, 150):
        keep = torch.zeros(batch, n_in).scatter_(1, x.abs().topk(k, dim=1).indices, 1.0)
        counts = torch.zeros(3, dtype=torch.float64)
        got = K.input_sparse_linear_segments(x, w_t, None, sizes, bias, counts=counts, topk=k)
        assert rel_err(got, (up(x) * up(keep)) @ up(w_t) + up(bias)) <= TOL, k
        assert counts.tolist() == [batch * k] * 3, k
    for bad in ({"topk": 0}, {"topk": 151}):
        with pytest.raises(ValueError, match="topk="):
            K.input_sparse_linear_segments(x, w_t, None, sizes, **bad)
    with pytest.raises(ValueError, match="not both"):
        K.input_sparse_linear_segments(x, w_t, torch.zeros(3), sizes, topk=5)


def test_input_sparse_segments_thread_team_at_4_and_8_threads(cpu_isa, gen):
    """cs_input_sparse_seg at 4 and 8 threads (users decode on every core; oversubscribed here: a correctness
    test): the threads split the output columns (each at least 256), every output's sum over the active inputs in
    one fixed order, so the 1-thread result BIT FOR BIT; scalar and per-channel thresholds, each token's top-k,
    1 and 3 tokens; the active counts the same."""
    n_in, sizes = 300, [1024, 512, 512]                   # 2048 outputs: 8 threads x 256
    w_t = rnd((n_in, sum(sizes)), gen, torch.float32, "cpu")
    bias = rnd((sum(sizes),), gen, torch.float32, "cpu")
    per_channel = torch.rand(n_in, generator=gen)
    for B in (1, 3):
        x = rnd((B, n_in), gen, torch.float32, "cpu")
        for thr, topk in ((torch.tensor([0.3, 0.8, 0.0]), None), ([per_channel, 0.5, 0.2], None), (None, 100)):
            def run(threads, thr=thr, topk=topk, x=x):
                prev = torch.get_num_threads()
                torch.set_num_threads(threads)
                try:
                    counts = torch.zeros(3, dtype=torch.float64)
                    return K.input_sparse_linear_segments(x, w_t, thr, sizes, bias, counts=counts, topk=topk), counts
                finally:
                    torch.set_num_threads(prev)

            y1, c1 = run(1)
            if isinstance(thr, torch.Tensor):            # (the other thresholds: the tests above)
                assert rel_err(y1, R.input_sparse_linear_segments(up(x), up(w_t), thr, sizes, up(bias))) <= TOL
            for T in (4, 8):
                yT, cT = run(T)
                assert torch.equal(yT.view(torch.int32), y1.view(torch.int32)) and torch.equal(cT, c1), (B, T, topk)
