"""Kernel tests run the Triton kernels on the GPU when there is one, else on the CPU through
Triton's interpreter. TRITON_INTERPRET must be set before triton is first imported."""
import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import secrets  # noqa: E402

import pytest  # noqa: E402

from tests.kernels import isa_support  # noqa: E402
from tests.kernels.kernel_support import GRID_SEED_ENV, INTERPRETED, grid_seed  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
SEED_ENV = "CTXSPARSE_TEST_SEED"       # every ``gen`` of the run starts from this seed instead of a random one
_GEN_SEED = pytest.StashKey[int]()


def _seeds_line() -> str:
    grids = (f"a seeded sample of each grid ({GRID_SEED_ENV}={grid_seed()}), the rest marked grid" if INTERPRETED
             else "every grid combination (GPU)")
    return f"kernel tests: {grids}; random inputs from a per-test seed shown on failure ({SEED_ENV} fixes it)"


def pytest_report_header(config):
    return _seeds_line()        # shown when tests/kernels is named on the command line (an initial conftest)


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(_seeds_line())      # every run that collected kernel tests, -q included


@pytest.fixture
def device():
    return DEVICE


def pytest_configure(config):
    config.addinivalue_line("markers", isa_support.MARK_HELP)


def pytest_generate_tests(metafunc):
    isa_support.generate(metafunc)


def pytest_collection_modifyitems(config, items):
    isa_support.deselect(config, items, ("tests.kernels.test_cpu", "path"))


@pytest.fixture
def cpu_isa(request):
    """The instruction-set build of the native CPU kernels this case runs (tests/kernels/isa_support.py:
    ``CTXSPARSE_TEST_ISAS`` chooses them; every one for a test marked ``every_isa``), loaded and checked."""
    with isa_support.build(request.param) as name:
        yield name


@pytest.fixture
def gen(request):
    """A fresh random generator per test, from $CTXSPARSE_TEST_SEED or a random seed; a failing test's report
    shows the seed (pytest_runtest_makereport below), so the failure can be replayed."""
    env = os.environ.get(SEED_ENV, "").strip()
    seed = int(env) if env else secrets.randbelow(2**31)
    request.node.stash[_GEN_SEED] = seed
    request.node.user_properties.append(("gen_seed", seed))
    return torch.Generator(device="cpu").manual_seed(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    rep = (yield).get_result()
    seed = item.stash.get(_GEN_SEED, None)
    if rep.failed and seed is not None:
        rep.sections.append(("random seed", f"gen seed {seed}: replay with {SEED_ENV}={seed} "
                                            f"{GRID_SEED_ENV}={grid_seed()} pytest -m '' '{item.nodeid}'"))


@pytest.fixture
def poison(monkeypatch):
    """Every output/workspace of the Triton ops starts as NaN (floats) or -7777 (ints)."""
    from kernels import common

    def empty(shape, device, dtype):
        t = torch.empty(shape, device=device, dtype=dtype)
        if dtype.is_floating_point:
            t.fill_(float("nan"))
        else:
            t.fill_(-7777 if dtype != torch.int8 else -77)
        return t

    monkeypatch.setattr(common, "empty", empty)
