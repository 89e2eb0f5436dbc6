"""A top-k mask in one pass (kernels.topk_mask_triton, through the interpreter on the CPU): the set of a stable
descending sort (equal scores in column order), so ``torch.topk``'s wherever a row's k-th largest score is unique;
and what the oracle's masked FFN selects with, whose logits stay the same."""
import pytest
import torch

from tests.kernels.kernel_support import logits_on_each_backend, rnd


def _topk(s, k):
    m = torch.zeros_like(s, dtype=torch.bool)
    if k:
        m.scatter_(1, s.topk(k, dim=1).indices, True)
    return m


@pytest.mark.parametrize("n", [37, 1536])
def test_the_one_pass_mask_is_the_top_k_set(n, device, gen):
    from kernels.topk_mask_triton import reference_topk_mask, topk_mask

    s = rnd((9, n), gen, torch.float32, device, 3.0)
    for k in sorted({0, 1, n // 3, n // 2, n - 1, n}):
        got = topk_mask(s, k)
        assert got.dtype == torch.bool and got.shape == s.shape
        assert torch.equal(got, reference_topk_mask(s, k)) and torch.equal(got, _topk(s, k))
        assert got.sum(1).tolist() == [k] * 9
    # ties, signed zeros, infinities: all above the k-th largest, then equal ones by column, k in all
    t = torch.tensor([[1.0, 2.0, 2.0, 2.0, 0.0, -0.0, 3.0, -1.0, float("inf"), -float("inf"), 2.0]], device=device)
    for k in range(t.shape[1] + 1):
        assert torch.equal(topk_mask(t, k), reference_topk_mask(t, k)), k
    assert topk_mask(t, 3)[0].nonzero().flatten().tolist() == [1, 6, 8]
    assert topk_mask(t, 8)[0].nonzero().flatten().tolist() == [0, 1, 2, 3, 4, 6, 8, 10]
    assert topk_mask(t, 9)[0, 5] and not topk_mask(t, 9)[0, 9]      # -0.0 ties 0.0, column order
    wide = s[:, : n - 5].contiguous()
    assert torch.equal(topk_mask(s[:, : n - 5], 4), topk_mask(wide, 4))    # a strided view is read as its values
    assert topk_mask(s[:0], 3).shape == (0, n)


def test_bad_input_is_refused(device):
    from kernels.topk_mask_triton import MAX_N, topk_mask

    with pytest.raises(ValueError, match="float32 scores"):
        topk_mask(torch.ones(2, 8, dtype=torch.float16, device=device), 2)
    with pytest.raises(ValueError, match="float32 scores"):
        topk_mask(torch.ones(8, device=device), 2)
    with pytest.raises(ValueError, match=r"0 <= k <= 8, got 9"):
        topk_mask(torch.ones(2, 8, device=device), 9)
    with pytest.raises(ValueError, match=f"at most {MAX_N} scores"):
        topk_mask(torch.ones(1, MAX_N + 1, device=device), 2)


def test_the_oracles_masked_ffn_uses_it_and_keeps_its_logits(monkeypatch):
    """A tiny Llama with the oracle at s = 0.5 on every layer, masked mode (a scoring forward): with
    ``CTXSPARSE_KERNELS=triton`` every layer's mask comes from the one-pass kernel, and the logits equal the eager
    top-k's bit for bit."""
    from kernels import topk_mask_triton as K
    from tests.workers.tiny_model_support import tiny_model
    from workers.loading.adapters import adapter_for
    from workers.sparsity.predictors.base import SparsityPlan, k_for
    from workers.methods.oracle.predictor import OracleMLP
    from workers.sparsity.sparse_exec import apply_sparsity

    model = tiny_model("llama")
    ad = adapter_for(model)
    act = ad.act_name(model.config)
    plan = SparsityPlan()
    for l, layer in enumerate(ad.decoder_layers(model)):
        w = ad.ffn_weights(layer)
        plan.mlp[l] = OracleMLP(w, act, k_for(0.5, w["up"].shape[0]))
    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    out, calls = logits_on_each_backend(monkeypatch, model, ids, K, "topk_mask",
                                        lambda: apply_sparsity(model, plan, mode="masked"))
    assert calls == len(plan.mlp)                                  # every layer, triton only
    assert torch.equal(out["cpu"], out["triton"])
    with torch.no_grad():
        assert (model(input_ids=ids).logits - out["cpu"]).abs().max() > 1e-3    # and the mask did something


def test_the_benchmark_times_the_masks_and_checks_they_agree(tmp_path, capsys):
    """``benchmarks.topk_mask`` on this CPU (the kernel through the interpreter, tiny shapes): one row per way and
    shape in the alternating order, every way's mask equal to torch.topk's, the ratios reported, the file written."""
    import json

    from benchmarks.topk_mask import main

    out = tmp_path / "topk.json"
    assert main(["--device", "cpu", "--tokens", "8", "--widths", "96,40", "--keep", "0.5,0.3", "--reps", "2",
                 "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    ways, back = ["torch_topk", "one_pass", "kthvalue"], ["kthvalue", "one_pass", "torch_topk"]
    assert [(r["op"], r["shape"], r["extra"]["k"]) for r in doc["rows"]] == [
        *[(w, "8x96", 48) for w in ways], *[(w, "8x96", 29) for w in back],
        *[(w, "8x40", 20) for w in ways], *[(w, "8x40", 12) for w in back]]
    assert all(r["extra"]["equal"] and r["median"] > 0 and r["extra"]["x_torch_topk"] > 0 for r in doc["rows"])
    assert all(r["extra"]["x_torch_topk"] == 1.0 for r in doc["rows"] if r["op"] == "torch_topk")
    assert "8x96 k=48     torch_topk" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--keep", "1.5"])


def test_the_benchmark_refuses_a_cpu_without_the_interpreter(monkeypatch, capsys):
    from benchmarks.topk_mask import main

    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(SystemExit):
        main(["--device", "cpu"])
    assert "runs on CUDA, or on cpu under TRITON_INTERPRET=1" in capsys.readouterr().err
