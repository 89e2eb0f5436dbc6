"""Which instruction set the native CPU kernels are built for, and what this CPU has.

One switch, ``CTXSPARSE_CPU_ISA``, chooses the build of every native CPU library (``cpu_native.c``,
``cpu_quant.c``):

* ``native`` (the default): ``-march=native``, the widest vectors this CPU has;
* ``avx2``: ``-march=native -mno-avx512f`` (what an AVX2-only x86 CPU runs; on an AVX-512 machine this times and
  tests the AVX2 code paths);
* ``scalar``: no SIMD paths at all (the portable C fallback).

Every CPU figure is recorded with :func:`cpu_info` (the CPU model, its relevant feature flags and the instruction
set the native code was built for), because a figure holds only for the instruction set that produced it.
"""
from __future__ import annotations

import os
import platform

ISA_ENV = "CTXSPARSE_CPU_ISA"
ISA_CHOICES = ("native", "avx2", "scalar")
# extra compiler flags per requested build (on top of -march=native)
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "native": (),
    "avx2": ("-mno-avx512f",),
    "scalar": ("-mno-avx512f", "-mno-avx2", "-mno-fma", "-mno-f16c", "-mno-avx"),
}
# the feature flags recorded with a CPU figure (those the kernels or llama.cpp branch on)
FLAGS_OF_INTEREST = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx_vnni",
                     "avx512_bf16", "amx_tile", "amx_int8", "neon", "asimd", "asimddp", "sve")


def _cpuinfo_lines() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            return f.read().splitlines()
    except OSError:
        return []


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (``/proc/cpuinfo``'s ``flags`` or, on ARM, ``Features``)."""
    for line in _cpuinfo_lines():
        key, _, val = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return frozenset(val.split())
    return frozenset()


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what :mod:`platform` says, else ``cpu``."""
    for line in _cpuinfo_lines():
        key, _, val = line.partition(":")
        if key.strip() in ("model name", "Model name") and val.strip():
            return val.strip()
    return platform.processor() or platform.machine() or "cpu"


def requested() -> str:
    """The build asked for by ``CTXSPARSE_CPU_ISA`` (``native`` when unset); anything else is an error."""
    isa = os.environ.get(ISA_ENV, "").strip().lower() or "native"
    if isa not in ISA_CHOICES:
        raise ValueError(f"{ISA_ENV}={isa!r}: expected one of {', '.join(ISA_CHOICES)}")
    return isa


def resolved(isa: str | None = None, flags: frozenset[str] | None = None) -> str:
    """The instruction set a build of ``isa`` (default: :func:`requested`) actually targets on this CPU:
    ``avx512``, ``avx2``, ``neon`` or ``scalar`` (an x86 CPU without AVX2/FMA also builds the scalar paths)."""
    isa = requested() if isa is None else isa
    if isa not in ISA_CHOICES:
        raise ValueError(f"unknown instruction-set build {isa!r}: expected one of {', '.join(ISA_CHOICES)}")
    flags = cpu_flags() if flags is None else flags
    if isa == "scalar":
        return "scalar"
    if platform.machine() in ("aarch64", "arm64"):
        return "neon"
    if isa == "native" and "avx512f" in flags:
        return "avx512"
    if "avx2" in flags and "fma" in flags:
        return "avx2"
    return "scalar"


def build_flags(isa: str | None = None) -> tuple[str, ...]:
    """Compiler flags (beside ``-march=native``) of the build ``isa`` (default: :func:`requested`)."""
    isa = requested() if isa is None else isa
    if platform.machine() not in ("x86_64", "AMD64", "i686", "i386"):
        return ()                       # the -mno-* flags are x86 options; other CPUs build native only
    return ISA_FLAGS[isa]


def runnable() -> tuple[str, ...]:
    """The builds this machine can run that target different instruction sets, widest first (``native``
    always; ``avx2`` only where native is wider; ``scalar`` only where native is not already scalar)."""
    out = ["native"]
    nat = resolved("native")
    if nat == "avx512":
        out.append("avx2")
    if nat != "scalar" and platform.machine() in ("x86_64", "AMD64"):
        out.append("scalar")
    return tuple(out)


def cpu_info(isa: str | None = None) -> dict:
    """What a CPU figure is recorded with: ``cpu_model``, ``cpu_flags`` (the flags of interest this CPU has,
    space-separated, sorted) and ``isa`` (what the native kernels are built for: :func:`resolved`)."""
    flags = cpu_flags()
    return {"cpu_model": cpu_model(),
            "cpu_flags": " ".join(sorted(f for f in flags if f in FLAGS_OF_INTEREST)),
            "isa": resolved(isa, flags)}
