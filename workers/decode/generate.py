"""Run a bundle: greedy text generation with the decode runtime, and its tokens/s dense vs sparse.

    res = run_bundle("smollm2-135m", "bundles/smollm2-teal-s0.4", "The capital of France is", tokens=32)
    print(res.text); print(res.summary())

or, with a model already loaded (``workers.loading.models.LoadedModel``) and a verified bundle:

    res = generate_with_plan(lm, load_bundle(path).plan(lm.model), prompt, tokens=32, device="cpu")

The prompt is prefilled dense and ``tokens`` tokens are decoded greedily with the plan (the runtime's
semantics; see workers.decode.runtime). Timing (workers.decode.timing): a dense and a sparse runtime over the
same weights decode the same prompt alternately (the order flips every round, one warm-up round first),
``repeats`` timed rounds each; tokens/s = decode steps / their summed step times, the median over the rounds. On
the CPU the dense products take the faster of torch matmuls and the row kernels (``pick_cpu_dense``), for both
runtimes.

Weights (CPU): a model loaded from a GGUF decodes the file's quantized blocks (the fastest dense path there; the
plan too where the quantized runtime takes it: input sparsity, FFN and head predictors); for a bundle, by default
what its setting was timed on in the sweep (the manifest's ``measured`` record); ``weights="float"`` keeps the
float weights.

Threads: ``threads`` if given; else, for a bundle, the count its setting was timed at in the sweep (the manifest's
``measured`` record, written by ``bundle export``), so the sweep's latency row and this run measure the same thing;
else every core of this process (``workers.host.available_cores``). The count is set for the run, restored after,
and reported (``extra["threads"]``, ``extra["threads_from"]``, the summary).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

import torch

from workers.decode.runtime import DecodeRuntime, runs_on_blocks
from workers.decode.timing import interleaved, pick_cpu_dense, step_times
from workers.decode.weights import from_hf
from workers.host import available_cores


@dataclass
class GenerateResult:
    text: str                          # the continuation (up to the first end-of-sequence token)
    tokens: list[int]                  # every generated token id (sparse runtime)
    dense_tokens: list[int]
    dense_tokens_per_s: float
    sparse_tokens_per_s: float
    realized_sparsity: dict
    device: str
    extra: dict = field(default_factory=dict)

    @property
    def speedup(self) -> float:
        return self.sparse_tokens_per_s / self.dense_tokens_per_s

    def summary(self) -> str:
        """Two lines: tokens/s dense vs sparse (and where the greedy tokens first differ from dense)."""
        same = next((i for i, (a, b) in enumerate(zip(self.tokens, self.dense_tokens)) if a != b), None)
        agree = "same tokens as dense" if same is None else f"first differs from dense at token {same}"
        sp = ", ".join(f"{k} {v:.3f}" for k, v in sorted(self.realized_sparsity.items())) or "none"
        t = self.extra.get("threads")
        at = f" at {t} thread{'' if t == 1 else 's'} ({self.extra.get('threads_from')})" if t else ""
        wd, ws = self.extra.get("weights"), self.extra.get("sparse_weights")
        on = f", {wd}" + (f" (sparse: {ws})" if ws and ws != wd else "") if wd else ""
        # a dense bundle (the CPU front's fastest is often dense): both runs are one model, the ratio is noise
        noise = "" if self.realized_sparsity else "; the bundle is dense, so the ratio is the timing's noise"
        return (f"tokens/s on {self.device} ({self.extra.get('accelerator', '')}{on}){at}: dense "
                f"{self.dense_tokens_per_s:.1f}, sparse {self.sparse_tokens_per_s:.1f} ({self.speedup:.2f}x), "
                f"median of {self.extra.get('repeats')} interleaved rounds of {len(self.tokens) - 1} decode steps\n"
                f"realized sparsity: {sp}; {agree}{noise}")


def _device(device: str) -> torch.device:
    dev = torch.device(device)
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be cpu or cuda, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device cuda: no CUDA device on this machine")
    return dev


def run_bundle(model: str, bundle, prompt: str, *, tokens: int = 32, device: str = "cpu", repeats: int = 3,
               dtype: torch.dtype | None = None, threads: int | None = None, weights: str = "auto",
               head_candidates=None) -> GenerateResult:
    """Load the model ``model`` (a workers.loading ref) and the bundle folder ``bundle`` (it must have been fitted
    on that model: same fingerprint), then :func:`generate_with_plan` at ``threads`` (default: the count the
    bundle's setting was timed at, else every core; module docstring). Bad input (empty prompt, a missing or
    damaged bundle, a bundle of another model, no such device, a thread count below 1) raises ValueError
    (BundleError is one) with one line saying what is wrong, before the model is loaded where it can.
    ``head_candidates``: the predicted head's candidate count for this run (an int or ``"all"``: the dense head;
    no refit), for a bundle that has one."""
    from workers.loading.models import load_model
    from workers.sparsity.bundle import MEASURED, BundleError, load_bundle, measured_threads

    _check_prompt(prompt, tokens, repeats, threads)
    _check_weights(weights)
    dev = _device(device)
    b = load_bundle(bundle)
    source = "given"
    if threads is None and (threads := measured_threads(b.manifest, dev.type)) is not None:
        source = "the count the sweep timed this setting at"
    if weights == "auto":                   # what the sweep's latency row read, where the bundle records it
        m = b.manifest.get(MEASURED)
        was = m.get("weights") if isinstance(m, dict) and m.get("device_type") == dev.type else None
        weights = "gguf" if str(was).startswith("gguf:") else "float" if was else "auto"
    lm = load_model(model)
    if lm.fingerprint != b.fingerprint:
        raise BundleError(f"{b.path}: fitted on model {b.manifest['model']['ref']} (fingerprint "
                          f"{b.fingerprint[:12]}), model {model} has fingerprint {lm.fingerprint[:12]}")
    plan = b.plan(lm.model)
    if head_candidates is not None:
        plan = with_head_candidates(plan, head_candidates, b.path)
    return generate_with_plan(lm, plan, prompt, tokens=tokens, device=device, repeats=repeats,
                              dtype=dtype, threads=threads, threads_from=source if threads is not None else None,
                              weights=weights)


def with_head_candidates(plan, k, where="the bundle"):
    """``plan`` with its predicted head's candidate count set to ``k`` (an int, or ``"all"``)."""
    from workers.sparsity.bundle import BundleError

    head = plan.part("head")
    if head is None:
        raise BundleError(f"{where}: no predicted head to set the candidates of")
    plan.parts = [head.with_candidates(k) if p is head else p for p in plan.parts]
    return plan


def _check_prompt(prompt: str, tokens: int, repeats: int, threads: int | None = None) -> None:
    if not prompt or not prompt.strip():
        raise ValueError("empty prompt: give the text to continue")
    if tokens < 2:
        raise ValueError(f"tokens must be >= 2 (the first comes from the prefill), got {tokens}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")
    if threads is not None and (isinstance(threads, bool) or not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads must be a count >= 1, got {threads!r}")


WEIGHTS = ("auto", "gguf", "float")


def _check_weights(weights: str) -> None:
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")


def generate_with_plan(lm, plan, prompt: str, *, tokens: int = 32, device: str = "cpu", repeats: int = 3,
                       dtype: torch.dtype | None = None, threads: int | None = None,
                       threads_from: str | None = None, weights: str = "auto") -> GenerateResult:
    """Greedy continuation of ``prompt`` with ``plan`` on the decode runtime, and tokens/s dense vs sparse, at
    ``threads`` torch threads (default: every core; ``threads_from`` says where the count came from, for the
    summary). ``dtype``: the runtime's (default float32 on the CPU, float16 on CUDA). ``weights`` (CPU): "gguf"
    the GGUF's quantized blocks (a model loaded from a GGUF: dense, and the plan where the quantized runtime
    takes it, ``runs_on_blocks``: input sparsity, FFN and head predictors; another plan runs over the float
    weights beside that dense), "float" the float weights, "auto" the blocks where the model has a GGUF."""
    _check_prompt(prompt, tokens, repeats, threads)
    _check_weights(weights)
    if threads is None:
        threads, threads_from = available_cores(), "every core"
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        res = _generate(lm, plan, prompt, tokens, device, repeats, dtype, weights)
    finally:
        torch.set_num_threads(before)
    res.extra.update(threads=threads, threads_from=threads_from or "given")
    return res


@torch.no_grad()
def _generate(lm, plan, prompt: str, tokens: int, device: str, repeats: int, dtype, weights: str) -> GenerateResult:
    from workers.decode.latency import accelerator_name, weights_name

    dev = _device(device)
    ids = torch.tensor([lm.tokenizer(prompt)["input_ids"]], dtype=torch.long)
    if ids.shape[1] == 0:
        raise ValueError("the prompt has no tokens")
    n_pos = getattr(lm.model.config, "max_position_embeddings", None)
    if n_pos is not None and ids.shape[1] + tokens > n_pos:
        raise ValueError(f"prompt ({ids.shape[1]} tokens) + {tokens} new tokens > the model's {n_pos} positions")
    dtype = dtype or (torch.float16 if dev.type == "cuda" else torch.float32)
    has_gguf = lm.meta.get("kind") == "gguf"
    if weights == "gguf" and (dev.type != "cpu" or not has_gguf):
        raise ValueError("weights gguf: the GGUF's quantized blocks decode on the CPU, for a model loaded from a "
                         "GGUF file")
    quant = dev.type == "cpu" and has_gguf and weights != "float"
    if quant:
        from workers.decode.quant_weights import from_gguf

        wq = from_gguf(lm.model, lm.source)
        dense = DecodeRuntime(wq)
        takes = runs_on_blocks(plan)
        sparse = DecodeRuntime(wq) if takes else DecodeRuntime(from_hf(lm.model, dtype=dtype, device=dev))
        if not takes:
            sparse.configure(cpu_rows=pick_cpu_dense(sparse))
    else:
        w = from_hf(lm.model, dtype=dtype, device=dev)
        dense, sparse = DecodeRuntime(w), DecodeRuntime(w)
        if dev.type == "cpu":
            sparse.configure(cpu_rows=pick_cpu_dense(dense))
    sparse.set_plan(plan)           # after pick_cpu_dense: the runtimes share the weights' layouts
    for rt in (dense, sparse):
        rt.setup(1, ids.shape[1] + tokens)
    out = {}

    def run(rt, r: int) -> float:   # round 0 warms up (compiles, captures the CUDA graphs)
        rt.prefill(ids)
        first = rt.tok.clone()
        ms = sum(step_times(rt, tokens - 1))
        out[id(rt)] = torch.cat([first, rt.out_tokens[0, ids.shape[1]: ids.shape[1] + tokens - 1]]).tolist()
        return ms
    tps = [(tokens - 1) * 1e3 / statistics.median(ms) for ms in interleaved([dense, sparse], repeats, run)]
    toks = out[id(sparse)]
    eos = lm.tokenizer.eos_token_id
    shown = toks[: toks.index(eos)] if eos is not None and eos in toks else toks
    return GenerateResult(text=lm.tokenizer.decode(shown, skip_special_tokens=True), tokens=toks,
                          dense_tokens=out[id(dense)], dense_tokens_per_s=tps[0],
                          sparse_tokens_per_s=tps[1], realized_sparsity=sparse.realized_sparsity(),
                          device=dev.type, extra={"accelerator": accelerator_name(dev), "repeats": repeats,
                                                  "prompt_tokens": ids.shape[1], "dtype": str(dtype),
                                                  "weights": weights_name(dense),
                                                  "sparse_weights": weights_name(sparse)})
