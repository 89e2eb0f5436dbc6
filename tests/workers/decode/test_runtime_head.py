"""The predicted head on the decode runtime (workers.methods.head.runtime): the candidates' logits are the dense
head's to the bit on every head format (fp32 rows, Q8_0 as SmolLM2's and Gemma-3's, Q6_K and Q4_K as K-quant
GGUFs'), the next token is the dense one wherever the candidates hold the dense argmax, and K = all is the dense
head. Each case runs on one instruction-set build (tests/kernels/isa_support.py)."""
from __future__ import annotations

import pytest
import torch

from tests.workers.decode.test_native_layer import _decode_logits, _quantized, _tiny
from workers.decode.runtime import DecodeRuntime
from workers.decode.weights import from_hf
from workers.methods.head.part import PredictedHead
from kernels.reference import HeadScreen
from workers.methods.head.runtime import RuntimeHead
from workers.methods.head.screen import fit_screen
from workers.sparsity.predictors.base import SparsityPlan

pytestmark = pytest.mark.usefixtures("cpu_isa")
LAYER_FORMATS = ("Q4_1",) * 7


def _wide():
    """A 1-layer random Llama whose hidden size (256) holds a K-quant block."""
    import transformers as tf

    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(tf.LlamaConfig(
        vocab_size=128, hidden_size=256, num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
        head_dim=64, intermediate_size=256, max_position_embeddings=64)).eval()


def _weights(fmt: str):
    model = _wide() if fmt.endswith("_K") else _tiny("llama")
    if fmt == "F32":
        return from_hf(model, torch.float32, "cpu")
    return _quantized(model, "llama", formats=LAYER_FORMATS + (fmt,))


def _part(w, rank: int, k, seed: int = 0) -> PredictedHead:
    """A screen fitted on random states for the runtime's own head (its dequantized values)."""
    from kernels import cpu_quant
    from kernels.quant import QuantWeight

    head = cpu_quant.dequantize(w.lm_head) if isinstance(w.lm_head, QuantWeight) else w.lm_head
    h = torch.randn(500, head.shape[1], generator=torch.Generator().manual_seed(seed))
    p, s = fit_screen(h, head, rank)
    return PredictedHead(p=p, s=s, candidates=k)


class _Record:
    """Wraps a RuntimeHead: records each step's input, candidates and token."""

    def __init__(self, head: RuntimeHead):
        self.head, self.seen = head, []

    def __call__(self, blocks, h, keep_logits):
        tok, logits = self.head(blocks, h, keep_logits)
        _, _, idx = self.head.screen(blocks, h)
        self.seen.append((h.clone(), idx, tok))
        return tok, logits


@pytest.mark.every_isa
@pytest.mark.parametrize("fmt", ["F32", "Q8_0", "Q6_K", "Q4_K"])
def test_candidate_logits_are_the_dense_heads_bit_for_bit(fmt):
    w = _weights(fmt)
    rt = DecodeRuntime(w, cpu_rows=True)           # fp32: the CPU row kernels, as CPU decode runs them
    part = _part(w, 32, 24)
    rt.set_plan(SparsityPlan(parts=[part]))
    head = rt.sparse_plan.head
    assert isinstance(head, RuntimeHead)
    assert isinstance(head.s, HeadScreen)             # int8 tiles on the CPU whatever the head's format
    h = torch.randn(3, w.dims.d, generator=torch.Generator().manual_seed(2))
    dense = rt.blocks.logits(h)
    _, est, idx = head.screen(rt.blocks, h)
    assert idx.shape == (3, 24)
    exact = head.rows(rt.blocks, h, idx)
    assert torch.equal(exact.view(torch.int32), dense.gather(1, idx).view(torch.int32)), fmt
    tok, logits = head(rt.blocks, h, True)
    assert torch.equal(logits.gather(1, idx), dense.gather(1, idx))
    assert torch.equal(tok, idx.gather(1, exact.argmax(-1, keepdim=True))[:, 0])


@pytest.mark.parametrize("fmt", ["F32", "Q8_0"])
def test_greedy_tokens_are_dense_wherever_the_candidates_hold_the_argmax(fmt):
    w = _weights(fmt)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(1))
    dense = DecodeRuntime(w, cpu_rows=True)
    want = _decode_logits(dense, ids, 8).argmax(-1)
    rt = DecodeRuntime(w, cpu_rows=True)
    rt.set_plan(SparsityPlan(parts=[_part(w, 64, 8)]))          # a full-rank screen: the argmax is always kept
    got = _decode_logits(rt, ids, 8)
    assert torch.equal(got.argmax(-1), want)
    rt.set_plan(SparsityPlan(parts=[_part(w, 4, 6)]))           # a poor screen: some steps miss it
    rec = _Record(rt.sparse_plan.head)
    rt.sparse_plan.head = rec
    _decode_logits(rt, ids, 12)
    hits = 0
    for h, idx, tok in rec.seen:
        top = dense.blocks.logits(h).argmax(-1)
        if bool((idx == top[:, None]).any()):
            assert torch.equal(tok, top)
            hits += 1
    assert 0 < hits < len(rec.seen), "the poor screen should keep the argmax at some steps and miss it at others"
    # K = all: the dense head
    rt.set_plan(SparsityPlan(parts=[_part(w, 4, "all")]))
    assert rt.sparse_plan.head is None
    assert torch.equal(_decode_logits(rt, ids, 4), _decode_logits(dense, ids, 4))
