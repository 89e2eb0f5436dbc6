"""Shared fixtures. The real packaged models are loaded once per session (the float cache makes reloads fast)."""
from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2():
    from workers.loading.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray cluster for the session: 2 CPUs, and one custom ``NPU`` unit so the Ascend placement path
    (Ray sets ASCEND_RT_VISIBLE_DEVICES for it) is exercised on a CPU box. Loopback only, no dashboard."""
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(num_cpus=2, resources={"NPU": 1}, include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
    yield ray
    ray.shutdown()
