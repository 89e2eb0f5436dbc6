"""Shared fixtures. The real packaged models are loaded once per session (the float cache makes reloads fast).

Every test session gets its own empty ``CTXSPARSE_HOME`` (a fresh temp folder, set here before anything reads
it, removed at the end), so no test reuses activations, bundles or a store left by an earlier run: a warm machine
tests what a cold one does. Only the model weights' cache is shared (``CTXSPARSE_MODEL_CACHE``, default
``<the user's CTXSPARSE_HOME>/models``): it is keyed by the content of the packaged weights, not a result. Local
Ray clusters started by the tests inherit this environment, and the sweep driver hands its home to every actor.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

USER_HOME = Path(os.environ.get("CTXSPARSE_HOME") or Path.home() / ".cache" / "ctxsparse").expanduser()
os.environ.setdefault("CTXSPARSE_MODEL_CACHE", str(USER_HOME / "models"))
SESSION_HOME = Path(tempfile.mkdtemp(prefix="ctxsparse-test-home-"))
os.environ["CTXSPARSE_HOME"] = str(SESSION_HOME)

import pytest  # noqa: E402


# pytest-timeout: 600 s per test by default (pyproject.toml). A session's Ray sweep fixtures run inside the first
# test that asks for them (a cold tiny sweep takes minutes on 2 cores), and slow tests run real models.
RAY_TIMEOUT_S = 1200
SLOW_TIMEOUT_S = 1800


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("timeout") is not None:
            continue                                   # a test's own mark wins
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
        elif "ray_local" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.timeout(RAY_TIMEOUT_S))


def pytest_unconfigure(config):
    shutil.rmtree(SESSION_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2():
    from workers.loading.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray cluster for the session: 2 CPUs, and one custom ``NPU`` unit so the Ascend placement path
    (Ray sets ASCEND_RT_VISIBLE_DEVICES for it) is exercised on a CPU box. Loopback only, no dashboard."""
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=2, resources={"NPU": 1}, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    yield ray
    ray.shutdown()
