"""Tiny random models of each supported family, built from a config (never downloaded)."""
from __future__ import annotations

import torch


def tiny_model(family: str, seed: int = 0):
    import transformers as tf

    common = dict(vocab_size=128, hidden_size=48, num_hidden_layers=2, num_attention_heads=4,
                  intermediate_size=80, max_position_embeddings=64)
    if family == "llama":
        cfg = tf.LlamaConfig(num_key_value_heads=2, **common)
    elif family == "mistral":
        cfg = tf.MistralConfig(num_key_value_heads=2, sliding_window=None, **common)
    elif family == "qwen2":
        cfg = tf.Qwen2Config(num_key_value_heads=2, **common)
    elif family == "gemma3":
        cfg = tf.Gemma3TextConfig(num_key_value_heads=1, head_dim=16, sliding_window=16, **common)
    elif family == "opt":
        cfg = tf.OPTConfig(vocab_size=128, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, ffn_dim=80,
                           max_position_embeddings=64, word_embed_proj_dim=48)
    elif family == "gpt2":
        cfg = tf.GPT2Config(vocab_size=128, n_embd=48, n_layer=2, n_head=4, n_inner=80, n_positions=64)
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    return model


def random_out_bias(model, seed: int = 8):
    """Random biases for the attention output projections that have one (OPT's); HF initialises biases to 0, so a
    path that dropped them would pass unseen."""
    with torch.no_grad():
        for name, mod in model.named_modules():
            if name.endswith("out_proj") and mod.bias is not None:
                mod.bias.normal_(0.0, 0.5, generator=torch.Generator().manual_seed(seed))
    return model


def runtime_logits(model, ids, steps: int, max_len: int = 24, **options):
    """The decode runtime's logits (``options``: its constructor's) on ``ids`` [B, T]: the prefill's last
    position, then ``steps`` greedy steps, stacked."""
    from workers.decode.runtime import DecodeRuntime

    rt = DecodeRuntime.from_hf(model, **options)
    rt.setup(ids.shape[0], max_len)
    return torch.stack([rt.prefill(ids)] + [rt.step(keep_logits=True) for _ in range(steps)])


def loaded(model, ref: str):
    """A tiny model as the LoadedModel that capture and fit take (no tokenizer: tests feed token ids)."""
    from workers.loading.adapters import adapter_for
    from workers.loading.models import LoadedModel, fingerprint

    ad = adapter_for(model)
    return LoadedModel(model=model, tokenizer=None, ref=ref, adapter=ad, dims=ad.dims(model.config),
                       fingerprint=fingerprint(model), source="config")
