"""An input-sparse projection's masked input in one pass (kernels.input_mask_triton, through the interpreter on the
CPU): equal to eager PyTorch's abs / multiply / compare / where bit for bit, and used by the masked projections
of a model, whose logits stay the same."""
import pytest
import torch

from kernels import reference as R
from tests.kernels.kernel_support import logits_on_each_backend, rnd


@pytest.mark.parametrize("wina", [False, True])
def test_masked_inputs_equal_eager_bit_for_bit(wina, device, gen):
    from kernels import input_mask_triton as K

    x = rnd((3, 700, 96), gen, torch.float32, device, 2.0)      # 201,600 entries: not a multiple of the block
    x[0, 0, :4] = torch.tensor([0.0, -0.0, 0.5, -0.5])
    scale = rnd((96,), gen, torch.float32, device).abs() if wina else None
    t = 1.5 if not wina else 1.0
    got = K.masked_inputs(x, t, scale)
    want = R.masked_inputs(x, t, scale)
    assert got.shape == x.shape and torch.equal(got, want)
    assert torch.equal(torch.signbit(got), torch.signbit(want))
    frac = (got == 0).float().mean().item()
    assert 0.2 < frac < 0.8                                     # a real mask
    assert torch.equal(K.masked_inputs(x.transpose(0, 1), t, scale), R.masked_inputs(x.transpose(0, 1), t, scale))
    with pytest.raises(ValueError, match="float32"):
        K.masked_inputs(x.half(), t)
    with pytest.raises(ValueError, match="scale of shape"):
        K.masked_inputs(x, t, torch.ones(95, device=device))


def test_a_models_masked_projections_use_it_and_keep_their_logits(monkeypatch):
    """A tiny Llama with TEAL thresholds on every projection, masked mode, counting off (a task unit): with
    ``CTXSPARSE_KERNELS=triton`` the masked inputs come from the one-pass kernel, and the logits equal eager's."""
    from kernels import input_mask_triton as K
    from tests.workers.tiny_model_support import tiny_model
    from workers.sparsity.input_sparse import InputStats, apply_input_sparsity, projection_paths
    from workers.loading.adapters import adapter_for

    model = tiny_model("llama")
    ad = adapter_for(model)
    thresholds = {l: {p: 0.3 for p in projection_paths(ad)} for l in range(2)}
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))

    def sparsified():
        stats = InputStats()
        stats.counting = False
        return apply_input_sparsity(model, thresholds, "abs", "masked", stats)

    out, calls = logits_on_each_backend(monkeypatch, model, ids, K, "masked_inputs", sparsified)
    assert calls == 2 * len(projection_paths(ad))               # every projection of both layers, triton only
    assert torch.equal(out["cpu"], out["triton"])
    with torch.no_grad():
        assert (model(ids).logits - out["cpu"]).abs().max() > 1e-3     # and the mask did something
