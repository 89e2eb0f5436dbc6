"""Module swaps on a model, undone in reverse order: what every ``apply_*(model, plan)`` returns is one of these.

    with apply_sparsity(model, plan) as applied:      # or applied = ...; applied.revert()
        ...

A swap replaces the submodule at ``path`` under ``root`` and remembers the original; a hook handle is removed on
revert. ``revert()`` restores everything in reverse order and is idempotent, so a failed ``apply_*`` can revert
what it did so far.
"""
from __future__ import annotations

from typing import Callable

from torch import nn

from workers.loading.adapters import get_path, set_path


class ModuleSwaps:
    def __init__(self):
        self._undo: list[Callable[[], None]] = []

    def swap(self, root: nn.Module, path: str, new: nn.Module) -> nn.Module:
        """Put ``new`` at ``path`` under ``root``; returns the original."""
        orig = get_path(root, path)
        set_path(root, path, new)
        self._undo.append(lambda: set_path(root, path, orig))
        return orig

    def hook(self, handle) -> None:
        """A hook handle (``register_forward_pre_hook`` ...) to remove on revert."""
        self._undo.append(handle.remove)

    def revert(self) -> None:
        while self._undo:
            self._undo.pop()()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.revert()
