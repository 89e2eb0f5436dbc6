"""The one measurement harness every benchmark script uses.

* :func:`copy_bandwidth` — a device-to-device copy, the measured bandwidth ceiling (GB/s, bytes read + written).
* :func:`time_graph` — capture a callable in a CUDA graph, replay it, time each replay with CUDA events:
  median / p10 / p90 µs per call (on a CPU device: the host clock, no graph; what the smoke runs use).
* :func:`time_cpu` — interleaved host-clock timing of named callables for paired comparisons: each round runs
  every callable once, in an order that alternates between rounds, so drift and load hit them alike; median
  and IQR per callable, and the ratio to the baseline.
* :class:`Row` — one result row (bench, op, shape, dtype, batch, device, median / p10 / p90 in ``unit``,
  bytes, GB/s, fraction of the copy bandwidth, extra) and :func:`write_results`, which stores
  ``{"meta": {machine, cpu_model, cpu_flags, isa, torch, triton, date, command, ...}, "rows": [...]}`` as JSON
  under ``benchmarks/results/``.
* :func:`device_line` — the header line a script prints for its run: the CPU it ran on (model, feature flags, the
  instruction set the native kernels were built for: ``kernels.isa.cpu_info``), or the GPU and its host CPU.

Imports only the standard library and torch (triton only for its version, and only if installed; ``kernels.isa``
for the CPU's description); CUDA is touched only inside the functions that time on a GPU, so this module imports
on a CPU-only machine.

Feeds: BENCHMARKS.md, "Scripts and result files" (where it is described; every timed tool's figures go through it).
"""
from __future__ import annotations

import dataclasses
import datetime as _dt
import json
import math
import os
import platform
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

RESULTS_DIR = Path(__file__).resolve().parent / "results"
UNIT_SCALE = {"s": 1.0, "ms": 1e-3, "us": 1e-6}   # seconds per unit


# ---------------------------------------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 1]) of ``values``: an observed sample, never an interpolation."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q must be in [0, 1], got {q}")
    s = sorted(values)
    return s[max(0, min(len(s) - 1, math.ceil(q * len(s)) - 1))]


@dataclass(frozen=True)
class Timing:
    """Summary of repeated timings of one callable, in ``unit`` per call."""

    median: float
    p10: float
    p90: float
    q1: float
    q3: float
    n: int
    unit: str = "us"
    samples: tuple = field(default=(), repr=False, compare=False)

    @property
    def iqr(self) -> float:
        return self.q3 - self.q1

    @classmethod
    def of(cls, samples: Sequence[float], unit: str = "us") -> "Timing":
        if unit not in UNIT_SCALE:
            raise ValueError(f"unknown unit {unit!r}; known: {sorted(UNIT_SCALE)}")
        return cls(median=statistics.median(samples), p10=percentile(samples, 0.1), p90=percentile(samples, 0.9),
                   q1=percentile(samples, 0.25), q3=percentile(samples, 0.75), n=len(samples), unit=unit,
                   samples=tuple(samples))


# ---------------------------------------------------------------------------------------------------------------
def copy_bandwidth(nbytes: int = 2 << 30, reps: int = 20, warmup: int = 3, device: str = "cuda") -> float:
    """Device-to-device copy bandwidth in GB/s (bytes read + written), median over ``reps`` timed copies of an
    ``nbytes`` buffer: the practical ceiling the memory-bound ops are compared with. CUDA: CUDA events;
    other devices: the host clock."""
    dev = torch.device(device)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    for _ in range(warmup):
        dst.copy_(src)
    ts = []
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        for _ in range(reps):
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            dst.copy_(src)
            e1.record()
            e1.synchronize()
            ts.append(e0.elapsed_time(e1) * 1e-3)
    else:
        for _ in range(reps):
            t0 = time.perf_counter()
            dst.copy_(src)
            ts.append(time.perf_counter() - t0)
    del src, dst
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return 2 * nbytes / max(statistics.median(ts), 1e-12) / 1e9


def time_graph(fn: Callable[[], Any], reps: int = 30, warmup: int = 3, per_replay: int = 1,
               device: str = "cuda") -> Timing:
    """µs per call of ``fn``: run it eagerly and on a side stream (compiles, allocates), capture one call in a
    CUDA graph, replay ``warmup`` times, then time ``reps`` replays with CUDA events. ``fn`` may issue several
    ops (e.g. one per layer); ``per_replay`` divides each replay's time (µs per op). On a non-CUDA ``device``
    each call is timed with the host clock instead (no graph), after one untimed call (none with ``warmup=0``)."""
    if reps < 1:
        raise ValueError("reps must be >= 1")
    if torch.device(device).type != "cuda":
        if warmup:
            fn()
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6 / per_replay)
        return Timing.of(ts, "us")
    fn()
    torch.cuda.synchronize()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    for _ in range(warmup):
        g.replay()
    torch.cuda.synchronize()
    ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for e0, e1 in ev:
        e0.record()
        g.replay()
        e1.record()
    torch.cuda.synchronize()
    ts = [e0.elapsed_time(e1) * 1e3 / per_replay for e0, e1 in ev]
    del g
    return Timing.of(ts, "us")


@dataclass
class Comparison:
    """What :func:`time_cpu` measured: a Timing and the last output per callable, and ratios to the baseline."""

    baseline: str
    timings: dict[str, Timing]
    outputs: dict[str, Any] = field(default_factory=dict, repr=False)

    def ratio(self, name: str) -> float:
        """Baseline median / ``name``'s median: > 1 when ``name`` is faster than the baseline."""
        den = self.timings[name].median
        return self.timings[self.baseline].median / den if den > 0 else math.inf

    def table(self) -> str:
        u = next(iter(self.timings.values())).unit
        w = max(len(n) for n in self.timings) + 2
        lines = [f"  {'':<{w}}{'median (' + u + ')':>14}{'IQR (' + u + ')':>12}{'speedup':>10}"]
        for name, t in self.timings.items():
            lines.append(f"  {name:<{w}}{t.median:>14.4g}{t.iqr:>12.3g}{self.ratio(name):>9.2f}x")
        lines.append(f"  (speedup = median of {self.baseline} / median; {next(iter(self.timings.values())).n} "
                     f"interleaved rounds)")
        return "\n".join(lines)


def time_cpu(fns: Mapping[str, Callable[[], Any]], repeats: int = 5, warmup: int = 0,
             baseline: str | None = None, unit: str = "s") -> Comparison:
    """Interleaved host-clock timing of named callables (the first is the baseline unless ``baseline`` says).
    Each of ``repeats`` rounds runs every callable once; odd rounds run them in reverse order."""
    if not fns:
        raise ValueError("time_cpu needs at least one callable")
    if repeats < 1:
        raise ValueError("repeats must be >= 1")
    if unit not in UNIT_SCALE:
        raise ValueError(f"unknown unit {unit!r}; known: {sorted(UNIT_SCALE)}")
    names = list(fns)
    baseline = names[0] if baseline is None else baseline
    if baseline not in fns:
        raise ValueError(f"baseline {baseline!r} is not one of {names}")
    outputs: dict[str, Any] = {}
    for _ in range(warmup):
        for n in names:
            outputs[n] = fns[n]()
    ts: dict[str, list[float]] = {n: [] for n in names}
    for r in range(repeats):
        for n in (names if r % 2 == 0 else names[::-1]):
            t0 = time.perf_counter()
            outputs[n] = fns[n]()
            ts[n].append((time.perf_counter() - t0) / UNIT_SCALE[unit])
    return Comparison(baseline, {n: Timing.of(ts[n], unit) for n in names}, outputs)


# ---------------------------------------------------------------------------------------------------------------
@dataclass
class Row:
    """One measured point. ``median``/``p10``/``p90`` are in ``unit`` ("us", "ms" or "s") per op;
    ``bytes`` the bytes the op must move, ``gbps`` those bytes over the median, ``frac_copy_bw`` that over
    the measured copy bandwidth; anything bench-specific goes in ``extra``."""

    bench: str
    op: str
    shape: str = ""
    dtype: str = ""
    batch: int | None = 1
    device: str = ""
    unit: str = "us"
    median: float | None = None
    p10: float | None = None
    p90: float | None = None
    bytes: int | None = None
    gbps: float | None = None
    frac_copy_bw: float | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.unit not in UNIT_SCALE:
            raise ValueError(f"unknown unit {self.unit!r}; known: {sorted(UNIT_SCALE)}")

    @classmethod
    def measured(cls, bench: str, op: str, timing: Timing | None = None, *, nbytes: float | None = None,
                 copy_bw_gbps: float | None = None, unit: str | None = None, median: float | None = None,
                 p10: float | None = None, p90: float | None = None, **kw) -> "Row":
        """A row from a Timing (or explicit median/p10/p90), with GB/s and the copy-bandwidth fraction derived
        from ``nbytes`` when given."""
        if timing is not None:
            unit, median, p10, p90 = timing.unit, timing.median, timing.p10, timing.p90
        unit = unit or "us"
        gbps = frac = None
        if nbytes is not None and median:
            gbps = nbytes / (median * UNIT_SCALE[unit]) / 1e9
            if copy_bw_gbps:
                frac = round(gbps / copy_bw_gbps, 4)
            gbps = round(gbps, 1)
        rnd = (lambda v: None if v is None else float(f"{v:.6g}"))  # noqa: E731
        return cls(bench=bench, op=op, unit=unit, median=rnd(median), p10=rnd(p10), p90=rnd(p90),
                   bytes=None if nbytes is None else int(nbytes), gbps=gbps, frac_copy_bw=frac, **kw)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping) -> "Row":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"not Row fields: {sorted(unknown)}")
        return cls(**d)


def device_name(device: str = "cuda") -> str:
    """The accelerator's name (CUDA), else the CPU's: the name latency rows carry."""
    from workers.decode.latency import accelerator_name

    dev = torch.device(device)
    return accelerator_name("cpu" if dev.type == "cuda" and not torch.cuda.is_available() else dev)


def cpu_info() -> dict:
    """``kernels.isa.cpu_info()``: ``cpu_model``, ``cpu_flags`` and ``isa`` (what the native CPU kernels are built
    for), recorded with every result: a CPU figure holds only for the instruction set that produced it."""
    from kernels.isa import cpu_info as _cpu_info

    return _cpu_info()


def device_line(device: str = "cuda") -> str:
    """The header line of a run: on a CPU, ``device cpu: MODEL (flags ...; native kernels built for ISA)``; on a
    GPU its name and, for completeness, the host CPU the same way (CUDA asked for where there is none: the CPU,
    as :func:`device_name` says)."""
    ci = cpu_info()
    cpu = f"{ci['cpu_model']} (flags {ci['cpu_flags'] or '-'}; native kernels built for {ci['isa']})"
    dev = torch.device(device)
    if dev.type == "cuda" and torch.cuda.is_available():
        return f"device {device_name(device)}; host cpu: {cpu}"
    if dev.type in ("cpu", "cuda"):
        return f"device cpu: {cpu}"
    return f"device {dev.type}; host cpu: {cpu}"


def machine(device: str = "cuda") -> dict:
    m = {"device": device_name(device), "platform": platform.platform(), "python": platform.python_version(),
         "cpus": os.cpu_count()}
    if torch.device(device).type == "cuda" and torch.cuda.is_available():
        m["sms"] = torch.cuda.get_device_properties(0).multi_processor_count
    return m


def versions() -> dict:
    try:
        import triton

        tv = triton.__version__
    except ImportError:
        tv = None
    return {"torch": torch.__version__, "triton": tv}


def command_line(module: str | None = None) -> str:
    """The command that is running, as typed from the repository root."""
    head = f"python -m {module}" if module else "python " + os.path.basename(sys.argv[0])
    return " ".join([head, *map(shlex.quote, sys.argv[1:])])


def task_limit(spec: str) -> tuple[str, int | None]:
    """A ``name[:limit]`` command-line item (an accuracy task and how many of its items) -> (name, limit or None)."""
    name, _, limit = spec.partition(":")
    return name, int(limit) if limit else None


def result_path(name: str | os.PathLike) -> Path:
    """A bare file name goes under ``benchmarks/results/``; a path with a directory is used as given."""
    p = Path(name)
    if p.suffix == "":
        p = p.with_suffix(".json")
    return RESULTS_DIR / p if p.parent == Path(".") else p


def write_results(name: str | os.PathLike, rows: Sequence[Row | Mapping], *, command: str | None = None,
                  device: str = "cuda", meta: Mapping | None = None, sections: Mapping | None = None) -> Path:
    """Write ``{"meta": {...}, "rows": [...], **sections}`` as JSON (see :func:`result_path`); returns the path.
    meta holds machine, the host CPU (:func:`cpu_info`: cpu_model, cpu_flags, isa; on a GPU run too), torch,
    triton, date and command, plus ``meta``'s own keys."""
    doc_meta = {"machine": machine(device), **cpu_info(), **versions(),
                "date": _dt.datetime.now().isoformat(timespec="seconds"), "command": command or command_line()}
    doc_meta.update(meta or {})
    out = []
    for r in rows:
        out.append(r.to_dict() if isinstance(r, Row) else Row.from_dict(r).to_dict())
    doc = {"meta": doc_meta, "rows": out, **(sections or {})}
    path = result_path(name)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1, default=str))
    os.replace(tmp, path)
    return path


def read_results(path: str | os.PathLike) -> tuple[dict, list[Row]]:
    """-> (meta, rows) of a file :func:`write_results` wrote."""
    doc = json.loads(Path(path).read_text())
    return doc.get("meta", {}), [Row.from_dict(r) for r in doc["rows"]]
