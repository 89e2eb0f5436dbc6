"""Fixtures of the evaluation tests that score requests (test_request_cache.py, test_shards.py)."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh shared home for one test (below the session's temporary one)."""
    monkeypatch.setenv("CTXSPARSE_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def tiny(smollm2):
    """A one-layer random Llama with SmolLM2's vocabulary and context length: (model, SmolLM2's tokenizer)."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=smollm2.model.config.vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=smollm2.model.config.max_position_embeddings)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(cfg).eval(), smollm2.tokenizer
