"""Input builders and error metric shared by the kernel tests."""
import itertools
import math
import os
import random

import torch

ON_GPU = torch.cuda.is_available()
# Relative error norm (rel_err) allowed against the reference evaluated in fp64 on the same rounded inputs. The
# kernels sum in fp32, so what is left is the output's rounding and at most one rounded intermediate (h on the tl.dot
# paths, attention's scores): a few units of roundoff u. fp16 (u = 2^-11): 2e-3, 4u; bf16 (u = 2^-8): 1e-2, 2.6u;
# fp32: 2e-6 (sums of up to a few hundred terms). Measured over the full FFN, attention and input-sparse grids in the
# interpreter, five random draws each (2026-12-02): largest 3.7e-4 (fp16), 7.7e-3 (bf16, the tl.dot path), 2.6e-7
# (fp32). One row of the ~100 active ones dropped is about 0.1; a dropped split partial far more.
TOL = {torch.float32: 2e-6, torch.float16: 2e-3, torch.bfloat16: 1e-2}

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


# Without a GPU the Triton kernels run in Triton's interpreter, orders of magnitude slower. There the default
# suite runs a seeded sample of each kernel grid (``grid``): every value of every axis named in ``cover`` at least
# once (an axis product such as "dtype*path": every dtype on every launch path), then EXTRA more combinations at
# random; the rest of the grid is marked ``grid`` (make test-all / make test-slow). The sample depends only on the
# seed and the test's name: CTXSPARSE_GRID_SEED (default DEFAULT_GRID_SEED, shown in the report header) picks
# another sample, so CI can rotate it. On a GPU every combination is in the default suite.
INTERPRETED = not ON_GPU
GRID_SEED_ENV = "CTXSPARSE_GRID_SEED"
DEFAULT_GRID_SEED = 0
EXTRA = 2
TRIES = 8


def grid_seed() -> int:
    """The seed of the interpreter's grid samples: $CTXSPARSE_GRID_SEED, else DEFAULT_GRID_SEED."""
    v = os.environ.get(GRID_SEED_ENV, "").strip()
    return int(v) if v else DEFAULT_GRID_SEED


def gpu_meaning_only(test):
    """Mark ``test`` ``grid`` in the interpreter: for a test whose check the interpreter cannot show (run-to-run
    bit identity of a GPU's split reductions: the interpreter runs a launch's programs one after another, so
    there it passes whatever the kernel does). It still runs with the rest of the grids (make test-all)."""
    import pytest

    return pytest.mark.grid(test) if INTERPRETED else test


def _id(v) -> str:
    return str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else str(v)


def _names(names) -> list[str]:
    return [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)


def sample_grid(names, combos, cover=None, extra: int = EXTRA, key: str = "", seed: int | None = None) -> list:
    """A deterministic sample of ``combos`` (tuples of values for ``names``, "a,b,c" or a list): for every group
    of ``cover`` (axis names, or products of them such as "dtype*path"; default: each axis alone) every value
    (tuple of values) that occurs in ``combos`` occurs in the sample; then ``extra`` more combinations drawn at
    random. Greedy: the next pick covers the most values still missing, ties broken at random. Same ``seed``
    (default: grid_seed()) and ``key`` (the test's name), same sample."""
    names = _names(names)
    groups = [tuple(names.index(a.strip()) for a in g.split("*")) for g in (names if cover is None else cover)]
    rng = random.Random(f"{grid_seed() if seed is None else seed}:{key}")
    combos = list(combos)
    needs = {c: frozenset((gi, tuple(c[i] for i in g)) for gi, g in enumerate(groups)) for c in combos}
    best = None
    for _ in range(TRIES):                              # greedy covers from a few random orders: the smallest
        pool = combos[:]
        rng.shuffle(pool)
        todo = set().union(*needs.values()) if combos else set()
        chosen = []
        while todo:
            pick = max(pool, key=lambda c: len(needs[c] & todo))   # the first of the best: a random one
            chosen.append(pick)
            pool.remove(pick)
            todo -= needs[pick]
        if best is None or len(chosen) < len(best[0]):
            best = chosen, pool
    chosen, pool = best
    return chosen + rng.sample(pool, min(extra, len(pool)))


def grid_of(names, combos, default=None, *, cover=None, extra: int = EXTRA):
    """``parametrize(names, combos)`` with ids naming every value (``float16-0.5-1-fixed``); in the interpreter
    the combinations outside ``sample_grid(names, combos, cover, extra, <module.test>)`` are marked ``grid``.
    ``default`` (a predicate over a combination) picks the default combinations by hand instead (older tests)."""
    import pytest

    combos = [tuple(c) for c in combos]

    def deco(fn):
        if not INTERPRETED:
            keep = combos
        elif default is not None:
            keep = [c for c in combos if default(*c)]
        else:
            keep = sample_grid(names, combos, cover, extra, f"{fn.__module__}.{fn.__qualname__}")
        params = [pytest.param(*c, id="-".join(_id(v) for v in c), marks=() if c in keep else (pytest.mark.grid,))
                  for c in combos]
        return pytest.mark.parametrize(names, params)(fn)

    return deco


def grid(names, axes: list, default=None, *, cover=None, extra: int = EXTRA):
    """``grid_of`` over the product of ``axes`` (one list of values per name)."""
    return grid_of(names, itertools.product(*axes), default, cover=cover, extra=extra)


def in_default(*combos):
    """A ``default`` predicate for ``grid``: true for exactly the listed combinations (hand-picked defaults; a
    seeded sample through ``cover`` is the rule)."""
    keep = set(combos)
    return lambda *combo: combo in keep


def logits_on_each_backend(monkeypatch, model, ids, module, name: str, sparsified):
    """A model's logits inside ``sparsified()`` (a block that makes it sparse) with ``CTXSPARSE_KERNELS=cpu`` and
    ``=triton``, and how many times ``module.name`` (a one-pass kernel's entry point) was called meanwhile:
    ({backend: logits}, calls)."""
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a: calls.append(1) or real(*a))
    out = {}
    for kernels in ("cpu", "triton"):
        monkeypatch.setenv("CTXSPARSE_KERNELS", kernels)
        with torch.no_grad(), sparsified():
            out[kernels] = model(input_ids=ids).logits
    return out, len(calls)
