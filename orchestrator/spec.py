"""The sweep spec: what a user submits (YAML), validated before anything runs.

    name: smollm2-demo
    models: [smollm2-135m]
    data: {source: lambada, calib_tokens: 8192, metric_tokens: 1024}
    methods:
      - {name: oracle, sparsity: [0.5, 0.7]}
      - {name: svd, sparsity: [0.5], rank: [128, 256], options: {target: product}}
      - {name: dejavu, sparsity: [0.5], rank: [256], attn_sparsity: [null, 0.3]}
    suites:
      perplexity: {tokens: 2048}
      tasks: [{name: piqa, limit: 100}, {name: copa, limit: 100}]
    latency: {devices: [cpu], batch: [1], prompt_len: [128], gen_len: 16}
    resources: {fitters: 1, evaluators: 1}

Every model is described relative to the dense model (a ``dense`` setting is always swept). Unknown keys
are rejected everywhere; an error names the field (``methods.1.rank.0: ...``). ``load_spec`` is what
``ctxsparse submit`` and the driver call, so a bad spec fails at submit time, before a job exists.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

DeviceType = Literal["cuda", "npu", "cpu"]
Fraction = Annotated[float, Field(ge=0.0, lt=1.0)]
Positive = Annotated[int, Field(ge=1)]


class SpecError(ValueError):
    """A sweep spec that cannot run; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _unique(values: list, what: str) -> list:
    if len(set(map(json.dumps, values))) != len(values):
        raise ValueError(f"{what} has duplicates: {values}")
    return values


class DataSpec(_Strict):
    source: str = Field("lambada", min_length=1, description="text source: lambada, boolq-passages, a file, hf:ID")
    calib_tokens: Annotated[int, Field(ge=256, le=10_000_000)] = 16384
    metric_tokens: Annotated[int, Field(ge=256, le=1_000_000)] = 2048   # held-out tokens for per-layer recall
    seq_len: Annotated[int, Field(ge=16, le=32768)] = 512


class MethodSpec(_Strict):
    name: str
    sparsity: Annotated[list[Fraction], Field(min_length=1)]
    rank: Annotated[list[Positive | None], Field(min_length=1)] = [None]
    attn_sparsity: Annotated[list[Fraction | None], Field(min_length=1)] = [None]
    allocation: Literal["uniform", "greedy"] = "uniform"
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        from workers.sparsity.predictors import REGISTRY

        if v not in REGISTRY:
            raise ValueError(f"unknown method {v!r}; known: {sorted(REGISTRY)}")
        return v

    @field_validator("sparsity", "rank", "attn_sparsity")
    @classmethod
    def _no_dupes(cls, v: list, info) -> list:
        return _unique(v, info.field_name)

    @field_validator("options")
    @classmethod
    def _jsonable(cls, v: dict) -> dict:
        try:
            json.dumps(v, sort_keys=True)
        except TypeError as e:
            raise ValueError(f"options must be plain JSON values ({e})") from None
        if {"rank", "attn_sparsity", "allocation", "sparsity"} & v.keys():
            raise ValueError("rank / sparsity / attn_sparsity / allocation are grid fields, not options")
        return v


class PerplexitySpec(_Strict):
    tokens: Annotated[int, Field(ge=128, le=10_000_000)] = 2048
    seq_len: Annotated[int, Field(ge=16, le=32768)] = 512


class TaskSpec(_Strict):
    name: str
    limit: Positive | None = 100

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        from workers.evals.suites import SUITES

        if v not in SUITES:
            raise ValueError(f"unknown task {v!r}; known: {sorted(SUITES)}")
        return v


class SuitesSpec(_Strict):
    perplexity: PerplexitySpec | None = PerplexitySpec()
    tasks: list[TaskSpec] = Field(default_factory=list)

    @model_validator(mode="after")
    def _something(self) -> "SuitesSpec":
        if self.perplexity is None and not self.tasks:
            raise ValueError("no suite: give perplexity and/or tasks")
        _unique([t.name for t in self.tasks], "tasks")
        return self


class LatencySpec(_Strict):
    devices: Annotated[list[DeviceType], Field(min_length=1)] = ["cpu"]
    batch: Annotated[list[Positive], Field(min_length=1)] = [1]
    prompt_len: Annotated[list[Annotated[int, Field(ge=1, le=131072)]], Field(min_length=1)] = [128]
    gen_len: Annotated[int, Field(ge=2, le=4096)] = 16
    repeats: Annotated[int, Field(ge=1, le=100)] = 3
    hf_generate_baseline: bool = True
    exclusive: bool = True     # time latency after every other unit, alone (CPU timings beside busy workers lie)

    @field_validator("devices", "batch", "prompt_len")
    @classmethod
    def _no_dupes(cls, v: list, info) -> list:
        return _unique(v, info.field_name)


class ResourcesSpec(_Strict):
    collectors: Positive = 1
    fitters: Positive = 1
    evaluators: Positive = 1
    benchers: Positive = 1
    cpus_per_actor: Annotated[float, Field(gt=0, le=256)] = 1.0
    gpus_per_actor: Annotated[float, Field(gt=0, le=8)] = 1.0    # on NVIDIA nodes (fitting, eval, cuda latency)
    npus_per_actor: Annotated[float, Field(gt=0, le=16)] = 1.0   # the custom resource NPU on Ascend nodes
    accelerator: Literal["cpu", "cuda", "npu"] = "cpu"           # where collect / fit / eval run
    torch_threads: Positive | None = None
    max_attempts: Annotated[int, Field(ge=1, le=20)] = 3          # per unit, counting actor deaths
    max_restarts: Annotated[int, Field(ge=0, le=100)] = 4         # per actor


class SweepSpec(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")]
    models: Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1)]
    data: DataSpec = DataSpec()
    methods: Annotated[list[MethodSpec], Field(min_length=1)]
    suites: SuitesSpec = SuitesSpec()
    latency: LatencySpec | None = LatencySpec()
    resources: ResourcesSpec = ResourcesSpec()
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> "SweepSpec":
        _unique(self.models, "models")
        shapes = [m for m in self.models if m.startswith("shape:")]
        if shapes:
            from workers.decode.latency import SHAPES

            unknown = [m for m in shapes if m[len("shape:"):] not in SHAPES]
            if unknown:
                raise ValueError(f"models: unknown shape(s) {unknown}; known: {['shape:' + k for k in SHAPES]}")
            if self.latency is None or "cpu" in self.latency.devices:
                raise ValueError(f"models {shapes} are 7B-class shapes with random weights, for GPU/NPU latency "
                                 "only: give latency.devices without cpu (or sweep them in a separate spec)")
        keys = [json.dumps([m.name, m.allocation, m.options], sort_keys=True) for m in self.methods]
        if len(set(keys)) != len(keys):
            raise ValueError("methods: the same method with the same allocation and options is listed twice "
                             "(merge their grids)")
        return self

    def canonical(self) -> dict:
        """The spec as plain JSON data, defaults filled in (what the sweep's hash covers)."""
        return json.loads(self.model_dump_json())

    def spec_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.canonical(), sort_keys=True).encode()).hexdigest()


def _field_path(loc: tuple) -> str:
    return ".".join(str(p) for p in loc) or "(top level)"


def parse_spec(data: Any, origin: str = "spec") -> SweepSpec:
    if not isinstance(data, dict):
        raise SpecError(f"{origin}: a sweep spec is a mapping (name:, models:, methods: ...), "
                        f"not {type(data).__name__}")
    try:
        return SweepSpec.model_validate(data)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                msg = "unknown key (not part of the sweep spec)"
            lines.append(f"  {_field_path(err['loc'])}: {msg}")
        raise SpecError(f"{origin}: invalid sweep spec\n" + "\n".join(lines)) from None


def load_spec(path: str | Path) -> SweepSpec:
    """Read and validate a YAML (or JSON) sweep spec; SpecError with the field named on any problem."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise SpecError(f"{path}: cannot read ({e.strerror or e})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise SpecError(f"{path}: not valid YAML ({e})") from None
    return parse_spec(data, str(path))
