"""Running an exported bundle (workers.decode.generate, ``ctxsparse generate``): a real bundle, fitted and saved
by the sweep's own code on a tiny random model saved as a model folder, greedy tokens equal to Hugging Face
``generate`` with the same bundle applied; bad input is one line and exit status 2."""
from __future__ import annotations

import time

import pytest
import torch

from tests.workers.tiny_model_support import tiny_model
from workers.decode.generate import generate_with_plan, run_bundle
from workers.loading.data import TokenSet
from workers.loading.models import load_model
from workers.sparsity.bundle import apply_bundle, load_bundle, save_bundle
from workers.sparsity.capture import capture_activations, sweep_components
from workers.sparsity.predictors import FitContext, fit_method

PROMPT = "The quick brown fox jumps over the lazy dog because"


@pytest.fixture(scope="module")
def tok(smollm2):
    """SmolLM2's tokenizer (the float cache's copy of the GGUF's: parsing the GGUF again takes seconds)."""
    return smollm2.tokenizer


def _model_folder(folder, tok, seed=0):
    """A tiny random Llama (vocabulary resized to SmolLM2's tokenizer) saved as a model folder load_model reads."""
    m = tiny_model("llama", seed=seed)
    torch.manual_seed(seed)
    m.resize_token_embeddings(len(tok), mean_resizing=False)
    m.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def _bundle(lm, root, method, s):
    """What a sweep's fit unit exports: capture on calibration tokens, fit, save_bundle."""
    w = torch.randint(0, lm.model.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0))
    toks = TokenSet(w, "random", "calib", w.numel(), 0, "random-gen-8-32")
    cache = capture_activations(lm, toks, root=root / "acts", progress=False, dtype="float32")
    plan = fit_method(method, FitContext(lm, cache, list(range(lm.dims.n_layers))), s)
    return save_bundle(plan, lm, root / f"{method}-{s}", method=method, sparsity=s)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tok):
    root = tmp_path_factory.mktemp("generate")
    folder = _model_folder(root / "tiny-llama", tok)
    return str(folder), load_model(str(folder)), root


def _hf_greedy(model, bundle, ids, n):
    """HF: the prompt dense (the runtime's prefill), then ``generate`` with the bundle applied for the rest."""
    with torch.no_grad():
        out = model(ids, use_cache=True)
        first = out.logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([ids, first], 1)
        with apply_bundle(model, bundle):
            gen = model.generate(seq, attention_mask=torch.ones_like(seq), past_key_values=out.past_key_values,
                                 max_new_tokens=n - 1, min_new_tokens=n - 1, do_sample=False, pad_token_id=0)
    return gen[0, ids.shape[1]:].tolist()


def test_the_summary_of_a_dense_bundle_says_its_ratio_is_noise():
    from workers.decode.generate import GenerateResult

    def summary(sparsity: dict) -> str:
        return GenerateResult("x", [1, 2, 3], [1, 2, 3], 100.0, 112.0, sparsity, "cpu",
                              {"repeats": 3, "threads": 2, "threads_from": "given"}).summary()

    dense = summary({})
    assert "(1.12x), median of 3 interleaved rounds of 2 decode steps" in dense
    assert dense.endswith("realized sparsity: none; same tokens as dense; the bundle is dense, so the ratio is the "
                          "timing's noise")
    assert summary({"weights": 0.3}).endswith("realized sparsity: weights 0.300; same tokens as dense")


@pytest.mark.parametrize("method, s", [("threshold", 0.5), ("teal", 0.4), ("static", 0.5), ("svd", 0.5)])
def test_bundle_generates_hf_generates_tokens(tiny, method, s):
    ref, lm, root = tiny
    path = _bundle(lm, root, method, s)
    res = run_bundle(ref, path, PROMPT, tokens=10, repeats=1)
    ids = torch.tensor([lm.tokenizer(PROMPT)["input_ids"]])
    assert res.tokens == _hf_greedy(lm.model, path, ids, 10)
    assert len(res.tokens) == 10 and res.dense_tokens_per_s > 0 and res.sparse_tokens_per_s > 0
    key = "weights" if method == "teal" else "mlp"
    if method == "static":          # one fixed top-k set per layer: exactly s
        assert res.realized_sparsity == {key: s}
    else:   # thresholds / biases calibrated to s on 256 tokens, realized on the prompt's (measured within 0.021)
        assert abs(res.realized_sparsity[key] - s) < 0.1, res.realized_sparsity
    assert res.text == lm.tokenizer.decode(res.tokens, skip_special_tokens=True)
    assert "tokens/s on cpu" in res.summary()


@pytest.mark.parametrize("method, options", [("larosa", {"rotate_o": False}), ("rsparse", {"rho": 0.9})])
def test_rotated_and_rank_sparse_bundles_generate_hf_tokens(tiny, method, options):
    """A LaRoSA bundle (rotations folded into the runtime's weights, adapters between layers, each token's top-k)
    and an R-Sparse bundle (low-rank terms beside the input-sparse rows) generate Hugging Face's tokens with the
    bundle applied (o's rotation off: HF's dense prompt pass then leaves the cache in the basis the runtime's
    prefill does)."""
    ref, lm, root = tiny
    w = torch.randint(0, lm.model.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0))
    toks = TokenSet(w, "random", "calib", w.numel(), 0, "random-gen-8-32")
    cache = capture_activations(lm, toks, root=root / "acts-cov", progress=False, dtype="float32",
                                components=sweep_components(["cov"]))
    plan = fit_method(method, FitContext(lm, cache, list(range(lm.dims.n_layers))), 0.4, **options)
    path = save_bundle(plan, lm, root / f"{method}-0.4", method=method, sparsity=0.4)
    res = run_bundle(ref, path, PROMPT, tokens=10, repeats=1)
    ids = torch.tensor([lm.tokenizer(PROMPT)["input_ids"]])
    assert res.tokens == _hf_greedy(lm.model, path, ids, 10)
    assert 0.2 < res.realized_sparsity["weights"] < res.realized_sparsity["inputs"] < 0.5, res.realized_sparsity


def test_bundle_at_s0_runs_the_dense_step(tiny):
    """A plan that keeps everything (threshold at s = 0: t = -1) is run by the dense step: dense tokens."""
    from workers.decode.runtime import DecodeRuntime

    _, lm, root = tiny
    plan = load_bundle(_bundle(lm, root, "threshold", 0.0)).plan(lm.model)
    rt = DecodeRuntime.from_hf(lm.model).set_plan(plan)
    assert rt.sparse_plan.dense and not rt.sparse and rt.plan is plan
    res = generate_with_plan(lm, plan, PROMPT, tokens=8, repeats=1)
    assert res.tokens == res.dense_tokens and res.realized_sparsity == {"mlp": 0.0}


def test_cli_generate_and_its_errors(tiny, tok, tmp_path, capsys):
    from orchestrator.cli import main

    ref, lm, root = tiny
    path = _bundle(lm, root, "threshold", 0.5)
    assert main(["generate", "--model", ref, "--bundle", str(path), "--prompt", PROMPT, "--tokens", "6",
                 "--repeats", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    from kernels.native import describe

    assert out[0] == describe()            # which CPU kernels run, first (`ctxsparse kernels`)
    assert out[2].startswith("tokens/s on cpu") and "dense" in out[2] and "sparse" in out[2]
    other = str(_model_folder(tmp_path / "other", tok, seed=1))
    capsys.readouterr()
    cases = [(["--bundle", str(tmp_path / "missing")], "missing: not a bundle folder"),
             (["--model", other], "fitted on model"),
             (["--prompt", "  "], "empty prompt")]
    for args, msg in cases:
        argv = {"--model": ref, "--bundle": str(path), "--prompt": PROMPT}
        argv.update(dict(zip(args[::2], args[1::2])))
        assert main(["generate", *[x for kv in argv.items() for x in kv]]) == 2
        err = [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]   # (HF's progress bars aside)
        assert len(err) == 1 and err[0].startswith("ctxsparse generate: error:") and msg in err[0], err


def test_a_head_bundle_generates_and_its_candidates_change_without_a_refit(tiny, capsys):
    """A predicted head's bundle (the dense decoder with the head) on the runtime: ``--head-candidates all`` is the
    dense head (the dense tokens), a smaller K runs the head; a bundle without a head refuses the flag."""
    from orchestrator.cli import main
    from workers.methods.head.fit import fit_head
    from workers.sparsity.predictors import SparsityPlan

    ref, lm, root = tiny
    w = torch.randint(0, lm.model.config.vocab_size, (8, 32), generator=torch.Generator().manual_seed(0))
    cache = capture_activations(lm, TokenSet(w, "random", "calib", w.numel(), 0, "random-head-8-32"),
                                components=("final",), root=root / "head-acts", progress=False, dtype="float32")
    head, _ = fit_head(FitContext(lm, cache, [0, 1]), rank=16, candidates=64)
    path = save_bundle(SparsityPlan(parts=[head]), lm, root / "head", method="dense", sparsity=0.0,
                       head={"rank": 16, "candidates": 64, "screen": "hidden"})
    dense = run_bundle(ref, path, PROMPT, tokens=8, repeats=1, head_candidates="all")
    assert dense.tokens == dense.dense_tokens
    res = run_bundle(ref, path, PROMPT, tokens=8, repeats=1, head_candidates=256)
    assert len(res.tokens) == 8 and res.sparse_tokens_per_s > 0
    other = _bundle(lm, root, "threshold", 0.5)
    assert main(["generate", "--model", ref, "--bundle", str(other), "--prompt", PROMPT,
                 "--head-candidates", "64"]) == 2
    assert "no predicted head to set the candidates of" in capsys.readouterr().err


@pytest.mark.slow       # SmolLM2 decodes a few tokens/s on a 2-core CPU; the tiny-model tests above check the same
def test_smollm2_teal_bundle(smollm2, tmp_path):
    """The real SmolLM2-135M with a TEAL bundle: the runtime's greedy tokens are HF generate's with the bundle."""
    t0 = time.time()
    path = _bundle(smollm2, tmp_path, "teal", 0.4)
    prompt = "The capital of France is"
    res = run_bundle("smollm2-135m", path, prompt, tokens=8, repeats=1)
    ids = torch.tensor([smollm2.tokenizer(prompt)["input_ids"]])
    assert res.tokens == _hf_greedy(smollm2.model, path, ids, 8)
    assert 0.2 < res.realized_sparsity["weights"] < 0.6 and res.text.strip()
    # a GGUF model decodes the file's blocks by default (dense and TEAL alike); "float" the float weights
    assert res.extra["weights"] == res.extra["sparse_weights"] == "gguf:Q4_1" and "gguf:Q4_1" in res.summary()
    flt = run_bundle("smollm2-135m", path, prompt, tokens=8, repeats=1, weights="float")
    assert flt.extra["weights"] == "fp32" and flt.tokens == res.tokens
    print(f"smollm2 generate test {time.time() - t0:.1f}s: {res.text!r}\n{res.summary()}")


def _set_threads_spy(monkeypatch) -> list[int]:
    """The counts ``torch.set_num_threads`` is called with (it still sets them)."""
    calls, real = [], torch.set_num_threads

    def spy(n):
        calls.append(n)
        real(n)
    monkeypatch.setattr(torch, "set_num_threads", spy)
    return calls


def test_generate_runs_at_the_count_the_sweep_timed_the_setting_at(tiny, tmp_path, monkeypatch):
    """A bundle without a measurement (exported before it was recorded) runs on every core; one whose manifest
    says it was timed at 1 thread on the CPU runs at 1; ``threads`` given wins; a measurement on another device
    type does not count for the CPU. The count is restored after and said in the summary."""
    from workers.host import available_cores
    from workers.sparsity.bundle import measured_threads, with_measurement

    ref, lm, root = tiny
    path = _bundle(lm, tmp_path, "threshold", 0.5)
    assert "measured" not in load_bundle(path).manifest
    calls = _set_threads_spy(monkeypatch)
    res = run_bundle(ref, path, PROMPT, tokens=4, repeats=1)
    cores = available_cores()
    assert res.extra["threads"] == cores and calls[0] == cores and torch.get_num_threads() == 1    # restored
    assert f"at {cores} thread" in res.summary() and "(every core)" in res.summary()
    b = with_measurement(path, {"device_type": "cpu", "threads": 1, "p50_ms_per_token": 2.0})
    assert measured_threads(b.manifest) == 1 and measured_threads(b.manifest, "cuda") is None
    assert load_bundle(path).manifest["measured"]["threads"] == 1           # digest re-made: still verifies
    calls.clear()
    res = run_bundle(ref, path, PROMPT, tokens=4, repeats=1)
    assert res.extra["threads"] == 1 and calls[0] == 1
    assert "at 1 thread (the count the sweep timed this setting at)" in res.summary()
    calls.clear()
    res = run_bundle(ref, path, PROMPT, tokens=4, repeats=1, threads=3)
    assert res.extra["threads"] == 3 and calls[0] == 3 and "at 3 threads (given)" in res.summary()
    with_measurement(path, {"device_type": "cuda", "threads": 1})
    assert run_bundle(ref, path, PROMPT, tokens=4, repeats=1).extra["threads"] == cores


def test_bundle_measurement_is_checked(tiny, tmp_path):
    from workers.sparsity.bundle import BundleError, with_measurement

    _, lm, _ = tiny
    path = _bundle(lm, tmp_path, "threshold", 0.5)
    for bad in (0, 1.5, True, "2"):
        with pytest.raises(BundleError, match="measured threads"):
            with_measurement(path, {"device_type": "cpu", "threads": bad})
    with pytest.raises(BundleError, match="not plain JSON"):
        with_measurement(path, {"device_type": "cpu", "threads": 1, "x": float("nan")})
    assert "measured" not in load_bundle(path).manifest                        # nothing written


def test_cli_generate_prints_the_thread_count(tiny, tmp_path, capsys):
    from orchestrator.cli import main
    from workers.sparsity.bundle import with_measurement

    ref, lm, _ = tiny
    path = _bundle(lm, tmp_path, "threshold", 0.5)
    with_measurement(path, {"device_type": "cpu", "threads": 1})
    argv = ["generate", "--model", ref, "--bundle", str(path), "--prompt", PROMPT, "--tokens", "4", "--repeats", "1"]
    assert main(argv) == 0
    assert "at 1 thread (the count the sweep timed this setting at)" in capsys.readouterr().out
    assert main(argv + ["--threads", "2"]) == 0
    assert "at 2 threads (given)" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(argv + ["--threads", "0"])
    assert e.value.code == 2 and "a thread count >= 1" in capsys.readouterr().err
