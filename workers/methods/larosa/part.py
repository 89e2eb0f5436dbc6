"""LaRoSA's plan part (kind ``larosa``): per layer the sparsity of each input group and the rotations, and the
forms the rest of the code runs it in (workers.sparsity.parts)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.methods.larosa import masked
from workers.methods.larosa.rotations import GROUPS, ROTATABLE, SCORES, rotation_numel
from workers.sparsity.parts import PlanPart, register_part


@register_part
@dataclass
class RotatedPlan(PlanPart):
    """{layer: {group: s}} (groups of ``GROUPS``; absent = dense) and {layer: {group: rotation}}: ``attn_in`` /
    ``ffn_in`` an orthogonal Q [d, d] (columns the basis), ``o`` R [n_kv_heads, head_dim, head_dim]. A sparse
    block input without a rotation keeps its top-k entries of the norm's own output (no rotation). ``scaled``:
    the block-input rotations act on the norm's output x = g ⊙ n (r = Qᵀ x, W' = W Q: the reference code's form)
    instead of on n; the residual stream cannot carry that basis, so each is an explicit d×d product."""
    kind = "larosa"
    label = "rotated"
    blocks_refused = "a rotated plan folds its rotations into float weights"   # (blocks would need requantizing)
    legacy_key, legacy_prefix = "rotated", "rot."

    sparsity: dict[int, dict[str, float]] = field(default_factory=dict)
    rotations: dict[int, dict[str, torch.Tensor]] = field(default_factory=dict)
    score: str = "abs"
    scaled: bool = False

    def __post_init__(self):
        if self.score not in SCORES:
            raise ValueError(f"rotated top-k score must be one of {SCORES}, got {self.score!r}")
        for l, per in self.sparsity.items():
            bad = set(per) - set(GROUPS)
            if bad:
                raise ValueError(f"layer {l}: unknown input groups {sorted(bad)}; known: {GROUPS}")
            for g, s in per.items():
                if not 0.0 <= s < 1.0:
                    raise ValueError(f"layer {l} {g}: sparsity must be in [0, 1), got {s}")
        for l, per in self.rotations.items():
            bad = set(per) - set(ROTATABLE)
            if bad:
                raise ValueError(f"layer {l}: no rotation for {sorted(bad)}; rotatable: {ROTATABLE}")

    def layers(self) -> list[int]:
        return sorted(set(self.sparsity) | set(self.rotations))

    # ---- bundle form: a rotation shared by several inputs or layers is stored once (and stays one object when
    # read back: the bytes charged for basis changes depend on it)
    def to_bundle(self) -> tuple[dict, dict[str, torch.Tensor]]:
        keys: dict[int, str] = {}
        tensors, rotations = {}, {}
        for l, per in sorted(self.rotations.items()):
            for g, t in sorted(per.items()):
                if id(t) not in keys:
                    keys[id(t)] = f"{l}.{g}"
                    tensors[keys[id(t)]] = t
                rotations.setdefault(str(l), {})[g] = keys[id(t)]
        return {"sparsity": {str(l): {g: float(s) for g, s in sorted(per.items())}
                             for l, per in sorted(self.sparsity.items())},
                "rotations": rotations, "score": self.score, "scaled": bool(self.scaled)}, tensors

    @classmethod
    def tensor_keys(cls, config: dict) -> set[str]:
        return {key for per in config["rotations"].values() for key in per.values()}

    @classmethod
    def from_bundle(cls, config: dict, tensors: dict[str, torch.Tensor], device) -> "RotatedPlan":
        shared = {key: tensors[key].to(device) for key in cls.tensor_keys(config)}   # one object per stored one
        return cls(sparsity={int(l): {g: float(s) for g, s in per.items()} for l, per in config["sparsity"].items()},
                   rotations={int(l): {g: shared[key] for g, key in per.items()}
                              for l, per in config["rotations"].items()},
                   score=config["score"], scaled=bool(config["scaled"]))

    @classmethod
    def legacy_config(cls, config: dict) -> dict:
        """Format 2 named the rotations by their full tensor keys (``rot.<layer>.<group>``)."""
        return {**config, "rotations": {l: {g: key.removeprefix(cls.legacy_prefix) for g, key in per.items()}
                                        for l, per in config["rotations"].items()}}

    # ---- masked form, bytes, runtime form
    def apply_masked(self, model, stats, swaps) -> int:
        return masked.apply_rotated_sparsity(model, self, stats, swaps=swaps).extra_numel

    def extra_numel(self, model) -> int:
        return rotation_numel(model, self)

    # the runtime form is imported when the decode runtime asks for it: it builds on workers.decode.plan, which
    # imports the predictors' package (and so this part) itself
    def runtime_weights(self, w):
        from workers.methods.larosa.runtime import rotated_weights

        return rotated_weights(w, self)

    def runtime(self, w):
        from workers.methods.larosa.runtime import compile_plan

        return compile_plan(self, w)
