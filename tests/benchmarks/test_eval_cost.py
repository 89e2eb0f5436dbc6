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


@pytest.mark.parametrize("spec, message", [("t0", "N >= 1"), ("x", "N >= 1"), ("32@fp16", "precision 'fp16'"),
                                           ("32+compiled", r"suffixes are \['fused', 'lmeval'\]"),
                                           ("32+fused+fused", "each at most once")])
def test_a_wrong_batching_is_refused_by_name(spec, message):
    with pytest.raises(ValueError, match=message):
        _batching(spec, "fp32")
