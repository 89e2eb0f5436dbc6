"""Fixtures of the orchestrator tests."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def tiny_folder(smollm2, tmp_path_factory):
    """A one-layer random Llama with SmolLM2's vocabulary and tokenizer, saved as a local model folder: a sweep
    on it loads, collects, fits and scores in a moment (its numbers mean nothing)."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=smollm2.model.config.vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         max_position_embeddings=smollm2.model.config.max_position_embeddings)
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("tiny-llama")
    tf.AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    smollm2.tokenizer.save_pretrained(folder)
    return str(folder)
