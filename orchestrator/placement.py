"""Where a sweep's actors go: how many of each role (pool sizes from the cluster's resources, unless the spec gives
a number), and on which GPU / NPU each one lands.

**Room.** For each device type a sweep uses, the actors of the spec's size (``cpus_per_actor``, ``gpus_per_actor``
or ``npus_per_actor``) the cluster holds at once, node by node: on GPU / NPU nodes, ``floor(1 / share)`` actors on
each device for a fractional share (``share`` whole devices each otherwise), as far as the node's CPUs go; on the
CPU, the CPUs over ``cpus_per_actor``. Every node also bounds it by its host memory at ``ACTOR_HOST_MEMORY`` per
actor (what a worker process with torch and a small model takes; Ray's ``memory`` resource).

**Pool sizes** (``pool_sizes``), for a count left ``auto``, from the room ``S`` of the accelerator:
evaluators ``S - S // 4``, fitters and collectors ``S // 4`` (at least 1 each); latency benchers one per GPU /
NPU (each timed alone on its own device), one for the CPU (two timings side by side on one host's cores are not
independent). Evaluators get most of the room because evaluation is most of a sweep's work. Fitters get the
quarter beside them, and collectors the same quarter, before them (a model's fits need its activations, so a
model's collection and its fits never run at the same time). Below four slots that quarter is none: the one fitter
then takes its turn on a slot that an idle evaluator leaves. ``driver._Pools.rebalance`` retires idle actors
whenever a unit waits for room, so pools larger than the room stay live; sizing them to the room keeps that
churn (an actor retired, then made again and its model reloaded) to the hand-overs between phases.

**Spread** (``DevicePlacement``). Ray 2.60 gives each actor asking ``num_gpus=1`` a GPU of its own, but packs
fractional shares: two actors at ``num_gpus=0.5`` on a 2-GPU node both get GPU 0 while GPU 1 idles (seen, not
assumed: tests/orchestrator/test_placement.py shows it next to the fix). So the actors of a GPU / NPU device
type go into a placement group of one bundle per device (``{GPU: 1, CPU: k * cpus_per_actor}``, k actors per
device), and each new actor into the bundle with the fewest actors of its role, then the fewest in all: the first
actors of a pool land on different devices. Ray still sets each actor's ``CUDA_VISIBLE_DEVICES`` /
``ASCEND_RT_VISIBLE_DEVICES`` to its bundle's device alone, so inside the actor its device is index 0. Rounding
the share up instead (one whole GPU per actor) would spread too, but leave most of an H200 idle under one small
model's actor. A group that cannot be reserved within ``PG_READY_TIMEOUT_S`` (another job holds the devices) is
given up, with a warning: the actors are then placed by Ray alone, as before. When the sweep also runs CPU actors
(CPU latency beside a GPU accelerator), each node keeps one actor's CPUs out of the bundles for them: a bundle's
CPUs are reserved for the sweep's life, and a CPU actor waiting for them would wait forever.
"""
from __future__ import annotations

import logging
import math
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

from orchestrator.spec import AUTO, ResourcesSpec
from workers.names import RAY_RESOURCE

log = logging.getLogger("ctxsparse.placement")

ROLES = ("collectors", "fitters", "evaluators", "benchers")
ACTOR_HOST_MEMORY = 4 * 2**30       # bytes of host memory per actor (Gemma-3-270M's worker: 3.3 GB RSS)
PG_READY_TIMEOUT_S = 30.0
_EPS = 1e-9


def _floor(x: float) -> int:
    return max(0, math.floor(x + _EPS))


def _share(r: ResourcesSpec, device: str) -> float:
    return {"cuda": r.gpus_per_actor, "npu": r.npus_per_actor}.get(device, 0.0)


@dataclass(frozen=True)
class Room:
    """What the cluster holds for the sweep's actors of one device type."""
    device: str
    slots: int                   # actors of the spec's size held at once
    bundles: int = 0             # devices (or groups of `share` whole devices) an actor is pinned to; 0 on cpu
    per_bundle: int = 0          # actors on one of them
    bundle: dict = field(default_factory=dict)    # one bundle's resources (a placement group's bundle)

    def describe(self, r: ResourcesSpec) -> str:
        if self.device == "cpu":
            return f"{self.slots} at {r.cpus_per_actor:g} CPU each"
        res, share = RAY_RESOURCE[self.device], _share(r, self.device)
        return (f"{self.slots} on {self.bundles} x {res}:{self.bundle.get(res, 0):g} ({self.per_bundle} each at "
                f"{share:g} {res} + {r.cpus_per_actor:g} CPU)")


def room(r: ResourcesSpec, nodes: Iterable[Mapping[str, float]], device: str, cpu_room: float = 0.0) -> Room:
    """The room of ``device`` on ``nodes`` (each a node's total resources, as ``ray.nodes()`` gives them: ``CPU``,
    ``GPU``, ``NPU``, ``memory`` in bytes). ``cpu_room``: CPUs each node keeps out of the GPU / NPU bundles."""
    cpus = r.cpus_per_actor
    nodes = [dict(n) for n in nodes]
    mem_cap = [_floor(n["memory"] / ACTOR_HOST_MEMORY) if "memory" in n else math.inf for n in nodes]
    if device == "cpu":
        return Room("cpu", sum(min(_floor(n.get("CPU", 0) / cpus), m) for n, m in zip(nodes, mem_cap)))
    res, share = RAY_RESOURCE[device], _share(r, device)
    per_device = 1 if share >= 1 else _floor(1 / share)
    per_bundle, held = per_device, []        # held: (bundles, memory cap) of each node with devices
    for n, m in zip(nodes, mem_cap):
        n_bundles = _floor(n.get(res, 0) / share) if share >= 1 else _floor(n.get(res, 0))
        if n_bundles == 0:
            continue
        cpu_budget = max(0.0, n.get("CPU", 0) - cpu_room)
        k = min(per_device, _floor(cpu_budget / (n_bundles * cpus)))
        if k == 0:                              # fewer CPUs than devices: one actor on as many devices as they go
            n_bundles, k = min(n_bundles, _floor(cpu_budget / cpus)), 1
        if n_bundles:
            per_bundle = min(per_bundle, k)     # one bundle shape for every node (placement groups take a list)
            held.append((n_bundles, m))
    if not held:
        return Room(device, 0)
    bundles = sum(b for b, _ in held)
    slots = sum(min(b * per_bundle, m) for b, m in held)
    bundle = {res: max(share, 1.0), "CPU": per_bundle * cpus}
    return Room(device, slots, bundles, per_bundle, bundle)


def auto_size(role: str, room: Room) -> int:
    """The ``auto`` size of a role's pool on a device type of this room (module docstring: why these shares)."""
    s = room.slots
    if role == "benchers":
        return 1 if room.device == "cpu" else max(1, min(room.bundles, s))
    quarter = s // 4
    if role in ("fitters", "collectors"):
        return max(1, quarter)
    if role == "evaluators":
        return max(1, s - quarter)
    raise ValueError(f"unknown role {role!r}; roles: {ROLES}")


@dataclass
class PoolPlan:
    """Pool sizes per (role, device type), with the rooms they came from."""
    rooms: dict[str, Room]
    sizes: dict[tuple[str, str], int]
    auto: set[tuple[str, str]]

    def size(self, role: str, device: str) -> int:
        return self.sizes[(role, device)]

    def on(self, device: str) -> list[int]:
        """The sizes of the pools on ``device`` (what its placement group is sized for)."""
        return [n for (_, d), n in self.sizes.items() if d == device]

    def summary(self, r: ResourcesSpec) -> str:
        parts = []
        for dev in dict.fromkeys(d for _, d in self.sizes):
            roles = ", ".join(f"{role} {self.sizes[(role, d)]}{'' if (role, d) in self.auto else ' (spec)'}"
                              for role, d in self.sizes if d == dev)
            parts.append(f"{dev}: {roles}; room {self.rooms[dev].describe(r)}")
        return " | ".join(parts)


def pool_sizes(r: ResourcesSpec, nodes: Iterable[Mapping[str, float]], latency_devices: Iterable[str] = ()) -> PoolPlan:
    """The sweep's pool sizes on a cluster of ``nodes`` (module docstring): collectors, fitters and evaluators on
    ``r.accelerator``, benchers on each of ``latency_devices``; an explicit count in ``r`` is kept as it is."""
    nodes = list(nodes)
    lat = list(dict.fromkeys(latency_devices))
    used = list(dict.fromkeys([r.accelerator, *lat]))
    cpu_room = r.cpus_per_actor if "cpu" in used else 0.0
    rooms = {d: room(r, nodes, d, cpu_room if d != "cpu" else 0.0) for d in used}
    sizes, auto = {}, set()
    keys = [(role, r.accelerator) for role in ROLES[:3]] + [("benchers", d) for d in lat]
    for role, dev in keys:
        given = getattr(r, role)
        if given == AUTO:
            auto.add((role, dev))
            sizes[(role, dev)] = auto_size(role, rooms[dev])
        else:
            sizes[(role, dev)] = given
    return PoolPlan(rooms, sizes, auto)


def alive_nodes(ray) -> list[dict]:
    """Each live node's total resources (their sum is ``ray.cluster_resources()``)."""
    return [dict(n["Resources"]) for n in ray.nodes() if n.get("Alive")]


class DevicePlacement:
    """One GPU / NPU device type's placement group (one bundle per device) and the bundle of each of our actors.

    ``create(role, make)`` calls ``make(extra_options)`` with the scheduling strategy of the chosen bundle and
    returns the actor, or None when every bundle is full (the unit waits; the driver retires an idle actor).
    Without a group (none reserved in time), ``make({})``: Ray places the actor alone, with no bound of ours."""

    def __init__(self, ray, room: Room, pools: Iterable[int], cpus_per_actor: float, timeout_s: float | None = None):
        """``pools``: the sizes of the pools on this device type. The group reserves what they can use: enough
        bundles for the largest pool to have one actor per device, and for all of them together (up to every
        device), each with the CPUs of the actors it will hold."""
        from ray.util.placement_group import placement_group, remove_placement_group

        self._remove = remove_placement_group
        pools = [n for n in pools if n > 0] or [1]
        want = sum(pools)
        n = min(room.bundles, max(math.ceil(want / room.per_bundle), max(pools)))
        self.per_bundle = min(room.per_bundle, math.ceil(want / n))
        self.bundle = {**room.bundle, "CPU": self.per_bundle * cpus_per_actor}
        self.device = room.device
        self.pg = placement_group([dict(self.bundle) for _ in range(n)], strategy="PACK")
        timeout_s = PG_READY_TIMEOUT_S if timeout_s is None else timeout_s
        if not self.pg.wait(timeout_s):
            log.warning("could not reserve %d x %s for the sweep's %s actors within %.0f s (does another job hold "
                        "them?): Ray places them alone, and packs fractional shares on one device first",
                        n, self.bundle, self.device, timeout_s)
            remove_placement_group(self.pg)
            self.pg = None
        self.load = [Counter() for _ in range(n if self.pg else 0)]    # bundle -> role -> our actors there
        self.where: dict[int, tuple[int, str]] = {}                    # id(actor) -> (bundle, role)

    @property
    def reserved(self) -> int:
        return len(self.load)

    def choose(self, role: str) -> int | None:
        free = [i for i, c in enumerate(self.load) if sum(c.values()) < self.per_bundle]
        return min(free, key=lambda i: (self.load[i][role], sum(self.load[i].values()), i)) if free else None

    def create(self, role: str, make: Callable[[dict], object]):
        if self.pg is None:
            return make({})
        i = self.choose(role)
        if i is None:
            return None
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        actor = make({"scheduling_strategy": PlacementGroupSchedulingStrategy(
            placement_group=self.pg, placement_group_bundle_index=i)})
        self.load[i][role] += 1
        self.where[id(actor)] = (i, role)
        return actor

    def release(self, actor) -> None:
        i, role = self.where.pop(id(actor), (None, None))
        if i is not None:
            self.load[i][role] -= 1

    def remove(self) -> None:
        if self.pg is not None:
            try:
                self._remove(self.pg)
            except Exception:       # the cluster is gone already
                pass
            self.pg = None
