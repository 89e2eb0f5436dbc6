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
      tasks: [{name: piqa, limit: 100}, {name: copa, limit: all}, {name: lm_eval:lambada_standard},
              {name: yaml:tasks/my_task.yaml, limit: 50}, {name: mmlu, limit: all, shards: 8},
              {name: gsm8k_cot, limit: 200, only: front}]
    latency: {devices: [cpu], batch: [1], prompt_len: [128], gen_len: 16}
    resources: {accelerator: cpu, evaluators: auto, fitters: 1}    # counts: a number or auto (the default)

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
from pydantic import (AfterValidator, BeforeValidator, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from db.units import OMIT_AT_DEFAULT, Canonical
from workers.names import DEVICE_TYPES, MATMUL_BF16, MATMUL_FP32, MATMUL_TF32, SHAPE_PREFIX, is_shape, shape_name

DeviceType = Literal[DEVICE_TYPES]
Fraction = Annotated[float, Field(ge=0.0, lt=1.0)]
Positive = Annotated[int, Field(ge=1)]


class SpecError(ValueError):
    """A sweep spec that cannot run; the message names the field."""


class _Strict(Canonical):
    """A spec section; its fields marked ``OMIT_AT_DEFAULT`` (added later) are left out of the spec's canonical form
    at their defaults, so specs without them keep their hash."""
    model_config = ConfigDict(extra="forbid", frozen=True)


def _unique(values: list, what: str) -> list:
    if len(set(map(json.dumps, values))) != len(values):
        raise ValueError(f"{what} has duplicates: {values}")
    return values


def _budget_holds_a_window(**budgets: int) -> None:
    """Token budgets smaller than their window length give no window at all (the data loader would refuse them
    inside a worker, after the job started)."""
    seq_len = budgets.pop("seq_len")
    short = [f"{k} ({v}) is smaller than seq_len ({seq_len})" for k, v in budgets.items() if v < seq_len]
    if short:
        raise ValueError("; ".join(short) + ": a token budget must hold at least one window")


PACKAGED_SOURCES = ("lambada", "boolq-passages")


class DataSpec(_Strict):
    source: str = Field("lambada", min_length=1, description="text source: lambada, boolq-passages, a file, hf:ID")
    calib_tokens: Annotated[int, Field(ge=256, le=10_000_000)] = 16384
    metric_tokens: Annotated[int, Field(ge=256, le=1_000_000)] = 2048   # held-out tokens for per-layer recall
    seq_len: Annotated[int, Field(ge=16, le=32768)] = 512

    @model_validator(mode="after")
    def _windows(self) -> "DataSpec":
        _budget_holds_a_window(calib_tokens=self.calib_tokens, metric_tokens=self.metric_tokens,
                               seq_len=self.seq_len)
        return self


class MethodSpec(_Strict):
    name: str
    sparsity: Annotated[list[Fraction], Field(min_length=1)]
    rank: Annotated[list[Positive | None], Field(min_length=1)] = [None]
    attn_sparsity: Annotated[list[Fraction | None], Field(min_length=1)] = [None]
    allocation: str = "uniform"           # one of workers.sparsity.fit.ALLOCATIONS
    options: dict[str, Any] = Field(default_factory=dict)

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        from workers.sparsity.predictors import REGISTRY

        if v not in REGISTRY:
            raise ValueError(f"unknown method {v!r}; known: {sorted(REGISTRY)}")
        return v

    @field_validator("allocation")
    @classmethod
    def _known_allocation(cls, v: str) -> str:
        from workers.sparsity.fit import check_allocation

        return check_allocation(v)

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

    @model_validator(mode="after")
    def _known_options(self) -> "MethodSpec":
        from workers.sparsity.predictors import check_option_names

        check_option_names(self.name, self.options)      # a typo fails at submit, not after the collect
        return self


class HeadSpec(_Strict):
    """The predicted output head (workers.methods.head), crossed: every (rank, candidates, screen) runs alone (with
    the dense decoder) and with every setting of the methods named in ``combine``."""
    rank: Annotated[list[Positive], Field(min_length=1)]
    candidates: Annotated[list[Positive], Field(min_length=1)]
    screen: Annotated[list[str], Field(min_length=1)] = ["hidden"]
    combine: list[str] = []

    @field_validator("rank", "candidates", "screen", "combine")
    @classmethod
    def _no_dupes(cls, v: list, info) -> list:
        return _unique(v, info.field_name)

    @field_validator("screen")
    @classmethod
    def _known(cls, v: list[str]) -> list[str]:
        from workers.methods.head.screen import SCREENS

        bad = [x for x in v if x not in SCREENS]
        if bad:
            raise ValueError(f"unknown head screen(s) {bad}; known: {list(SCREENS)}")
        return v


class PerplexitySpec(_Strict):
    tokens: Annotated[int, Field(ge=128, le=10_000_000)] = 2048
    seq_len: Annotated[int, Field(ge=16, le=32768)] = 512

    @model_validator(mode="after")
    def _windows(self) -> "PerplexitySpec":
        _budget_holds_a_window(tokens=self.tokens, seq_len=self.seq_len)
        return self


def _all_items(v: Any) -> Any:
    from workers.evals.tasks import ALL_ITEMS

    return None if v == ALL_ITEMS else v


MAX_SHARDS = 64
ONLY_FRONT = "front"      # ``only: front``: the task runs for dense and the settings on the front of the others


def _shards(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_SHARDS:
        raise ValueError(f"shards is a whole number of units from 1 (not split) to {MAX_SHARDS}, not {v!r}")
    return v


class TaskSpec(_Strict):
    """One accuracy task. ``name``: a packaged task (offline data), ``lm_eval:NAME`` (any lm-eval task, data from
    the hub) or ``yaml:PATH`` (a local lm-eval task file); see ``workers.evals.tasks``. ``limit``: the first N
    items, or every item with ``null`` / ``all`` (both stored as null).

    ``shards``: split the task into that many eval units per setting (packaged log-likelihood tasks only: MMLU,
    HellaSwag, ...); each scores a contiguous run of the task's scoring batches, and the task's rows are assembled
    once every shard is done, equal to the unsharded unit's (whose id the assembled unit keeps). ``only: front``:
    the task runs only for dense and the settings on the front of the sweep's other suites (decided when those
    are done: ``orchestrator.driver``). ``within`` (with ``only: front``): only the front's settings that lose at
    most this fraction of dense's value on the front's metric (0.25: a perplexity at most 1.25x dense's), so that a
    task that costs minutes per setting (GSM8K) runs for settings a user would deploy; dense always runs. These
    three are left out of the spec's canonical form at their defaults, so specs without them keep their hash."""

    name: str
    limit: Annotated[Positive | None, BeforeValidator(_all_items)] = 100
    shards: Annotated[int, BeforeValidator(_shards), OMIT_AT_DEFAULT] = 1
    only: Annotated[Literal["front"] | None, OMIT_AT_DEFAULT] = None
    within: Annotated[Annotated[float, Field(gt=0)] | None, OMIT_AT_DEFAULT] = None

    @field_validator("name")
    @classmethod
    def _known(cls, v: str) -> str:
        from workers.evals.tasks import check_task_name

        return check_task_name(v)     # one line: the packaged tasks and how to name the others

    @field_validator("shards")
    @classmethod
    def _splittable(cls, v: int, info) -> int:
        name, limit = info.data.get("name"), info.data.get("limit")
        if v == 1 or name is None:          # (a bad name is reported on its own field)
            return v
        from workers.evals.request_cache import cacheable
        from workers.evals.tasks import SUITES

        if not cacheable(name):
            kind = ("a generation task" if name in SUITES else
                    "not a packaged task (lm_eval:/yaml: tasks run lm-eval's own pass)")
            raise ValueError(f"{name} is {kind}; only packaged log-likelihood tasks split into shards "
                             f"({', '.join(n for n in SUITES if cacheable(n))})")
        items = limit
        if items is not None and SUITES[name].members_of is not None:
            try:
                items *= len(SUITES[name].members())    # the limit is per member (MMLU's subjects)
            except (OSError, ValueError):
                items = None                            # data not installed here: nothing to count
        if items is not None and v > items:
            raise ValueError(f"{v} shards for {items} item(s) of {name} (its limit): give at most one shard per "
                             "item")
        return v

    @model_validator(mode="after")
    def _within_the_front(self):
        if self.within is not None and self.only != ONLY_FRONT:
            raise ValueError(f"{self.name}: 'within' bounds the front's settings that an 'only: front' task runs "
                             "for; give 'only: front' with it, or leave it out")
        return self


class SuitesSpec(_Strict):
    """The accuracy suites. ``matmul``: the precision of the evaluation forwards: ``fp32`` (the default: exact
    fp32), ``tf32`` (CUDA: the float32 products on tensor cores, inputs rounded to 10 mantissa bits, fp32 sums;
    several times the fp32 throughput of an H100/H200) or ``bf16`` (CUDA, NPU: the forward under bfloat16
    autocast: products and attention in bf16 with fp32 sums, norms, softmax and the residual stream in fp32; the
    weights stay fp32). Collection and fitting stay fp32. ``fused`` (CUDA): the forwards' RMS norms and rotary
    embedding as one Triton kernel each (``workers.evals.fused_forward``; the same functions, summed in another
    order). ``generation_batch`` (GPUs, NPUs): sequences per generation batch of a generation task (GSM8K);
    ``None``: 64. The three are left out of the canonical form at their defaults, so specs without them keep their
    hash."""
    perplexity: PerplexitySpec | None = PerplexitySpec()
    tasks: list[TaskSpec] = Field(default_factory=list)
    matmul: Annotated[Literal["fp32", "tf32", "bf16"], OMIT_AT_DEFAULT] = MATMUL_FP32
    fused: Annotated[bool, OMIT_AT_DEFAULT] = False
    generation_batch: Annotated[Annotated[int, Field(ge=1, le=4096)] | None, OMIT_AT_DEFAULT] = None

    @model_validator(mode="after")
    def _something(self) -> "SuitesSpec":
        if self.perplexity is None and not self.tasks:
            raise ValueError("no suite: give perplexity and/or tasks")
        _unique([t.name for t in self.tasks], "tasks")
        deferred = [t.name for t in self.tasks if t.only == ONLY_FRONT]
        if deferred and self.perplexity is None and len(deferred) == len(self.tasks):
            raise ValueError(f"tasks {deferred} run only on the front ('only: front'), but no suite draws it: give "
                             "perplexity or a task without 'only'")
        return self


class LatencySpec(_Strict):
    devices: Annotated[list[DeviceType], Field(min_length=1)] = ["cpu"]
    batch: Annotated[list[Positive], Field(min_length=1)] = [1]
    prompt_len: Annotated[list[Annotated[int, Field(ge=1, le=131072)]], Field(min_length=1)] = [128]
    gen_len: Annotated[int, Field(ge=2, le=4096)] = 16
    repeats: Annotated[int, Field(ge=1, le=100)] = 3
    hf_generate_baseline: bool = True
    exclusive: bool = True     # time latency after every other unit, alone (CPU timings beside busy workers lie)
    # what CPU latency decodes: "auto" the GGUF's quantized blocks for a model loaded from a GGUF (the weights a
    # CPU user runs; every plan the runtime decodes runs over them), else the float weights; "gguf" the same but an
    # error for a model without a GGUF; "float" always the float weights
    cpu_weights: Annotated[Literal["auto", "gguf", "float"], OMIT_AT_DEFAULT] = "auto"

    @field_validator("devices", "batch", "prompt_len")
    @classmethod
    def _no_dupes(cls, v: list, info) -> list:
        return _unique(v, info.field_name)


AUTO = "auto"     # a pool size sized from the cluster's resources when the sweep starts


def _count(v: Any) -> int | str:
    if v == AUTO:
        return AUTO
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"a number of actors (1 or more) or {AUTO!r}, not {v!r}")
    return v


def _device_share(v: float) -> float:
    """Ray grants a fraction of one device, or whole devices: 0.25 and 2 are shares, 1.5 is neither."""
    if v > 1 and v != int(v):
        raise ValueError(f"a fraction of one device (at most 1) or a whole number of devices, not {v}")
    return v


Count = Annotated[int | Literal["auto"], BeforeValidator(_count)]
DeviceShare = AfterValidator(_device_share)


class ResourcesSpec(_Strict):
    """How many actors of each role a sweep runs, and what each asks Ray for.

    A count is a number, or ``auto`` (the default): sized from the cluster's resources when the sweep starts
    (``orchestrator.placement``): the actors of the spec's size that the GPUs / NPUs (for ``accelerator``), the
    CPUs and the host memory hold at once; evaluators get that room but a quarter, which fitters (and, before
    them, collectors) use; one latency bencher per GPU / NPU, one for CPU timings."""
    collectors: Count = AUTO
    fitters: Count = AUTO
    evaluators: Count = AUTO
    benchers: Count = AUTO
    cpus_per_actor: Annotated[float, Field(gt=0, le=256)] = 1.0
    gpus_per_actor: Annotated[float, Field(gt=0, le=8), DeviceShare] = 1.0   # NVIDIA nodes (fit, eval, cuda latency)
    npus_per_actor: Annotated[float, Field(gt=0, le=16), DeviceShare] = 1.0  # the custom resource NPU on Ascend nodes
    accelerator: DeviceType = "cpu"                               # where collect / fit / eval run
    torch_threads: Positive | None = None
    max_attempts: Annotated[int, Field(ge=1, le=20)] = 3          # per unit, counting actor deaths
    max_restarts: Annotated[int, Field(ge=0, le=100)] = 4         # per actor


def _model_ref(ref: str) -> str:
    """A ref the model loader can resolve: a packaged name, ``shape:NAME`` (checked with the latency spec), a
    .gguf path, a folder, or a Hugging Face id ``org/name``. Whether a path exists is checked where the spec is
    submitted and where it runs (``check_inputs``): the spec itself may be validated elsewhere."""
    from workers.loading.models import PACKAGED

    path_like = ref.endswith(".gguf") or "/" in ref or ref.startswith((".", "~")) or Path(ref).expanduser().is_dir()
    if ref in PACKAGED or is_shape(ref) or path_like:
        return ref
    raise ValueError(f"unknown model {ref!r}; known: {', '.join(PACKAGED)}, shape:NAME (latency only), a .gguf "
                     "path, a local model folder, or a Hugging Face id like 'HuggingFaceTB/SmolLM2-135M'")


class SweepSpec(_Strict):
    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")]
    models: Annotated[list[Annotated[str, Field(min_length=1), AfterValidator(_model_ref)]], Field(min_length=1)]
    data: DataSpec = DataSpec()
    methods: Annotated[list[MethodSpec], Field(min_length=1)]
    head: Annotated[HeadSpec | None, OMIT_AT_DEFAULT] = None
    suites: SuitesSpec = SuitesSpec()
    latency: LatencySpec | None = LatencySpec()
    resources: ResourcesSpec = ResourcesSpec()
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> "SweepSpec":
        _unique(self.models, "models")
        shapes = [m for m in self.models if is_shape(m)]
        if shapes:
            from workers.decode.shapes import SHAPES

            unknown = [m for m in shapes if shape_name(m) not in SHAPES]
            if unknown:
                raise ValueError(f"models: unknown shape(s) {unknown}; known: {[SHAPE_PREFIX + k for k in SHAPES]}")
            if self.latency is None or "cpu" in self.latency.devices:
                raise ValueError(f"models {shapes} are 7B-class shapes with random weights, for GPU/NPU latency "
                                 "only: give latency.devices without cpu (or sweep them in a separate spec)")
        keys = [json.dumps([m.name, m.allocation, m.options], sort_keys=True) for m in self.methods]
        if len(set(keys)) != len(keys):
            raise ValueError("methods: the same method with the same allocation and options is listed twice "
                             "(merge their grids)")
        for ref in self.models:
            check_ranks(self, ref, _known_hidden_size(ref))
        if self.head is not None:
            names = {m.name for m in self.methods}
            bad = [m for m in self.head.combine if m not in names]
            if bad:
                raise ValueError(f"head.combine: {bad} not among the sweep's methods {sorted(names)}")
            if shapes:
                raise ValueError(f"head: models {shapes} have random weights; a predicted head is fitted on a real "
                                 "model's states")
        if self.suites.matmul == MATMUL_TF32 and self.resources.accelerator != "cuda":
            raise ValueError(f"suites.matmul: tf32 is a CUDA GPU's precision; resources.accelerator is "
                             f"{self.resources.accelerator!r} (give fp32, or accelerator: cuda)")
        if self.suites.matmul == MATMUL_BF16 and self.resources.accelerator == "cpu":
            raise ValueError("suites.matmul: bf16 is an accelerator's precision (cuda, npu); resources.accelerator "
                             "is 'cpu' (give fp32)")
        if self.suites.fused and self.resources.accelerator != "cuda":
            raise ValueError(f"suites.fused: the fused norm and rotary kernels are Triton kernels for CUDA GPUs; "
                             f"resources.accelerator is {self.resources.accelerator!r}")
        if self.suites.generation_batch is not None and self.resources.accelerator == "cpu":
            raise ValueError("suites.generation_batch sizes an accelerator's generation batches (cuda, npu); on the "
                             "CPU a task's batch is 8 sequences: leave it out")
        return self

    def canonical(self) -> dict:
        """The spec as plain JSON data, defaults filled in (what the sweep's hash covers)."""
        return json.loads(self.model_dump_json())

    def spec_hash(self) -> str:
        return hashlib.sha256(json.dumps(self.canonical(), sort_keys=True).encode()).hexdigest()


def _known_hidden_size(ref: str) -> int | None:
    """The hidden size d of a model known without loading it or reading a file (a packaged model, a shape)."""
    from workers.loading.models import PACKAGED_HIDDEN_SIZE

    if is_shape(ref):
        from workers.decode.shapes import ffn_shape

        return ffn_shape(shape_name(ref))[0]
    return PACKAGED_HIDDEN_SIZE.get(ref)


def check_ranks(spec: SweepSpec, ref: str, d: int | None) -> None:
    """A predictor's rank is at most the model's hidden size d (a rank-r map from d inputs has rank <= d: SVDP
    truncates an SVD of a D x d matrix, Deja Vu's d -> r -> D factors gain nothing past r = d). ValueError naming
    the grid value and the model; nothing to check where d is not known here (``d`` None)."""
    if d is None:
        return
    for i, m in enumerate(spec.methods):
        for j, r in enumerate(m.rank):
            if r is not None and r > d:
                raise ValueError(f"methods.{i}.rank.{j}: rank {r} is larger than the hidden size of model {ref!r} "
                                 f"(d = {d}); a predictor's rank is at most d")


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
            if not err["loc"] and err["type"] == "value_error":    # a check across fields names its own fields
                lines.append(f"  {msg.removeprefix('Value error, ')}")
            else:
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


def _folder_hidden_size(spec: SweepSpec, folder: Path) -> int | None:
    """A local model folder's hidden size, from its config (read only where the spec gives a rank); None where the
    config cannot be read as a known architecture (the worker that loads it says why)."""
    if all(r is None for m in spec.methods for r in m.rank):
        return None
    from transformers import AutoConfig

    from workers.loading.adapters import adapter_for

    try:
        config = AutoConfig.from_pretrained(folder)
        return adapter_for(config).dims(config).d
    except (ValueError, KeyError, OSError):
        return None


def check_inputs(spec: SweepSpec) -> None:
    """What the spec names on this machine's disk, checked before a job exists: model files and folders given by
    path exist (a folder's hidden size bounds the predictor ranks: ``check_ranks``), a local task YAML (``yaml:PATH``) is readable as one lm-eval task, and a local data file exists
    and holds some text. SpecError naming the field.

    Packaged models and data, and Hugging Face ids, are left to the workers (they may be installed there only)."""
    from workers.evals.tasks import YAML_PREFIX, SuiteError, yaml_task_config
    from workers.loading.data import DataError, documents

    for i, t in enumerate(spec.suites.tasks):
        if t.name.startswith(YAML_PREFIX):
            try:
                yaml_task_config(t.name[len(YAML_PREFIX):])
            except SuiteError as e:
                raise SpecError(f"suites.tasks.{i}.name: {e}") from None
    for i, ref in enumerate(spec.models):
        p = Path(ref).expanduser()
        if ref.endswith(".gguf") and not p.is_file():
            raise SpecError(f"models.{i}: model file not found: {ref}")
        if ref.startswith(("/", ".", "~")) and not ref.endswith(".gguf"):
            if not p.is_dir():
                raise SpecError(f"models.{i}: model folder not found: {ref}")
            if not (p / "config.json").is_file():
                raise SpecError(f"models.{i}: {ref} has no config.json (not a Hugging Face model folder)")
            try:
                check_ranks(spec, ref, _folder_hidden_size(spec, p))
            except ValueError as e:
                raise SpecError(str(e)) from None
    src = spec.data.source
    if src in PACKAGED_SOURCES or src.startswith("hf:"):
        return
    p = Path(src).expanduser()
    if not p.suffix and not p.exists():
        raise SpecError(f"data.source: unknown data source {src!r}: use {' or '.join(map(repr, PACKAGED_SOURCES))}, "
                        "a local .txt/.jsonl/.parquet file, or 'hf:NAME'")
    if not p.is_file():
        raise SpecError(f"data.source: data file not found: {src}")
    try:
        has_text = any(isinstance(d, str) and d.strip() for d in documents(src))
    except (DataError, OSError, UnicodeDecodeError) as e:
        raise SpecError(f"data.source: {e}") from None
    if not has_text:
        raise SpecError(f"data.source: {src} has no text (no non-empty document)")
