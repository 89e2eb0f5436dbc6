"""One activation table (kernels.common.ACTS / apply_act) for the torch reference, the Triton kernels (through
the interpreter on CPU) and the model adapters; ``gelu`` is the exact erf GeLU."""
import math

import pytest
import torch

from kernels import common
from kernels import reference as R
from tests.kernels.kernel_support import D_FF, D_MODEL, ffn_weights, make_idx, rel_err, rnd, up

EXACT_GELU = {-3.0: -0.0040496, -1.0: -0.15865525393145707, 0.5: 0.34573123063700656, 1.0: 0.8413447460685429}


def test_the_table():
    assert common.ACTS == {"none": 0, "relu": 1, "silu": 2, "gelu_tanh": 3, "gelu": 4}
    with pytest.raises(ValueError, match=r"unknown activation 'swish'; expected one of \['gelu', 'gelu_tanh'"):
        common.apply_act(torch.zeros(1), "swish")


def test_gelu_is_the_exact_erf_gelu():
    x = torch.tensor(list(EXACT_GELU), dtype=torch.float64)
    got = common.apply_act(x, "gelu")
    want = torch.tensor([v * 0.5 * (1 + math.erf(v / math.sqrt(2))) for v in EXACT_GELU], dtype=torch.float64)
    assert torch.allclose(got, want, rtol=0, atol=1e-12)
    assert torch.allclose(got, torch.tensor(list(EXACT_GELU.values()), dtype=torch.float64), atol=1e-7)
    tanh = common.apply_act(x, "gelu_tanh")
    assert (got - tanh).abs().max() > 1e-5          # a different function from the tanh approximation


@pytest.mark.parametrize("act", ["gelu", "gelu_tanh"])
def test_triton_gelu_matches_the_reference(act, device, gen, poison):
    from kernels import ffn_triton as T

    wg, wu, wdt = ffn_weights(gen, torch.float32, device)
    x = rnd((2, D_MODEL), gen, torch.float32, device, 3.0)
    idx, count = make_idx(gen, D_FF, 0.5, "padded", device)
    out = T.gated_gather_gemv(x, wg, wu, idx, count, act)
    ref = R.gated_gather_gemv(up(x), up(wg), up(wu), idx, count, act)
    assert rel_err(out, ref) <= 1e-6                # fp32 rounding only (seen: ~1e-7)
    other = R.gated_gather_gemv(up(x), up(wg), up(wu), idx, count, "gelu_tanh" if act == "gelu" else "gelu")
    assert rel_err(out, other) > 2e-5               # the other GeLU is ~1e-4 away: this one is computed
    y = T.sparse_ffn(x, wg, wu, wdt, idx, count, act)
    assert rel_err(y, R.sparse_ffn(up(x), up(wg), up(wu), up(wdt), idx, count, act)) <= 1e-5


def test_adapters_use_the_same_table():
    from workers.loading.adapters import ADAPTERS, activation_fn

    x = torch.linspace(-4, 4, 41)
    for name in common.ACTS:
        assert torch.equal(activation_fn(name)(x), common.apply_act(x, name))
    assert {ad.ffn.act for ad in ADAPTERS.values()} <= set(common.ACTS)
    with pytest.raises(ValueError, match="unknown activation 'swiglu'"):
        activation_fn("swiglu")
