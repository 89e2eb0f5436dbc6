"""Tiny random models of each supported family, built from a config (never downloaded)."""
from __future__ import annotations

import torch


def tiny_model(family: str, seed: int = 0):
    """A 2-layer random model of ``family`` (``seed``: its weights). Every bias the architecture has and every
    norm's weight (and LayerNorm bias) are random too (:func:`randomize_norms_and_biases`): HF initialises biases
    to 0 and norm gains to 1, so a path that dropped a bias or ignored a norm weight would match the HF model
    unseen. Gemma-3's layer 1 is a full-attention layer (its own RoPE table), layer 0 a sliding one."""
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
        cfg = tf.Gemma3TextConfig(num_key_value_heads=1, head_dim=16, sliding_window=16,
                                  layer_types=["sliding_attention", "full_attention"], **common)
    elif family == "opt":
        cfg = tf.OPTConfig(vocab_size=128, hidden_size=48, num_hidden_layers=2, num_attention_heads=4, ffn_dim=80,
                           max_position_embeddings=64, word_embed_proj_dim=48)
    elif family == "gpt2":
        cfg = tf.GPT2Config(vocab_size=128, n_embd=48, n_layer=2, n_head=4, n_inner=80, n_positions=64)
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = tf.AutoModelForCausalLM.from_config(cfg).eval()
    return randomize_norms_and_biases(model, seed)


def _is_norm(mod) -> bool:
    return isinstance(mod, torch.nn.LayerNorm) or type(mod).__name__.endswith("RMSNorm")


@torch.no_grad()
def randomize_norms_and_biases(model, seed: int = 0):
    """Seeded random values (an own generator: the global RNG is left as it was) for every norm weight -- gain
    1 + 0.3·N(0, 1); Gemma's norms compute (1 + w), so there w = 0.3·N(0, 1) -- every LayerNorm bias
    (0.1·N(0, 1)) and every bias of a projection (0.1·N(0, 1): Qwen2's QKV, OPT's and GPT-2's every Linear /
    Conv1D). A projection's output entries are about 0.15 in size here (init std 0.02, d = 48), so each bias moves
    them by a large fraction and each gain rescales a norm's output by about 30 % per channel."""
    g = torch.Generator().manual_seed(1_000_003 + seed)
    for mod in model.modules():
        if _is_norm(mod) and mod.weight is not None:
            one_plus = type(mod).__name__.startswith("Gemma")      # output * (1 + w)
            mod.weight.copy_((0.0 if one_plus else 1.0) + 0.3 * torch.randn(mod.weight.shape, generator=g))
        b = getattr(mod, "bias", None)
        if isinstance(b, torch.Tensor):
            b.copy_(0.1 * torch.randn(b.shape, generator=g))
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
