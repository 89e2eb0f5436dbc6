"""The interpreter's grid sample (tests/kernels/kernel_support.py): coverage, determinism, the seed."""
import itertools

import pytest
import torch

from tests.kernels import kernel_support as KS

AXES = [[torch.float32, torch.float16, torch.bfloat16], [0.0, 0.5, 0.9, 1.0], [1, 3, 8], ["fixed", "padded"],
        ["fused", "split"]]
NAMES = "dtype,s,batch,mode,path"
COMBOS = list(itertools.product(*AXES))
COVER = ["dtype*path", "mode*path", "s", "batch"]


def _covered(sample, group):
    idx = [NAMES.split(",").index(a) for a in group.split("*")]
    return {tuple(c[i] for i in idx) for c in sample}


@pytest.mark.parametrize("seed", range(20))
def test_sample_covers_every_value_of_every_cover_group(seed):
    sample = KS.sample_grid(NAMES, COMBOS, COVER, extra=3, key="t", seed=seed)
    assert len(set(sample)) == len(sample) and set(sample) <= set(COMBOS)
    for group in COVER:
        assert _covered(sample, group) == _covered(COMBOS, group), group
    assert len(sample) <= 6 + 3                # 6 values of dtype*path: a cover of 6 exists, plus the extras


def test_sample_is_fixed_by_seed_and_test_name():
    one = KS.sample_grid(NAMES, COMBOS, COVER, key="a", seed=1)
    assert one == KS.sample_grid(NAMES, COMBOS, COVER, key="a", seed=1)
    others = [KS.sample_grid(NAMES, COMBOS, COVER, key=k, seed=s) for k, s in (("a", 2), ("a", 3), ("b", 1))]
    assert all(set(o) != set(one) for o in others)
    # default cover: every value of every axis
    sample = KS.sample_grid(NAMES, COMBOS, extra=0, key="a", seed=1)
    for i, axis in enumerate(AXES):
        assert {c[i] for c in sample} == set(axis)


def test_grid_seed_from_the_environment(monkeypatch):
    monkeypatch.delenv(KS.GRID_SEED_ENV, raising=False)
    assert KS.grid_seed() == KS.DEFAULT_GRID_SEED
    monkeypatch.setenv(KS.GRID_SEED_ENV, "1234")
    assert KS.grid_seed() == 1234
    assert KS.sample_grid(NAMES, COMBOS, COVER, key="a") == KS.sample_grid(NAMES, COMBOS, COVER, key="a", seed=1234)
    monkeypatch.setenv(KS.GRID_SEED_ENV, "soon")
    with pytest.raises(ValueError):
        KS.grid_seed()


def test_grid_marks_the_rest_of_the_grid(monkeypatch):
    def test_fn(dtype, s, batch, mode, path):
        pass

    for interpreted in (True, False):
        monkeypatch.setattr(KS, "INTERPRETED", interpreted)
        fn = KS.grid(NAMES, AXES, cover=COVER)(test_fn)
        params = fn.pytestmark[-1].args[1]
        assert len(params) == len(COMBOS) and params[0].id == "float32-0.0-1-fixed-fused"
        default = [p.values for p in params if not p.marks]
        assert all(m.name == "grid" for p in params for m in p.marks)
        if interpreted:
            key = f"{test_fn.__module__}.{test_fn.__qualname__}"
            assert sorted(default, key=COMBOS.index) == sorted(KS.sample_grid(NAMES, COMBOS, COVER, key=key),
                                                               key=COMBOS.index)
        else:
            assert default == COMBOS                 # on a GPU: the whole grid by default
        del test_fn.pytestmark
