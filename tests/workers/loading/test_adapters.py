import pytest
import torch
from torch import nn

from workers.loading.adapters import ADAPTERS, activation_fn, adapter_for, get_path, linear_weight
from tests.workers.tiny_model_support import tiny_model

FAMILIES = ["llama", "mistral", "qwen2", "gemma3", "opt", "gpt2"]


@pytest.mark.parametrize("family", FAMILIES)
def test_adapter_finds_ffn_and_attention_with_right_shapes(family):
    model = tiny_model(family)
    ad = adapter_for(model)
    assert ad.family == family
    dims = ad.dims(model.config)
    assert (dims.d, dims.D, dims.n_layers) == (48, 80, 2)
    layers = ad.decoder_layers(model)
    assert len(layers) == dims.n_layers
    for _, layer in ad.iter_layers(model):
        ffn = ad.ffn_module(layer)
        up = linear_weight(get_path(ffn, ad.ffn.up))
        down = linear_weight(get_path(ffn, ad.ffn.down))
        assert tuple(up.shape) == (dims.D, dims.d)
        assert tuple(down.shape) == (dims.d, dims.D)
        if ad.ffn.gated:
            assert tuple(linear_weight(get_path(ffn, ad.ffn.gate)).shape) == (dims.D, dims.d)
        attn = ad.attn_module(layer)
        o = linear_weight(get_path(attn, ad.attn.o))
        assert tuple(o.shape) == (dims.d, dims.n_heads * dims.head_dim)
        if ad.attn.q:
            assert linear_weight(get_path(attn, ad.attn.q)).shape[0] == dims.n_heads * dims.head_dim
            assert linear_weight(get_path(attn, ad.attn.k)).shape[0] == dims.n_kv_heads * dims.head_dim
        assert isinstance(get_path(layer, ad.ffn.norm), nn.Module)
    assert isinstance(get_path(model, ad.final_norm), nn.Module)


@pytest.mark.parametrize("family", FAMILIES)
def test_ffn_recomputed_from_adapter_matches_the_model(family):
    """The adapter's description is enough to recompute the FFN output: act(gate)*up then down."""
    model = tiny_model(family)
    ad = adapter_for(model)
    layer = ad.decoder_layers(model)[1]
    ffn = ad.ffn_module(layer)
    act = activation_fn(ad.act_name(model.config))
    x = torch.randn(5, 48)
    up_m, down_m = get_path(ffn, ad.ffn.up), get_path(ffn, ad.ffn.down)
    h = act(up_m(x)) if not ad.ffn.gated else act(get_path(ffn, ad.ffn.gate)(x)) * up_m(x)
    ours = down_m(h)
    if family == "opt":   # OPT has no MLP module: fc1 -> relu -> fc2 inline in the layer
        ref = layer.fc2(layer.activation_fn(layer.fc1(x)))
    else:
        ref = ffn(x)
    torch.testing.assert_close(ours, ref)


def test_unknown_family_is_a_clear_error():
    class Cfg:
        model_type = "mamba"

    with pytest.raises(ValueError, match="no architecture adapter for model_type 'mamba'"):
        adapter_for(Cfg())


def test_every_family_has_an_adapter():
    assert set(FAMILIES) <= set(ADAPTERS)


def test_post_ffn_norm_gain_only_where_the_family_has_one():
    """Gemma-3 normalizes the FFN output (gain 1 + w); Llama-style families add it to the residual as is."""
    g = tiny_model("gemma3")
    ad = adapter_for(g)
    layer = ad.decoder_layers(g)[0]
    with torch.no_grad():
        layer.post_feedforward_layernorm.weight.copy_(torch.arange(layer.post_feedforward_layernorm.weight.numel()))
    gain = ad.ffn_out_gain(layer)
    assert torch.equal(gain, 1.0 + torch.arange(gain.numel(), dtype=torch.float32))
    # the gain is what the module really applies: norm(y) / gain equals y / rms(y)
    y = torch.randn(3, gain.numel())
    out = layer.post_feedforward_layernorm(y)
    eps = layer.post_feedforward_layernorm.eps
    torch.testing.assert_close(out, gain * y / (y.square().mean(-1, keepdim=True) + eps).sqrt())
    m = tiny_model("llama")
    assert adapter_for(m).ffn_out_gain(adapter_for(m).decoder_layers(m)[0]) is None
