"""A real, small sweep on SmolLM2 (shared by the orchestrator and dashboard tests).

``TINY_SPEC`` is kept small enough for the 2-core CI (a few minutes with warm model caches): two sparsity
methods plus dense, perplexity on 512 held-out tokens and 8 COPA items, CPU latency of 4 decode tokens.
"""
from __future__ import annotations

import copy
import os
from pathlib import Path

SHARED_CACHES = ("activations", "allocation")

TINY_SPEC = {
    "name": "tiny-test",
    "models": ["smollm2-135m"],
    "data": {"calib_tokens": 1024, "metric_tokens": 512, "seq_len": 256},
    "methods": [
        {"name": "oracle", "sparsity": [0.5]},
        {"name": "threshold", "sparsity": [0.5]},
    ],
    "suites": {"perplexity": {"tokens": 512, "seq_len": 256}, "tasks": [{"name": "copa", "limit": 8}]},
    "latency": {"devices": ["cpu"], "batch": [1], "prompt_len": [16], "gen_len": 4, "repeats": 1},
    "resources": {"fitters": 1, "evaluators": 1, "benchers": 1, "torch_threads": 1},
}

# the accuracy rows of one perplexity eval unit (workers.units.Units.evaluate)
PERPLEXITY_METRICS = ("ppl", "nll", "mlp_sparsity", "head_sparsity", "input_sparsity", "weight_skipped")


def tiny_spec(**overrides):
    from orchestrator.spec import parse_spec

    d = copy.deepcopy(TINY_SPEC)
    d.update(overrides)
    return parse_spec(d)


def run_tiny_sweep(db_url: str, **overrides):
    """Run the tiny sweep (on the already-initialized Ray) into ``db_url``; returns the SweepOutcome."""
    from orchestrator.driver import run_sweep

    return run_sweep(tiny_spec(**overrides), db_url, heartbeat_s=30.0)


def private_home(root: Path) -> Path:
    """A CTXSPARSE_HOME of its own under ``root`` (bundles, store), sharing the activation caches with the test
    session's home (tests/conftest.py; model weights are in CTXSPARSE_MODEL_CACHE): tests that damage bundle files
    touch only their own."""
    real = Path(os.environ["CTXSPARSE_HOME"])
    home = root / "home"
    home.mkdir()
    for name in SHARED_CACHES:
        (real / name).mkdir(parents=True, exist_ok=True)
        (home / name).symlink_to(real / name, target_is_directory=True)
    return home
