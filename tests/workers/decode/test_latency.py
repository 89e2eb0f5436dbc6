"""Paired CPU timing: a sparse plan and dense decode the same prompts alternately in one process."""
import pytest
import torch

from tests.workers.tiny_model_support import tiny_model
from workers.decode.latency import bench_decode, random_plan
from workers.names import RUNTIME_DENSE_PAIRED, RUNTIME_SPARSE


def test_sparse_plan_on_the_cpu_is_timed_with_its_paired_dense():
    m = tiny_model("llama")
    rows = bench_decode(m, random_plan(m, 0.5, rank=8), batch=1, prompt_len=8, gen_len=5, repeats=3)
    assert [r["runtime"] for r in rows] == [RUNTIME_SPARSE, RUNTIME_DENSE_PAIRED]
    sparse, dense = rows
    assert sparse["realized_sparsity"] == 0.5 and dense["realized_sparsity"] is None    # batch 1: top-k keeps k
    assert all(r["p50_ms_per_token"] > 0 and r["gen_len"] == 5 for r in rows)


def test_interleaved_flips_the_order_every_round_and_drops_the_warm_up():
    from workers.decode.timing import interleaved

    seen = []
    kept = interleaved(["a", "b"], 3, lambda arm, r: seen.append((arm, r)) or f"{arm}{r}", warmup=1)
    assert seen == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2), ("b", 3), ("a", 3)]
    assert kept == [["a1", "a2", "a3"], ["b1", "b2", "b3"]]


def test_pairs_alternate_and_decode_the_same_prompts(monkeypatch):
    """Every repeat decodes one prompt with both plans, the order flipping each repeat (warm-up included); only
    the timed repeats' steps make the row."""
    from workers.decode.runtime import DecodeRuntime

    m = tiny_model("llama")
    plan = random_plan(m, 0.5, rank=8)
    seen = []
    real = DecodeRuntime.prefill

    def spy(self, ids):
        seen.append(("sparse" if self.plan is not None else "dense", ids.clone()))
        return real(self, ids)

    monkeypatch.setattr(DecodeRuntime, "prefill", spy)
    rows = bench_decode(m, plan, batch=1, prompt_len=6, gen_len=3, repeats=2, warmup=1, detail=True)
    assert [s[0] for s in seen[-6:]] == ["sparse", "dense", "dense", "sparse", "sparse", "dense"]
    seen = seen[-6:]             # (before them: the dense path's pick on the CPU)
    for i in range(0, 6, 2):
        assert torch.equal(seen[i][1], seen[i + 1][1])       # one prompt per repeat, both plans
    assert not torch.equal(seen[0][1], seen[2][1])
    assert all(r["repeats"] == 2 and r["mean_ms_per_token"] > 0 for r in rows)


def test_paired_needs_a_plan_and_is_off_without_one():
    m = tiny_model("llama")
    with pytest.raises(ValueError, match="paired timing needs a sparse plan"):
        bench_decode(m, None, prompt_len=4, gen_len=3, repeats=1, paired=True)
    assert [r["runtime"] for r in bench_decode(m, None, prompt_len=4, gen_len=3, repeats=1)] == ["ctxsparse-dense"]


def test_cpu_latency_picks_the_faster_dense_path_once_and_keeps_the_plan():
    from workers.decode.runtime import DecodeRuntime
    from workers.decode.timing import pick_cpu_dense

    m = tiny_model("llama")
    plan = random_plan(m, 0.5, rank=8)
    rt = DecodeRuntime.from_hf(m).set_plan(plan)
    assert rt.cpu_rows is None
    picked = pick_cpu_dense(rt, steps=2, rounds=1)
    assert isinstance(picked, bool) and rt.cpu_rows is picked and rt.plan is plan and rt.sparse
    rows = bench_decode(rt, plan, prompt_len=4, gen_len=3, repeats=1)
    assert rt.cpu_rows is picked and [r["runtime"] for r in rows] == [RUNTIME_SPARSE, RUNTIME_DENSE_PAIRED]


def test_hf_static_cache_baseline():
    """HF generate with a static cache (the baseline HF can compile) gives a row; compiling needs that cache."""
    from workers.names import RUNTIME_HF

    m = tiny_model("llama")
    r = bench_decode(m, None, prompt_len=6, gen_len=4, repeats=1, runtime="hf-generate", hf_cache="static",
                     detail=True)[0]
    assert r["runtime"] == RUNTIME_HF and r["hf_cache"] == "static" and r["hf_compile"] is False
    assert r["p50_ms_per_token"] > 0
    with pytest.raises(ValueError, match="needs hf_cache='static'"):
        bench_decode(m, None, prompt_len=6, gen_len=4, repeats=1, runtime="hf-generate", hf_compile=True)


def test_calibrated_input_plan_realizes_its_sparsity_in_the_runtime():
    """Thresholds read from one prefill's projection inputs: decoding random tokens on the same model skips about
    that fraction of every projection's inputs (inputs of a decode step are like the prefill's)."""
    from tests.workers.tiny_model_support import tiny_model
    from workers.decode.latency import calibrated_input_plan
    from workers.decode.runtime import DecodeRuntime

    m = tiny_model("llama")
    plan = calibrated_input_plan(m, 0.5, n_tokens=48)
    assert set(plan.inputs) == {0, 1} and set(plan.inputs[0]) == {"q", "k", "v", "o", "gate", "up", "down"}
    rt = DecodeRuntime.from_hf(m, dtype=torch.float32, device="cpu")
    rt.set_plan(plan)
    ids = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(3))
    rt.generate(ids, 16)
    realized = rt.realized_sparsity()
    assert 0.35 < realized["inputs"] < 0.65, realized      # every projection is input-sparse: weights = inputs
    assert realized["weights"] == pytest.approx(realized["inputs"])


def test_decode_bytes_of_known_dims_charge_the_predictors():
    """Bytes of one decode step of the tiny Llama (fp32; d 48, D 80, 2 layers, 4 heads of 12, 2 KV heads, vocab
    128, untied head): dense 2·(3·48·80 + 2·4·12·48 + 2·2·12·48)·4 + 128·48·4 = 172,032. At MLP 0.5, heads 0.25,
    rank 8 and 10 cached positions: weights 2·(5,760 + 3,456 + 2,304)·4 + 24,576 = 116,736; the predictors
    2·(8·(48 + 80) + 8·(48 + 4))·4 = 11,520, read every step; the KV cache 2·2·2·12·10·4 = 3,840."""
    from workers.decode.latency import decode_bytes
    from workers.decode.runtime import DecodeRuntime

    rt = DecodeRuntime.from_hf(tiny_model("llama"))
    assert decode_bytes(rt) == dict(weights=172_032, predictor=0, kv_cache=0, total=172_032)
    assert decode_bytes(rt, 0.5, 0.25, rank=8, context=10) == dict(weights=116_736, predictor=11_520, kv_cache=3_840,
                                                                   total=132_096)


def test_cpu_rows_say_fallback_where_the_native_kernels_did_not_run_and_accelerator_rows_record_no_build(
        monkeypatch):
    """With the native kernels off (``CTXSPARSE_CPU_NATIVE=0``, as where they do not build) the torch primitives
    time the decode and the rows say ``fallback``, with the CPU's flags still; a GPU/NPU row records no CPU build."""
    from kernels.isa import cpu_info
    from workers.decode.latency import cpu_build

    monkeypatch.setenv("CTXSPARSE_CPU_NATIVE", "0")
    m = tiny_model("llama")
    rows = bench_decode(m, random_plan(m, 0.5, rank=8), batch=1, prompt_len=4, gen_len=3, repeats=1)
    assert [(r["isa"], r["cpu_flags"]) for r in rows] == [("fallback", cpu_info()["cpu_flags"])] * 2
    assert cpu_build("cuda") == {"cpu_flags": None, "isa": None}
    monkeypatch.delenv("CTXSPARSE_CPU_NATIVE")
    assert cpu_build("cpu") == {"cpu_flags": cpu_info()["cpu_flags"], "isa": cpu_info()["isa"]}
