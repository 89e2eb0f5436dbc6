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
import sys
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
# test that asks for them (a cold tiny sweep takes minutes on 2 cores; the shared one runs from the start of the
# session and its first reader waits for it), and slow tests run real models.
RAY_TIMEOUT_S = 1200
SLOW_TIMEOUT_S = 1800


def _uses(item, fixture: str) -> bool:
    return fixture in getattr(item, "fixturenames", ())


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("timeout") is not None:
            continue                                   # a test's own mark wins
        if item.get_closest_marker("slow") is not None:
            item.add_marker(pytest.mark.timeout(SLOW_TIMEOUT_S))
        elif _uses(item, "ray_local"):
            item.add_marker(pytest.mark.timeout(RAY_TIMEOUT_S))
    # The modules that read the shared sweep (``tiny_sweep``) run last, whole and in their usual order: the sweep
    # runs in the background from the start of the session (pytest_collection_finish), beside the other tests.
    late = {item.nodeid.split("::")[0] for item in items if _uses(item, "tiny_sweep")}
    items[:] = ([i for i in items if i.nodeid.split("::")[0] not in late]
                + [i for i in items if i.nodeid.split("::")[0] in late])


# the session's shared sweep (tests/sweep_support.py), started once the tests to run are known
_SHARED = None


def _start_shared_sweep(ray):
    global _SHARED
    from tests.sweep_support import SharedSweep

    root = Path(tempfile.mkdtemp(prefix="ctxsparse-test-sweep-"))
    _SHARED = SharedSweep(root, ray.get_runtime_context().gcs_address)


def pytest_collection_finish(session):
    opt = session.config.option
    if getattr(opt, "collectonly", False) or getattr(opt, "setuponly", False) or getattr(opt, "setupplan", False):
        return
    if any(_uses(item, "tiny_sweep") for item in session.items):
        _start_shared_sweep(_init_ray())


def pytest_sessionfinish(session, exitstatus):
    if _SHARED is not None:
        _SHARED.stop()                                 # a run cut short: no driver outlives the session


def pytest_unconfigure(config):
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()                  # started for the shared sweep but no test used ray_local
    if _SHARED is not None:
        shutil.rmtree(_SHARED.root, ignore_errors=True)
    shutil.rmtree(SESSION_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2():
    from workers.loading.models import load_model

    return load_model("smollm2-135m")


def _init_ray():
    import ray

    if not ray.is_initialized():
        # Ray's start-up chatter on stderr (its NPU probe's traceback on a box without the Ascend stack, the token
        # notice) goes to a file: started before the first test (pytest_collection_finish), nothing captures it
        with open(SESSION_HOME / "ray-start.log", "w") as log:
            saved = os.dup(2)
            os.dup2(log.fileno(), 2)
            try:
                ray.init(num_cpus=2, resources={"NPU": 1}, include_dashboard=False, log_to_driver=False,
                         configure_logging=False)
            finally:
                os.dup2(saved, 2)
                os.close(saved)
    return ray


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray cluster for the session: 2 CPUs, and one custom ``NPU`` unit so the Ascend placement path
    (Ray sets ASCEND_RT_VISIBLE_DEVICES for it) is exercised on a CPU box. Loopback only, no dashboard.
    (Started at collection already when the shared sweep will be read: pytest_collection_finish.)"""
    ray = _init_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def tiny_sweep(ray_local):
    """The session's one real tiny SmolLM2 sweep through the Ray driver (tests/sweep_support.py: what it holds),
    read by the orchestrator and dashboard tests; it has run in the background since collection ended. Tests
    that add sweeps work on a copy (``copy_store``)."""
    if _SHARED is None:                                # asked for without being collected: start it now
        _start_shared_sweep(ray_local)
    try:
        return _SHARED.result(timeout=RAY_TIMEOUT_S - 60)
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)
