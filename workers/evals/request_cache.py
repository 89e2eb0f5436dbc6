"""Requests built once: a packaged task's log-likelihood requests templated, tokenized and put in scoring order once
per (task config, tokenizer), kept on disk under ``$CTXSPARSE_HOME/requests/``, and read by every later evaluation of
the pair (every setting of a sweep, and later sweeps).

What an entry holds (``RequestSet``): for every request (one per choice of a multiple-choice item, one per LAMBADA
passage) its context and continuation as lm-eval built them (the task's own templates on the shipped data, as
``lm_eval.evaluator.evaluate`` calls them) and as lm-eval tokenized them (``ScoringLM.encode``: lm-eval's
``loglikelihood`` up to where it would score); for every item its leaf task (MMLU's subject), doc id, gold choice and
choice lengths (what lm-eval's ``process_results`` reads); and the order lm-eval scores the requests in
(``workers.evals.scoring.scoring_order``: longest first, requests sharing a window answered by one row). Scoring
it (``ScoringLM.score_request_set``) runs the forwards lm-eval's requests would run, so the rows equal the
uncached path's (``tests/workers/evals/test_request_cache.py``).

The key (``entry_key``) is a hash of what changes the requests:
  - the task config: the packaged task's declaration (``SuiteTask``), the upstream YAML of each member as lm-eval
    loads it (functions by name and source), the shipped data's fingerprint, the item selection (``limit``), the
    few-shot seed, and the code that builds requests (this module, ``tasks.py``, ``gold_index``);
  - the tokenizer: its whole pipeline (vocabulary, merges, normalizer, pre- and post-processor, added and special
    tokens), its chat template, and how lm-eval calls it (``add_bos_token``, the prefix token for empty contexts);
  - the versions of lm-eval, transformers and tokenizers, and ``FORMAT``.

Files are NumPy ``.npz`` archives of integer, float and byte arrays (read with ``allow_pickle=False``; the strings
are UTF-8 bytes with offsets, the metadata one JSON document), written to a per-process temporary file and renamed
into place: a reader sees no file or a whole one. An entry that cannot be read, fails its CRC or does not hold
what its key says is rebuilt with a warning. Only packaged tasks with log-likelihood requests are kept here
(multiple choice, LAMBADA); generation tasks and ``lm_eval:`` / ``yaml:`` tasks run lm-eval's own path.
"""
from __future__ import annotations

import collections
import functools
import hashlib
import inspect
import itertools
import json
import logging
import os
import uuid
import weakref
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from workers.evals.items import ItemScore, fingerprint_items, gold_index, packaged_data_fingerprint

log = logging.getLogger(__name__)

FORMAT = 1                                         # bump when an entry's layout or meaning changes
CACHED_OUTPUT_TYPES = ("multiple_choice", "loglikelihood")
# metrics whose per-item values are computed here as lm-eval's ``process_results`` computes them
ITEM_METRICS = {"multiple_choice": ("acc", "acc_norm"), "loglikelihood": ("acc", "perplexity")}
AGGREGATIONS = ("mean", "perplexity")               # lm-eval's registered aggregations an entry may name
BOOTSTRAP_ITERS = 1000                              # lm-eval's bootstrap resamples for a stderr (perplexity)
counts: collections.Counter = collections.Counter()     # "built", "read", "rebuilt" entries in this process

_ARRAYS = ("meta", "doc_leaf", "doc_id", "gold", "doc_off", "doc_req", "choice_len", "req_ctx", "ctx_off",
           "ctx_tokens", "cont_off", "cont_tokens", "req_text", "text_off", "text", "row_off", "members")


class NotCacheable(Exception):
    """A task whose requests or metrics are not the kinds kept here (lm-eval's own path scores it)."""


def cacheable(name: str) -> bool:
    """Whether a task name is one this cache may hold (a packaged log-likelihood task)."""
    from workers.evals.tasks import SUITES

    return name in SUITES and SUITES[name].output_type in CACHED_OUTPUT_TYPES


# --------------------------------------------------------------------------------------------- the entry
@dataclass(frozen=True)
class Leaf:
    """One lm-eval task of an entry (MMLU: one per subject)."""

    key: str                          # lm-eval's task name (``mmlu_anatomy``)
    subtask: str | None               # the member label of its items (the key, for a group's members)
    output_type: str
    version: str                      # the upstream task version (``task.VERSION``)
    n_total: int                      # documents in the split
    metrics: tuple[str, ...]          # per-item metrics, as lm-eval's samples list them
    aggregations: dict[str, str]      # metric -> lm-eval's registered aggregation name
    directions: dict[str, bool]       # metric -> higher is better


@dataclass
class RequestSet:
    """One (task config, tokenizer) pair's requests. Documents are in lm-eval's order (leaf by leaf, doc id order),
    requests in the order lm-eval sends them to the model."""

    key: str
    task: str
    limit: int | None
    leaves: tuple[Leaf, ...]
    items_fingerprint: str            # ``items.fingerprint_items`` over every item (requests and gold)
    doc_leaf: np.ndarray              # per document: index into ``leaves``
    doc_id: np.ndarray                # per document: its doc id within its leaf
    gold: np.ndarray                  # per document: the correct choice (0 for loglikelihood tasks)
    doc_off: np.ndarray               # document d's requests: doc_req[doc_off[d]:doc_off[d + 1]], choice order
    doc_req: np.ndarray
    choice_len: np.ndarray            # per request: length of its choice in characters (acc_norm's divisor)
    req_ctx: np.ndarray               # per request: its context's index into the context token table
    ctx_off: np.ndarray               # context tokens c: ctx_tokens[ctx_off[c]:ctx_off[c + 1]]
    ctx_tokens: np.ndarray
    cont_off: np.ndarray              # request r's continuation tokens: cont_tokens[cont_off[r]:cont_off[r + 1]]
    cont_tokens: np.ndarray
    req_text: np.ndarray              # per request: (context string, continuation string) indices
    text_off: np.ndarray              # string s: text[text_off[s]:text_off[s + 1]] (UTF-8)
    text: np.ndarray
    row_off: np.ndarray               # scoring window p answers members[row_off[p]:row_off[p + 1]]
    members: np.ndarray

    @property
    def n_requests(self) -> int:
        return len(self.req_ctx)

    def context(self, r: int) -> np.ndarray:
        c = self.req_ctx[r]
        return self.ctx_tokens[self.ctx_off[c]:self.ctx_off[c + 1]]

    def continuation(self, r: int) -> np.ndarray:
        return self.cont_tokens[self.cont_off[r]:self.cont_off[r + 1]]

    def strings(self) -> list[str]:
        """Every string of the entry, decoded once (``req_text`` indexes them)."""
        blob = self.text.tobytes()
        off = self.text_off.tolist()
        return [blob[off[i]:off[i + 1]].decode("utf-8") for i in range(len(off) - 1)]

    def arrays(self) -> dict[str, np.ndarray]:
        meta = {"format": FORMAT, "key": self.key, "task": self.task, "limit": self.limit,
                "leaves": [asdict(lf) for lf in self.leaves], "items_fingerprint": self.items_fingerprint}
        out = {"meta": np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)}
        out.update({k: getattr(self, k) for k in _ARRAYS if k != "meta"})
        return out

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray], key: str) -> "RequestSet":
        """The entry, checked: its key, and every offset and index in range (a damaged file raises)."""
        if set(arrays) != set(_ARRAYS):
            raise ValueError(f"arrays {sorted(arrays)}, expected {sorted(_ARRAYS)}")
        meta = json.loads(arrays["meta"].tobytes().decode("utf-8"))
        if meta.get("format") != FORMAT or meta.get("key") != key:
            raise ValueError(f"entry of format {meta.get('format')} and key {str(meta.get('key'))[:16]}, "
                             f"expected {FORMAT} and {key[:16]}")
        rs = cls(key=key, task=meta["task"], limit=meta["limit"],
                 leaves=tuple(Leaf(**{**lf, "metrics": tuple(lf["metrics"])}) for lf in meta["leaves"]),
                 items_fingerprint=meta["items_fingerprint"],
                 **{k: arrays[k] for k in _ARRAYS if k != "meta"})
        rs.check()
        return rs

    def check(self) -> None:
        n_docs, n_req = len(self.doc_id), len(self.req_ctx)

        def offsets(name: str, n: int, total: int) -> None:
            off = getattr(self, name)
            if off.ndim != 1 or len(off) != n + 1 or off[0] != 0 or off[-1] != total or np.any(np.diff(off) < 0):
                raise ValueError(f"{name} is not {n} ranges over {total} entries")

        def index(name: str, bound: int) -> None:
            a = getattr(self, name)
            if a.size and (a.min() < 0 or a.max() >= bound):
                raise ValueError(f"{name} points outside 0..{bound - 1}")

        for name in ("doc_leaf", "gold"):
            if len(getattr(self, name)) != n_docs:
                raise ValueError(f"{name} has {len(getattr(self, name))} entries for {n_docs} documents")
        for name in ("choice_len", "cont_off"):
            if len(getattr(self, name)) != n_req + (name == "cont_off"):
                raise ValueError(f"{name} does not match {n_req} requests")
        if self.req_text.shape != (n_req, 2):
            raise ValueError(f"req_text has shape {self.req_text.shape}, expected ({n_req}, 2)")
        offsets("doc_off", n_docs, len(self.doc_req))
        offsets("ctx_off", len(self.ctx_off) - 1, len(self.ctx_tokens))
        offsets("cont_off", n_req, len(self.cont_tokens))
        offsets("text_off", len(self.text_off) - 1, len(self.text))
        offsets("row_off", len(self.row_off) - 1, len(self.members))
        index("doc_leaf", len(self.leaves))
        index("doc_req", n_req)
        index("req_ctx", len(self.ctx_off) - 1)
        index("req_text", len(self.text_off) - 1)
        index("members", n_req)
        if len(self.members) != n_req or len(self.doc_req) != n_req:
            raise ValueError("not every request is scored and owned by a document once")


# --------------------------------------------------------------------------------------------- keys
def _describe(obj: Any) -> Any:
    """A JSON-able description of a task config value: functions by module, name and a hash of their source."""
    if isinstance(obj, dict):
        return {str(k): _describe(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, (list, tuple)):
        return [_describe(v) for v in obj]
    if obj is None or isinstance(obj, (str, int, float, bool)):
        return obj
    if callable(obj):
        fn = getattr(obj, "__wrapped__", obj)
        try:
            src = hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()[:16]
        except (OSError, TypeError):
            src = None
        return {"fn": f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}",
                "src": src}
    return repr(obj)


@functools.cache
def _source_hash(module_file: str) -> str:
    return hashlib.sha256(Path(module_file).read_bytes()).hexdigest()


@functools.cache
def _function_hash(fn) -> str:
    return hashlib.sha256(inspect.getsource(fn).encode()).hexdigest()


def _declaration(spec) -> str:
    """Hash of a packaged task's declaration and of its members' upstream configs (as lm-eval loads the YAML;
    memoized per declaration: MMLU's 57 YAML files take most of a second to load)."""
    return _declaration_of(spec, spec.docs)


@functools.lru_cache(maxsize=64)
def _declaration_of(spec, docs) -> str:
    from lm_eval.tasks._yaml_loader import load_yaml

    from workers.evals.tasks import _lm_eval_tasks_dir

    fields = {k: _describe(v) for k, v in sorted(vars(spec).items())}
    members = spec.members() or [None]
    configs = [_describe(load_yaml(_lm_eval_tasks_dir() / spec.upstream_yaml.format(member=m), resolve_func=True))
               for m in members]
    return hashlib.sha256(json.dumps([fields, members, configs], sort_keys=True).encode()).hexdigest()


def task_fingerprint(name: str, limit: int | None, seed: int) -> str:
    """Hash of everything about a packaged task that changes its requests (see the module doc)."""
    import lm_eval

    from workers.evals import tasks

    spec = tasks.SUITES[name]
    data = packaged_data_fingerprint(spec)
    code = [_source_hash(__file__), _source_hash(tasks.__file__), _function_hash(gold_index)]
    return hashlib.sha256(json.dumps({"declaration": _declaration(spec), "data": data, "limit": limit,
                                      "seed": seed, "code": code, "lm_eval": lm_eval.__version__},
                                     sort_keys=True).encode()).hexdigest()


_TOKENIZER_FPS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _tokenizer_state(tok) -> tuple:
    """What can change in place on a tokenizer object between two calls (checked before a memoized hash is used)."""
    return (type(tok).__name__, len(tok), getattr(tok, "chat_template", None),
            json.dumps(getattr(tok, "special_tokens_map", {}), sort_keys=True, default=str),
            getattr(tok, "add_bos_token", None), getattr(tok, "add_eos_token", None),
            id(getattr(tok, "backend_tokenizer", None)))


def tokenizer_fingerprint(tok) -> str:
    """Hash of a tokenizer's whole encoding pipeline and chat template (not its name): a fast tokenizer's
    serialized pipeline (vocabulary, merges, normalizer, pre- and post-processor, added tokens), else its vocabulary
    and vocabulary file; its special tokens, added tokens and chat template. Memoized per object while the state
    ``_tokenizer_state`` reads stays the same."""
    import tokenizers
    import transformers

    state = _tokenizer_state(tok)
    try:
        memo = _TOKENIZER_FPS.get(tok)
    except TypeError:                          # not weak-referenceable: no memo
        memo = None
    if memo is not None and memo[0] == state:
        return memo[1]
    h = hashlib.sha256()
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
        vocab_file = getattr(tok, "vocab_file", None)
        if vocab_file and os.path.isfile(vocab_file):
            h.update(Path(vocab_file).read_bytes())
    added = {int(i): str(t) for i, t in getattr(tok, "added_tokens_decoder", {}).items()}
    h.update(json.dumps({"state": state[:-1], "added": added, "special_ids": list(tok.all_special_ids),
                         "transformers": transformers.__version__, "tokenizers": tokenizers.__version__},
                        sort_keys=True, default=str).encode())
    fp = h.hexdigest()
    try:
        _TOKENIZER_FPS[tok] = (state, fp)
    except TypeError:
        pass
    return fp


def encoding_fingerprint(hflm) -> str:
    """The tokenizer's fingerprint and how lm-eval's model wrapper calls it."""
    settings = {"add_bos_token": hflm.add_bos_token, "prefix_token_id": hflm.prefix_token_id,
                "backend": hflm.backend}
    return hashlib.sha256(json.dumps([tokenizer_fingerprint(hflm.tokenizer), settings],
                                     sort_keys=True).encode()).hexdigest()


def entry_key(name: str, limit: int | None, seed: int, hflm) -> str:
    return hashlib.sha256(f"{FORMAT}:{task_fingerprint(name, limit, seed)}:{encoding_fingerprint(hflm)}"
                          .encode()).hexdigest()


def entry_path(name: str, limit: int | None, key: str) -> Path:
    from workers.paths import home

    return home() / "requests" / f"{name}-{'all' if limit is None else limit}-{key[:24]}.npz"


# --------------------------------------------------------------------------------------------- load, build, store
def load_or_build(name: str, limit: int | None, seed: int, hflm) -> RequestSet:
    """The entry of (task, limit, seed, hflm's tokenizer): read from the shared home, else built and stored.

    A file that cannot be read or checked is rebuilt (a warning says why) and replaced; NotCacheable for a task
    whose requests are not kept here."""
    if not cacheable(name):
        raise NotCacheable(f"{name}: not a packaged log-likelihood task")
    key = entry_key(name, limit, seed, hflm)
    path = entry_path(name, limit, key)
    if path.exists():
        try:
            rs = RequestSet.from_arrays(read_arrays(path), key)
            counts["read"] += 1
            return rs
        except Exception as e:               # any damage: a short read, a bad CRC, a foreign or partial entry
            log.warning("request cache %s unreadable (%s: %s); building it again", path.name, type(e).__name__, e)
            counts["rebuilt"] += 1
    rs = build(name, limit, seed, hflm, key)
    save(rs, path)
    return rs


def read_arrays(path: Path) -> dict[str, np.ndarray]:
    """The arrays of an entry file (no pickled objects; each member's CRC is checked as it is read whole)."""
    with np.load(path, allow_pickle=False) as z:
        return {k: z[k] for k in z.files}


def save(rs: RequestSet, path: Path) -> None:
    """Write through a temporary file of this process and one rename (readers never see a partial file; two
    writers of the same key write the same content)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "wb") as f:
            np.savez(f, **rs.arrays())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _check_leaf(task) -> Leaf:
    """The leaf's description, or NotCacheable where its per-item metrics are not computed here as lm-eval's."""
    from lm_eval.api.registry import get_aggregation

    name, out_type = task.config.task, task.OUTPUT_TYPE
    if out_type not in CACHED_OUTPUT_TYPES:
        raise NotCacheable(f"{name}: output type {out_type}")
    if callable(task.config.process_results) or task.multiple_target:
        raise NotCacheable(f"{name}: its own process_results or several targets")
    filters = [(ens.name, [getattr(f, "func", f).__name__ for f in ens.filters]) for ens in task._filters]
    if filters != [("none", ["TakeFirstFilter"])]:
        raise NotCacheable(f"{name}: filters {filters}")
    metrics = tuple(m["metric"] if isinstance(m["metric"], str) else m["metric"].__name__
                    for m in task.config.metric_list or []) or tuple(task.higher_is_better() or {})
    scored = tuple(task._metric_fn_list)
    if not set(scored) <= set(ITEM_METRICS[out_type]) or not set(metrics) <= set(scored):
        raise NotCacheable(f"{name}: metrics {scored}")
    aggregations = {}
    for m in scored:
        fn = task.aggregation().get(m)
        found = [a for a in AGGREGATIONS if get_aggregation(a) is fn]
        if not found:
            raise NotCacheable(f"{name}: aggregation {fn} of {m}")
        aggregations[m] = found[0]
    directions = {m: bool(task.higher_is_better()[m]) for m in scored}
    return Leaf(key=name, subtask=None, output_type=out_type, version=str(task.VERSION),
                n_total=len(task.eval_docs), metrics=metrics, aggregations=aggregations, directions=directions)


def build(name: str, limit: int | None, seed: int, hflm, key: str) -> RequestSet:
    """Template, tokenize and order a packaged task's requests: lm-eval's ``build_all_requests`` with the arguments
    ``simple_evaluate`` gives it for ``run_suite``, lm-eval's tokenization (``hflm.encode``), lm-eval's scoring
    order (``scoring_order``)."""
    from workers.evals.scoring import scoring_order

    leaves, instances, docs = _task_requests(name, limit, seed)
    encoded = hflm.encode(instances)
    if len(encoded) != len(instances):
        raise RuntimeError(f"{name}: {len(instances)} requests, {len(encoded)} encoded")
    tables = _request_tables(name, instances, encoded)
    doc_arrays, items = _document_arrays(name, leaves, docs, instances)
    row_off, members_order = scoring_order(encoded)
    rs = RequestSet(key=key, task=name, limit=limit, leaves=tuple(leaves), items_fingerprint=fingerprint_items(items),
                    row_off=row_off, members=members_order, **doc_arrays, **tables)
    rs.check()
    counts["built"] += 1
    return rs


def _task_requests(name: str, limit: int | None, seed: int) -> tuple[list[Leaf], list, list]:
    """A packaged task's leaves, its instances as lm-eval sends them, and its documents: (leaf index, doc id, doc,
    its instances in index order, its task)."""
    from lm_eval.evaluator_utils import get_sample_size

    from workers.evals.tasks import SUITES, build_task

    spec = SUITES[name]
    members = spec.members()
    built = [(f"{spec.lm_eval_task}_{m}", build_task(name, m)) for m in members] if members else \
        [(spec.lm_eval_task, build_task(name))]
    leaves, instances, docs = [], [], []
    for li, (leaf_key, task) in enumerate(built):
        leaf = _check_leaf(task)
        leaves.append(replace(leaf, subtask=leaf_key if members else None))
        if task.get_config("num_fewshot") is None:
            task.set_config(key="num_fewshot", value=0)
        task.set_fewshot_seed(seed=seed)
        task.build_all_requests(limit=get_sample_size(task, limit), samples=None, rank=0, world_size=1,
                                cache_requests=False, rewrite_requests_cache=False, system_instruction=None,
                                apply_chat_template=False, fewshot_as_multiturn=True, chat_template=None,
                                tokenizer_name="")
        by_doc: dict[int, list] = collections.defaultdict(list)
        for inst in task.instances:
            by_doc[inst.doc_id].append(inst)
        instances += task.instances
        for doc_id in sorted(by_doc):
            mine = sorted(by_doc[doc_id], key=lambda x: x.idx)
            docs.append((li, doc_id, mine[0].doc, mine, task))
    return leaves, instances, docs


def _request_tables(name: str, instances: list, encoded: list) -> dict[str, np.ndarray]:
    """The requests' ``RequestSet`` arrays: contexts (each distinct one stored once), continuations and strings."""
    strings: dict[str, int] = {}
    contexts: dict[tuple, int] = {}

    def string(s: str) -> int:
        return strings.setdefault(s, len(strings))

    req_ctx, req_text, conts = [], [], []
    for inst, (req_str, ctx, cont) in zip(instances, encoded):
        if tuple(req_str) != tuple(inst.args):
            raise RuntimeError(f"{name}: encoded requests out of order")
        req_ctx.append(contexts.setdefault(tuple(ctx), len(contexts)))
        req_text.append((string(str(inst.args[0])), string(str(inst.args[1]))))
        conts.append(cont)
    text = [s.encode("utf-8") for s in strings]
    ctx_off, ctx_tokens = _flat(list(contexts))
    cont_off, cont_tokens = _flat(conts)
    token_dtype = np.int32 if max(ctx_tokens.max(initial=0), cont_tokens.max(initial=0)) < 2 ** 31 else np.int64
    return dict(req_ctx=np.asarray(req_ctx, dtype=np.int64), ctx_off=ctx_off, ctx_tokens=ctx_tokens.astype(token_dtype),
                cont_off=cont_off, cont_tokens=cont_tokens.astype(token_dtype),
                req_text=np.asarray(req_text, dtype=np.int64).reshape(-1, 2), text_off=_offsets(text),
                text=np.frombuffer(b"".join(text), dtype=np.uint8))


def _document_arrays(name: str, leaves: list[Leaf], docs: list, instances: list) -> tuple[dict, list[ItemScore]]:
    """The documents' ``RequestSet`` arrays (leaf, doc id, gold, requests; each request's choice length) and their
    items."""
    position = {id(inst): r for r, inst in enumerate(instances)}
    choice_len = np.zeros(len(instances), dtype=np.float64)
    doc_leaf, doc_id, gold, doc_req, doc_off, items = [], [], [], [], [0], []
    for li, d, doc, mine, task in docs:
        reqs = [position[id(inst)] for inst in mine]
        if leaves[li].output_type == "multiple_choice":
            choices = task.doc_to_choice(doc)
            if len(choices) != len(reqs):
                raise NotCacheable(f"{name}: {len(reqs)} requests for {len(choices)} choices")
            choice_len[reqs] = [float(len(c)) for c in choices]
            g = gold_index(task, doc)
        else:
            if len(reqs) != 1:
                raise NotCacheable(f"{name}: {len(reqs)} requests for one loglikelihood item")
            g = 0
        doc_leaf.append(li)
        doc_id.append(d)
        gold.append(g)
        doc_req += reqs
        doc_off.append(len(doc_req))
        items.append(ItemScore(doc_id=d, gold=g, requests=tuple((str(i.args[0]), str(i.args[1])) for i in mine),
                               loglikelihoods=(), metrics={}, subtask=leaves[li].subtask))
    arrays = dict(doc_leaf=np.asarray(doc_leaf, dtype=np.int32), doc_id=np.asarray(doc_id, dtype=np.int64),
                  gold=np.asarray(gold, dtype=np.int64), doc_off=np.asarray(doc_off, dtype=np.int64),
                  doc_req=np.asarray(doc_req, dtype=np.int64), choice_len=choice_len)
    return arrays, items


def _offsets(seqs) -> np.ndarray:
    off = np.zeros(len(seqs) + 1, dtype=np.int64)
    off[1:] = np.cumsum([len(s) for s in seqs])
    return off


def _flat(seqs) -> tuple[np.ndarray, np.ndarray]:
    off = _offsets(seqs)
    return off, np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(off[-1]))
