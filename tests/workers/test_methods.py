"""workers/methods/: every method folder registers its fit (or, the predicted head, its plan part) when
``workers.methods`` is imported, and nothing else registers one."""
from __future__ import annotations

from pathlib import Path

# the registered methods, by the folder that holds each (a known answer: a folder left out of workers/methods'
# import, or a fit registered from elsewhere, changes it)
METHODS = {"dejavu": {"dejavu"}, "larosa": {"larosa"}, "oracle": {"oracle"}, "rsparse": {"rsparse"},
           "static": {"static"}, "svd": {"svd"}, "teal": {"teal", "wina"}, "threshold": {"threshold"}}
# the registered plan parts, by folder: the predicted head is a part only (no decoder fit: a sweep's ``head`` key)
PARTS = {"head": {"head"}, "larosa": {"larosa"}, "rsparse": {"rsparse"}}


def test_every_method_folder_registers_its_methods():
    import workers.methods
    from workers.sparsity.predictors.base import REGISTRY

    from workers.sparsity.parts import PART_TYPES

    folders = {p.name for p in Path(workers.methods.__file__).parent.iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(METHODS) | set(PARTS)
    by_folder: dict[str, set[str]] = {}
    for name, fit in REGISTRY.items():
        assert fit.__module__.startswith("workers.methods."), (name, fit.__module__)
        by_folder.setdefault(fit.__module__.split(".")[2], set()).add(name)
    assert by_folder == METHODS
    parts: dict[str, set[str]] = {}
    for kind, cls in PART_TYPES.items():
        assert cls.__module__.startswith("workers.methods."), (kind, cls.__module__)
        parts.setdefault(cls.__module__.split(".")[2], set()).add(kind)
    assert parts == PARTS
