"""Which build the native CPU kernels are (kernels.isa, kernels.native.native_status / describe), and a native build
that fails is loud: a compiler that fails or is missing gives one NativeBuildWarning per library with the
compiler's message and the switch that silences it (CTXSPARSE_CPU_NATIVE=0: the fallback, knowingly, no warning);
an unknown CTXSPARSE_CPU_ISA is a clear error. The broken compilers are real executables (a script that prints an
error and exits 1, a path that does not exist, a PATH without one) and every case starts from an empty kernel
cache. About 2 s (the builds of each instruction set are cached for the session)."""
from __future__ import annotations

import platform
import shutil
import stat
import warnings

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu, cpu_quant, isa, native
from tests.kernels import isa_support

CC_ERROR = "cc1: error: unrecognized command-line option '-mfancy-vectors'"


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """An empty kernel cache (CTXSPARSE_HOME), nothing loaded, no warning given yet; the environment's build
    loaded again after the test."""
    monkeypatch.setenv("CTXSPARSE_HOME", str(tmp_path / "home"))
    for var in ("CTXSPARSE_CPU_NATIVE", isa.ISA_ENV, "CTXSPARSE_CPU_CFLAGS"):
        monkeypatch.delenv(var, raising=False)
    cpu.reload_native()
    yield tmp_path
    cpu.reload_native()


def _broken_cc(tmp_path) -> str:
    cc = tmp_path / "broken-cc"
    cc.write_text(f"#!/bin/sh\necho \"{CC_ERROR}\" >&2\necho 'compilation terminated.' >&2\nexit 1\n")
    cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
    return str(cc)


def _use_every_library():
    """What the ops do: ask for both libraries, several times, and for every build of the quantized one (as the
    tests do; each a build of its own)."""
    for _ in range(3):
        cpu.native_available()
        cpu_quant.load_library()
        for b in isa.ISA_CHOICES:
            cpu_quant.load_library(isa=b)
        cpu.compile_native(cpu._SRC, isa="scalar")
    return native.native_status()


def _native_build_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, cpu.NativeBuildWarning)]


def test_a_failing_compiler_warns_once_per_library_with_its_message(fresh, monkeypatch):
    monkeypatch.setenv("CC", _broken_cc(fresh))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        st = _use_every_library()
    msgs = _native_build_warnings(caught)
    assert len(msgs) == 2, msgs                                   # one per library, not one per call
    for name, msg in zip(("cpu_native", "cpu_quant"), msgs):
        assert name in msg and CC_ERROR in msg and "exited with status 1" in msg, msg
        assert "CTXSPARSE_CPU_NATIVE=0" in msg and "fallback" in msg, msg
        s = st[name]
        assert s["built"] is False and s["isa"] is None and CC_ERROR in s["error"], s
    line = native.describe(st)
    assert line.startswith("native kernels: NOT BUILT (") and "exited with status 1" in line
    assert "torch fallback (slow)" in line and "\n" not in line
    # the ops still run, on the fallback
    x, w = torch.randn(2, 64), torch.randn(32, 64)
    assert not cpu.native_available() and torch.allclose(cpu.linear(x, w), F.linear(x, w))


def test_the_fallback_chosen_knowingly_gives_no_warning(fresh, monkeypatch):
    monkeypatch.setenv("CC", _broken_cc(fresh))
    monkeypatch.setenv("CTXSPARSE_CPU_NATIVE", "0")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        st = _use_every_library()
    assert _native_build_warnings(caught) == []
    assert cpu_quant.load_library() is None and not cpu.native_available()
    for name in cpu.LIBRARIES:
        assert st[name]["built"] is False and st[name]["disabled"] is True and st[name]["error"] is None
    assert native.describe(st).startswith("native kernels: off (CTXSPARSE_CPU_NATIVE=0); torch fallback (slow)")
    assert not (fresh / "home" / "cpu_kernels").exists()            # nothing was compiled


@pytest.mark.parametrize("how", ["CC names no file", "no compiler on PATH"])
def test_a_missing_compiler_warns_once_per_library(fresh, monkeypatch, how):
    if how == "CC names no file":
        monkeypatch.setenv("CC", str(fresh / "no-such-cc"))
        want = "did not run"
    else:
        monkeypatch.delenv("CC", raising=False)
        monkeypatch.setenv("PATH", str(fresh))                        # a folder with no cc / gcc
        want = "no C compiler found"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        st = _use_every_library()
    msgs = _native_build_warnings(caught)
    assert len(msgs) == 2 and all(want in m and "CTXSPARSE_CPU_NATIVE=0" in m for m in msgs), msgs
    assert not st["cpu_native"]["built"] and want in st["cpu_native"]["error"]
    assert want in native.describe(st)


def test_the_quantized_library_is_one_unit_of_its_parts_each_in_the_build_key(fresh, monkeypatch):
    """kernels/cpu_quant.c includes every cpu_quant_*.c beside it (one translation unit, compiled alone; cpu_native.c
    one, the predicted head's cpu_head.c); a change to any part is a new build (the cache key hashes the parts), a part missing a clear
    build error. The compiler here only writes its output file (no real build)."""
    kdir = cpu_quant._SRC.parent
    copy = fresh / "kernels"
    copy.mkdir()
    for f in [*kdir.glob("*.c"), *kdir.glob("*.h")]:
        shutil.copy(f, copy)
    src = copy / cpu_quant._SRC.name
    parts = cpu._parts(src)
    assert sorted(p.name for p in parts) == sorted(p.name for p in kdir.glob("cpu_quant_*.c")) and len(parts) >= 5
    assert [p.name for p in cpu._parts(cpu._SRC)] == ["cpu_head.c"]
    cc = fresh / "fake-cc"
    cc.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && : > "$2"; shift; done\n')
    cc.chmod(cc.stat().st_mode | stat.S_IXUSR)
    monkeypatch.setenv("CC", str(cc))
    flags = cpu.native_flags("native", cpu_quant.EXTRA_FLAGS)
    seen = [cpu._compile(src, flags)]
    assert cpu._compile(src, flags) == seen[0]                       # the same sources: the cached build
    for part in parts:
        part.write_text(part.read_text() + "\n")
        seen.append(cpu._compile(src, flags))
    assert len(set(seen)) == len(parts) + 1, seen
    parts[-1].unlink()
    with pytest.raises(cpu.NativeBuildError, match=f"{parts[-1].name} \\(included by cpu_quant.c\\) missing"):
        cpu._compile(src, flags)


def test_an_unknown_instruction_set_is_a_clear_error(fresh, monkeypatch):
    monkeypatch.setenv(isa.ISA_ENV, "avx3")
    for what in (cpu.native_available, cpu_quant.load_library, native.native_status, isa.requested):
        with pytest.raises(ValueError, match=r"CTXSPARSE_CPU_ISA='avx3': expected one of native, avx2, scalar"):
            what()
    with pytest.raises(ValueError, match="unknown instruction-set build 'sse9'"):
        isa.resolved("sse9")


@pytest.mark.every_isa
def test_status_says_what_each_build_targets(cpu_isa):
    """Each build: both libraries compiled with that build's flags (kernels.isa.ISA_FLAGS after -march=native),
    for what it resolves to on this CPU (as the libraries themselves say: cs_isa()), into a file of its own;
    describe() says so on one line with the CPU's model and flags."""
    st = native.native_status()
    info = isa.cpu_info(cpu_isa)
    want = isa.resolved(cpu_isa)
    for name, extra in (("cpu_native", ()), ("cpu_quant", cpu_quant.EXTRA_FLAGS)):
        s = st[name]
        assert s["built"] and s["error"] is None and s["requested"] == cpu_isa and s["isa"] == want == info["isa"]
        flags = s["flags"].split()
        mine = list(isa.ISA_FLAGS[cpu_isa]) if platform.machine() in ("x86_64", "AMD64") else []
        assert flags[:2] == ["-O3", "-march=native"] and flags[len(flags) - len(mine) - len(extra):] == [*mine, *extra]
    assert (st["cpu_model"], st["cpu_flags"]) == (info["cpu_model"], info["cpu_flags"])
    asked = "" if cpu_isa == "native" else f"CTXSPARSE_CPU_ISA={cpu_isa}; "
    assert native.describe(st) == f"native kernels: {want} build ({asked}{info['cpu_model']}; flags {info['cpu_flags']})"


def test_describe_a_mixed_state():
    """One library built, the other not: both said, the reason on the same line."""
    st = {"cpu_native": {"built": True, "isa": "avx2", "error": None, "requested": "native"},
          "cpu_quant": {"built": False, "isa": None, "error": "gcc exited with status 1:\nboom", "requested": "native"},
          "cpu_model": "Some CPU", "cpu_flags": "avx2 fma"}
    assert native.describe(st) == ("native kernels: cpu_native avx2 build, cpu_quant NOT BUILT (gcc exited with status "
                                "1:; torch fallback, slow) (Some CPU; flags avx2 fma)")


def test_isa_builds_and_what_they_resolve_to():
    """kernels.isa's table: the flags of each build, what each targets for a given CPU's flags, and the builds a
    CPU can run (x86)."""
    assert {b: isa.ISA_FLAGS[b] for b in isa.ISA_CHOICES} == {
        "native": (), "avx2": ("-mno-avx512f",),
        "scalar": ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx")}
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 builds")
    zen4, zen3, old = (frozenset({"avx2", "fma", "avx512f"}), frozenset({"avx2", "fma"}), frozenset({"sse4_2"}))
    assert [isa.resolved(b, zen4) for b in isa.ISA_CHOICES] == ["avx512", "avx2", "scalar"]
    assert [isa.resolved(b, zen3) for b in isa.ISA_CHOICES] == ["avx2", "avx2", "scalar"]
    assert [isa.resolved(b, old) for b in isa.ISA_CHOICES] == ["scalar", "scalar", "scalar"]
    assert isa.build_flags("avx2") == ("-mno-avx512f",)
    here = isa.runnable()
    assert here[0] == "native" and here[-1] == "scalar" and ("avx2" in here) == ("avx512f" in isa.cpu_flags())


def test_the_test_switch_chooses_the_builds(monkeypatch):
    """CTXSPARSE_TEST_ISAS: a list, 'all' (runnable()), unset (all; or the whole-process CTXSPARSE_CPU_ISA's
    build alone); anything else a usage error."""
    monkeypatch.delenv(isa.ISA_ENV, raising=False)
    for raw, want in (("scalar, native", ("scalar", "native")), ("all", isa.runnable()), ("", isa.runnable()),
                      ("avx2,avx2", ("avx2",))):
        monkeypatch.setenv(isa_support.TEST_ISAS_ENV, raw)
        assert isa_support.selected() == want, raw
    monkeypatch.delenv(isa_support.TEST_ISAS_ENV)
    monkeypatch.setenv(isa.ISA_ENV, "scalar")
    assert isa_support.selected() == ("scalar",)
    monkeypatch.setenv(isa_support.TEST_ISAS_ENV, "sse2")
    with pytest.raises(pytest.UsageError, match="CTXSPARSE_TEST_ISAS='sse2'"):
        isa_support.selected()
