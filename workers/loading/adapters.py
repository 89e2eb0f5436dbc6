"""Architecture adapters: where the FFN and the attention live in each decoder layer.

One small declared description per model family. Everything that walks a model (activation capture,
sparse execution, the decode runtime) goes through these, never through family-specific `if`s.

Paths are attribute paths relative to the decoder layer (``"mlp.gate_proj"``). ``gate`` is ``None`` for
non-gated MLPs (OPT, GPT-2), where ``up`` is the first projection (fc1 / c_fc) and the intermediate
activation is ``act(up(x))``. GPT-2 stores its projections as ``Conv1D`` (weight ``[in, out]``) and fuses
q/k/v in ``c_attn``: :func:`linear_weight` hides the transpose, ``qkv_fused`` says how to split.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn


@dataclass(frozen=True)
class FFNSpec:
    up: str                 # fc1 / up_proj
    down: str               # fc2 / down_proj
    act: str                # "silu" | "gelu_tanh" | "gelu" | "relu"
    gate: str | None = None  # gate_proj for gated MLPs
    module: str = "mlp"     # module whose *input* is the normed FFN input ("" = the layer itself, OPT)
    norm: str = ""          # norm applied right before the FFN
    inline_act: str | None = None  # OPT: the activation module sits in the layer between fc1 and fc2
    post_norm: str = ""     # norm applied to the FFN's output before the residual add (Gemma-2/3), "" = none

    @property
    def gated(self) -> bool:
        return self.gate is not None


@dataclass(frozen=True)
class AttnSpec:
    o: str                   # output projection; its *input* holds every head's output
    q: str | None = None
    k: str | None = None
    v: str | None = None
    qkv_fused: str | None = None   # GPT-2 c_attn: one [d, 3d] projection
    module: str = "self_attn"
    norm: str = ""


@dataclass(frozen=True)
class ArchAdapter:
    family: str
    layers: str              # path from the top model to the ModuleList of decoder layers
    ffn: FFNSpec
    attn: AttnSpec
    final_norm: str

    # ---- walking a model ------------------------------------------------------------------
    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        return get_path(model, self.layers)

    def iter_layers(self, model: nn.Module) -> Iterator[tuple[int, nn.Module]]:
        yield from enumerate(self.decoder_layers(model))

    def ffn_module(self, layer: nn.Module) -> nn.Module:
        return get_path(layer, self.ffn.module) if self.ffn.module else layer

    def attn_module(self, layer: nn.Module) -> nn.Module:
        return get_path(layer, self.attn.module)

    def ffn_weights(self, layer: nn.Module) -> dict[str, torch.Tensor]:
        """The layer's FFN weights in nn.Linear layout, detached (no copies): ``up`` [D, d], ``down`` [d, D],
        ``gate`` [D, d] for gated MLPs, ``b_up`` / ``b_down`` where the projections have biases."""
        ffn = self.ffn_module(layer)
        up, down = get_path(ffn, self.ffn.up), get_path(ffn, self.ffn.down)
        out = {"up": linear_weight(up), "down": linear_weight(down)}
        if self.ffn.gated:
            out["gate"] = linear_weight(get_path(ffn, self.ffn.gate))
        if getattr(up, "bias", None) is not None:
            out["b_up"] = up.bias
        if getattr(down, "bias", None) is not None:
            out["b_down"] = down.bias
        return {k: v.detach() for k, v in out.items()}

    def ffn_out_gain(self, layer: nn.Module) -> torch.Tensor | None:
        """Where the FFN output y passes through a norm before the residual add (Gemma-3's
        ``post_feedforward_layernorm``: g ⊙ y / rms(y)), the per-channel gain g as float32 [d]; else None.
        A neuron's effect on the residual stream is then its down column scaled by g and divided by the token's
        rms(y): the damage of dropping it is measured there (see :func:`workers.sparsity.predictors.base.neuron_damage`)."""
        if not self.ffn.post_norm:
            return None
        return norm_gain(get_path(layer, self.ffn.post_norm))

    def act_name(self, config) -> str:
        """The FFN activation, read from the config where it says (hidden_act / activation_function)."""
        cfg = getattr(config, "text_config", None) or config
        raw = _first(cfg, "hidden_activation", "hidden_act", "activation_function", default=self.ffn.act)
        return _ACT_ALIASES.get(raw, raw)

    # ---- shapes ------------------------------------------------------------------------------
    def dims(self, config) -> "ModelDims":
        cfg = getattr(config, "text_config", None) or config
        d = _first(cfg, "hidden_size", "n_embd", "d_model")
        n_heads = _first(cfg, "num_attention_heads", "n_head")
        n_kv = _first(cfg, "num_key_value_heads", default=n_heads) or n_heads
        head_dim = _first(cfg, "head_dim", default=None) or d // n_heads
        D = _first(cfg, "intermediate_size", "ffn_dim", "n_inner", default=None) or 4 * d
        n_layers = _first(cfg, "num_hidden_layers", "n_layer")
        return ModelDims(d=d, D=D, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim)


@dataclass(frozen=True)
class ModelDims:
    d: int
    D: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int


def _first(cfg, *names, default=KeyError):
    for n in names:
        v = getattr(cfg, n, None)
        if v is not None:
            return v
    if default is KeyError:
        raise KeyError(f"config has none of {names}")
    return default


def get_path(root: nn.Module, path: str) -> nn.Module:
    obj = root
    for part in path.split(".") if path else []:
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def set_path(root: nn.Module, path: str, value: nn.Module) -> None:
    parent_path, _, name = path.rpartition(".")
    parent = get_path(root, parent_path) if parent_path else root
    setattr(parent, name, value)


def norm_gain(norm: nn.Module) -> torch.Tensor:
    """The per-channel gain an RMSNorm/LayerNorm module multiplies by, float32: Gemma's RMSNorm stores w and
    scales by (1 + w); the others scale by their weight."""
    w = norm.weight.detach().float()
    return 1.0 + w if type(norm).__name__.startswith("Gemma") else w


def linear_weight(module: nn.Module) -> torch.Tensor:
    """The projection's weight as ``[out_features, in_features]`` (nn.Linear layout)."""
    if isinstance(module, nn.Linear):
        return module.weight
    if type(module).__name__ == "Conv1D":  # transformers.pytorch_utils.Conv1D: weight [in, out]
        return module.weight.t()
    raise TypeError(f"not a projection: {type(module).__name__}")


_LLAMA_LIKE = dict(
    layers="model.layers",
    ffn=FFNSpec(gate="gate_proj", up="up_proj", down="down_proj", act="silu", norm="post_attention_layernorm"),
    attn=AttnSpec(q="q_proj", k="k_proj", v="v_proj", o="o_proj", norm="input_layernorm"),
    final_norm="model.norm",
)

ADAPTERS: dict[str, ArchAdapter] = {
    "llama": ArchAdapter(family="llama", **_LLAMA_LIKE),
    "mistral": ArchAdapter(family="mistral", **_LLAMA_LIKE),
    "qwen2": ArchAdapter(family="qwen2", **_LLAMA_LIKE),
    "gemma3": ArchAdapter(
        family="gemma3",
        layers="model.layers",
        ffn=FFNSpec(gate="gate_proj", up="up_proj", down="down_proj", act="gelu_tanh", norm="pre_feedforward_layernorm",
                    post_norm="post_feedforward_layernorm"),
        attn=AttnSpec(q="q_proj", k="k_proj", v="v_proj", o="o_proj", norm="input_layernorm"),
        final_norm="model.norm",
    ),
    "opt": ArchAdapter(
        family="opt",
        layers="model.decoder.layers",
        ffn=FFNSpec(up="fc1", down="fc2", act="relu", module="", norm="final_layer_norm", inline_act="activation_fn"),
        attn=AttnSpec(q="q_proj", k="k_proj", v="v_proj", o="out_proj", norm="self_attn_layer_norm"),
        final_norm="model.decoder.final_layer_norm",
    ),
    "gpt2": ArchAdapter(
        family="gpt2",
        layers="transformer.h",
        ffn=FFNSpec(up="c_fc", down="c_proj", act="gelu_tanh", norm="ln_2"),
        attn=AttnSpec(qkv_fused="c_attn", o="c_proj", module="attn", norm="ln_1"),
        final_norm="transformer.ln_f",
    ),
}
# model_type aliases that share a layout
ADAPTERS["gemma3_text"] = ADAPTERS["gemma3"]


def adapter_for(model_or_config) -> ArchAdapter:
    config = getattr(model_or_config, "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    try:
        return ADAPTERS[model_type]
    except KeyError:
        raise ValueError(
            f"no architecture adapter for model_type {model_type!r}; supported: {sorted(ADAPTERS)}"
        ) from None


_ACT_ALIASES = {
    "swish": "silu", "silu": "silu", "relu": "relu", "gelu": "gelu",
    "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh",
}


def activation_fn(name: str):
    """The FFN activation by adapter name, as a torch function (``kernels.common.apply_act``: the one table)."""
    from kernels.common import act_code, apply_act

    act_code(name)      # ValueError naming the known activations
    return lambda x: apply_act(x, name)
