"""The test session's own CTXSPARSE_HOME (tests/conftest.py): fresh and empty, never the user's cache, seen by
Ray actors; only the model weights' cache is shared."""
from __future__ import annotations

import os
from pathlib import Path

import torch

from tests.conftest import SESSION_HOME, USER_HOME
from workers.paths import home, model_cache


def test_session_home_is_private_and_the_model_cache_is_shared():
    assert Path(os.environ["CTXSPARSE_HOME"]) == SESSION_HOME == home()
    default = (Path.home() / ".cache" / "ctxsparse").resolve()
    assert SESSION_HOME.resolve() not in (default, USER_HOME.resolve())
    assert not SESSION_HOME.resolve().is_relative_to(default)
    assert model_cache() == Path(os.environ["CTXSPARSE_MODEL_CACHE"])
    assert not model_cache().resolve().is_relative_to(SESSION_HOME.resolve())


def test_the_first_capture_of_a_session_is_collected_not_found(tmp_path):
    """The same deterministic capture misses on its first call in every session (a home shared across sessions
    would serve it from an earlier run), then hits."""
    from tests.workers.tiny_model_support import tiny_model
    from workers.loading.adapters import adapter_for
    from workers.loading.data import TokenSet
    from workers.loading.models import LoadedModel, fingerprint
    from workers.sparsity.capture import capture_activations

    m = tiny_model("llama", seed=7)
    ad = adapter_for(m)
    lm = LoadedModel(model=m, tokenizer=None, ref="session-home", adapter=ad, dims=ad.dims(m.config),
                     fingerprint=fingerprint(m), source="config")
    toks = TokenSet(torch.arange(32).reshape(2, 16) % 128, "fixed", "calib", 32, 0, "fp-session-home")
    first = capture_activations(lm, toks, progress=False, dtype="float32")
    assert not first.hit and first.path.is_relative_to(SESSION_HOME / "activations")
    assert capture_activations(lm, toks, progress=False, dtype="float32").hit


def test_ray_actors_see_the_session_home(ray_local):
    ray = ray_local

    @ray.remote(num_cpus=0)
    def where() -> tuple[str | None, str | None, str]:
        from workers.paths import home

        return os.environ.get("CTXSPARSE_HOME"), os.environ.get("CTXSPARSE_MODEL_CACHE"), str(home())

    assert ray.get(where.remote()) == (str(SESSION_HOME), os.environ["CTXSPARSE_MODEL_CACHE"], str(SESSION_HOME))
