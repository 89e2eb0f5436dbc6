"""Tests over every instruction-set build of the native CPU kernels (kernels.isa), in one process.

One switch, ``CTXSPARSE_TEST_ISAS``, chooses the builds: a comma list of ``native``, ``avx2``, ``scalar``, or
``all`` (kernels.isa.runnable(): native, an AVX2-only build where native is AVX-512, the scalar build). Unset:
``all``, or, when ``CTXSPARSE_CPU_ISA`` names a build for the whole process, that build alone.

A test asks for a build through the ``cpu_isa`` fixture (tests/kernels/conftest.py, tests/workers/decode/
conftest.py): it runs once per chosen build when marked ``every_isa`` (the mark may sit on one parameter), else
once, on ``native`` (or on the first chosen build when native is not chosen; its other cases are deselected). For
its case the fixture sets ``CTXSPARSE_CPU_ISA``, reloads both native libraries (kernels.cpu.reload_native: built
once per session, then from the session's kernel cache) and asserts that each of them was compiled for that
instruction set (their ``cs_isa()``) before the test starts; after it, the environment's build is loaded again.
"""
from __future__ import annotations

import os
from contextlib import contextmanager

import pytest

from kernels import cpu, cpu_quant, isa, native

TEST_ISAS_ENV = "CTXSPARSE_TEST_ISAS"
MARK = "every_isa"
MARK_HELP = (f"{MARK}: run on every instruction-set build {TEST_ISAS_ENV} chooses (tests/kernels/isa_support.py); "
             "unmarked tests that take the cpu_isa fixture run on the native build only")


def selected() -> tuple[str, ...]:
    """The builds ``CTXSPARSE_TEST_ISAS`` chooses (see the module's docstring); a clear error for a bad value."""
    raw = os.environ.get(TEST_ISAS_ENV, "").strip().lower()
    if not raw:
        if os.environ.get(isa.ISA_ENV, "").strip():
            return (isa.requested(),)
        raw = "all"
    if raw == "all":
        return isa.runnable()
    out = tuple(dict.fromkeys(p.strip() for p in raw.split(",") if p.strip()))
    bad = [p for p in out if p not in isa.ISA_CHOICES]
    if bad or not out:
        raise pytest.UsageError(f"{TEST_ISAS_ENV}={raw!r}: expected 'all' or a comma list of "
                                f"{', '.join(isa.ISA_CHOICES)}")
    return out


def primary(builds: tuple[str, ...]) -> str:
    return "native" if "native" in builds else builds[0]


def generate(metafunc) -> None:
    """pytest_generate_tests: parametrize the ``cpu_isa`` fixture of a test by every chosen build (``deselect``
    then keeps the primary one alone for a test not marked ``every_isa``: a mark on one parameter counts)."""
    if "cpu_isa" in metafunc.fixturenames:
        metafunc.parametrize("cpu_isa", selected(), indirect=True)


def deselect(config, items, own=None) -> None:
    """pytest_collection_modifyitems: drop the cases of a test not marked ``every_isa`` on a build other than the
    primary one: its ``cpu_isa`` parameter, and in the module ``own[0]`` its parameter ``own[1]`` (test_cpu.py's
    ``path``: a build or the torch fallback)."""
    first = primary(selected())
    keep, drop = [], []
    for item in items:
        cs = getattr(item, "callspec", None)
        params = ["cpu_isa"]
        if own is not None and getattr(getattr(item, "module", None), "__name__", None) == own[0]:
            params.append(own[1])
        builds = [cs.params[p] for p in params if cs is not None and p in cs.params]
        off = any(b in isa.ISA_CHOICES and b != first for b in builds)
        (drop if off and item.get_closest_marker(MARK) is None else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def check_build(name: str) -> None:
    """Both native libraries are loaded, built for what ``name`` targets on this CPU (kernels.isa.resolved)."""
    want = isa.resolved(name)
    st = native.native_status()
    for lib in cpu.LIBRARIES:
        s = st[lib]
        assert s["built"], f"{lib} ({name} build) did not build: {s['error']}"
        assert s["requested"] == name and s["isa"] == want, f"{lib}: asked {name} ({want}), loaded {s}"
    assert cpu_quant.simd() == (want in ("avx2", "avx512")), want


@contextmanager
def build(name: str):
    """``CTXSPARSE_CPU_ISA=name`` for the block, both libraries reloaded and checked; afterwards the environment's
    own build again."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(isa.ISA_ENV, name)
        cpu.reload_native()
        try:
            check_build(name)
            yield name
        finally:
            mp.undo()
            cpu.reload_native()
