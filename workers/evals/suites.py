"""Running and scoring the accuracy suites with lm-evaluation-harness: ``run_suite`` scores a model on tasks named
as ``workers.evals.tasks`` describes (packaged offline tasks, ``lm_eval:NAME``, ``yaml:PATH``), one row per
(task, metric).

Every row carries its standard error as lm-eval computes it: the closed form sqrt(var/n) for mean metrics (acc,
acc_norm, exact_match), bootstrap (1,000 resamples, seeded, in-process) for perplexity.

Items are deterministic: the first ``limit`` documents of the split in dataset order (lm-eval's ``limit``), so dense
and sparse runs of one task see the same items; ``items_fingerprint`` (a hash of every scored request and gold)
proves it. Timings per task: ``BENCHMARKS.md`` and ``python -m benchmarks.suites``.

A packaged task with log-likelihood requests (every one but gsm8k_cot) is scored from its requests as
``workers.evals.request_cache`` keeps them: templated, tokenized and ordered once per (task config, tokenizer) under
the shared home, then read by every later call; the rows equal lm-eval's own pass (same requests, batches and
forwards; same per-item metrics and aggregations, computed by lm-eval's functions). Each such task is scored on its
own; the other tasks (generation, ``lm_eval:`` and ``yaml:`` tasks, or all with ``request_cache=False``) run in one
lm-eval pass.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import math
import os
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from workers.evals import request_cache as rc
from workers.evals.items import ItemScore, fingerprint_items, gold_index, packaged_data_fingerprint
from workers.evals.scoring import BATCHED_FOR, token_batches
from workers.evals.tasks import (
    LM_EVAL_PREFIX,
    SUITES,
    YAML_PREFIX,
    SuiteError,
    SuiteTask,
    build_task,
    check_task_names,
    data_dir,
    task_kind,
    yaml_task_config,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SuiteResult:
    """One (task, metric) row."""

    task: str                   # the name as given (packaged name, ``lm_eval:NAME``, ``yaml:PATH``)
    lm_eval_task: str
    kind: str                   # the task's kind (``workers.evals.tasks.task_kind``): its rows' ``suite`` label
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


@functools.cache
def _template(env, source: str):
    return env.from_string(source)


@contextmanager
def _lean_lm_eval():
    """Two of lm-eval's per-call costs that change no score, removed while a suite runs:
    - it renders each doc's Jinja templates by compiling the template string anew every time (about 1 ms a compile,
      several per item: most of a small model's evaluation time on a GPU): each string is compiled once per process;
    - it reports the environment into every result (``collect_env``: subprocesses, a third of a second a call),
      which we do not record."""
    import lm_eval.evaluator as lm_evaluator
    import lm_eval.utils as lm_utils

    if not all(hasattr(m, n) for m, n in ((lm_utils, "apply_template"), (lm_utils, "env"),
                                          (lm_evaluator, "add_env_info"))):
        yield                      # another lm-eval layout: its own (slower) path, same scores
        return
    originals = lm_utils.apply_template, lm_evaluator.add_env_info

    def apply_template(template: str, doc: dict) -> str:
        return _template(lm_utils.env, template).render(**doc)

    lm_utils.apply_template, lm_evaluator.add_env_info = apply_template, lambda results: None
    try:
        yield
    finally:
        lm_utils.apply_template, lm_evaluator.add_env_info = originals


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


def _mean_stderr(values: Sequence[float]) -> float | None:
    """lm-eval's ``mean_stderr``: sample standard deviation / sqrt(n)."""
    n = len(values)
    if n < 2:
        return None
    mu = sum(values) / n
    return math.sqrt(sum((v - mu) ** 2 for v in values) / (n - 1) / n)


def run_suite(model, tokenizer, tasks: Sequence[str] | str, limit: int | None, batch_size: int = 8,
              seed: int = 0, keep_items: bool = False, batch_tokens: int | None = None,
              request_cache: bool = True, generation: str = "rounds") -> list[SuiteResult]:
    """Score ``model`` (any HF causal LM module, dense or sparse) on tasks; one row per (task, metric).

    ``tasks``: packaged names, ``lm_eval:NAME`` or ``yaml:PATH`` (see the module doc).
    ``limit``: the first ``limit`` items of each task in dataset order (each group member's: MMLU's subjects);
    ``None``: every item. ``batch_size`` sequences per forward. ``keep_items``: attach the per-item scores to each
    row. ``request_cache``: score packaged log-likelihood tasks from their cached requests, each on its own (see
    the module doc); the other tasks run in one lm-eval pass (requests of every task batched together).
    ``batch_tokens``: log-likelihood forwards of at most this many padded tokens each instead of ``batch_size``
    sequences (``token_batches``: how an accelerator is filled; ``batch_size`` still sizes generation).
    ``generation``: greedy generation in batches refilled as sequences finish (``"rounds"``) or in lm-eval's loop
    (``"lm_eval"``; ``scoring.GENERATION_LOOPS``).
    """
    names = check_task_names(tasks)
    _check_run_args(limit, batch_size, batch_tokens)
    import lm_eval
    from lm_eval.tasks import TaskManager

    t0 = time.time()
    was_training = model.training
    model.eval()
    by_name: dict[str, list[SuiteResult]] = {}
    with _in_process_bootstrap(), _lean_lm_eval():
        try:
            hflm = _scorer(model, tokenizer, batch_size, batch_tokens, generation)
            cached: dict[str, tuple] = {}        # name -> (request set, log-likelihoods, greedy)
            if request_cache and hflm.scores_request_sets:
                for n in names:
                    if not rc.cacheable(n):
                        continue
                    try:
                        rs = rc.load_or_build(n, limit, seed, hflm)
                    except rc.NotCacheable as ex:
                        log.info("%s: scored by lm-eval's own pass (%s)", n, ex)
                        continue
                    _seed_all(seed)              # as lm-eval's pass does before it scores
                    cached[n] = (rs, *hflm.score_request_set(rs))
            entries = _entries([n for n in names if n not in cached])
            out = None
            if entries:
                out = lm_eval.simple_evaluate(
                    model=hflm, tasks=[t for e in entries for t in e.leaves.values()], limit=limit,
                    task_manager=TaskManager(include_defaults=False),   # tasks are given as objects: index nothing
                    bootstrap_iters=rc.BOOTSTRAP_ITERS,   # mean metrics use the closed form; perplexity bootstrapped
                    log_samples=True, random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                    fewshot_random_seed=seed,
                )
                if out is None:
                    raise SuiteError("lm-eval returned no results (not rank 0?)")
        finally:
            model.train(was_training)
        seconds = round(time.time() - t0, 2)
        for n, (rs, ll, greedy) in cached.items():
            by_name[n] = _request_set_rows(rs, ll, greedy, limit, seconds, keep_items)
        for e in entries:
            rows: list[SuiteResult] = []
            if e.spec is None and len(e.leaves) > 1:    # an lm_eval:GROUP: each member's rows, then the group's
                for leaf, task in e.leaves.items():
                    rows += _lm_eval_rows(_Entry(f"{e.name}/{leaf}", leaf, {leaf: task}), out, limit, seconds,
                                          keep_items, in_group=True)
                rows += _group_rows(e, out, rows, seconds)
            else:
                rows += _lm_eval_rows(e, out, limit, seconds, keep_items)
            by_name[e.name] = rows
    return [r for n in names for r in by_name[n]]


def _check_run_args(limit, batch_size, batch_tokens) -> None:
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise SuiteError(f"limit must be a positive int or None (all items), not {limit!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise SuiteError(f"batch_size must be a positive int, not {batch_size!r}")
    if batch_tokens is not None:
        try:
            token_batches([], batch_tokens)        # the scorer's own check of it
        except ValueError as e:
            raise SuiteError(str(e)) from None


def _scorer(model, tokenizer, batch_size: int, batch_tokens: int | None, generation: str = "rounds"):
    """The ``ScoringLM`` over ``model`` that ``run_suite`` scores with: ``batch_size`` sequences per forward, or
    log-likelihood batches of at most ``batch_tokens`` padded tokens; greedy generation by ``generation``."""
    from workers.evals.scoring_lm import ScoringLM         # lm-eval: a heavy import, on first use

    return ScoringLM(pretrained=model, tokenizer=tokenizer, batch_size=batch_size, batch_tokens=batch_tokens,
                     generation=generation)


# --------------------------------------------------------------------------------------------- shards
@dataclass(frozen=True)
class ShardScores:
    """What one shard of a task scored: its requests (indices into the task's request set, ascending), their
    summed log-likelihoods and greedy flags."""

    request: tuple[int, ...]
    loglikelihood: tuple[float, ...]
    greedy: tuple[bool, ...]


def shardable(name: str) -> bool:
    """Whether a task can be split into shards: a packaged log-likelihood task (its requests are kept in the
    request cache, so every shard sees the same requests, batches and scoring order)."""
    return rc.cacheable(name)


def _request_set(hflm, name: str, limit: int | None, seed: int):
    if not shardable(name):
        raise SuiteError(f"{name}: only packaged log-likelihood tasks split into shards "
                         f"({', '.join(n for n in SUITES if shardable(n))})")
    if not hflm.scores_request_sets:
        import lm_eval

        raise SuiteError(f"{name}: shards need the batched scorer (lm-eval {', '.join(BATCHED_FOR)}); lm-eval "
                         f"{lm_eval.__version__} scores requests its own way: run the task unsharded")
    with _lean_lm_eval():
        return rc.load_or_build(name, limit, seed, hflm)


def score_shard(model, tokenizer, task: str, limit: int | None, shard: int, n_shards: int, batch_size: int = 8,
                seed: int = 0, batch_tokens: int | None = None) -> ShardScores:
    """Score shard ``shard`` of ``n_shards`` of a packaged log-likelihood task: the contiguous run of the task's
    scoring batches that ``ScoringLM.score_request_shard`` gives it, each batch exactly as ``run_suite`` runs it
    (same ``batch_size`` / ``batch_tokens``, same seed), so :func:`assemble_shards` of every shard's scores gives
    ``run_suite``'s rows bit for bit."""
    _check_run_args(limit, batch_size, batch_tokens)
    if isinstance(n_shards, bool) or not isinstance(n_shards, int) or n_shards < 1 or \
            isinstance(shard, bool) or not isinstance(shard, int) or not 0 <= shard < n_shards:
        raise SuiteError(f"shard {shard!r} of {n_shards!r}: shards are numbered 0 .. n_shards - 1")
    was_training = model.training
    model.eval()
    try:
        hflm = _scorer(model, tokenizer, batch_size, batch_tokens)
        rs = _request_set(hflm, task, limit, seed)
        _seed_all(seed)                         # as run_suite does before it scores
        req, ll, greedy = hflm.score_request_shard(rs, shard, n_shards)
    finally:
        model.train(was_training)
    return ShardScores(tuple(req.tolist()), tuple(ll.tolist()), tuple(bool(g) for g in greedy.tolist()))


def assemble_shards(model, tokenizer, task: str, limit: int | None, shards: Sequence[ShardScores],
                    seed: int = 0, keep_items: bool = False) -> list[SuiteResult]:
    """The rows of a task from its shards' scores: every request of the task's request set must be scored by
    exactly one shard (else SuiteError naming how many are missing or scored twice); then each item's metrics,
    aggregations and standard errors as ``run_suite`` computes them from the same values, so the rows are equal.
    ``model`` is not run (its tokenizer keys the request set)."""
    _check_run_args(limit, 1, None)
    hflm = _scorer(model, tokenizer, 1, None)
    rs = _request_set(hflm, task, limit, seed)
    ll = np.zeros(rs.n_requests, dtype=np.float64)
    greedy = np.zeros(rs.n_requests, dtype=bool)
    seen = np.zeros(rs.n_requests, dtype=np.int64)
    for part in shards:
        req = np.asarray(part.request, dtype=np.int64)
        if not (len(req) == len(part.loglikelihood) == len(part.greedy)):
            raise SuiteError(f"{task}: a shard's requests, log-likelihoods and greedy flags differ in number")
        if req.size and (req.min() < 0 or req.max() >= rs.n_requests):
            raise SuiteError(f"{task}: a shard scored request {int(req.max())}, the task has {rs.n_requests} "
                             "(the shards were scored for other requests: another limit, tokenizer or task version)")
        np.add.at(seen, req, 1)
        ll[req] = np.asarray(part.loglikelihood, dtype=np.float64)
        greedy[req] = np.asarray(part.greedy, dtype=bool)
    missing, twice = int((seen == 0).sum()), int((seen > 1).sum())
    if missing or twice:
        raise SuiteError(f"{task}: its {len(shards)} shard(s) scored {int((seen > 0).sum())} of its "
                         f"{rs.n_requests} requests ({missing} missing, {twice} scored more than once): the task's "
                         "rows are assembled only from shards that cover every request once")
    with _in_process_bootstrap():
        return _request_set_rows(rs, ll, greedy, limit, 0.0, keep_items)


def prepare_requests(model, tokenizer, tasks: Sequence[str] | str, limit: int | None, seed: int = 0) -> dict[str, str]:
    """Build (or check) the cached requests of tasks without scoring them, so that the first evaluation that reads
    them is not charged their building: {task: "read" | "built" | "lm-eval"} ("lm-eval": not kept in the cache,
    run by lm-eval's pass)."""
    names = check_task_names(tasks)
    out = {}
    with _lean_lm_eval():
        hflm = _scorer(model, tokenizer, batch_size=1, batch_tokens=None)
        for n in names:
            before = rc.counts["built"]
            try:
                if not (rc.cacheable(n) and hflm.scores_request_sets):
                    raise rc.NotCacheable(n)
                rc.load_or_build(n, limit, seed, hflm)
                out[n] = "built" if rc.counts["built"] > before else "read"
            except rc.NotCacheable:
                out[n] = "lm-eval"
    return out


def _seed_all(seed: int) -> None:
    """The seeds lm-eval's ``simple_evaluate`` sets before it evaluates."""
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@dataclass
class _LeafScores:
    """One lm-eval task's scores, from either path: its result entry and its items per filter."""

    key: str                          # lm-eval's task name
    version: str                      # its upstream version
    n_total: int                      # documents in its split
    results: dict[str, Any]           # lm-eval's result entry: "metric,filter" -> value, "metric_stderr,filter"
    items: dict[str, list[ItemScore]]     # filter -> items in doc order
    directions: dict[str, bool]       # metric -> higher is better
    mean_metrics: frozenset[str]      # metrics lm-eval aggregates with its ``mean``


def _request_set_rows(rs: rc.RequestSet, ll, greedy, limit: int | None, seconds: float,
                      keep_items: bool) -> list[SuiteResult]:
    """The rows of a packaged task scored from its cached requests: each item's metrics as lm-eval's
    ``process_results`` computes them (multiple choice: argmax of the log-likelihoods, and of them over the choice
    lengths in characters, against gold; LAMBADA: the log-likelihood and whether greedy decoding gives the word),
    each metric aggregated, and its stderr taken, by lm-eval's own functions."""
    import numpy as np
    from lm_eval.api.metrics import stderr_for_metric
    from lm_eval.api.registry import get_aggregation

    strings = rs.strings()
    texts = rs.req_text.tolist()
    doc_off, doc_leaf, doc_id, gold = (a.tolist() for a in (rs.doc_off, rs.doc_leaf, rs.doc_id, rs.gold))
    items: list[list[ItemScore]] = [[] for _ in rs.leaves]
    values: list[dict[str, list]] = [{m: [] for m in lf.aggregations} for lf in rs.leaves]
    for d in range(len(doc_id)):
        li = doc_leaf[d]
        leaf = rs.leaves[li]
        reqs = rs.doc_req[doc_off[d]:doc_off[d + 1]]
        lls = ll[reqs]
        if leaf.output_type == "multiple_choice":
            g = gold[d]
            v = {"acc": 1.0 if np.argmax(lls) == g else 0.0,
                 "acc_norm": 1.0 if np.argmax(lls / rs.choice_len[reqs]) == g else 0.0}
        else:
            g = 0
            v = {"perplexity": float(lls[0]), "acc": int(greedy[reqs[0]])}
        for m, vals in values[li].items():
            vals.append(v[m])
        items[li].append(ItemScore(doc_id=doc_id[d], gold=g, loglikelihoods=tuple(lls.tolist()),
                                   requests=tuple((strings[texts[r][0]], strings[texts[r][1]]) for r in reqs.tolist()),
                                   metrics={m: float(v[m]) for m in leaf.metrics}, subtask=leaf.subtask))
    leaves = []
    for leaf, mine, vals in zip(rs.leaves, items, values):
        results: dict[str, Any] = {}
        for m, xs in vals.items():
            agg = get_aggregation(leaf.aggregations[m])
            results[f"{m},none"] = agg(xs)
            stderr = stderr_for_metric(agg, rc.BOOTSTRAP_ITERS)
            results[f"{m}_stderr,none"] = stderr(xs) if stderr and len(xs) > 1 else "N/A"
        leaves.append(_LeafScores(key=leaf.key, version=leaf.version, n_total=leaf.n_total, results=results,
                                  items={"none": mine}, directions=dict(leaf.directions),
                                  mean_metrics=frozenset(m for m, a in leaf.aggregations.items() if a == "mean")))
    spec = SUITES[rs.task]
    e = _Entry(rs.task, spec.lm_eval_task, {lf.key: None for lf in rs.leaves}, spec=spec)
    return _entry_rows(e, leaves, list(spec.metrics), limit, seconds, keep_items, spec.output_type, spec.split,
                       items_fingerprint=rs.items_fingerprint)


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
            task=e.name, lm_eval_task=e.lm_eval_task, kind=task_kind(e.name, group=True), metric=m,
            higher_is_better=members[0].higher_is_better,
            value=float(res[f"{metric},{flt}"]), stderr=_float_or_none(res.get(f"{metric}_stderr,{flt}")),
            n=sum(r.n for r in members), n_total=sum(r.n_total for r in members), split=members[0].split,
            task_version=str(out["versions"].get(e.group)), suite_version=0, lm_eval_version=lm_eval.__version__,
            data_fingerprint=hashlib.sha256("".join(r.data_fingerprint for r in members).encode()).hexdigest(),
            items_fingerprint=hashlib.sha256("".join(r.items_fingerprint for r in members).encode()).hexdigest(),
            comparable_with_published=all(r.comparable_with_published for r in members), seconds=seconds,
            subtasks=subs))
    return rows


def _lm_eval_rows(e: _Entry, out: dict, limit: int | None, seconds: float, keep_items: bool,
                  in_group: bool = False) -> list[SuiteResult]:
    """The rows of one task of lm-eval's pass (``out``: what ``simple_evaluate`` returned)."""
    first = next(iter(e.leaves.values()))
    metrics = list(e.spec.metrics) if e.spec else _result_metrics(out["results"][first.config.task])
    mean = _lm_eval_mean()
    leaves = [_LeafScores(
        key=key, version=str(out["versions"].get(key)), n_total=int(out["n-samples"][key]["original"]),
        results=out["results"][key],
        items={flt: _items(task, out["samples"][key], flt, key if len(e.leaves) > 1 else None)
               for flt in {_split_metric(m)[1] for m in metrics}},
        directions=dict(task.higher_is_better() or {}),
        mean_metrics=frozenset(m for m, fn in task.aggregation().items() if fn is mean))
        for key, task in e.leaves.items()]
    return _entry_rows(e, leaves, metrics, limit, seconds, keep_items, first.config.output_type,
                       first.config.test_split or first.config.validation_split or "?", in_group=in_group)


def _entry_rows(e: _Entry, leaves: list[_LeafScores], metrics: list[str], limit: int | None, seconds: float,
                keep_items: bool, output_type: str, split: str, in_group: bool = False,
                items_fingerprint: str | None = None) -> list[SuiteResult]:
    """The rows of one packaged task (a packaged group: one row per metric over every member's items), or of one
    lm-eval task (``in_group``: a member of an ``lm_eval:GROUP``), from its leaves' scores (either path).
    ``items_fingerprint``: the items' fingerprint where it is known already (a cached request set's)."""
    import lm_eval

    spec = e.spec
    directions: dict[str, bool] = {}
    for lf in leaves:
        directions.update(lf.directions)
    n_total = 0
    for lf in leaves:
        n_total += lf.n_total
        expected_n = min(limit, lf.n_total) if limit else lf.n_total
        for flt, items in lf.items.items():
            if len(items) != expected_n or [it.doc_id for it in items] != list(range(expected_n)):
                raise SuiteError(f"{e.name}: scored doc ids {[it.doc_id for it in items][:10]}... of "
                                 f"{lf.key} ({flt}), expected the first {expected_n}")
    first_flt = _split_metric(metrics[0])[1]
    all_items = [it for lf in leaves for it in lf.items[first_flt]]
    versions = sorted({lf.version for lf in leaves})
    common = dict(
        task=e.name, lm_eval_task=e.lm_eval_task, kind=task_kind(e.name, output_type, in_group),
        n=len(all_items), n_total=n_total, split=spec.split if spec else split,
        task_version="/".join(versions), suite_version=spec.version if spec else 0,
        lm_eval_version=lm_eval.__version__, data_fingerprint=_data_fingerprint(e),
        items_fingerprint=items_fingerprint or fingerprint_items(all_items),
        comparable_with_published=spec.comparable_with_published if spec else e.yaml_path is None,
        seconds=seconds, items=tuple(all_items) if keep_items else None,
    )
    rows: list[SuiteResult] = []
    for m in metrics:
        metric, flt = _split_metric(m)
        if not isinstance(directions.get(metric), bool):
            raise SuiteError(f"{e.name}/{metric}: lm-eval declares no direction for it ({directions})")
        subs = []
        for lf in leaves:
            value = float(lf.results[f"{metric},{flt}"])
            items = lf.items[flt]
            if metric in lf.mean_metrics and items and all(metric in it.metrics for it in items):
                mean = sum(it.metrics[metric] for it in items) / len(items)
                if abs(mean - value) > 1e-9:    # our per-item view must be lm-eval's
                    raise SuiteError(f"{e.name}/{lf.key}/{m}: lm-eval says {value}, its samples average {mean}")
            subs.append((lf.key, len(items), value, _float_or_none(lf.results.get(f"{metric}_stderr,{flt}"))))
        if len(subs) == 1:
            value, stderr = subs[0][2], subs[0][3]
            subtasks: tuple = ()
        else:
            # a packaged group (MMLU): micro average over every item, as lm-eval's group with weight_by_size;
            # per-item values of a mean metric give its closed-form stderr over all items
            vals = [it.metrics[metric] for lf in leaves for it in lf.items[flt]]
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
    if e.spec is not None:
        return packaged_data_fingerprint(e.spec)
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
