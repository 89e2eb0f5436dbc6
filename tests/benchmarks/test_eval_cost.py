"""benchmarks.eval_cost's batchings: how each one scores (known answers) and the refused spellings."""
import pytest

from benchmarks.eval_cost import _batching


def test_a_batching_says_its_size_precision_and_fusion():
    assert _batching("32", "fp32") == {"batch_size": 32}
    assert _batching("32", "tf32") == {"batch_size": 32, "matmul": "tf32"}
    assert _batching("t32768@bf16", "tf32") == {"batch_tokens": 32768, "matmul": "bf16"}
    assert _batching("t32768@fp32+fused", "tf32") == {"batch_tokens": 32768, "fused": True}
    assert _batching("t65536+fused", "tf32") == {"batch_tokens": 65536, "matmul": "tf32", "fused": True}
    assert _batching("128+lmeval", "tf32") == {"batch_size": 128, "matmul": "tf32", "generation": "lm_eval"}
    assert _batching("t32768+lmeval+fused", "fp32") == {"batch_tokens": 32768, "fused": True, "generation": "lm_eval"}
    assert _batching("t32768+eager", "tf32") == {"batch_tokens": 32768, "matmul": "tf32", "masks": "eager"}
    assert _batching("t32768+torchtopk", "fp32") == {"batch_tokens": 32768, "masks": "torchtopk"}


@pytest.mark.parametrize("spec, message", [("t0", "N >= 1"), ("x", "N >= 1"), ("32@fp16", "precision 'fp16'"),
                                           ("32+compiled", r"suffixes are \['eager', 'fused', 'lmeval', 'torchtopk'\]"),
                                           ("32+fused+fused", "each at most once"),
                                           ("32+eager+torchtopk", "one way of making the masks")])
def test_a_wrong_batching_is_refused_by_name(spec, message):
    with pytest.raises(ValueError, match=message):
        _batching(spec, "fp32")


def test_the_masks_options_put_back_the_earlier_masks_and_restore():
    """``+eager``'s baseline: inside the block the oracle and the threshold read their input again, input masks take
    the eager path and top-k is sorted (the same set); ``+torchtopk``'s: only the top-k masks by ``torch.topk``;
    after either, everything is as before."""
    import torch

    from benchmarks.eval_cost import _masks
    from workers.sparsity import input_sparse
    from workers.sparsity.predictors.base import MLPPredictor
    from workers.methods.oracle.predictor import OracleMLP
    from workers.methods.threshold.predictor import GateThreshold

    from workers.sparsity.predictors import base

    before = (OracleMLP.reads_ffn, GateThreshold.reads_ffn, input_sparse._one_pass, base.topk_mask)
    p = MLPPredictor("ffn_in", "topk", 3, 8)
    s = torch.tensor([[0.1, 0.9, 0.3, 0.8, 0.2, 0.7, 0.0, 0.5]])
    fused = p.select(s)
    with _masks("eager"):
        assert not OracleMLP.reads_ffn and not GateThreshold.reads_ffn
        assert input_sparse._one_pass(torch.zeros(2, dtype=torch.float32)) is False
        assert base.topk_mask is not before[3] and torch.equal(p.select(s), fused)
    assert fused[0].tolist() == [False, True, False, True, False, True, False, False]
    assert (OracleMLP.reads_ffn, GateThreshold.reads_ffn, input_sparse._one_pass, base.topk_mask) == before
    with _masks(None):
        assert OracleMLP.reads_ffn
    with _masks("torchtopk"):
        assert OracleMLP.reads_ffn and input_sparse._one_pass is before[2]
        assert base.topk_mask is base.torch_topk_mask and torch.equal(p.select(s), fused)
    assert (OracleMLP.reads_ffn, GateThreshold.reads_ffn, input_sparse._one_pass, base.topk_mask) == before
    with pytest.raises(ValueError, match="masks 'sorted': one of"):
        with _masks("sorted"):
            pass
