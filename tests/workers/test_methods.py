"""workers/methods/: every method folder registers its fit when ``workers.methods`` is imported, and nothing else
registers one."""
from __future__ import annotations

from pathlib import Path

# the registered methods, by the folder that holds each (a known answer: a folder left out of workers/methods'
# import, or a fit registered from elsewhere, changes it)
METHODS = {"dejavu": {"dejavu"}, "larosa": {"larosa"}, "oracle": {"oracle"}, "rsparse": {"rsparse"},
           "static": {"static"}, "svd": {"svd"}, "teal": {"teal", "wina"}, "threshold": {"threshold"}}


def test_every_method_folder_registers_its_methods():
    import workers.methods
    from workers.sparsity.predictors.base import REGISTRY

    folders = {p.name for p in Path(workers.methods.__file__).parent.iterdir() if (p / "__init__.py").is_file()}
    assert folders == set(METHODS)
    by_folder: dict[str, set[str]] = {}
    for name, fit in REGISTRY.items():
        assert fit.__module__.startswith("workers.methods."), (name, fit.__module__)
        by_folder.setdefault(fit.__module__.split(".")[2], set()).add(name)
    assert by_folder == METHODS
