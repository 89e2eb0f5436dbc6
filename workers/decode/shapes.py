"""The 7B-class model shapes timed with random weights: one table for the decode latency units (``shape:NAME``
models) and the kernel benchmark. Stdlib only (the GPU benchmark imports it without transformers).

``SHAPES[name] = (family, Hugging Face config kwargs)``; :func:`ffn_shape` and :func:`attn_shape` read the
dimensions a kernel needs from it.
"""
from __future__ import annotations

SHAPES = {
    "llama2-7b": ("llama", dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
                                rms_norm_eps=1e-5, rope_theta=10000.0)),
    "llama3-8b": ("llama", dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                                rms_norm_eps=1e-5, rope_theta=500000.0)),
    "mistral-7b": ("mistral", dict(vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                                   rms_norm_eps=1e-5, rope_theta=1000000.0, sliding_window=None)),
    "qwen2-7b": ("qwen2", dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                               num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=32768,
                               rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=False)),
    "opt-6.7b": ("opt", dict(vocab_size=50272, hidden_size=4096, ffn_dim=16384, num_hidden_layers=32,
                             num_attention_heads=32, max_position_embeddings=2048, word_embed_proj_dim=4096,
                             do_layer_norm_before=True)),
}
_FFN_KIND = {"llama": (True, "silu"), "mistral": (True, "silu"), "qwen2": (True, "silu"), "opt": (False, "relu")}


def shape_entry(name: str) -> tuple[str, dict]:
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}; known: {sorted(SHAPES)}") from None


def ffn_shape(name: str) -> tuple[int, int, bool, str]:
    """(d, D, gated, activation) of the shape's FFN."""
    family, kw = shape_entry(name)
    gated, act = _FFN_KIND[family]
    return kw["hidden_size"], kw.get("intermediate_size") or kw["ffn_dim"], gated, act


def attn_shape(name: str) -> tuple[int, int, int, int]:
    """(d, query heads, KV heads, head dim) of the shape's attention."""
    _, kw = shape_entry(name)
    d, nh = kw["hidden_size"], kw["num_attention_heads"]
    return d, nh, kw.get("num_key_value_heads", nh), d // nh
