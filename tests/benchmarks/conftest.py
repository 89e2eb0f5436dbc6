"""Fixtures of the benchmark scripts' tests: one tiny real model that every script runs on, and the Triton
interpreter for the GPU scripts' CPU paths.

Without a GPU, ``TRITON_INTERPRET`` is set here before anything imports triton (as ``tests/kernels/conftest.py``
does): a GPU script's ``--smoke`` runs its Triton kernels in the interpreter.
"""
from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

TINY_VOCAB = 4096        # the first 4,096 of SmolLM2's tokens (tests/workers/test_qwen2_gguf.py): a fast tokenizer


def tiny_qwen2(seed: int = 0):
    """A 2-layer random Qwen2 (d 64, 4 query / 2 KV heads of 16, D 128, q/k/v biases, an untied LM head) with random
    norm gains and biases, whose context (4,096 positions) holds a 512-token window and an 8-shot GSM8K prompt."""
    import transformers as tf

    from tests.workers.tiny_model_support import randomize_norms_and_biases

    cfg = tf.Qwen2Config(vocab_size=TINY_VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=128, max_position_embeddings=4096,
                         rms_norm_eps=1e-6, tie_word_embeddings=False,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    return randomize_norms_and_biases(model, seed)


@pytest.fixture(scope="session")
def tiny_gguf(tmp_path_factory):
    """(path of a tiny random Qwen2 as a Q8_0 GGUF file with SmolLM2's byte-level BPE cut to 4,096 tokens, the
    model cache it was converted into). Every benchmark script loads it by path (``--model PATH``), the GGUF
    scripts decode its quantized blocks. The conversion to the float cache happens here, once, into a cache of the
    session's own (a model cache left by an earlier run is never read)."""
    from transformers import AutoTokenizer

    from tests.workers.test_qwen2_gguf import write_qwen2_gguf
    from workers.loading.models import load_model, packaged_tokenizer_folder

    tok = AutoTokenizer.from_pretrained(packaged_tokenizer_folder("smollm2-135m"))
    root = tmp_path_factory.mktemp("tiny-gguf")
    path = write_qwen2_gguf(tiny_qwen2(), tok, root / "tiny-qwen2-q8_0.gguf", "Q8_0")
    cache = root / "model-cache"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("CTXSPARSE_MODEL_CACHE", str(cache))
        lm = load_model(str(path))
    assert lm.family == "qwen2" and lm.model.config.vocab_size == TINY_VOCAB
    return str(path), cache


@pytest.fixture
def tiny_model(tiny_gguf, monkeypatch) -> str:
    """The tiny model's ref (its GGUF's path) with the session's model cache in place for this test."""
    path, cache = tiny_gguf
    monkeypatch.setenv("CTXSPARSE_MODEL_CACHE", str(cache))
    return path


@pytest.fixture(autouse=True)
def _torch_threads():
    """The scripts set torch's thread count for their run (``--threads``): put it back after each test."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)
