"""An eval unit's forward precision (``suites.matmul``, ``workers.units.matmul_precision``): bf16 runs every sweep
method's sparse model under bfloat16 autocast (checked here on the CPU's autocast, the same op policy an
accelerator's applies to linear layers), close to its fp32 forward but not equal to it, and leaves the process as
it found it."""
from __future__ import annotations

import pytest
import torch

from tests.workers.tiny_model_support import loaded, tiny_model
from workers.loading.data import TokenSet
from workers.names import DENSE, MATMUL_BF16, MATMUL_FP32, MATMUL_TF32
from workers.sparsity.capture import capture_activations
from workers.sparsity.predictors import FitContext, SparsityPlan, fit_method
from workers.sparsity.sparse_exec import apply_sparsity
from workers.units import matmul_precision

# (method, rank, options) of dense and every method a sweep spec can name, at sparsity 0.5
METHODS = [(DENSE, None, {}), ("oracle", None, {}), ("threshold", None, {}), ("svd", 8, {"target": "product"}),
           ("dejavu", 8, {"epochs": 1}), ("teal", None, {}), ("wina", None, {}), ("larosa", None, {}),
           ("rsparse", None, {"rho": 0.8})]


def _windows(seed: int, n: int = 6, seq_len: int = 24) -> torch.Tensor:
    return torch.randint(0, 128, (n, seq_len), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def fitted(request, tmp_path_factory):
    """A tiny model of the family and every method's plan fitted on it."""
    model = tiny_model(request.param)
    lm = loaded(model, "tiny")
    w = _windows(0)
    toks = TokenSet(w, "random", "calib", w.numel(), 0, "random-0")
    cache = capture_activations(lm, toks, root=tmp_path_factory.mktemp("acts"), progress=False, dtype="float32")
    ctx = FitContext(lm, cache, list(range(lm.dims.n_layers)))
    return model, {m: SparsityPlan() if m == DENSE else fit_method(m, ctx, 0.5, rank, **opts)
                   for m, rank, opts in METHODS}


@pytest.mark.parametrize("method", [m for m, _, _ in METHODS])
def test_every_methods_sparse_forward_runs_under_bf16_autocast_close_to_fp32(fitted, method):
    model, plans = fitted
    ids = _windows(1, n=3)
    with torch.no_grad(), apply_sparsity(model, plans[method]):
        with matmul_precision(MATMUL_FP32, "cpu"):
            want = model(ids).logits.float()
        with matmul_precision(MATMUL_BF16, "cpu"):
            got = model(ids).logits
    assert got.dtype == torch.bfloat16 and got.shape == want.shape and torch.isfinite(got).all()
    err = (got.float() - want).abs().mean() / want.abs().mean()
    # dense is within 1 % of fp32 on both tiny models; a threshold on inputs flips where bf16 rounds an input
    # across it, which these random models (many inputs near every threshold) show at up to 20 %
    assert 0 < err < (0.01 if method == DENSE else 0.25), f"{method}: mean relative difference {err:.4f} from fp32"


def test_the_precision_holds_inside_the_block_and_is_restored_after():
    m = torch.backends.cuda.matmul
    before = m.fp32_precision
    with matmul_precision(MATMUL_TF32):
        assert m.fp32_precision == "tf32" and not torch.is_autocast_enabled("cpu")
        with matmul_precision(MATMUL_FP32):
            assert m.fp32_precision == "ieee"
        with matmul_precision(MATMUL_BF16, "cpu"):
            assert m.fp32_precision == "ieee" and torch.is_autocast_enabled("cpu")
            assert torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert m.fp32_precision == "tf32" and not torch.is_autocast_enabled("cpu")
    assert m.fp32_precision == before
    with pytest.raises(ValueError, match="matmul precision 'fp16': fp32, tf32 or bf16"):
        with matmul_precision("fp16"):
            pass
