"""The prefill's fused RMS norm and rotary embedding (kernels.norm_rope_triton, through the interpreter on the CPU)
against the references, and inside a model: a tiny Llama's and Gemma-3's logits with the scoring forward's
elementwise steps fused (workers.evals.fused_forward) are their eager logits."""
import pytest
import torch

from kernels import reference as R
from tests.kernels.kernel_support import rnd


@pytest.mark.parametrize("d, one_plus", [(64, False), (576, False), (640, True)])
def test_rms_norm_matches_the_reference(d, one_plus, device, gen):
    from kernels import norm_rope_triton as K

    x = rnd((3, 5, d), gen, torch.float32, device, 3.0)
    w = rnd((d,), gen, torch.float32, device)
    got = K.rms_norm(x, w, 1e-6, one_plus)
    want = R.rms_norm(x, (1.0 + w) if one_plus else w, 1e-6, one_plus)
    assert got.shape == x.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="float32"):
        K.rms_norm(x.half(), w, 1e-6)


@pytest.mark.parametrize("batch_cos", [2, 1])
def test_rotary_matches_rotate_half_on_a_transposed_view(batch_cos, device, gen):
    """x as attention makes it: [B, T, H, D] projections viewed as [B, H, T, D] (strided); cos / sin of one batch
    row broadcast over the batch, or one per row."""
    from kernels import norm_rope_triton as K

    B, T, H, D = 2, 5, 3, 64
    x = rnd((B, T, H, D), gen, torch.float32, device, 2.0).transpose(1, 2)
    cos, sin = rnd((batch_cos, T, D), gen, torch.float32, device), rnd((batch_cos, T, D), gen, torch.float32, device)
    got = K.rotary(x, cos, sin)
    c, s = cos[:, None], sin[:, None]
    want = x * c + R.rot_half(x) * s
    assert got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match=r"x \[B, H, T, D\]"):
        K.rotary(x[..., :63], cos[..., :63], sin[..., :63])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_a_models_logits_are_the_same_with_its_norms_and_rotary_fused(family, monkeypatch):
    """Every RMS norm (Gemma-3's q / k norms and four per layer included) and the rotary embedding run through the
    kernels; the logits are the eager model's, and leaving the block restores the eager code."""
    from tests.workers.tiny_model_support import tiny_model
    from workers.evals.fused_forward import fused_elementwise

    monkeypatch.setenv("CTXSPARSE_KERNELS", "triton")          # the kernels on this CPU: Triton's interpreter
    model = tiny_model(family)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(0))
    modeling = __import__(type(model).__module__, fromlist=["apply_rotary_pos_emb"])
    eager_rope = modeling.apply_rotary_pos_emb
    calls = []
    with torch.no_grad():
        want = model(ids).logits
        with fused_elementwise(model) as n_norms:
            assert modeling.apply_rotary_pos_emb is not eager_rope
            from kernels import norm_rope_triton as K
            monkeypatch.setattr(K, "rotary", lambda *a, _f=K.rotary: calls.append(1) or _f(*a))
            got = model(ids).logits
        again = model(ids).logits
    layers = model.config.num_hidden_layers
    assert n_norms == (4 * layers + 2 * layers + 1 if family == "gemma3" else 2 * layers + 1)
    assert len(calls) == 2 * layers                             # q and k of every layer
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert modeling.apply_rotary_pos_emb is eager_rope and torch.equal(again, want)
