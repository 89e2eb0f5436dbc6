"""From a validated spec and the models' fingerprints to the sweep's units and their dependencies.

    collect (model, data) ─▶ fit (method, s, r, attention s, allocation, options) ─┬▶ eval (perplexity | task)
                                                                                  └▶ latency (device, batch, prompt)

A task split into shards (``shards: n`` in the spec) gets n shard units (its config plus ``shard: [k, n]``) and its
own unit, which depends on them and assembles their scores into the task's rows; that unit's config, and so its id,
is the unsharded unit's (the rows are bit for bit the same), so an unsharded run of the task and a sharded one
share it. A task with ``only: front`` is planned for every setting, marked ``only``; the driver registers and runs
the units of the settings the front picks (``orchestrator.driver``).

A ``shape:NAME`` model (a 7B-class shape with random weights) gets only fit placeholders and latency units: its
predictors are drawn at random with the real shapes at each grid sparsity, so the timing is real and the accuracy
meaningless. A ``dense`` fit (an empty plan) is always planned: the baseline every setting is compared with,
evaluated and timed like the others; Hugging Face ``generate`` is timed on it too. It reads no activations, so it
does not wait for the collection: dense's evaluations start while the model's activations are still being
captured. A unit's config is the typed model of its kind (``db.units``); its id is the hash of its kind, its
canonical config (model and data fingerprints included; the fields added later left out at their defaults) and
``CODE_VERSION``: the same work always gets the same id, whichever sweep asks for it, so finished units are reused
and never run twice.

Fit, eval and latency configs carry ``threads``, the torch thread count the worker sets before computing
(:func:`torch_threads`, :func:`latency_threads`): results depend on it (summation order), so rows measured under
different counts never share a unit. CPU latency units default to every core of a node (what a user's decode
runs on, and what the bencher has to itself while latency is timed alone); ``resources.torch_threads`` overrides
it. CPU latency of a model loaded from a GGUF decodes the file's quantized blocks (``latency.cpu_weights``,
config ``weights: gguf``). On a CPU, the dense setting also gets a ``llama.cpp`` latency unit when
llama-cpp-python is installed and the model was loaded from a GGUF file (llama.cpp on that file, interleaved with
our dense decode); when it is not installed the plan logs why, once.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

from db.front.settings import setting_label
from db.units import (AnyUnitConfig, CollectConfig, DataConfig, FitConfig, GridSetting, HeadSetting, LatencyConfig,
                      PerplexityConfig, PerplexityEvalConfig, TaskEvalConfig)
from orchestrator.spec import SweepSpec
from workers.host import available_cores
from workers.names import DENSE, RUNTIME_HF, RUNTIME_LLAMA_CPP, is_shape

log = logging.getLogger("ctxsparse.plan")

CODE_VERSION = "sweep-2"      # bump when a unit's computation changes meaning (old rows then stop matching)

EVAL_BATCH_ACCELERATOR = 64   # sequences per generation batch on GPUs / NPUs (suites.generation_batch: another)
EVAL_TOKENS_ACCELERATOR = 32768     # padded tokens per log-likelihood forward on GPUs / NPUs (scoring.token_batches)


@dataclass(frozen=True)
class PlannedUnit:
    id: str
    kind: str                  # collect | fit | eval | latency
    model: str
    device_type: str
    config: AnyUnitConfig
    deps: tuple[str, ...] = ()
    method: str | None = None
    sparsity: float | None = None
    rank: int | None = None
    attn_sparsity: float | None = None
    label: str = field(default="", compare=False)
    shards: tuple[str, ...] = ()     # a task split into shards: its shard units (this unit assembles their scores)
    only: str | None = None          # "front": planned for every setting, run for those the front picks
    within: float | None = None      # with only: the front's settings within this loss against dense (TaskSpec)
    priority: int = field(default=0, compare=False)     # among ready units of one kind, lower runs first

    def columns(self) -> dict:
        """The db.schemas.UnitSpec fields (model/dataset ids added by the driver)."""
        return {"id": self.id, "kind": self.kind, "method": self.method, "sparsity": self.sparsity,
                "rank": self.rank, "attn_sparsity": self.attn_sparsity, "device_type": self.device_type,
                "config": self.config.canonical(), "code_version": CODE_VERSION}


def _unit(config: AnyUnitConfig, device: str, deps=(), label="", **coords) -> PlannedUnit:
    return PlannedUnit(config.unit_id(CODE_VERSION), config.kind, config.model, device, config, tuple(deps),
                       label=label, **coords)


def fit_priority(method: str) -> int:
    """The order a sweep's ready fits start in (lower first): fits from activation statistics first (seconds
    each: their settings' evaluations start at once), then the longest (training before decompositions), so the
    fits that gate the last evaluations start early. Measured on an H200 with the GPU busy evaluating: Deja Vu's
    and SVD's fits take about 2 minutes each (Deja Vu's took 6-14 before its training moved onto the fitter's
    device), the others under a minute."""
    from workers.sparsity.predictors import FIT_COST, FIT_COSTS

    cost = FIT_COST.get(method, 0)
    return 0 if cost == 0 else max(FIT_COSTS) + 1 - cost


def torch_threads(spec: SweepSpec) -> int:
    """The torch thread count of the sweep's fit / eval units and GPU / NPU latency units:
    ``resources.torch_threads``, else one per CPU the spec gives each actor (what Ray sets OMP_NUM_THREADS to)."""
    r = spec.resources
    return r.torch_threads or max(1, int(r.cpus_per_actor))


def latency_threads(spec: SweepSpec, device: str, cpu_cores: int) -> int:
    """The thread count of the sweep's latency units on ``device``: ``resources.torch_threads`` where the spec
    gives it; else, on the CPU, ``cpu_cores`` (every core of a node: a user decodes on all of them, and latency is
    timed alone, ``latency.exclusive``); on GPUs / NPUs the fit / eval count (:func:`torch_threads`)."""
    if spec.resources.torch_threads:
        return spec.resources.torch_threads
    return max(1, int(cpu_cores)) if device == "cpu" else torch_threads(spec)


def node_cores(nodes) -> int | None:
    """The CPUs of the largest of ``nodes`` (each a node's resources as Ray reports them): where CPU latency is
    timed, the default thread count of its units; None without a node that has CPUs."""
    return max((int(n.get("CPU", 0)) for n in nodes), default=0) or None


def llama_cpp_plan(spec: SweepSpec, described: dict[str, dict]) -> tuple[bool, str | None]:
    """(whether the sweep times the ``llama.cpp`` baseline, why not where it is asked for but cannot be): on the
    CPU, for models loaded from a GGUF file, when llama-cpp-python imports (here, where the plan is made: the
    driver runs in the workers' environment)."""
    if spec.latency is None or "cpu" not in spec.latency.devices or 1 not in spec.latency.batch:
        return False, None
    if not any(d.get("gguf") for d in described.values()):
        return False, None
    from workers.decode.llama_cpp import llama_cpp_missing

    why = llama_cpp_missing()
    return why is None, why


def settings(spec: SweepSpec) -> list[GridSetting]:
    """Every (method, s, r, attention s, allocation, options) of the grid, dense first; then, with a ``head``
    key, every head setting alone (with the dense decoder) and with each setting of the methods it combines."""
    out = [GridSetting(method=DENSE, sparsity=0.0)]
    for m in spec.methods:
        for s in m.sparsity:
            for r in m.rank:
                for a in m.attn_sparsity:
                    out.append(GridSetting(method=m.name, sparsity=s, rank=r, attn_sparsity=a,
                                           allocation=m.allocation, options=dict(m.options)))
    if spec.head is None:
        return out
    heads = [HeadSetting(rank=r, candidates=k, screen=sc) for sc in spec.head.screen for r in spec.head.rank
             for k in spec.head.candidates]
    with_head = [st for st in out if st.method == DENSE or st.method in spec.head.combine]
    return out + [st.model_copy(update={"head": h}) for h in heads for st in with_head]


def plan_units(spec: SweepSpec, described: dict[str, dict], cpu_cores: int | None = None) -> list[PlannedUnit]:
    """All units of the sweep, in dependency order. ``described[model]`` comes from Units.describe; ``cpu_cores``:
    the CPUs of the node CPU latency is timed on (the driver: the largest node's, as Ray counts them; default: the
    cores of this process)."""
    cores = available_cores() if cpu_cores is None else cpu_cores
    llama, why = llama_cpp_plan(spec, described)
    if why:
        log.warning("no llama.cpp baseline row on the CPU front: %s", why)
    if spec.latency is not None and "cpu" in spec.latency.devices:
        log.info("CPU latency timed at %d threads (%s)", latency_threads(spec, "cpu", cores),
                 "resources.torch_threads" if spec.resources.torch_threads else "every core of a node")
    from workers.sparsity.capture import FINAL
    from workers.sparsity.predictors import CAPTURES

    capture = tuple(sorted({c for st in settings(spec) for c in CAPTURES.get(st.method, ())}
                           | ({FINAL} if spec.head is not None else set())))    # the head's input states
    units: list[PlannedUnit] = []
    for ref in spec.models:
        units += _model_units(spec, ref, described[ref], capture, llama, cores)
    return units


def _model_units(spec: SweepSpec, ref: str, d: dict, capture: tuple[str, ...], llama: bool,
                 cores: int) -> list[PlannedUnit]:
    """The units of model ``ref`` (``d``: what Units.describe said of it): its collection, then each setting's fit,
    evaluations and latency."""
    acc = spec.resources.accelerator
    shape = is_shape(ref)   # random weights: latency only, nothing to collect or evaluate
    base = {"model": ref, "model_fp": d["fingerprint"]}
    units: list[PlannedUnit] = []
    if not shape:
        base.update(data=DataConfig(**spec.data.model_dump()), calib_fp=d["calib_fp"], capture=capture)
        collect = _unit(CollectConfig(**base), acc, label=f"{ref} collect")
        units.append(collect)
    for st in settings(spec):
        tag = _tag(st)
        coords = dict(method=st.method, sparsity=st.sparsity, rank=st.rank, attn_sparsity=st.attn_sparsity)
        fit = _unit(FitConfig(**base, **dict(st), seed=spec.seed, threads=torch_threads(spec)), acc,
                    [] if shape or st.baseline else [collect.id],   # the dense baseline fits nothing
                    f"{ref} {tag} fit", priority=fit_priority(st.method), **coords)
        units.append(fit)
        if not shape:
            units += _eval_units(spec, base, d, fit.id, f"{ref} {tag}", coords)
        if spec.latency is not None:
            units += _latency_units(spec, ref, d, st, fit.id, llama, cores, f"{ref} {tag}", coords)
    return units


def _eval_units(spec: SweepSpec, base: dict, d: dict, fit_id: str, label: str, coords: dict) -> list[PlannedUnit]:
    """A setting's eval units: the held-out perplexity and each task.

    Accuracy rows are dense products with the unselected entries zeroed on every device (``exec_mode: masked``:
    the same selection and numbers up to summation order as the token-sparse products, and faster than them for
    evaluation forwards on a CPU and on an H200: workers/sparsity/sparse_exec.py); latency rows run the decode
    kernels, which really skip the work. Accelerators score log-likelihoods in forwards of up to 32,768 padded
    tokens and generate 64 sequences at a time, or suites.generation_batch (the CPU: the worker's 8 sequences);
    batching changes only summation order."""
    acc, suites = spec.resources.accelerator, spec.suites
    ev = dict(**base, fit_unit=fit_id, threads=torch_threads(spec), exec_mode="masked", matmul=suites.matmul,
              fused=suites.fused)
    units = []
    if suites.perplexity is not None:
        units.append(_unit(PerplexityEvalConfig(**ev, perplexity=PerplexityConfig(**suites.perplexity.model_dump()),
                                                heldout_fp=d["heldout_fp"]),
                           acc, [fit_id], f"{label} perplexity", **coords))
    if acc != "cpu":
        ev.update(batch_size=suites.generation_batch or EVAL_BATCH_ACCELERATOR, batch_tokens=EVAL_TOKENS_ACCELERATOR)
    for t in suites.tasks:
        units += task_units(t, acc, TaskEvalConfig(**ev, suite=t.name, limit=t.limit), f"{label} {t.name}", coords)
    return units


def _latency_units(spec: SweepSpec, ref: str, d: dict, st: GridSetting, fit_id: str, llama: bool, cores: int,
                   label: str, coords: dict) -> list[PlannedUnit]:
    """A setting's latency units: each device, batch, prompt length and runtime (``llama``: the llama.cpp
    baseline is timed on this model)."""
    lat = spec.latency
    dense = st.baseline
    units = []
    for dev in lat.devices:
        runtimes = ["ctxsparse"] + ([RUNTIME_HF] if dense and lat.hf_generate_baseline else [])
        if dense and dev == "cpu" and llama and d.get("gguf"):
            runtimes.append(RUNTIME_LLAMA_CPP)      # batch 1 only (one sequence)
        for b in lat.batch:
            for pl in lat.prompt_len:
                for rt in runtimes:
                    if rt == RUNTIME_LLAMA_CPP and b != 1:
                        continue
                    gguf = dev == "cpu" and rt != RUNTIME_HF and gguf_weights(lat, ref, d)
                    cfg = LatencyConfig(model=ref, model_fp=d["fingerprint"], fit_unit=fit_id, device_type=dev,
                                        batch=b, prompt_len=pl, gen_len=lat.gen_len, repeats=lat.repeats,
                                        runtime=rt, threads=latency_threads(spec, dev, cores),
                                        # a sparse setting on the CPU is timed side by side with dense (one process)
                                        paired=dev == "cpu" and rt == "ctxsparse" and not dense,
                                        weights="gguf" if gguf else "float",    # the GGUF's blocks, or float
                                        setting=st if is_shape(ref) else None)
                    units.append(_unit(cfg, dev, [fit_id], f"{label} latency {dev} b{b} p{pl} {rt}", **coords))
    return units


def gguf_weights(lat, ref: str, described: dict) -> bool:
    """Whether CPU latency of model ``ref`` decodes its GGUF's quantized blocks (``latency.cpu_weights``)."""
    if lat.cpu_weights == "float":
        return False
    if not described.get("gguf"):
        if lat.cpu_weights == "gguf":
            raise ValueError(f"latency.cpu_weights is 'gguf' but model {ref} was not loaded from a GGUF file (give "
                             "'auto' or 'float')")
        return False
    return True


def task_units(t, device: str, cfg: TaskEvalConfig, label: str, coords: dict) -> list[PlannedUnit]:
    """The eval units of task ``t`` (a ``TaskSpec``) for one setting: one unit of config ``cfg``; split in
    ``t.shards`` > 1, also that many shard units (``cfg`` with ``shard: [k, n]``), which the task's unit depends on
    and assembles. The task's unit keeps the config, so the id, of the unsharded unit: its rows are the same."""
    front = {"only": getattr(t, "only", None), "within": getattr(t, "within", None)}
    n = getattr(t, "shards", 1)
    if n == 1:
        return [_unit(cfg, device, [cfg.fit_unit], label, **front, **coords)]
    shards = [_unit(cfg.model_copy(update={"shard": (k, n)}), device, [cfg.fit_unit], f"{label} shard {k + 1}/{n}",
                    **front, **coords) for k in range(n)]
    ids = tuple(u.id for u in shards)
    return shards + [_unit(cfg, device, [cfg.fit_unit, *ids], label, shards=ids, **front, **coords)]


def without_needless_shards(units: list[PlannedUnit], done: set[str]) -> list[PlannedUnit]:
    """``units`` without the shards of tasks whose unit is done already (by an unsharded run, or an earlier one
    with other shards): nothing would read their scores."""
    drop = {k for u in units if u.shards and u.id in done for k in u.shards}
    return [u for u in units if u.id not in drop]


def _tag(st: GridSetting) -> str:
    return setting_label(st.method, st.sparsity, st.rank, st.attn_sparsity, st.allocation, st.options,
                         None if st.head is None else st.head.model_dump())
