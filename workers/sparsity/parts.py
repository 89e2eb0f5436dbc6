"""Plan parts: a method's whole share of a :class:`~workers.sparsity.predictors.base.SparsityPlan`, registered by
name, with every form the rest of the code needs from it.

A method whose plan is not made of per-layer predictors or input thresholds (LaRoSA's rotations, R-Sparse's
low-rank factors) puts one :class:`PlanPart` into ``SparsityPlan.parts``. Its type, registered under ``kind``
(:func:`register_part`), carries:

  bundle form    ``to_bundle`` / ``from_bundle`` (a plain-JSON config and tensors keyed by the part's own names,
                 which a bundle stores as ``<kind>.<name>``; ``tensor_keys`` names those a config needs), and how a
                 bundle written before parts existed names it (``legacy_key``, ``legacy_prefix``, ``legacy_config``)
  masked form    ``apply_masked``: the module swaps on a Hugging Face model for accuracy rows
  runtime form   ``runtime_weights`` and ``runtime``: what the decode runtime runs (workers.decode.plan.PartRuntime:
                 per-layer attention / FFN callables over weights the part may fold into)
  byte charges   ``extra_numel``: weight elements a token reads beside the model's projections

The bundle code, ``sparse_exec.apply_sparsity`` and the runtime's plan compiler loop over a plan's parts; none of
them knows a method by name. A method's folder (``workers/methods/<name>/``) holds its part, fit and forms.
"""
from __future__ import annotations

from typing import ClassVar

import torch

PART_TYPES: dict[str, type["PlanPart"]] = {}
_RESERVED = ("mlp", "attn")          # a bundle's predictor tensors are keyed <comp>.<layer>.<name>


class PlanPart:
    kind: ClassVar[str] = ""              # the registered name (SparsityPlan.part, a bundle's key)
    label: ClassVar[str] = ""             # how messages name it ("rotated", "rank-sparse")
    alone: ClassVar[bool] = True          # runs with no predictors, input thresholds or other decoder part beside it
    decoder: ClassVar[bool] = True        # changes decoder layers (the predicted output head does not: it runs
                                          # beside any plan)
    reports: ClassVar[tuple[str, ...]] = ("inputs",)   # the realized-sparsity keys it counts
    blocks_refused: ClassVar[str | None] = None   # why the decode runtime over a GGUF's blocks cannot run it
    legacy_key: ClassVar[str | None] = None   # its key in a format-2 manifest's plan (bundles before parts)
    legacy_prefix: ClassVar[str] = ""          # and the prefix of its tensors' keys there

    def layers(self) -> list[int]:
        raise NotImplementedError

    # ---- bundle form
    def to_bundle(self) -> tuple[dict, dict[str, torch.Tensor]]:
        """(config, tensors): the config plain JSON, the tensors keyed by the part's own names."""
        raise NotImplementedError

    @classmethod
    def tensor_keys(cls, config: dict) -> set[str]:
        """The tensor names ``config`` needs (a bundle holds exactly these for the part)."""
        raise NotImplementedError

    @classmethod
    def from_bundle(cls, config: dict, tensors: dict[str, torch.Tensor], device) -> "PlanPart":
        """Rebuild from a bundle, the tensors on ``device`` (KeyError / TypeError / ValueError: a bad config)."""
        raise NotImplementedError

    @classmethod
    def legacy_config(cls, config: dict) -> dict:
        """A format-2 manifest's config in this format (its tensors lose ``legacy_prefix``)."""
        return config

    # ---- masked form, byte charges
    def apply_masked(self, model, stats, swaps) -> int:
        """Swap the part's modules into ``model`` (recorded in ``swaps``, counted in ``stats``, an
        ``input_sparse.InputStats``); returns :meth:`extra_numel`."""
        raise NotImplementedError

    def extra_numel(self, model) -> int:
        """Weight elements every token reads beside the model's projections (rotations, factors)."""
        return 0

    # ---- runtime form
    def runtime_weights(self, w):
        """The decode runtime's weights this part runs over (``w``, or a copy with something folded in)."""
        return w

    def runtime(self, w):
        """The part compiled for the runtime's weights ``w`` (those of :meth:`runtime_weights`): a
        workers.decode.plan.PartRuntime."""
        raise NotImplementedError


def register_part(cls: type[PlanPart]) -> type[PlanPart]:
    """Class decorator: register a part type under its ``kind``."""
    if not cls.kind or cls.kind in _RESERVED or "." in cls.kind:
        raise ValueError(f"part kind {cls.kind!r}: a name without dots, not one of {_RESERVED}")
    if PART_TYPES.get(cls.kind, cls) is not cls:
        raise ValueError(f"plan part {cls.kind!r} registered twice")
    PART_TYPES[cls.kind] = cls
    return cls
