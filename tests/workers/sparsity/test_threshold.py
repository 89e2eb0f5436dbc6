import torch

from workers.methods.threshold.predictor import quantile


def test_quantile_of_a_tensor_larger_than_the_sample_cap():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(25_165_824, generator=g)          # SmolLM2: 16k tokens x 1536 neurons
    assert abs(quantile(x, 0.5) - 0.5) < 2e-3
    assert abs(quantile(x, 0.9) - 0.9) < 2e-3
    small = torch.randn(1000, generator=g)
    assert quantile(small, 0.3) == torch.quantile(small, 0.3).item()


def test_the_fitted_threshold_scores_with_fc1s_bias_as_it_was_calibrated(tmp_path):
    """On a model whose first FFN projection has a bias (OPT's fc1), the threshold is calibrated on fc1's output,
    bias included: the fitted predictor scores with that bias too (as the one rebuilt from a bundle does), so it
    keeps the calibrated fraction of the calibration tokens' neurons."""
    import pytest

    from tests.workers.tiny_model_support import tiny_model
    from workers.loading.adapters import adapter_for
    from workers.loading.data import TokenSet
    from workers.loading.models import LoadedModel
    from workers.sparsity.capture import capture_activations
    from workers.sparsity.predictors import FitContext, fit_method
    from workers.methods.threshold.predictor import GateThreshold

    model = tiny_model("opt")
    ad = adapter_for(model)
    lm = LoadedModel(model, None, "tiny-opt", ad, ad.dims(model.config), "fp-tiny-opt", "random weights")
    ids = torch.randint(0, 128, (4, 32), generator=torch.Generator().manual_seed(0))
    toks = TokenSet(windows=ids, source="random", split="calib", n_tokens=ids.numel(), prefix_len=0,
                    fingerprint="tiny-opt-calib")
    cache = capture_activations(lm, toks, ("ffn_in", "gate"), layers=[0, 1], dtype="float32", root=tmp_path,
                                progress=False)
    plan = fit_method("threshold", FitContext(lm, cache, [0, 1]), {0: 0.5, 1: 0.5})
    for l, pred in plan.mlp.items():
        w = ad.ffn_weights(ad.decoder_layers(model)[l])
        assert pred.b_first is not None and torch.equal(pred.b_first, w["b_up"]) and pred.same_ffn(w)
        rebuilt = GateThreshold.from_parts(pred.config(), {}, w)
        x = cache.load(l, "ffn_in").float()
        assert torch.equal(pred.scores(x), rebuilt.scores(x))
        assert (pred.scores(x) <= 0).float().mean().item() == pytest.approx(0.5, abs=0.01)
