"""The Ray actors of a sweep: ActivationCollector, PredictorFitter, Evaluator, LatencyBencher.

Each actor runs units (``run(task)``) through ``workers.units.Units`` and writes the unit's rows itself, in one
transaction (``db.store.Store.finish_unit``), the moment the unit is done; a failure is recorded with its
traceback (``fail_unit``) and reported back, never half-written. Resources are declared on the classes
(one CPU each); the driver adds ``num_gpus`` for NVIDIA nodes or the custom resource ``NPU`` for Ascend
nodes (Ray then sets ``CUDA_VISIBLE_DEVICES`` / ``ASCEND_RT_VISIBLE_DEVICES``) with ``actor_options``, and the
placement-group bundle of one device (``orchestrator.placement``). An actor sees only the devices Ray assigned it,
so its device is index 0 (``cuda`` is ``cuda:0``); one that sees others refuses to run (``visible_devices_problem``).
Construction is cheap (a restarted actor is back at once); models load on first use and stay loaded.
``torch_npu`` is imported only inside an actor placed on an NPU.
"""
from __future__ import annotations

import os
import socket
import time
import traceback
from typing import Annotated, Any, Literal

import ray
from pydantic import BaseModel, ConfigDict, Field

from db.provenance import stamp
from db.schemas import AccuracyRow, ArtifactRow, LatencyRow, LayerRow, RequestScoreRow
from db.store import Store
from workers.names import DEVICE_TYPES, RAY_RESOURCE, UNIT_KINDS

DeviceType = Literal[DEVICE_TYPES]


class UnitTask(BaseModel):
    """The payload of one unit (what crosses from the driver to an actor)."""
    model_config = ConfigDict(extra="forbid", frozen=True)
    id: str = Field(pattern=r"^[0-9a-f]{16,64}$")
    kind: Literal[UNIT_KINDS]
    config: dict[str, Any]
    # a task split into shards: its shard units, whose scored requests this unit assembles into the task's rows
    shards: list[Annotated[str, Field(pattern=r"^[0-9a-f]{16,64}$")]] = Field(default_factory=list)


def actor_options(device_type: DeviceType, *, cpus: float = 1.0, gpus: float = 1.0, npus: float = 1.0,
                  max_restarts: int = 4) -> dict:
    """Ray ``.options(...)`` placing an actor on a node of ``device_type``."""
    opts: dict[str, Any] = {"num_cpus": cpus, "max_restarts": max_restarts, "max_task_retries": 0}
    if device_type == "cuda":
        opts["num_gpus"] = gpus
    elif device_type == "npu":
        opts["resources"] = {RAY_RESOURCE["npu"]: npus}
    elif device_type != "cpu":
        raise ValueError(f"device type must be one of {list(DEVICE_TYPES)}, not {device_type!r}")
    return opts


VISIBLE_ENV = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def assigned_devices(device_type: DeviceType) -> list[str]:
    """The ids of the GPUs / NPUs Ray assigned to this actor (its bundle's device; [] on the CPU)."""
    if device_type not in RAY_RESOURCE:
        return []
    ids = ray.get_runtime_context().get_accelerator_ids().get(RAY_RESOURCE[device_type], [])
    return [str(i) for i in ids]


def visible_devices_problem(device_type: DeviceType) -> str | None:
    """Why this actor would not compute on its own device alone, or None: the visible-devices variable must list
    exactly the devices Ray assigned (unset, as under ``RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES``, every actor
    would use device 0, whichever Ray gave it)."""
    if device_type not in VISIBLE_ENV:
        return None
    var, ids = VISIBLE_ENV[device_type], assigned_devices(device_type)
    seen = os.environ.get(var)
    if not ids:
        return f"actor placed for {device_type} but Ray assigned it no {RAY_RESOURCE[device_type]}"
    if seen is None or seen.split(",") != ids:
        return f"{var}={seen!r}, but Ray assigned this actor {RAY_RESOURCE[device_type]} {','.join(ids)}"
    return None


def _torch_device(device_type: DeviceType) -> str:
    import torch

    problem = visible_devices_problem(device_type)
    if problem:
        raise RuntimeError(problem)
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"actor placed for cuda but sees no GPU (CUDA_VISIBLE_DEVICES="
                               f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
        n, ids = torch.cuda.device_count(), assigned_devices(device_type)
        if n != len(ids):
            raise RuntimeError(f"actor assigned GPU {','.join(ids)} sees {n} GPUs")
        return "cuda"          # index 0: the first of the devices this actor sees, its own
    if device_type == "npu":
        try:
            import torch_npu  # noqa: F401  (Ascend plugin; only ever imported here, on an NPU node)
        except ImportError as e:
            raise RuntimeError(f"actor placed on an NPU node but torch_npu is not importable ({e})") from None
        return "npu"
    return "cpu"


def _quiet_progress_bars() -> None:
    """Per-batch progress bars (weights loading, lm-eval requests) from many actors drown the driver's log."""
    import logging

    os.environ.setdefault("TQDM_DISABLE", "1")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except ImportError:
        pass
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.WARNING)


class _UnitActor:
    role = "worker"

    def __init__(self, db_url: str | None, device_type: DeviceType = "cpu", torch_threads: int | None = None,
                 home: str | None = None):
        self.db_url, self.device_type, self.torch_threads = db_url, device_type, torch_threads
        if home:
            os.environ["CTXSPARSE_HOME"] = home
        self.name = f"{self.role}@{socket.gethostname()}:{os.getpid()}"
        self._units = None
        self._store = None

    def _setup(self):
        if self._units is None:
            _quiet_progress_bars()     # first: tqdm reads TQDM_DISABLE when it is imported
            import torch

            from workers.units import Units

            if self.torch_threads:
                torch.set_num_threads(self.torch_threads)
            st = stamp()
            self._units = Units(_torch_device(self.device_type), st["package_versions"], st["git_rev"])
            self._store = Store(self.db_url)
        return self._units

    def info(self) -> dict:
        """Where this actor runs and what it sees (placement checks, logs)."""
        keys = ("CUDA_VISIBLE_DEVICES", "ASCEND_RT_VISIBLE_DEVICES", "CTXSPARSE_HOME")
        return {"name": self.name, "role": self.role, "device_type": self.device_type,
                "node_id": ray.get_runtime_context().get_node_id(),
                "env": {k: os.environ.get(k) for k in keys}, "pid": os.getpid(),
                "devices": assigned_devices(self.device_type),
                "visible_problem": visible_devices_problem(self.device_type)}

    def describe(self, ref: str, data: dict, ppl: dict | None) -> dict:
        return self._setup().describe(ref, data, ppl)

    def run(self, task: dict) -> dict:
        t = UnitTask.model_validate(task)
        units = self._setup()
        st = stamp()
        if not self._store.start_unit(t.id, self.name, **st):
            return {"id": t.id, "status": "done", "skipped": True, "worker": self.name}
        t0 = time.time()
        try:
            shard_scores = self._shard_scores(t.shards) if t.shards else None
            out = units.run(t.kind, t.id, t.config, shard_scores=shard_scores)
            acc = [AccuracyRow(**r, **st) for r in out.accuracy]
            lat = [LatencyRow(**r, **st) for r in out.latency]
            lay = [LayerRow(**r) for r in out.layers]
            art = [ArtifactRow(**r) for r in out.artifacts]
            scores = [RequestScoreRow(**r) for r in out.scores]
            self._store.finish_unit(t.id, acc, lat, lay, art, duration_s=time.time() - t0, request_scores=scores)
        except Exception as e:  # recorded on the unit; the driver decides what follows
            self._store.fail_unit(t.id, f"{self.name}: {traceback.format_exc()}")
            return {"id": t.id, "status": "failed", "error": f"{type(e).__name__}: {e}", "worker": self.name}
        return {"id": t.id, "status": "done", "summary": out.summary, "duration_s": round(time.time() - t0, 1),
                "worker": self.name}

    def _shard_scores(self, shards: list[str]) -> list:
        """Every shard's scored requests, read once each from the store; RuntimeError while any shard is not done
        (a task's rows are written only from all of its shards)."""
        from workers.evals.suites import ShardScores

        waiting, found = self._store.shard_scores(shards)
        if waiting:
            raise RuntimeError(f"{len(waiting)} of the task's {len(shards)} shards are not done "
                               f"({', '.join(k[:12] for k in waiting[:4])}{' ...' if len(waiting) > 4 else ''}): "
                               "its rows are written only once every shard is")
        empty = ShardScores((), (), ())
        return [ShardScores(tuple(v.request), tuple(v.loglikelihood), tuple(v.greedy)) if (v := found.get(k))
                else empty for k in dict.fromkeys(shards)]


@ray.remote(num_cpus=1, max_restarts=4, max_task_retries=0)
class ActivationCollector(_UnitActor):
    role = "collector"


@ray.remote(num_cpus=1, max_restarts=4, max_task_retries=0)
class PredictorFitter(_UnitActor):
    role = "fitter"


@ray.remote(num_cpus=1, max_restarts=4, max_task_retries=0)
class Evaluator(_UnitActor):
    role = "evaluator"


@ray.remote(num_cpus=1, max_restarts=4, max_task_retries=0)
class LatencyBencher(_UnitActor):
    role = "bencher"


ROLE_CLASSES = {"collect": ActivationCollector, "fit": PredictorFitter, "eval": Evaluator,
                "latency": LatencyBencher}
