"""Input builders and error metric shared by the kernel tests."""
import math

import torch

ON_GPU = torch.cuda.is_available()
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}  # relative error norm

D_FF, D_MODEL = 200, 72  # odd, non-multiple-of-block sizes


def rnd(shape, gen, dtype, device, scale=1.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(device)


def make_idx(gen, n, s, mode, device, idx_dtype=torch.int32):
    """Active set of round((1-s)*n) distinct rows. mode 'fixed': idx of exactly K, count None.
    mode 'padded': a longer buffer whose tail is out-of-range junk (must never be read) + count."""
    k = int(round((1 - s) * n))
    perm = torch.randperm(n, generator=gen)
    if mode == "fixed":
        return perm[:k].to(idx_dtype).to(device), None
    pad = 13
    idx = torch.cat([perm[:k], torch.full((pad,), 10**6 + 7)]).to(idx_dtype).to(device)
    return idx, torch.tensor([k], dtype=torch.int32, device=device)


def ffn_weights(gen, dtype, device, d=D_MODEL, n=D_FF):
    wg = rnd((n, d), gen, dtype, device, d**-0.5)
    wu = rnd((n, d), gen, dtype, device, d**-0.5)
    wdt = rnd((n, d), gen, dtype, device, n**-0.5)
    return wg, wu, wdt


def up(t):
    return None if t is None else (t.double() if t.is_floating_point() else t)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in fp64 (NaN anywhere -> inf; ref == 0 -> ||out||)."""
    out = out.double().cpu()
    ref = ref.double().cpu()
    if torch.isnan(out).any():
        return math.inf
    nref = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / nref if nref > 0 else diff


# Without a GPU the Triton kernels run in Triton's interpreter, orders of magnitude slower: there the default
# suite runs each test on a few combinations of its grid (each launch path, each dtype, both edge kinds at least
# once) and the rest of the grid is marked slow (make test-all / make test-slow). On a GPU every combination is
# in the default suite.
INTERPRETED = not ON_GPU


def slow_in_interpreter(test):
    """Mark ``test`` slow in the interpreter only (a test that checks what the interpreter cannot show)."""
    import pytest

    return pytest.mark.slow(test) if INTERPRETED else test


def _id(v) -> str:
    return str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else str(v)


def grid(names: str, axes: list, default) -> "pytest.MarkDecorator":
    """``parametrize(names, product(*axes))``; in the interpreter a combination for which ``default(*combo)`` is
    false is marked slow. Ids name every value (``float16-0.5-1-fixed``)."""
    import itertools

    import pytest

    params = []
    for combo in itertools.product(*axes):
        slow = INTERPRETED and not default(*combo)
        params.append(pytest.param(*combo, id="-".join(_id(v) for v in combo),
                                   marks=(pytest.mark.slow,) if slow else ()))
    return pytest.mark.parametrize(names, params)


def in_default(*combos):
    """A ``default`` predicate for ``grid``: true for exactly the listed combinations."""
    keep = set(combos)
    return lambda *combo: combo in keep
