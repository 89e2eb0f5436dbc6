"""The Ray job entrypoint of a sweep: ``python -m orchestrator.driver SPEC`` (what ``ray job submit`` runs).

1. Validate the spec and the files it names; open the store (``--db`` / ``$CTXSPARSE_DB_URL`` / SQLite) and
   migrate it, before any Ray work: an unreachable store is one message, exit status 2.
2. Ask a collector actor for each model's and data's fingerprints; plan the units (``orchestrator.plan``)
   and register them under the sweep (idempotent: units finished by any earlier sweep stay finished). A task split
   into shards runs its shard units, then its own unit, which assembles their scores (shards of a task already
   done are not planned). Units of ``only: front`` tasks wait (``FrontWait``): once every other eval unit of every
   model has finished, and the latency units timed alone after them, the front of each model's recorded rows
   against weights skipped (``db.front.pareto.front_pick``) picks the settings they run for, dense's among
   them; those are registered and run, the rest never are.
3. Run what is not done, in dependency order, on actor pools (``workers.actors``), at most one unit in flight
   per actor (backpressure through ``ray.wait``); which unit starts when is ``orchestrator.scheduler``'s: among
   ready units of one kind, the lower ``priority`` first (the plan starts fits from activation statistics first,
   then the longest, ``orchestrator.plan.fit_priority``). Actors write each unit's rows the moment it finishes.
   A dead actor is replaced and its unit retried (up to ``resources.max_attempts``); a unit that raises is
   recorded as failed with its traceback, and what depends on it is marked failed too (a resume retries them).
4. Units for a device type the cluster does not have (no ``GPU`` / ``NPU`` resource) stay pending, and the log
   says so: no latency is ever invented.
5. Print the Pareto front per model and device type.

Exit status: 0 when every placeable unit is done, 1 when some failed, 2 on a bad spec or store, or a model or
data the workers cannot load (the worker's own error, in one line).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field

from db.front.pareto import FrontPick, ParetoError, format_front
from db.schemas import DatasetSpec, ModelSpec, NewUnit
from db.store import Store, StoreError, first_line, open_store
from orchestrator.placement import DevicePlacement, alive_nodes, pool_sizes
from orchestrator.plan import PlannedUnit, node_cores, plan_units, without_needless_shards
from orchestrator.scheduler import Scheduler
from orchestrator.spec import SpecError, SweepSpec, check_inputs, load_spec, parse_spec
from workers.names import DENSE, DEVICE_TYPES, RAY_RESOURCE

log = logging.getLogger("ctxsparse.driver")

ROLE_OF_KIND = {"collect": "collectors", "fit": "fitters", "eval": "evaluators", "latency": "benchers"}


@dataclass
class SweepOutcome:
    sweep_id: int
    total: int
    done: int
    failed: list[str] = field(default_factory=list)
    unplaceable: list[str] = field(default_factory=list)
    ran: int = 0                  # units computed by this run (the rest were done already)
    model_names: list[str] = field(default_factory=list)   # as stored (a shape:NAME model is NAME-shape)
    worker_deaths: int = 0

    @property
    def ok(self) -> bool:
        return not self.failed


class SweepSetupError(RuntimeError):
    """A model or its data that the workers cannot load (found when the first worker describes them)."""


def reason(e: BaseException) -> str:
    """An exception as one line: a Ray task error is told by the worker's own exception, not Ray's wrapper."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        e = cause
    return f"{type(e).__name__}: {first_line(e)}"


def _ray():
    import ray

    if not ray.is_initialized():
        # inside `ray job submit` RAY_ADDRESS points at the cluster; on its own this starts a local one
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, log_to_driver=True)
    return ray


def cluster_device_types(ray) -> set[str]:
    res = ray.cluster_resources()
    return {"cpu"} | {dev for dev, name in RAY_RESOURCE.items() if res.get(name, 0) > 0}


class _Pools:
    """Actor pools keyed by (role, device type), created on demand up to their size (``orchestrator.placement``:
    a spec's number, or ``auto`` from the cluster's resources); dead actors are replaced. The actors of a GPU / NPU
    device type are spread over its devices through one placement group (``DevicePlacement``), made when the
    first of them is needed."""

    def __init__(self, ray, spec: SweepSpec, db_url: str | None):
        from workers.actors import ROLE_CLASSES, actor_options

        self.ray, self.spec, self.db_url = ray, spec, db_url
        self._classes, self._options = ROLE_CLASSES, actor_options
        self.actors: dict[tuple[str, str], list] = defaultdict(list)
        self.idle: dict[tuple[str, str], deque] = defaultdict(deque)
        self.started: set[int] = set()      # actors that have answered at least once (so were placed)
        lat = spec.latency.devices if spec.latency else []
        self.plan = pool_sizes(spec.resources, alive_nodes(ray), lat)
        self.placements: dict[str, DevicePlacement | None] = {}

    def _size(self, kind: str, device: str) -> int:
        return self.plan.size(ROLE_OF_KIND[kind], device)

    def _placement(self, device: str) -> DevicePlacement | None:
        if device not in self.placements:
            room = self.plan.rooms.get(device)
            spread = device in RAY_RESOURCE and room is not None and room.bundles > 0
            self.placements[device] = DevicePlacement(self.ray, room, self.plan.on(device),
                                                      self.spec.resources.cpus_per_actor) if spread else None
            if spread and self.placements[device].reserved:
                pl = self.placements[device]
                log.info("%s actors: spread over %d placement-group bundles of %s, %d actors each", device,
                         pl.reserved, pl.bundle, pl.per_bundle)
        return self.placements[device]

    def _new(self, kind: str, device: str):
        r = self.spec.resources
        opts = self._options(device, cpus=r.cpus_per_actor, gpus=r.gpus_per_actor, npus=r.npus_per_actor,
                             max_restarts=r.max_restarts)
        home = os.environ.get("CTXSPARSE_HOME")

        def make(extra: dict):
            return self._classes[kind].options(**opts, **extra).remote(self.db_url, device, r.torch_threads, home)

        placement = self._placement(device)
        return make({}) if placement is None else placement.create(ROLE_OF_KIND[kind], make)

    def take(self, kind: str, device: str):
        """An idle actor of (kind, device), or a new one while the pool is below its size and its devices have
        room; None otherwise (the unit waits)."""
        key = (kind, device)
        if self.idle[key]:
            return self.idle[key].popleft()
        if len(self.actors[key]) < self._size(kind, device):
            a = self._new(kind, device)
            if a is not None:
                self.actors[key].append(a)
            return a
        return None

    def rebalance(self, ready: dict, inflight_actors) -> int:
        """Retire idle actors that have nothing ready while other work waits for room; returns how many.

        Idle actors keep their CPU/GPU reservation: on a small cluster an idle fitter and an idle evaluator can
        hold every CPU while a new latency bencher waits to be placed, forever. So whenever some ready unit
        has no actor, or a unit waits on an actor that has not answered yet (maybe not placed), every idle
        actor whose own queue is empty is released; it is created again (cheaply) when its work comes.
        """
        blocked = any(q and not self.idle[key] for key, q in ready.items())
        unplaced = any(id(a) not in self.started for a in inflight_actors)
        if not (blocked or unplaced):
            return 0
        retired = 0
        for key, q in self.idle.items():
            while q and not ready.get(key):
                self.replace(*key, q.popleft())
                retired += 1
        return retired

    def give_back(self, kind: str, device: str, actor) -> None:
        self.started.add(id(actor))
        self.idle[(kind, device)].append(actor)

    def replace(self, kind: str, device: str, dead) -> None:
        key = (kind, device)
        try:
            self.ray.kill(dead, no_restart=True)
        except Exception:  # already gone
            pass
        self.actors[key] = [a for a in self.actors[key] if a is not dead]
        if self.placements.get(device) is not None:
            self.placements[device].release(dead)

    def describe(self, refs: list[str], spec: SweepSpec) -> dict[str, dict]:
        """Each model's description (``Units.describe``), the models on collectors of their own at once where the
        pool has room: a model's first load on a host converts its GGUF, so the models' loads overlap."""
        from ray.exceptions import RayTaskError

        device = spec.resources.accelerator
        actors = []
        while len(actors) < len(refs) and (a := self.take("collect", device)) is not None:
            actors.append(a)
        if not actors:
            raise SweepSetupError(f"no room for a collector on {device} in this cluster")
        ppl = spec.suites.perplexity.model_dump() if spec.suites.perplexity else None
        out: dict[str, dict] = {}
        try:
            for at in range(0, len(refs), len(actors)):
                running = {ref: a.describe.remote(ref, spec.data.model_dump(), ppl)
                           for ref, a in zip(refs[at:at + len(actors)], actors)}
                for ref, future in running.items():
                    try:
                        out[ref] = self.ray.get(future)
                    except RayTaskError as e:
                        raise SweepSetupError(f"model {ref} with data {spec.data.source!r}: {reason(e)}") from None
        finally:
            for a in actors:
                self.give_back("collect", device, a)
        return out

    def shutdown(self) -> None:
        for actors in self.actors.values():
            for a in actors:
                try:
                    self.ray.kill(a, no_restart=True)
                except Exception:
                    pass
        for placement in self.placements.values():
            if placement is not None:
                placement.remove()


def _fmt_eta(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m" if seconds >= 3600 else f"{seconds // 60}m{seconds % 60:02d}s"


def _new_units(spec: SweepSpec, described: dict[str, dict], units: list[PlannedUnit]) -> list[NewUnit]:
    """``units`` as the store registers them, with their models and calibration data (recorded where new)."""
    models, datasets = {}, {}
    for ref in dict.fromkeys(u.model for u in units):
        d = described[ref]
        models[ref] = ModelSpec(name=d["name"], fingerprint=d["fingerprint"], family=d["family"],
                                config={"dims": d["dims"]}, n_params=d["n_params"])
        datasets[ref] = None if d["calib_fp"] is None else DatasetSpec(
            name=f"{spec.data.source}-calib", fingerprint=d["calib_fp"], source=spec.data.source,
            n_tokens=d["calib_n_tokens"], split="calib")
    return [NewUnit(model=models[u.model], dataset=datasets[u.model], unit=u.columns()) for u in units]


def register(store: Store, spec: SweepSpec, described: dict[str, dict], units: list[PlannedUnit],
             submission_id: str | None) -> int:
    """Create (or find) the sweep and register its units, but those waiting for the front (``only``): they are
    registered when the front picks them (``front_units``)."""
    now = [u for u in units if not u.only]
    sweep_id, created = store.record_sweep(name=spec.name, spec_hash=spec.spec_hash(), spec=spec.canonical(),
                                           units=_new_units(spec, described, now), submission_id=submission_id,
                                           status="running")
    held = len(units) - len(now)
    log.info("sweep %s (id %d, %s): %d units registered%s", spec.name, sweep_id,
             "new" if created else "known: resuming", len(now),
             f", {held} more wait for the front ('only: front')" if held else "")
    return sweep_id


def prune_shards(store: Store, units: list[PlannedUnit]) -> list[PlannedUnit]:
    """The plan without the shards of tasks the store has done already (``plan.without_needless_shards``)."""
    tasks = [u.id for u in units if u.shards]
    if not tasks:
        return units
    done = {k for k, v in store.unit_statuses(tasks).items() if v == "done"}
    return without_needless_shards(units, done)


def front_units(store: Store, held: list[PlannedUnit], gate: set[str]) -> tuple[list[PlannedUnit], FrontPick]:
    """Which of one model's ``only: front`` units run: those of dense and of the settings on the front
    (``db.front.pareto.front_pick``) drawn on the rows of ``gate`` (the model's front-defining eval units,
    all finished) among the settings the units belong to, less those beyond the unit's task's ``within``
    (``FrontPick.within``); with their shards, if split."""
    fits = list(dict.fromkeys(u.config.fit_unit for u in held))
    pick = store.front_pick(held[0].config.model_fp, fits, gate)
    chosen = {w: set(pick.within(w)) for w in {u.within for u in held}}
    return [u for u in held if u.config.fit_unit in chosen[u.within]], pick


def before_front(spec: SweepSpec, units: list[PlannedUnit]) -> set[str]:
    """The units the ``only: front`` units wait for besides the fronts' own (``FrontWait``'s ``after``): the latency
    units, when the spec times latency alone."""
    if spec.latency is None or not spec.latency.exclusive:
        return set()
    return {u.id for u in units if u.kind == "latency"}


class FrontWait:
    """A sweep's ``only: front`` units, held until every other eval unit of every model of the sweep (the units that
    draw the fronts) has finished; then :func:`front_units` picks those that run for each model (dense's and the
    front's), which are registered under the sweep. The others are never registered: the sweep's progress counts
    what it runs.

    Why all models, and dense's too: these units generate (GSM8K), and a decode step is hundreds of small dependent
    kernels. Beside other processes' scoring forwards on a shared accelerator each of them waits its turn: on an
    H200 under MPS, dense's GSM8K started with the sweep ran 16-21x slower than alone and was the sweep's last unit
    to finish (BENCHMARKS.md). Held to the end, they run together on a device of their own.

    ``after``: units that go before them too, the latency units when latency is timed alone (``latency.exclusive``).
    Those are seconds each where a generation unit takes minutes, they complete every model's accuracy-latency
    front, and a sweep stopped during generation still has them."""

    def __init__(self, store: Store, spec: SweepSpec, described: dict[str, dict], sweep_id: int,
                 units: list[PlannedUnit], after: set[str] = frozenset()):
        self.store, self.spec, self.described, self.sweep_id = store, spec, described, sweep_id
        self.after = set(after)
        self.held: dict[str, list[PlannedUnit]] = defaultdict(list)
        for u in units:
            if u.only:
                self.held[u.model].append(u)
        self.gates = {m: {u.id for u in units if u.model == m and u.kind == "eval" and not u.only}
                      for m in self.held}

    def release(self, finished: set[str]) -> tuple[list[PlannedUnit], dict[str, str]]:
        """(the units released now, registered under the sweep, and their statuses in the store): once every
        model's front-defining units are in ``finished`` (done, failed or never placeable), dense's and the
        front's of each model, once ``after`` is in ``finished`` too; nothing before, and nothing after that once."""
        if not self.gates or not self.after <= finished or not all(gate <= finished for gate in self.gates.values()):
            return [], {}
        out = []
        for m in list(self.gates):
            gate, mine = self.gates.pop(m), self.held.pop(m)
            chosen, pick = front_units(self.store, mine, gate)
            on = ", ".join(pick.labels.get(k, k[:12]) for k in pick.front) or "none"
            budgets = sorted({u.within for u in mine if u.within is not None})
            log.info("%s: the front of %s vs %s: %d of %d settings (%s); 'only: front' units of dense and the "
                     "front%s: %d of %d", m, pick.metric or "(no front-defining rows)", pick.axis, len(pick.front),
                     len({u.config.fit_unit for u in mine}), on,
                     f" within {', '.join(f'{b:g}' for b in budgets)} of dense" if budgets else "",
                     len(chosen), len(mine))
            out += chosen
        if not out:
            return [], {}
        return out, self.store.add_units(self.sweep_id, _new_units(self.spec, self.described, out))


def run_sweep(spec: SweepSpec, db_url: str | None = None, submission_id: str | None = None,
              heartbeat_s: float = 60.0) -> SweepOutcome:
    store = open_store(db_url)
    ray = _ray()
    pools = _Pools(ray, spec, db_url if db_url is not None else store.url)
    res = ray.cluster_resources()
    log.info("cluster: %s; pools %s", ", ".join(f"{res[k]:g} {k}" for k in (*RAY_RESOURCE.values(), "CPU") if res.get(k)),
             pools.plan.summary(spec.resources))
    try:
        described = pools.describe(list(spec.models), spec)
        for ref, d in described.items():
            data = (f"calibration data {d['calib_fp'][:12]} ({d['calib_n_tokens']} tokens)" if d["calib_fp"]
                    else "random weights: latency only")
            log.info("model %s: %s, fingerprint %s; %s", ref, d["family"], d["fingerprint"][:12], data)
        units = prune_shards(store, plan_units(spec, described, cpu_cores=node_cores(alive_nodes(ray))))
        sweep_id = register(store, spec, described, units, submission_id)
        out = _execute(ray, store, pools, spec, sweep_id, units, heartbeat_s, described)
        out.model_names = [described[m]["name"] for m in spec.models]
        return out
    finally:
        pools.shutdown()


def _execute(ray, store: Store, pools: _Pools, spec: SweepSpec, sweep_id: int, units: list[PlannedUnit],
             heartbeat_s: float, described: dict[str, dict]) -> SweepOutcome:
    front = FrontWait(store, spec, described, sweep_id, units, after=before_front(spec, units))
    units = [u for u in units if not u.only]
    status = store.unit_statuses([u.id for u in units])
    sched = Scheduler(units, {k for k, v in status.items() if v == "done"}, cluster_device_types(ray),
                      max_attempts=spec.resources.max_attempts,
                      exclusive_latency=spec.latency is not None and spec.latency.exclusive,
                      front=front.release, record_failure=store.fail_unit)
    _warn_unplaceable(units, sched.unplaceable)
    log.info("%d of %d units already done; %d to run", len(sched.done), sched.total, len(sched.waiting))
    run = _Run(ray, store, pools, sched, heartbeat_s)
    run.loop()
    out = SweepOutcome(sweep_id, total=sched.total, done=len(sched.done), failed=sorted(sched.failed),
                       unplaceable=sched.unplaceable, ran=run.ran, worker_deaths=run.deaths)
    if sched.failed:
        final = "failed"
    elif sched.unplaceable:
        final = "running"   # resumable on a cluster that has the missing devices
    else:
        final = "done"
    prog = store.finish_sweep(sweep_id, final)
    log.info("sweep %s: %d/%d units done, %d failed, %d waiting for devices this cluster lacks; %d computed "
             "now in %s; %d worker deaths", spec.name, prog.done, prog.total, prog.failed, len(sched.unplaceable),
             run.ran, _fmt_eta(time.time() - run.t_start), run.deaths)
    return out


def _warn_unplaceable(units: list[PlannedUnit], unplaceable: list[str]) -> None:
    by_id = {u.id: u for u in units}
    for dev in sorted({by_id[k].device_type for k in unplaceable}):
        n = sum(by_id[k].device_type == dev for k in unplaceable)
        log.warning("no %s resources in this cluster (%s): %d %s units stay pending; no %s rows are written",
                    dev, RAY_RESOURCE[dev], n, dev, dev)


def _task(u: PlannedUnit) -> dict:
    """What an actor's ``run`` is given (the config in its stored form, typed again by ``Units.run``)."""
    task = {"id": u.id, "kind": u.kind, "config": u.config.canonical()}
    if u.shards:
        task["shards"] = list(u.shards)
    return task


class _Run:
    """The scheduler's units run on the actor pools, at most one in flight per actor (backpressure through
    ``ray.wait``): each result, or an actor's death, is told to the scheduler, and the progress logged."""

    def __init__(self, ray, store: Store, pools: _Pools, sched: Scheduler, heartbeat_s: float):
        self.ray, self.store, self.pools, self.sched, self.heartbeat_s = ray, store, pools, sched, heartbeat_s
        self.inflight: dict = {}          # ObjectRef -> (unit, actor)
        self.t_start, self.ran, self.deaths = time.time(), 0, 0      # ran: computed now (not done already)

    def loop(self) -> None:
        last_beat = time.time()
        while True:
            for u, actor in self.sched.dispatch(self.pools):
                self.inflight[actor.run.remote(_task(u))] = (u, actor)
            if not self.inflight:
                return
            finished, _ = self.ray.wait(list(self.inflight), num_returns=1, timeout=self.heartbeat_s)
            if finished:
                self._result(finished[0])
            elif time.time() - last_beat >= self.heartbeat_s:
                running = ", ".join(u.label for u, _ in self.inflight.values())
                log.info("[%d/%d] running: %s", len(self.sched.done), self.sched.total, running)
                last_beat = time.time()

    def _result(self, ref) -> None:
        from ray.exceptions import RayActorError

        u, actor = self.inflight.pop(ref)
        try:
            res = self.ray.get(ref)
        except RayActorError as e:
            self.deaths += 1
            self.pools.replace(u.kind, u.device_type, actor)
            self.sched.worker_died(u.id, type(e).__name__)
            return
        except Exception as e:   # the actor's own bookkeeping failed (e.g. the store was unreachable from it)
            res = {"status": "failed", "error": reason(e), "worker": "?"}
            self.store.fail_unit(u.id, f"the worker could not run or record the unit: {res['error']}")
        self.pools.give_back(u.kind, u.device_type, actor)
        sched = self.sched
        if res["status"] != "done":
            sched.unit_failed(u.id)
            log.error("[%d/%d] %s FAILED on %s: %s", len(sched.done), sched.total, u.label, res["worker"],
                      res["error"])
            return
        sched.unit_done(u.id)
        if not res.get("skipped"):
            self.ran += 1
        eta = (time.time() - self.t_start) / max(self.ran, 1) * sched.left  # per unit: reflects parallelism already
        log.info("[%d/%d] %s: %s (%.1fs, %s) ETA %s", len(sched.done), sched.total, u.label,
                 res.get("summary") or ("already done" if res.get("skipped") else ""),
                 res.get("duration_s") or 0.0, res["worker"], _fmt_eta(eta))


def print_fronts(store: Store, models: list[str], device_types: tuple[str, ...] = DEVICE_TYPES) -> None:
    """Each model's front on each device type that has latency rows (the end of a sweep's log)."""
    for m in models:
        for dev in device_types:
            try:
                _, front = store.front(m, device_type=dev)
            except ParetoError as e:
                print(f"{m}: {e}")
                break
            if front.message and dev != "cpu" and all(r.latency_ms is None for r in front.rows):
                print(f"{m}: no latency rows for {dev} yet")
                continue
            print(format_front(front, m))


def spec_from_env(var: str = "CTXSPARSE_SPEC") -> SweepSpec:
    import json

    text = os.environ.get(var)
    if not text:
        raise SpecError(f"spec '-' given but ${var} is empty")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise SpecError(f"${var}: not JSON ({e})") from None
    return parse_spec(data, f"${var}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m orchestrator.driver", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("spec", help="sweep spec (YAML); '-' reads it from $CTXSPARSE_SPEC (what `ctxsparse submit` sets)")
    ap.add_argument("--db", default=None, help="SQLAlchemy URL (default: $CTXSPARSE_DB_URL, else SQLite)")
    ap.add_argument("--submission-id", default=os.environ.get("CTXSPARSE_SUBMISSION_ID"))
    ap.add_argument("--no-pareto", action="store_true", help="do not print the Pareto fronts at the end")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("alembic").setLevel(logging.WARNING)
    from ray.exceptions import RayTaskError

    try:
        spec = load_spec(args.spec) if args.spec != "-" else spec_from_env()
        check_inputs(spec)
    except SpecError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        outcome = run_sweep(spec, args.db, args.submission_id)
    except (StoreError, SweepSetupError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError, OSError, RayTaskError) as e:   # anything else the sweep could not start with
        print(f"error: {reason(e)}", file=sys.stderr)
        return 2
    if not args.no_pareto:
        print_fronts(Store(args.db), outcome.model_names)
    return 0 if outcome.ok else 1


if __name__ == "__main__":
    sys.exit(main())
