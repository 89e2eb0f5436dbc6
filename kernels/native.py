"""What the native CPU libraries are (kernels.cpu's and kernels.cpu_quant's): built or not, for which instruction
set, on which CPU. What ``ctxsparse kernels`` and ``generate`` print, and what a CPU figure is recorded with."""
from __future__ import annotations

from . import cpu, cpu_quant, isa


def _first_line(error: str | None, chars: int = 160) -> str:
    line = (error or "").strip().splitlines()[0] if (error or "").strip() else "unknown reason"
    return line if len(line) <= chars else line[: chars - 3] + "..."


def native_status() -> dict:
    """What every native library is, building it (or reading the cache) where not done yet: {"cpu_native":
    {built, isa, error, requested, flags}, "cpu_quant": {...}, "cpu_model", "cpu_flags"} (kernels.isa.cpu_info;
    ``isa``: what the compiler targeted, from the library itself). ``CTXSPARSE_CPU_NATIVE=0``: not built,
    ``disabled`` True, no error. An unknown ``CTXSPARSE_CPU_ISA`` raises ValueError."""
    info = isa.cpu_info("native")
    requested = isa.requested()
    out: dict = {}
    if cpu.native_disabled():
        for name in cpu.LIBRARIES:
            out[name] = {"built": False, "isa": None, "error": None, "requested": requested, "disabled": True}
    else:
        cpu._native()
        cpu_quant.load_library()
        for name, st in (("cpu_native", cpu.library_status()), ("cpu_quant", cpu_quant.library_status())):
            st = dict(st) if st is not None else {"built": False, "isa": None, "error": "not loaded",
                                                  "requested": requested}
            st["disabled"] = False
            out[name] = st
    out["cpu_model"], out["cpu_flags"] = info["cpu_model"], info["cpu_flags"]
    return out


def describe(status: dict | None = None) -> str:
    """One line: which build the native kernels are (or why there are none), on which CPU, e.g.
    ``native kernels: avx2 build (AMD EPYC 7B13; flags avx2 f16c fma)`` or
    ``native kernels: NOT BUILT (no C compiler found ...); torch fallback (slow)``."""
    st = native_status() if status is None else status
    where = f"{st['cpu_model']}; flags {st['cpu_flags'] or '(none of interest)'}"
    libs = {n: st[n] for n in cpu.LIBRARIES}
    req = next(iter(libs.values())).get("requested", "native")
    asked = "" if req == "native" else f"{isa.ISA_ENV}={req}; "
    if all(s.get("disabled") for s in libs.values()):
        return f"native kernels: off ({cpu.NATIVE_ENV}=0); torch fallback (slow) ({where})"
    built = {n: s for n, s in libs.items() if s["built"]}
    isas = {s["isa"] for s in built.values()}
    if len(built) == len(libs) and len(isas) == 1:
        return f"native kernels: {isas.pop()} build ({asked}{where})"
    if not built:
        return f"native kernels: NOT BUILT ({_first_line(libs['cpu_native']['error'])}); torch fallback (slow) ({where})"
    parts = [f"{n} {s['isa']} build" if s["built"] else f"{n} NOT BUILT ({_first_line(s['error'])}; torch "
             "fallback, slow)" for n, s in libs.items()]
    return f"native kernels: {', '.join(parts)} ({asked}{where})"
