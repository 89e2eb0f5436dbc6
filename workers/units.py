"""What one sweep unit computes, without Ray or a database: config in, plain rows out.

A unit's ``config`` (the typed model of its kind, ``db.units``: built by the orchestrator, hashed into its id) says
everything it needs:

  collect   model, data                 -> the calibration and held-out activation caches
  fit       + method, sparsity, rank, attn_sparsity, allocation, options, seed, threads
                                        -> a predictor bundle (``bundle_dir(unit id)``), per-layer quality rows
  eval      + fit_unit, suite (perplexity or a task), its size, threads
                                        -> accuracy rows (perplexity, realized sparsity, or task accuracy:
                                           ``task_rows``); with ``shard: [k, n]`` the scored requests of shard k
                                           of the task (``scores``, no rows); given every shard's scores
                                           (``shard_scores``), the task's rows assembled from them
  latency   + fit_unit, device_type, batch, prompt_len, gen_len, repeats, runtime, threads
                                        -> latency rows from a real decode loop (runtime ``llama.cpp``: llama.cpp on
                                           the model's GGUF, interleaved with our dense decode), each row
                                           recording the thread count it was timed at and, on the CPU,
                                           the instruction set of the native build (``cpu_build``; not
                                           part of the unit's id: one unit may hold rows of two builds)

``threads`` is torch's intra-op thread count, set before the unit computes: GEMM summation order depends on it,
and a threshold method's |act(gate)| > t flips boundary neurons when it changes (+0.75 % perplexity seen from 1
to 2 threads), so rows measured under different counts belong to different units; a latency measured at one count
holds only at that count (CPU latency units default to every core of the node: ``orchestrator.plan``). The fit
itself is ``workers.sparsity.fit`` (shared with the points runner ``benchmarks.quality``).

Fitted methods reach the evaluators only through the bundle on disk (``$CTXSPARSE_HOME/bundles``), and
activations only through the activation cache: nothing large travels through Ray's object store.
``Units`` keeps loaded models between units (one process serves many units of the same model).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from db.units import (CollectConfig, EvalConfig, FitConfig, LatencyConfig, PerplexityEvalConfig, TaskEvalConfig,
                      Threaded, UnitConfig, unit_config)
from workers.host import available_cores
from workers.names import (DENSE, MATMUL_BF16, MATMUL_FP32, MATMUL_TF32, RUNTIME_LLAMA_CPP, UNIT_KINDS, is_shape,
                           shape_name)
from workers.names import shape_identity as _shape_identity
from workers.paths import home, sha256_file

log = logging.getLogger(__name__)


def shape_identity(name: str) -> tuple[str, str]:
    """(store name, fingerprint) of a random-weights shape (``workers.names.shape_identity`` of its FFN dims)."""
    from workers.decode.shapes import ffn_shape

    d, D, _, _ = ffn_shape(name)
    return _shape_identity(name, d, D)


EVAL_BATCH_CPU = 8     # sequences per batch of a task unit without batch_size (the plan leaves it out on the CPU)


def bundle_dir(fit_unit: str) -> Path:
    return home() / "bundles" / fit_unit


def task_rows(rows) -> list[dict]:
    """Accuracy rows of ``run_suite``'s results (``SuiteResult``), each labelled ``suite`` = its task's kind
    (``workers.evals.tasks.task_kind``: ``mc`` only for single multiple-choice tasks, which the mean task accuracy
    averages). A packaged group's members (MMLU's subjects) get a row each too, as ``<task>/<member>`` (lm-eval's
    subtask name) with the member's own value, stderr and n; an ``lm_eval:GROUP``'s members have rows of their own
    already (``run_suite``), so only packaged groups are expanded."""
    from workers.evals.tasks import SUITES

    out = []
    for r in rows:
        out.append({"suite": r.kind, "task": r.task, "metric": r.metric, "higher_is_better": r.higher_is_better,
                    "value": r.value, "stderr": r.stderr, "n": r.n})
        if r.task in SUITES:
            out += [{"suite": r.kind, "task": f"{r.task}/{member}", "metric": r.metric,
                     "higher_is_better": r.higher_is_better, "value": value, "stderr": stderr, "n": n}
                    for member, n, value, stderr in r.subtasks]
    return out


@dataclass
class UnitOutput:
    accuracy: list[dict] = field(default_factory=list)
    latency: list[dict] = field(default_factory=list)
    layers: list[dict] = field(default_factory=list)
    artifacts: list[dict] = field(default_factory=list)
    scores: list[dict] = field(default_factory=list)   # a task shard's scored requests (db RequestScoreRow)
    summary: dict = field(default_factory=dict)      # a few figures for the driver's progress log


def release_cached_memory(device: str) -> None:
    """Give the blocks this process's allocator keeps cached on an accelerator back to the device. Many actors share
    one GPU, and each one's cache grows to its own peak: on an H200 with 16 actors the device was 142.5 of 143.7 GB
    full. Released after every unit, a unit's peak is lent to the others, not kept."""
    kind = torch.device(device).type
    if kind == "cuda":
        torch.cuda.empty_cache()
    elif kind == "npu":
        torch.npu.empty_cache()


@contextmanager
def matmul_precision(precision: str, device: str = "cpu"):
    """An eval unit's forward precision (``matmul``, ``workers.names``) inside the block, restored after it; every
    unit sets it, so an actor's previous unit never leaks its choice. fp32 and tf32: CUDA's float32 products
    exact or on TF32 tensor cores. bf16: also ``torch.autocast`` to bfloat16 on ``device``'s type."""
    if precision not in (MATMUL_FP32, MATMUL_TF32, MATMUL_BF16):
        raise ValueError(f"matmul precision {precision!r}: {MATMUL_FP32}, {MATMUL_TF32} or {MATMUL_BF16}")
    m = torch.backends.cuda.matmul
    new_api = hasattr(m, "fp32_precision")     # torch >= 2.9 (mixing it with allow_tf32 raises)
    before = m.fp32_precision if new_api else m.allow_tf32
    if new_api:
        m.fp32_precision = "tf32" if precision == MATMUL_TF32 else "ieee"
    else:
        m.allow_tf32 = precision == MATMUL_TF32
    autocast = (torch.autocast(torch.device(device).type, dtype=torch.bfloat16) if precision == MATMUL_BF16
                else nullcontext())
    try:
        with autocast:
            yield
    finally:
        if new_api:
            m.fp32_precision = before
        else:
            m.allow_tf32 = before


class Units:
    """Computes units; caches loaded models (by ref and device) across calls."""

    def __init__(self, device: str = "cpu", versions: dict[str, str] | None = None, git_rev: str | None = None):
        self.device = device
        self.versions, self.git_rev = dict(versions or {}), git_rev   # stamped into bundles
        self._lms: dict[str, object] = {}

    # ------------------------------------------------------------------ shared state
    def lm(self, ref: str, expect_fp: str | None = None):
        from workers.loading.models import load_model

        if ref not in self._lms:
            self._lms[ref] = self._shape_lm(ref) if is_shape(ref) else load_model(ref, device=self.device)
        lm = self._lms[ref]
        if expect_fp is not None and lm.fingerprint != expect_fp:
            raise RuntimeError(f"model {ref} now has fingerprint {lm.fingerprint[:12]}, the sweep planned "
                               f"{expect_fp[:12]}: its weights changed; submit the sweep again")
        return lm

    def _shape_lm(self, ref: str):
        from workers.loading.adapters import adapter_for
        from workers.decode.latency import shape_model
        from workers.loading.models import LoadedModel

        name = shape_name(ref)
        dtype = torch.float32 if self.device == "cpu" else torch.float16
        model = shape_model(name, dtype=dtype, device=self.device)
        ad = adapter_for(model)
        return LoadedModel(model, None, ref, ad, ad.dims(model.config), shape_identity(name)[1],
                           "random weights", {"shape": name})

    def describe(self, ref: str, data: dict, ppl: dict | None) -> dict:
        """Model and data fingerprints (what unit ids are made of)."""
        from workers.loading.data import token_windows

        if is_shape(ref):      # from the config alone: no weights, no data
            from workers.loading.adapters import adapter_for
            from workers.decode.latency import shape_config

            name = shape_name(ref)
            cfg = shape_config(name)
            store_name, fp = shape_identity(name)
            dims = adapter_for(cfg).dims(cfg)
            return {"fingerprint": fp, "family": adapter_for(cfg).family, "ref": ref, "name": store_name,
                    "n_params": None, "dims": asdict(dims), "gguf": False,
                    "calib_fp": None, "calib_n_tokens": 0, "heldout_fp": None}

        lm = self.lm(ref)
        calib = token_windows(lm.tokenizer, data["source"], "calib", data["calib_tokens"], data["seq_len"])
        out = {"fingerprint": lm.fingerprint, "family": lm.family, "ref": lm.ref, "name": lm.ref,
               "n_params": sum(p.numel() for p in lm.model.parameters()),
               "dims": asdict(lm.dims), "gguf": lm.meta.get("kind") == "gguf",   # llama.cpp can run its file
               "calib_fp": calib.fingerprint, "calib_n_tokens": calib.n_tokens, "heldout_fp": None}
        if ppl is not None:
            held = token_windows(lm.tokenizer, data["source"], "heldout", ppl["tokens"], ppl["seq_len"])
            out.update(heldout_fp=held.fingerprint, heldout_n_tokens=held.n_tokens)
        return out

    def _caches(self, cfg: CollectConfig | FitConfig):
        from workers.sparsity.capture import capture_activations, sweep_components
        from workers.loading.data import token_windows

        lm = self.lm(cfg.model, cfg.model_fp)
        d = cfg.data
        comps = sweep_components(cfg.capture)    # optional parts only where a method of the sweep needs them
        calib = capture_activations(lm, token_windows(lm.tokenizer, d.source, "calib", d.calib_tokens, d.seq_len),
                                    comps, progress=False)
        held = capture_activations(lm, token_windows(lm.tokenizer, d.source, "heldout", d.metric_tokens, d.seq_len),
                                   comps, progress=False)
        return lm, calib, held

    # ------------------------------------------------------------------ kinds
    def run(self, kind: str, unit_id: str, cfg: UnitConfig | Mapping[str, Any],
            shard_scores: list | None = None) -> UnitOutput:
        """Compute one unit of config ``cfg`` (typed, or its stored form: ``db.units.unit_config``).
        ``shard_scores`` (an eval unit of a task split into shards): every shard's scores
        (``workers.evals.suites.ShardScores``), from which the task's rows are assembled instead of scored."""
        fns = {"collect": self.collect, "fit": self.fit, "eval": self.evaluate, "latency": self.latency}
        assert tuple(fns) == UNIT_KINDS
        fn = fns.get(kind)
        if fn is None:
            raise ValueError(f"unknown unit kind {kind!r}; known: {list(UNIT_KINDS)}")
        if shard_scores is not None and kind != "eval":
            raise ValueError(f"a {kind} unit has no shards to assemble")
        cfg = unit_config(kind, cfg)
        if isinstance(cfg, Threaded) and cfg.threads is not None:  # before anything computes (module docstring)
            torch.set_num_threads(cfg.threads)
        try:
            if shard_scores is not None:
                return self.assemble(unit_id, cfg, shard_scores)
            return fn(unit_id, cfg)
        finally:
            release_cached_memory(self.device)

    def collect(self, unit_id: str, cfg: CollectConfig) -> UnitOutput:
        _, calib, held = self._caches(cfg)
        out = UnitOutput(summary={"calib_tokens": calib.n_tokens, "cache_hit": calib.hit})
        for name, c in (("calib", calib), ("heldout", held)):
            out.artifacts.append({"kind": f"activations_{name}", "uri": str(c.path), "size_bytes": c.size_bytes()})
        return out

    def fit(self, unit_id: str, cfg: FitConfig) -> UnitOutput:
        from workers.sparsity import fit as F
        from workers.sparsity.bundle import save_bundle
        from workers.sparsity.predictors import FitContext

        allocation = F.check_allocation(cfg.allocation)
        if is_shape(cfg.model):   # random predictors of the real shapes are drawn by the latency unit itself
            return UnitOutput(summary={"random_predictors": cfg.method != DENSE})
        method, s, rank, attn = cfg.method, cfg.sparsity, cfg.rank, cfg.attn_sparsity
        head = None if cfg.head is None else cfg.head.model_dump()
        if cfg.baseline:        # nothing to fit or score: no activations (the plan does not wait for the collection)
            lm, calib, held = self.lm(cfg.model, cfg.model_fp), None, None
        else:
            lm, calib, held = self._caches(cfg)
        ctx = FitContext(lm, calib, list(range(lm.dims.n_layers)), seed=cfg.seed, device=self.device)
        t0 = time.time()
        dest = bundle_dir(unit_id)
        cached = self._cached_bundle(dest, lm)
        if cached is not None:     # the same unit (same id: same config and code) was fitted before: reuse it
            plan = cached.plan(lm.model, device="cpu")     # scored on the cached activations (CPU) below
            per_layer = {int(k): v for k, v in cached.manifest["per_layer_sparsity"].items()}
        else:
            fitted = F.fit_setting(ctx, method, s, rank, attn, allocation, cfg.options, head=head)
            plan, per_layer, facts = fitted.plan, fitted.per_layer, fitted.facts
        fit_s = time.time() - t0
        path = dest if cached is not None else save_bundle(
            plan, lm, dest, method=method, sparsity=s, rank=rank, attn_sparsity=attn,
            allocation=allocation, options=cfg.options, per_layer_sparsity=per_layer, head=head,
            unit_id=unit_id, versions=self.versions, git_rev=self.git_rev)
        out = UnitOutput(summary={"fit_s": round(fit_s, 1), **({"bundle_cache_hit": True} if cached else facts)})
        quality = F.layer_quality(plan, held, lm, attn)
        out.layers = F.layer_rows(plan, quality)
        if quality:
            r = F.mean_mlp(quality, "recall")
            out.summary["mean_recall"] = None if r != r else round(r, 4)
        for f in sorted(path.iterdir()):
            out.artifacts.append({"kind": "bundle_file", "uri": str(f), "sha256": sha256_file(f),
                                  "size_bytes": f.stat().st_size})
        return out

    @staticmethod
    def _cached_bundle(dest: Path, lm):
        """The bundle a previous run of this fit unit published, if it is intact and for this model.

        Bundles are keyed by unit id (config + code version), so the first one published stays: every store
        that records it sees the same files. A damaged one is set aside and fitted again."""
        from workers.sparsity.bundle import BundleError, load_bundle

        if not dest.exists():
            return None
        try:
            b = load_bundle(dest)
        except BundleError as e:
            log.warning("%s: %s; fitting again", dest, e)
            dest.rename(dest.with_name(f".damaged-{dest.name}-{int(time.time())}"))
            return None
        return b if b.fingerprint == lm.fingerprint else None

    def _bundle(self, cfg: EvalConfig | LatencyConfig):
        """(lm, the fit unit's bundle), checked against the loaded model."""
        from workers.sparsity.bundle import BundleError, load_bundle

        lm = self.lm(cfg.model, cfg.model_fp)
        b = load_bundle(bundle_dir(cfg.fit_unit))
        if b.fingerprint != lm.fingerprint:
            raise BundleError(f"bundle of unit {cfg.fit_unit} is for another model")
        return lm, b

    def evaluate(self, unit_id: str, cfg: EvalConfig) -> UnitOutput:
        from workers.evals.fused_forward import fused_elementwise
        from workers.sparsity.bundle import apply_bundle

        lm, b = self._bundle(cfg)
        # fingerprint compared in _bundle (cached on lm); exec_mode: how the rows are computed (plan.py says why)
        applied = apply_bundle(lm.model, b, check_model=False, mode=cfg.exec_mode)
        # only the perplexity unit reports the realized sparsity: the task units' forwards count nothing
        perplexity = isinstance(cfg, PerplexityEvalConfig)
        applied.stats.counting = perplexity
        fused = fused_elementwise(lm.model) if cfg.fused else nullcontext()     # suites.fused
        with applied, matmul_precision(cfg.matmul, self.device), fused:
            return self._perplexity(lm, applied.stats, cfg) if perplexity else self._task(lm, cfg)

    @staticmethod
    def _perplexity(lm, stats, cfg: PerplexityEvalConfig) -> UnitOutput:
        """The held-out perplexity rows, and the sparsities the forwards realized (``stats``, counted)."""
        from workers.evals.perplexity import perplexity
        from workers.loading.data import token_windows

        toks = token_windows(lm.tokenizer, cfg.data.source, "heldout", cfg.perplexity.tokens, cfg.perplexity.seq_len)
        r = perplexity(lm.model, toks)
        task = f"{cfg.data.source}-heldout"
        n = r.n_tokens
        # each row says which way its metric improves; the sparsities are measurements (more is more skipped),
        # kept out of the accuracy metrics a front is drawn on
        rows = [{"metric": "ppl", "higher_is_better": False, "value": r.ppl},
                {"metric": "nll", "higher_is_better": False, "value": r.nll, "stderr": r.stderr_nll},
                {"metric": "mlp_sparsity", "higher_is_better": True, "value": stats.mlp_sparsity()},
                {"metric": "head_sparsity", "higher_is_better": True, "value": stats.head_sparsity()},
                {"metric": "input_sparsity", "higher_is_better": True, "value": stats.input_sparsity()},
                {"metric": "weight_skipped", "higher_is_better": True, "value": stats.weight_skipped()},
                {"metric": "all_weight_skipped", "higher_is_better": True,
                 "value": stats.all_weight_skipped(lm.model)}]
        rows += [row for report in stats.reporters for row in report()]     # a predicted head's own rows
        return UnitOutput(accuracy=[{"suite": "perplexity", "task": task, **row, "n": n} for row in rows],
                          summary={"ppl": round(r.ppl, 3), "mlp_sparsity": round(stats.mlp_sparsity(), 3)})

    @staticmethod
    def _task(lm, cfg: TaskEvalConfig) -> UnitOutput:
        """A task's rows; of one shard of the task, its scored requests (no rows yet)."""
        from workers.evals.suites import run_suite, score_shard

        batch_size = EVAL_BATCH_CPU if cfg.batch_size is None else cfg.batch_size
        if cfg.shard is not None:
            k, n = cfg.shard
            sc = score_shard(lm.model, lm.tokenizer, cfg.suite, cfg.limit, k, n, batch_size=batch_size,
                             batch_tokens=cfg.batch_tokens)
            return UnitOutput(scores=[{"request": r, "loglikelihood": v, "greedy": g}
                                      for r, v, g in zip(sc.request, sc.loglikelihood, sc.greedy)],
                              summary={"shard": f"{k + 1}/{n}", "requests": len(sc.request)})
        rows = run_suite(lm.model, lm.tokenizer, [cfg.suite], cfg.limit, batch_size=batch_size,
                         batch_tokens=cfg.batch_tokens, generation=cfg.generation)
        return UnitOutput(accuracy=task_rows(rows), summary={r.metric: round(r.value, 3) for r in rows})

    def assemble(self, unit_id: str, cfg: EvalConfig, shard_scores: list) -> UnitOutput:
        """A task's rows from its shards' scores (``workers.evals.suites.assemble_shards``): the rows the unsharded
        unit (same config, same id) computes, to the bit. Nothing is run on the model; its tokenizer keys the
        task's requests."""
        from workers.evals.suites import assemble_shards

        if not isinstance(cfg, TaskEvalConfig) or cfg.shard is not None:
            raise ValueError(f"unit {unit_id[:12]} is not a task's unit: nothing to assemble")
        lm = self.lm(cfg.model, cfg.model_fp)
        rows = assemble_shards(lm.model, lm.tokenizer, cfg.suite, cfg.limit, shard_scores)
        return UnitOutput(accuracy=task_rows(rows), summary={**{r.metric: round(r.value, 3) for r in rows},
                                                             "shards": len(shard_scores)})

    def latency(self, unit_id: str, cfg: LatencyConfig) -> UnitOutput:
        from workers.decode.latency import bench_decode, bench_llama_cpp, random_plan

        threads = torch.get_num_threads()      # set by run() from the config: what the rows record
        cores = available_cores()
        if self.device == "cpu" and threads > cores:
            log.warning("latency unit %s: %d threads on %d cores of this host (the sweep planned the count from "
                        "the cluster's nodes): its times are oversubscribed", unit_id[:12], threads, cores)
        if cfg.runtime == RUNTIME_LLAMA_CPP:     # the dense setting's baseline: llama.cpp on the model's GGUF
            lm = self.lm(cfg.model, cfg.model_fp)
            if lm.meta.get("kind") != "gguf":
                raise ValueError(f"model {cfg.model} was not loaded from a GGUF file: llama.cpp has nothing to run")
            rows = bench_llama_cpp(lm.model, lm.source, prompt_len=cfg.prompt_len, gen_len=cfg.gen_len,
                                   repeats=cfg.repeats, ours_quantized=cfg.weights == "gguf")
            return UnitOutput(latency=rows, summary={
                "p50_ms": round(rows[0]["p50_ms_per_token"], 2), "threads": threads, "isa": rows[0].get("isa"),
                "speedup_vs_paired_dense": round(rows[1]["p50_ms_per_token"] / rows[0]["p50_ms_per_token"], 3)})
        if is_shape(cfg.model):
            lm = self.lm(cfg.model, cfg.model_fp)
            st = cfg.setting
            plan = None if st.method == DENSE else random_plan(lm.model, st.sparsity, st.attn_sparsity,
                                                                rank=st.rank or 256)
        else:
            lm, b = self._bundle(cfg)
            plan = None if b.manifest["method"] == DENSE and not b.manifest.get("head") else b.plan(lm.model)
        gguf = None
        if cfg.weights == "gguf":        # the GGUF's quantized blocks (orchestrator.plan.gguf_weights)
            if lm.meta.get("kind") != "gguf":
                raise ValueError(f"model {cfg.model} was not loaded from a GGUF file: no quantized blocks to time")
            gguf = lm.source
        rows = bench_decode(lm.model, plan, device=self.device, batch=cfg.batch, prompt_len=cfg.prompt_len,
                            gen_len=cfg.gen_len, repeats=cfg.repeats, runtime=cfg.runtime,
                            paired=cfg.paired and plan is not None, gguf=gguf)
        summary = {"p50_ms": round(rows[0]["p50_ms_per_token"], 2), "threads": threads} if rows else {}
        if rows:
            summary["weights"] = rows[0].get("weights")
            summary["isa"] = rows[0].get("isa")
        if len(rows) == 2:      # sparse and its paired dense
            summary["speedup_vs_paired_dense"] = round(rows[1]["p50_ms_per_token"] / rows[0]["p50_ms_per_token"], 3)
        return UnitOutput(latency=rows, summary=summary)
