import torch

from workers.sparsity.predictors.threshold import quantile


def test_quantile_of_a_tensor_larger_than_the_sample_cap():
    g = torch.Generator().manual_seed(0)
    x = torch.rand(25_165_824, generator=g)          # SmolLM2: 16k tokens x 1536 neurons
    assert abs(quantile(x, 0.5) - 0.5) < 2e-3
    assert abs(quantile(x, 0.9) - 0.9) < 2e-3
    small = torch.randn(1000, generator=g)
    assert quantile(small, 0.3) == torch.quantile(small, 0.3).item()
