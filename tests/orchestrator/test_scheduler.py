"""The sweep's scheduling without Ray (``orchestrator.scheduler``): hand-built units on fake worker pools, events
told as the driver tells them, and the known answers: what starts when, on which worker, what is retried and what
is failed, with which reason."""
from __future__ import annotations

from collections import defaultdict, deque

from orchestrator.plan import PlannedUnit
from orchestrator.scheduler import Scheduler, enqueue

DEATH = "RayActorError"


def unit(uid: str, kind: str = "eval", deps: tuple[str, ...] = (), device: str = "cpu", priority: int = 0,
         only: str | None = None) -> PlannedUnit:
    return PlannedUnit(uid, kind, "m", device, {}, tuple(deps), label=uid, priority=priority, only=only)


class Pool:
    """Workers handed out as ``driver._Pools`` does: an idle one, else a new one while the pool (kind, device) is
    below its size; a dead one is replaced (its successor has a new name). ``room``: pools that get their size only
    once ``rebalance`` has retired an idle worker."""

    def __init__(self, sizes: dict[tuple[str, str], int], room: dict[tuple[str, str], int] | None = None):
        self.sizes, self.room = dict(sizes), dict(room or {})
        self.made: dict[tuple[str, str], int] = defaultdict(int)
        self.live: dict[tuple[str, str], list[str]] = defaultdict(list)
        self.idle: dict[tuple[str, str], list[str]] = defaultdict(list)
        self.rebalanced: list[tuple[dict, list]] = []      # what each rebalance call saw

    def take(self, kind: str, device: str) -> str | None:
        key = (kind, device)
        if self.idle[key]:
            return self.idle[key].pop(0)
        if len(self.live[key]) < self.sizes.get(key, 0):
            self.made[key] += 1
            self.live[key].append(f"{kind}@{device}#{self.made[key]}")
            return self.live[key][-1]
        return None

    def rebalance(self, ready, busy) -> int:
        self.rebalanced.append(({k: len(q) for k, q in ready.items()}, list(busy)))
        if not self.room:
            return 0
        self.sizes.update(self.room)
        self.room = {}
        return 1

    def give_back(self, worker: str) -> None:
        kind, device = worker.split("#")[0].split("@")
        self.idle[(kind, device)].append(worker)

    def replace(self, worker: str) -> None:
        kind, device = worker.split("#")[0].split("@")
        self.live[(kind, device)].remove(worker)


def pools(**sizes: int) -> Pool:
    """``pools(fit=1, eval=2)``: that many workers of each kind on the CPU."""
    return Pool({(kind, "cpu"): n for kind, n in sizes.items()})


def start(sched: Scheduler, pool: Pool) -> list[tuple[str, str]]:
    return [(u.id, w) for u, w in sched.dispatch(pool)]


def done(sched: Scheduler, pool: Pool, *uids: str) -> None:
    for uid in uids:
        pool.give_back(sched.running[uid][1])
        sched.unit_done(uid)


def failures() -> tuple[list, object]:
    """(the recorded failures, the sink that records them)."""
    got = []
    return got, lambda uid, why: got.append((uid, why))


# ------------------------------------------------------------------------------------------------- order
def test_ready_units_of_a_pool_start_lower_priority_first_then_first_come():
    q = deque()
    for u in (unit("svd", "fit", priority=2), unit("teal1", "fit"), unit("dejavu", "fit", priority=1),
              unit("teal2", "fit")):
        enqueue(q, u)
    assert [u.id for u in q] == ["teal1", "teal2", "dejavu", "svd"]
    fits = [unit("svd", "fit", priority=2), unit("teal1", "fit"), unit("dejavu", "fit", priority=1),
            unit("teal2", "fit")]
    sched, pool = Scheduler(fits, set(), {"cpu"}, max_attempts=3), pools(fit=1)
    order = []
    while step := start(sched, pool):            # one fitter: one unit at a time
        order += step
        done(sched, pool, *(uid for uid, _ in step))
    assert order == [("teal1", "fit@cpu#1"), ("teal2", "fit@cpu#1"), ("dejavu", "fit@cpu#1"), ("svd", "fit@cpu#1")]
    assert sched.done == {"svd", "teal1", "dejavu", "teal2"} and sched.left == 0
    sched, pool = Scheduler(fits, set(), {"cpu"}, max_attempts=3), pools(fit=4)
    assert [uid for uid, _ in start(sched, pool)] == ["teal1", "teal2", "dejavu", "svd"]


def test_a_unit_starts_once_its_dependencies_are_done():
    units = [unit("c", "collect"), unit("f", "fit", ("c",)), unit("e1", "eval", ("f",)), unit("e2", "eval", ("f",)),
             unit("l", "latency", ("f",))]
    sched, pool = Scheduler(units, set(), {"cpu"}, max_attempts=3), pools(collect=1, fit=1, eval=1, latency=1)
    assert start(sched, pool) == [("c", "collect@cpu#1")]
    assert start(sched, pool) == []                               # nothing ended: nothing new
    done(sched, pool, "c")
    assert start(sched, pool) == [("f", "fit@cpu#1")]
    done(sched, pool, "f")
    assert start(sched, pool) == [("e1", "eval@cpu#1"), ("l", "latency@cpu#1")]    # one evaluator: e2 waits
    assert sched.left == 3 and [u.id for u in sched.ready[("eval", "cpu")]] == ["e2"]
    done(sched, pool, "e1")
    assert start(sched, pool) == [("e2", "eval@cpu#1")]
    # resumed: what is done is never run, what depends on it is ready at once
    sched = Scheduler(units, {"c", "f", "e1"}, {"cpu"}, max_attempts=3)
    assert (sched.total, sched.left) == (5, 2)
    assert start(sched, pools(collect=1, fit=1, eval=2, latency=1)) == [("e2", "eval@cpu#1"), ("l", "latency@cpu#1")]


def test_latency_timed_alone_waits_until_no_other_unit_waits_or_runs():
    units = [unit("f", "fit"), unit("e", "eval", ("f",)), unit("l", "latency", ("f",))]
    sched, pool = Scheduler(units, set(), {"cpu"}, max_attempts=3, exclusive_latency=True), \
        pools(fit=1, eval=1, latency=1)
    assert start(sched, pool) == [("f", "fit@cpu#1")]
    done(sched, pool, "f")
    assert start(sched, pool) == [("e", "eval@cpu#1")]            # the bencher waits for the evaluator
    done(sched, pool, "e")
    assert start(sched, pool) == [("l", "latency@cpu#1")]
    beside = Scheduler(units, {"f"}, {"cpu"}, max_attempts=3)     # not exclusive: side by side
    assert start(beside, pools(eval=1, latency=1)) == [("e", "eval@cpu#1"), ("l", "latency@cpu#1")]


def test_room_a_retired_worker_leaves_is_used_in_the_same_dispatch():
    """The latency pool has room only once an idle worker is retired (``_Pools.rebalance``): its unit starts in the
    same dispatch; rebalance saw the ready queues and the busy workers."""
    units = [unit("e", "eval"), unit("l", "latency")]
    pool = Pool({("eval", "cpu"): 1}, room={("latency", "cpu"): 1})
    sched = Scheduler(units, set(), {"cpu"}, max_attempts=3)
    assert start(sched, pool) == [("e", "eval@cpu#1"), ("l", "latency@cpu#1")]
    assert pool.rebalanced == [({("eval", "cpu"): 0, ("latency", "cpu"): 1}, ["eval@cpu#1"]),
                               ({("eval", "cpu"): 0, ("latency", "cpu"): 0}, ["eval@cpu#1", "latency@cpu#1"])]


# ------------------------------------------------------------------------------------------------- failures
def test_a_dead_workers_unit_is_retried_first_on_a_new_worker():
    got, sink = failures()
    sched, pool = Scheduler([unit("e1"), unit("e2")], set(), {"cpu"}, max_attempts=3, record_failure=sink), \
        pools(eval=1)
    assert start(sched, pool) == [("e1", "eval@cpu#1")]
    pool.replace("eval@cpu#1")                                    # the driver replaces the dead actor
    assert sched.worker_died("e1", DEATH) is True
    assert start(sched, pool) == [("e1", "eval@cpu#2")]           # ahead of e2, which was ready first
    done(sched, pool, "e1")
    assert start(sched, pool) == [("e2", "eval@cpu#2")]
    assert got == [] and sched.attempts == {"e1": 1} and sched.failed == set()


def test_a_unit_whose_workers_keep_dying_fails_after_max_attempts_and_so_do_its_dependants():
    got, sink = failures()
    units = [unit("e"), unit("x", "latency", ("e",)), unit("y", "latency", ("x",)), unit("z", "latency")]
    sched, pool = Scheduler(units, set(), {"cpu"}, max_attempts=2, record_failure=sink), pools(eval=1, latency=1)
    assert start(sched, pool) == [("e", "eval@cpu#1"), ("z", "latency@cpu#1")]
    pool.replace("eval@cpu#1")
    assert sched.worker_died("e", DEATH) is True
    assert start(sched, pool) == [("e", "eval@cpu#2")]
    pool.replace("eval@cpu#2")
    assert sched.worker_died("e", DEATH) is False
    assert got == [("e", f"worker died while running the unit (attempt 2): {DEATH}")]
    assert start(sched, pool) == []                               # z's bencher is still busy
    assert got[1:] == [("x", "not run: a unit it depends on failed (['e'])"),
                       ("y", "not run: a unit it depends on failed (['x'])")]
    assert sched.failed == {"e", "x", "y"} and sched.left == 1 and list(sched.running) == ["z"]


def test_a_failed_unit_fails_its_dependants_and_the_rest_runs():
    """The failed unit's own failure is the worker's to record; the scheduler records its dependants', naming the
    failed ones they depend on (a dependant of a dependant later in the plan fails in the same release)."""
    got, sink = failures()
    units = [unit("bad", "fit"), unit("ok", "fit"), unit("shard", "eval", ("bad",)),
             unit("task", "eval", ("shard", "ok")), unit("other", "eval", ("ok",))]
    sched, pool = Scheduler(units, set(), {"cpu"}, max_attempts=3, record_failure=sink), pools(fit=2, eval=2)
    assert start(sched, pool) == [("bad", "fit@cpu#1"), ("ok", "fit@cpu#2")]
    pool.give_back("fit@cpu#1")
    sched.unit_failed("bad")
    assert got == []                                              # recorded when the scheduler releases
    done(sched, pool, "ok")
    assert start(sched, pool) == [("other", "eval@cpu#1")]
    assert got == [("shard", "not run: a unit it depends on failed (['bad'])"),
                   ("task", "not run: a unit it depends on failed (['shard'])")]
    assert sched.failed == {"bad", "shard", "task"} and sched.done == {"ok"}


def test_units_of_a_device_type_no_worker_has_stay_pending():
    units = [unit("f", "fit"), unit("l-cpu", "latency", ("f",)), unit("l-cuda", "latency", ("f",), device="cuda"),
             unit("e-cuda", "eval", ("f",), device="cuda")]
    sched = Scheduler(units, {"e-cuda"}, {"cpu"}, max_attempts=3)   # e-cuda was done on another cluster
    pool = Pool({("fit", "cpu"): 1, ("latency", "cpu"): 1})
    assert sched.unplaceable == ["l-cuda"] and (sched.total, sched.left) == (4, 2)
    assert start(sched, pool) == [("f", "fit@cpu#1")]
    done(sched, pool, "f")
    assert start(sched, pool) == [("l-cpu", "latency@cpu#1")]
    done(sched, pool, "l-cpu")
    assert start(sched, pool) == [] and sched.left == 0
    assert sched.unplaceable == ["l-cuda"] and sched.failed == set() and len(sched.done) == 3


# ------------------------------------------------------------------------------------------------- the front
class Front:
    """``driver.FrontWait`` with a fixed answer: nothing until ``gate`` is finished, then ``chosen`` (with
    ``statuses``) once; every finished set it was asked with is kept."""

    def __init__(self, gate: set[str], chosen: list[PlannedUnit], statuses: dict[str, str]):
        self.gate, self.chosen, self.statuses, self.asked = gate, chosen, statuses, []

    def __call__(self, finished: set[str]):
        self.asked.append(set(finished))
        if not self.chosen or not self.gate <= finished:
            return [], {}
        chosen, self.chosen = self.chosen, []
        return chosen, self.statuses


def test_front_units_wait_until_the_front_is_known_then_run():
    gate = [unit("f", "fit"), unit("e1", "eval", ("f",)), unit("e2", "eval", ("f",))]
    front = Front({"e1", "e2"}, [unit("g-dense", "eval", ("f",), only="front"),
                                 unit("g-best", "eval", ("f",), only="front"),
                                 unit("g-cuda", "eval", ("f",), device="cuda", only="front")],
                  {"g-dense": "done", "g-best": "pending"})
    got, sink = failures()
    sched, pool = Scheduler(gate, set(), {"cpu"}, max_attempts=2, front=front, record_failure=sink), \
        pools(fit=1, eval=2)
    assert start(sched, pool) == [("f", "fit@cpu#1")]
    done(sched, pool, "f")
    assert start(sched, pool) == [("e1", "eval@cpu#1"), ("e2", "eval@cpu#2")]
    pool.replace("eval@cpu#2")
    assert sched.worker_died("e2", DEATH) is True
    assert start(sched, pool) == [("e2", "eval@cpu#3")]
    assert front.asked == [set(), {"f"}]                          # a retry releases nothing: the front is not asked
    done(sched, pool, "e1")
    assert start(sched, pool) == [] and front.asked[-1] == {"f", "e1"} and sched.total == 3
    done(sched, pool, "e2")
    assert start(sched, pool) == [("g-best", "eval@cpu#1")]       # done already: counted; no GPU: pending
    assert front.asked[-1] == {"f", "e1", "e2"}
    assert sched.total == 6 and sched.done == {"f", "e1", "e2", "g-dense"} and sched.unplaceable == ["g-cuda"]
    done(sched, pool, "g-best")
    assert start(sched, pool) == [] and sched.left == 0 and got == []


def test_the_front_is_drawn_on_failed_units_too():
    """A front-defining unit that failed is finished: the front is drawn on the rest."""
    got, sink = failures()
    front = Front({"e"}, [unit("g", "eval", only="front")], {})
    sched, pool = Scheduler([unit("e")], set(), {"cpu"}, max_attempts=1, front=front, record_failure=sink), \
        pools(eval=1)
    assert start(sched, pool) == [("e", "eval@cpu#1")]
    pool.replace("eval@cpu#1")
    assert sched.worker_died("e", DEATH) is False
    assert start(sched, pool) == [("g", "eval@cpu#2")]
    assert got == [("e", f"worker died while running the unit (attempt 1): {DEATH}")] and sched.total == 2
