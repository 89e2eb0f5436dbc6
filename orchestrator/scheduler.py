"""Which of a sweep's units run next, on which kind of worker, and what a unit's end means for the others: the
sweep's scheduling, without Ray and without the store (``orchestrator.driver`` runs it on Ray actors).

A :class:`Scheduler` is told what happens (a unit finished, failed, or its worker died) and answers through
:meth:`Scheduler.dispatch`: the units to start now, each with the worker it took. Three things are injected:

* ``workers`` (passed to ``dispatch``): ``take(kind, device)``, an idle worker of that pool or None, and
  ``rebalance(ready, busy)``, how many idle workers it retired to make room (``driver._Pools``);
* ``front``: the ``only: front`` units released once the units they wait for are finished (``driver.FrontWait``);
* ``record_failure(unit, reason)``: where the failures it decides go (the store's ``fail_unit``).

The rules:

* a unit is ready once every unit it depends on is done; among ready units of one pool (kind, device type) the
  lower ``priority`` starts first, first come first served within a priority (:func:`enqueue`);
* a unit whose dependency failed is failed too, naming it (a resume retries them);
* a unit whose worker died goes back to the head of its queue, for a new worker, up to ``max_attempts``
  attempts; then it fails with the last death as its reason;
* units of a device type no worker has (``devices``) stay pending, never dispatched;
* with ``exclusive_latency`` a latency unit starts only while no other unit waits, is ready or runs;
* what an event allows is released at the next ``dispatch`` after a unit ended (done, failed, or given up on);
  a retry releases nothing.
"""
from __future__ import annotations

import logging
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Mapping, Sized
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from orchestrator.plan import PlannedUnit

log = logging.getLogger("ctxsparse.scheduler")

# the finished units' ids (done, failed or unplaceable) -> (the units released now, their known statuses: "done"
# ones count as done)
FrontRelease = Callable[[set[str]], "tuple[list[PlannedUnit], dict[str, str]]"]


class Workers(Protocol):
    def take(self, kind: str, device: str) -> Any | None:
        """An idle worker of the pool, or None (the unit waits)."""

    def rebalance(self, ready: Mapping[tuple[str, str], Sized], busy: list) -> int:
        """How many idle workers were retired so that ready units of other pools find room."""


def enqueue(queue: deque, unit: PlannedUnit) -> None:
    """Put a ready unit into its queue behind every unit of its priority or a lower one (first come, first served
    within a priority; ``PlannedUnit.priority``)."""
    i = len(queue)
    while i and queue[i - 1].priority > unit.priority:
        i -= 1
    queue.insert(i, unit)


def _no_front(finished: set[str]) -> tuple[list, dict]:
    return [], {}


class Scheduler:
    """The state of a sweep's units: done, failed, unplaceable, waiting for dependencies, ready in their pool's
    queue, or running on a worker; ``total`` counts the units the sweep runs (released front units included)."""

    def __init__(self, units: Iterable[PlannedUnit], done: set[str], devices: set[str], *, max_attempts: int,
                 exclusive_latency: bool = False, front: FrontRelease = _no_front,
                 record_failure: Callable[[str, str], object] = lambda unit, reason: None):
        units = list(units)
        self.devices, self.max_attempts, self.exclusive_latency = set(devices), max_attempts, exclusive_latency
        self.front, self.record_failure = front, record_failure
        self.total = len(units)
        self.done = set(done)
        self.failed: set[str] = set()
        self.unplaceable = [u.id for u in units if u.device_type not in self.devices and u.id not in self.done]
        skip = self.done | set(self.unplaceable)
        self.waiting = {u.id: u for u in units if u.id not in skip}
        self.ready: dict[tuple[str, str], deque] = defaultdict(deque)
        self.running: dict[str, tuple[PlannedUnit, Any]] = {}       # unit id -> (unit, worker)
        self.attempts: dict[str, int] = defaultdict(int)
        self._due = True            # an event left units to release (the first dispatch releases the start's)

    @property
    def left(self) -> int:
        """Units still to run: waiting, ready or running."""
        return len(self.waiting) + sum(len(q) for q in self.ready.values()) + len(self.running)

    # ------------------------------------------------------------------------------------------- events
    def unit_done(self, unit_id: str) -> None:
        """The unit is done (its rows are written)."""
        self.running.pop(unit_id)
        self.done.add(unit_id)
        self._due = True

    def unit_failed(self, unit_id: str) -> None:
        """The unit failed; its failure is recorded already (by the worker, or by whoever saw it fail)."""
        self.running.pop(unit_id)
        self.failed.add(unit_id)
        self._due = True

    def worker_died(self, unit_id: str, error: str) -> bool:
        """The worker running the unit died of ``error`` (a name): True when the unit goes back to the head of its
        queue for a new worker, False when this was its last attempt (it fails, with the death as its reason)."""
        u, _ = self.running.pop(unit_id)
        self.attempts[unit_id] += 1
        n = self.attempts[unit_id]
        msg = f"worker died while running the unit (attempt {n}): {error}"
        if n < self.max_attempts:
            log.warning("%s: %s; retrying on a new worker", u.label, msg)
            self.ready[(u.kind, u.device_type)].appendleft(u)
            return True
        log.error("%s: %s; giving up after %d attempts", u.label, msg, n)
        self.record_failure(unit_id, msg)
        self.failed.add(unit_id)
        self._due = True
        return False

    # ------------------------------------------------------------------------------------------- answers
    def dispatch(self, workers: Workers) -> list[tuple[PlannedUnit, Any]]:
        """Release what the events since the last call allow, then start every ready unit a worker of its pool
        takes: -> [(unit, worker)], now running. Passes repeat while ``workers.rebalance`` retires idle workers
        (room one left is used now, not after the next unit ends)."""
        if self._due:
            self._due = False
            self._release()
        # latency is timed alone when the spec says so: no other unit of this sweep runs beside a bencher
        others_busy = any(k[0] != "latency" and q for k, q in self.ready.items()) or \
            any(u.kind != "latency" for u in self.waiting.values()) or \
            any(u.kind != "latency" for u, _ in self.running.values())
        started = []
        while True:
            for key, q in self.ready.items():
                if key[0] == "latency" and self.exclusive_latency and others_busy:
                    continue
                while q:
                    worker = workers.take(*key)
                    if worker is None:
                        break
                    u = q.popleft()
                    self.running[u.id] = (u, worker)
                    started.append((u, worker))
            # each pass retires at least one idle worker and takes none back to idle: this ends
            if not workers.rebalance(self.ready, [w for _, w in self.running.values()]):
                return started

    def _release(self) -> None:
        """The front's units once it is known, then every waiting unit whose dependencies are done into its queue,
        and every one with a failed dependency failed."""
        self._release_front()
        for uid in list(self.waiting):
            u = self.waiting[uid]
            if any(d in self.failed for d in u.deps):
                self.waiting.pop(uid)
                self.record_failure(u.id, f"not run: a unit it depends on failed "
                                          f"({[d for d in u.deps if d in self.failed]})")
                self.failed.add(uid)
            elif all(d in self.done for d in u.deps):
                enqueue(self.ready[(u.kind, u.device_type)], self.waiting.pop(uid))

    def _release_front(self) -> None:
        chosen, statuses = self.front(self.done | self.failed | set(self.unplaceable))
        self.total += len(chosen)
        for u in chosen:
            if statuses.get(u.id) == "done":
                self.done.add(u.id)
            elif u.device_type not in self.devices:
                self.unplaceable.append(u.id)
            else:
                self.waiting[u.id] = u
