import json
import time

import pytest
import torch
import torch.nn.functional as F

import workers.sparsity.capture as capture_mod
from workers.sparsity.capture import CacheCorruptError, capture_activations, open_cache
from workers.loading.data import token_windows

LAYERS = [0, 7, 29]
# SmolLM2 forwards ~100 tokens/s on a 2-core CPU: the captures here are 4 windows of 64 tokens (content checks,
# streaming) and 2 windows of 64 (cache integrity); what is checked does not depend on how many tokens there are
N_TOKENS, WINDOW = 256, 64
ALL_LAYERS = list(range(30))      # at 64 tokens a window, one component of every layer outgrows a 1 MB buffer


@pytest.fixture(scope="module")
def calib(smollm2):
    return token_windows(smollm2.tokenizer, "lambada", "calib", N_TOKENS, WINDOW)


@pytest.fixture(scope="module")
def calib2(smollm2):
    """Two windows: enough for two shards, the least a damaged-cache check needs."""
    return token_windows(smollm2.tokenizer, "lambada", "calib", 2 * WINDOW, WINDOW)


def test_capture_records_consistent_components_and_hits_the_cache(smollm2, calib, tmp_path):
    c = capture_activations(smollm2, calib, layers=LAYERS, root=tmp_path, progress=False)
    assert not c.hit and c.n_tokens == N_TOKENS
    again = capture_activations(smollm2, calib, layers=LAYERS, root=tmp_path, progress=False)
    assert again.hit and again.path == c.path
    mlp = smollm2.model.model.layers[7].mlp
    x = c.load(7, "ffn_in")
    gate, inter = c.load(7, "gate"), c.load(7, "inter")
    assert x.shape == (N_TOKENS, 576) and gate.shape == inter.shape == (N_TOKENS, 1536)
    assert c.load(7, "head_norm").shape == (N_TOKENS, 9) and c.load(7, "residual").shape == (N_TOKENS, 576)
    with torch.no_grad():
        ref_gate = mlp.gate_proj(x)
        ref_inter = F.silu(ref_gate) * mlp.up_proj(x)
    # stored as float16: compare at that precision
    assert torch.allclose(gate, ref_gate, rtol=2e-2, atol=2e-2)
    assert (inter - ref_inter).norm() / ref_inter.norm() < 5e-3
    # the FFN input is the normed residual stream after attention, not the raw residual
    assert not torch.allclose(x, c.load(7, "residual"), atol=1e-2)
    with pytest.raises(KeyError, match="cache has no"):
        c.load(3, "gate")


def test_small_memory_budget_streams_many_shards_with_the_same_content(smollm2, calib, tmp_path):
    # one window per forward in both (a batched forward of 4 windows may round differently on the CPU: what is
    # compared here is the streaming into shards, not the batching)
    one = capture_activations(smollm2, calib, layers=ALL_LAYERS, components=("inter",), root=tmp_path / "a",
                              batch_windows=1, progress=False)
    many = capture_activations(smollm2, calib, layers=ALL_LAYERS, components=("inter",), root=tmp_path / "b",
                               max_buffer_mb=1, batch_windows=1, progress=False)
    assert len(one.manifest["shards"]) == 1 and len(many.manifest["shards"]) == 4   # one 64-token window each
    for layer in (0, 7, 29):
        assert torch.equal(one.load(layer, "inter"), many.load(layer, "inter"))


def test_interrupted_write_leaves_no_cache_that_looks_complete(smollm2, calib2, tmp_path, monkeypatch):
    real = capture_mod.save_file
    calls = {"n": 0}

    def dying_save(tensors, path):
        calls["n"] += 1
        if calls["n"] == 2:
            raise KeyboardInterrupt("killed mid-write")
        real(tensors, path)

    monkeypatch.setattr(capture_mod, "save_file", dying_save)
    with pytest.raises(KeyboardInterrupt):
        capture_activations(smollm2, calib2, layers=ALL_LAYERS, components=("gate",), root=tmp_path,
                            max_buffer_mb=1, progress=False)
    assert calls["n"] == 2
    assert list(tmp_path.iterdir()) == []      # nothing published, scratch removed
    monkeypatch.setattr(capture_mod, "save_file", real)
    c = capture_activations(smollm2, calib2, layers=ALL_LAYERS, components=("gate",), root=tmp_path,
                            max_buffer_mb=1, progress=False)
    assert not c.hit and c.n_tokens == 2 * WINDOW and len(c.manifest["shards"]) == 2


def test_corrupted_cache_is_detected_and_collected_again(smollm2, calib2, tmp_path):
    c = capture_activations(smollm2, calib2, layers=[0], components=("gate",), root=tmp_path, progress=False)
    shard = c.path / c.manifest["shards"][0]["file"]
    data = bytearray(shard.read_bytes())
    data[-100:] = b"\x00" * 100                 # same size, different bytes
    shard.write_bytes(bytes(data))
    with pytest.raises(CacheCorruptError, match="sha256"):
        open_cache(c.path, checksums=True)
    shard.write_bytes(bytes(data[:1000]))       # truncated: caught by the cheap size check on every open
    with pytest.raises(CacheCorruptError, match="size"):
        open_cache(c.path)
    fresh = capture_activations(smollm2, calib2, layers=[0], components=("gate",), root=tmp_path, progress=False)
    assert not fresh.hit
    open_cache(fresh.path, checksums=True)
    assert any(p.name.startswith(".corrupt-") for p in tmp_path.iterdir())


def test_shard_with_flipped_bytes_of_the_same_size_is_not_served_as_a_hit(smollm2, calib2, tmp_path):
    """The damage sits in the tensor data (not the header), the size is unchanged: only the digest can tell."""
    kw = dict(layers=[0], components=("gate",), root=tmp_path, progress=False)

    def flip(cache):
        shard = cache.path / cache.manifest["shards"][0]["file"]
        data = bytearray(shard.read_bytes())
        mid = len(data) // 2
        data[mid:mid + 64] = bytes(b ^ 0xFF for b in data[mid:mid + 64])
        shard.write_bytes(bytes(data))
        assert shard.stat().st_size == cache.manifest["shards"][0]["bytes"]

    c = capture_activations(smollm2, calib2, **kw)
    want = c.load(0, "gate")
    flip(c)
    assert not torch.equal(c.load(0, "gate"), want)          # the flip reads back as different numbers
    again = capture_activations(smollm2, calib2, **kw)
    assert not again.hit and torch.equal(again.load(0, "gate"), want)
    assert [p.name.startswith(".corrupt-") for p in tmp_path.iterdir()].count(True) == 1

    # a shard this process has already checked on a hit is checked again once rewritten
    assert capture_activations(smollm2, calib2, **kw).hit
    time.sleep(0.05)            # file timestamps are coarse: let the clock move past the last write
    flip(again)
    third = capture_activations(smollm2, calib2, **kw)
    assert not third.hit and torch.equal(third.load(0, "gate"), want)


def test_manifest_says_what_it_holds(smollm2, calib2, tmp_path):
    c = capture_activations(smollm2, calib2, layers=[0], components=("head_norm",), root=tmp_path, progress=False)
    m = json.loads((c.path / "manifest.json").read_text())
    assert m["complete"] and m["model_fingerprint"] == smollm2.fingerprint
    assert m["data_fingerprint"] == calib2.fingerprint and m["n_tokens"] == 2 * WINDOW and m["dtype"] == "float16"
    assert m["tokens_per_s"] > 0


def test_bad_arguments(smollm2, calib, tmp_path):
    with pytest.raises(ValueError, match="unknown components"):
        capture_activations(smollm2, calib, components=("attn_probs",), root=tmp_path)
    with pytest.raises(ValueError, match="layers must lie in"):
        capture_activations(smollm2, calib, layers=[30], root=tmp_path)


@pytest.mark.parametrize("family", ["opt", "gpt2", "gemma3"])
def test_capture_on_other_families(family, tmp_path):
    from tests.workers.tiny_model_support import tiny_model
    from workers.loading.adapters import activation_fn, adapter_for
    from workers.loading.data import TokenSet
    from workers.loading.models import LoadedModel, fingerprint

    m = tiny_model(family)
    ad = adapter_for(m)
    lm = LoadedModel(model=m, tokenizer=None, ref=family, adapter=ad, dims=ad.dims(m.config),
                     fingerprint=fingerprint(m), source="config")
    ids = torch.randint(0, 128, (3, 16))
    toks = TokenSet(ids, "random", "calib", 48, 0, "fp-" + family)
    c = capture_activations(lm, toks, root=tmp_path, progress=False, dtype="float32")
    x, gate, inter = c.load(1, "ffn_in"), c.load(1, "gate"), c.load(1, "inter")
    assert gate.shape == (48, 80) and c.load(1, "head_norm").shape == (48, 4)
    act = activation_fn(ad.act_name(m.config))
    if not ad.ffn.gated:
        torch.testing.assert_close(inter, act(gate))
    else:
        assert inter.shape == (48, 80)


def test_auto_dtype_falls_back_to_bfloat16_when_float16_overflows(tmp_path):
    from tests.workers.tiny_model_support import tiny_model
    from workers.loading.adapters import adapter_for
    from workers.loading.data import TokenSet
    from workers.loading.models import LoadedModel, fingerprint

    m = tiny_model("llama")
    with torch.no_grad():
        m.model.embed_tokens.weight.mul_(1e6)          # residual stream far past float16's 65504
    ad = adapter_for(m)
    lm = LoadedModel(model=m, tokenizer=None, ref="big", adapter=ad, dims=ad.dims(m.config),
                     fingerprint=fingerprint(m), source="config")
    toks = TokenSet(torch.randint(0, 128, (2, 8)), "random", "calib", 16, 0, "fp-big")
    with pytest.raises(OverflowError, match="non-finite"):
        capture_activations(lm, toks, root=tmp_path, progress=False, dtype="float16")
    c = capture_activations(lm, toks, root=tmp_path, progress=False)
    assert c.manifest["dtype"] == "bfloat16" and not c.hit
    assert torch.isfinite(c.load(0, "residual")).all()
    assert capture_activations(lm, toks, root=tmp_path, progress=False).hit
