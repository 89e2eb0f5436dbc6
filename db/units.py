"""What each unit kind is given, typed: one frozen model per kind, and the one canonical form that makes a unit's id.

    collect   CollectConfig          model, its calibration data
    fit       FitConfig              + one setting of the grid (GridSetting), seed, threads
    eval      PerplexityEvalConfig   + the fit unit, the held-out perplexity run, threads, precision
              TaskEvalConfig         + the fit unit, a task (its limit, batching, shard), threads, precision
    latency   LatencyConfig          model, the fit unit, device, batch, prompt, runtime, threads

``orchestrator.plan`` builds them; the workers, the driver, the front and the dashboard read their attributes;
the store keeps their canonical form (the ``config`` column) and ``unit_config`` reads it back. No Ray, no torch.

A unit's id is the hash of its kind, its canonical config and the code version (``unit_id``), so the same work
always gets the same id, whichever sweep asks for it. The canonical form is the config as JSON, every field
written, except the fields marked ``OMIT_AT_DEFAULT`` while they hold their default: fields added after units were
first stored, left out at the value that means "as before", so the units planned before them keep their ids
(``tests/db/test_unit_configs.py`` recomputes the id of every unit of the published result sets). The other fields'
defaults only read configs that were written without them (a benchmark's, a test's); the planner gives them all.
A key this code does not know (a newer planner's) is kept as it is, in the canonical form too.
"""
from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Mapping
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, model_serializer

from db.schemas import DeviceType

# copies of workers.names (db imports no workers; tests/workers/test_names.py checks them)
UNIT_KINDS = ("collect", "fit", "eval", "latency")
DENSE = "dense"                                # the dense setting's method
Matmul = Literal["fp32", "tf32", "bf16"]       # an eval unit's forward precision (suites.matmul)
PERPLEXITY = "perplexity"                      # the suite of the held-out perplexity eval unit


class _OmitAtDefault:
    """Field metadata: the field is left out of the canonical form while it equals its default."""

    def __repr__(self) -> str:
        return "OMIT_AT_DEFAULT"


OMIT_AT_DEFAULT = _OmitAtDefault()


@functools.cache
def _omitted(cls: type[BaseModel]) -> dict[str, Any]:
    """{field: default} of ``cls``'s fields marked ``OMIT_AT_DEFAULT``."""
    return {name: f.default for name, f in cls.model_fields.items() if OMIT_AT_DEFAULT in f.metadata}


class Canonical(BaseModel):
    """A frozen model whose dump (``model_dump``, ``model_dump_json``) is its canonical form: the fields marked
    ``OMIT_AT_DEFAULT`` are left out while they equal their default. The sweep spec's models share it (their
    canonical form is what a spec's hash covers)."""

    model_config = ConfigDict(frozen=True)

    @model_serializer(mode="wrap")
    def _canonical(self, handler):
        out = handler(self)
        if isinstance(out, dict):
            for name, default in _omitted(type(self)).items():
                if name in out and getattr(self, name) == default:
                    del out[name]
        return out


class _Record(Canonical):
    model_config = ConfigDict(frozen=True, extra="allow")   # unknown keys kept: their ids hold

    def canonical(self) -> dict[str, Any]:
        """The canonical form as plain JSON data (of a unit's config: what the store keeps and the id hashes)."""
        return self.model_dump(mode="json")


class DataConfig(_Record):
    """The calibration and held-out text (the spec's ``data``)."""
    source: str
    calib_tokens: int
    metric_tokens: int
    seq_len: int


class PerplexityConfig(_Record):
    """The held-out perplexity run (the spec's ``suites.perplexity``)."""
    tokens: int
    seq_len: int


class HeadSetting(_Record):
    """A predicted output head (workers.methods.head): the screen's rank, the candidates given exact logits, the
    screen's kind."""
    rank: int
    candidates: int
    screen: str = "hidden"


class GridSetting(_Record):
    """One setting of the grid: what a fit unit fits (``dense``: nothing, the baseline; ``dense`` with a ``head``:
    the predicted head alone)."""
    method: str
    sparsity: float
    rank: int | None = None
    attn_sparsity: float | None = None
    allocation: str = "uniform"
    options: dict[str, Any] = {}
    head: Annotated[HeadSetting | None, OMIT_AT_DEFAULT] = None

    @property
    def baseline(self) -> bool:
        """The dense baseline: no decoder method and the dense head."""
        return self.method == DENSE and self.head is None


class UnitConfig(_Record):
    """What every unit names: the model (its ref, and the fingerprint the plan was made with)."""
    kind: ClassVar[str]
    model: str
    model_fp: str

    def unit_id(self, code_version: str) -> str:
        return unit_id(self.kind, self.canonical(), code_version)


class Threaded(_Record):
    """A unit that sets torch's thread count before it computes (fit, eval, latency): its rows depend on it."""
    threads: int | None = None


class _Calibrated(UnitConfig):
    """A unit of the model's calibration data (collect, fit, eval); a ``shape:NAME`` model (random weights) has
    none, and its fits carry none."""
    data: Annotated[DataConfig | None, OMIT_AT_DEFAULT] = None
    calib_fp: Annotated[str | None, OMIT_AT_DEFAULT] = None
    # optional parts of the activation capture that a method of the sweep needs (``cov``)
    capture: Annotated[tuple[str, ...], OMIT_AT_DEFAULT] = ()


class CollectConfig(_Calibrated):
    kind: ClassVar[str] = "collect"
    data: DataConfig
    calib_fp: str


class FitConfig(_Calibrated, GridSetting, Threaded):
    kind: ClassVar[str] = "fit"
    seed: int = 0

    @property
    def setting(self) -> GridSetting:
        return GridSetting(**{k: getattr(self, k) for k in GridSetting.model_fields})


class _EvalConfig(_Calibrated, Threaded):
    kind: ClassVar[str] = "eval"
    data: DataConfig
    fit_unit: str
    suite: str
    # how the rows are computed (workers.sparsity.sparse_exec): masked dense products, the token-sparse kernels
    exec_mode: Literal["masked", "kernel", "auto"] = "auto"
    matmul: Annotated[Matmul, OMIT_AT_DEFAULT] = "fp32"
    fused: Annotated[bool, OMIT_AT_DEFAULT] = False       # the forwards' norms and rotary as Triton kernels


class PerplexityEvalConfig(_EvalConfig):
    suite: Literal["perplexity"] = PERPLEXITY
    perplexity: PerplexityConfig
    heldout_fp: str | None = None


class TaskEvalConfig(_EvalConfig):
    limit: int | None = None                                # the first N items; None: every item
    # sequences per generation batch and padded tokens per log-likelihood forward (None: the worker's own)
    batch_size: Annotated[int | None, OMIT_AT_DEFAULT] = None
    batch_tokens: Annotated[int | None, OMIT_AT_DEFAULT] = None
    generation: Annotated[Literal["rounds", "lm_eval"], OMIT_AT_DEFAULT] = "rounds"
    shard: Annotated[tuple[int, int] | None, OMIT_AT_DEFAULT] = None    # (k, n): shard k of n, scores only

    @property
    def whole(self) -> "TaskEvalConfig":
        """The task's own unit of a shard (the config without ``shard``: the unsharded unit's, and its id)."""
        return self.model_copy(update={"shard": None})


EvalConfig = PerplexityEvalConfig | TaskEvalConfig


class LatencyConfig(UnitConfig, Threaded):
    kind: ClassVar[str] = "latency"
    fit_unit: str
    device_type: DeviceType
    batch: int
    prompt_len: int
    gen_len: int
    repeats: int
    runtime: str                    # ctxsparse, hf-generate, llama.cpp (workers.names)
    paired: bool = False            # timed side by side with dense in one process
    weights: Annotated[Literal["float", "gguf"], OMIT_AT_DEFAULT] = "float"    # gguf: the GGUF's blocks (CPU)
    setting: Annotated[GridSetting | None, OMIT_AT_DEFAULT] = None   # a shape model's: random predictors of it


AnyUnitConfig = CollectConfig | FitConfig | EvalConfig | LatencyConfig
_BY_KIND: dict[str, type[UnitConfig]] = {"collect": CollectConfig, "fit": FitConfig, "latency": LatencyConfig}


def unit_config(kind: str, config: Mapping[str, Any] | UnitConfig) -> AnyUnitConfig:
    """The typed config of a unit of ``kind`` from its stored form (a typed one is checked and returned);
    ``pydantic.ValidationError`` where it lacks a field or has one of the wrong type."""
    if isinstance(config, UnitConfig):
        if config.kind != kind:
            raise ValueError(f"a {config.kind} config given for a {kind} unit")
        return config
    if kind == "eval":
        cls = PerplexityEvalConfig if config.get("suite") == PERPLEXITY else TaskEvalConfig
    elif kind in _BY_KIND:
        cls = _BY_KIND[kind]
    else:
        raise ValueError(f"unknown unit kind {kind!r}; known: {list(UNIT_KINDS)}")
    return cls.model_validate(config)


def unit_id(kind: str, canonical: Mapping[str, Any], code_version: str) -> str:
    """The id of the unit of ``kind`` with this canonical config (``UnitConfig.canonical``) and code version."""
    blob = json.dumps({"kind": kind, "config": canonical, "code_version": code_version}, sort_keys=True,
                      separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:40]
