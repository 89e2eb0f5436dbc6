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


# pytest-timeout: 600 s per test by default (pyproject.toml). A session's background sweeps are read inside the
# first test that asks for them (a cold tiny sweep takes minutes on 2 cores; they run from the start of the
# session and their first reader waits for them), and slow tests run real models.
RAY_TIMEOUT_S = 1200
SLOW_TIMEOUT_S = 1800
# Logical CPUs of the session's Ray cluster (the machine has 2 cores): the background sweeps (and the jobs they
# submit) run side by side, each actor asking for half a CPU (most of an actor's life on 2 cores is starting up or
# waiting for the store; each unit's torch threads are its spec's, 1 here).
RAY_CPUS = 8
# The background sweeps (tests/sweep_support.py), in the order they are started, and the fixtures that read them.
BACKGROUND = ("shared", "troubled", "pg")
READERS = {"tiny_sweep": "shared", "tiny_sweep_resumed": "shared", "troubled_sweep": "troubled", "pg_sweep": "pg"}
REPO = Path(__file__).resolve().parents[1]


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
    # The modules that read a background sweep run last, whole and in their usual order: the sweeps run from the
    # start of the session (pytest_collection_finish), beside the other tests.
    late = {item.nodeid.split("::")[0] for item in items if any(_uses(item, f) for f in READERS)}
    items[:] = ([i for i in items if i.nodeid.split("::")[0] not in late]
                + [i for i in items if i.nodeid.split("::")[0] in late])


_BG: dict = {}            # kind -> tests.sweep_support.Background
_PG = None                # the session's PostgreSQL cluster (tests/pg_support.py), started on first use
_JOB_ADDRESS = None       # the session Ray cluster's job API
_PREV_ADDRESS = None      # what Ray's address file named before the session wrote its own (None: no file)


def _pg():
    global _PG
    if _PG is None:
        from tests.pg_support import start_cluster

        _PG = start_cluster()
    return _PG


def _background(kind: str, ray):
    """The background sweep ``kind`` (started now if it is not running yet)."""
    from tests.sweep_support import PG_DATABASE, Background, private_home

    if kind not in _BG:
        address = ray.get_runtime_context().gcs_address
        root = Path(tempfile.mkdtemp(prefix=f"ctxsparse-test-{kind}-"))
        sqlite = f"sqlite:///{root / 'store.db'}"
        if kind == "shared":
            _BG[kind] = Background(kind, root, address, sqlite, private_home(root), jobs=_JOB_ADDRESS)
        elif kind == "troubled":
            _BG[kind] = Background(kind, root, address, sqlite, private_home(root))
        else:
            shared = _BG.get("shared")
            _BG[kind] = Background(kind, root, address, _pg().create_database(PG_DATABASE), private_home(root),
                                   after=shared.url if shared else None)
    return _BG[kind]


def pytest_collection_finish(session):
    opt = session.config.option
    if getattr(opt, "collectonly", False) or getattr(opt, "setuponly", False) or getattr(opt, "setupplan", False):
        return
    wanted = {kind for item in session.items for f, kind in READERS.items() if _uses(item, f)}
    if wanted:
        ray = _init_ray()
        for kind in (k for k in BACKGROUND if k in wanted):
            try:
                _background(kind, ray)
            except RuntimeError:
                pass            # (PostgreSQL unavailable) its fixture says so, failing its tests
    from tests import probe_support

    for name in probe_support.CHILDREN:
        if any(_uses(item, name) for item in session.items):
            probe_support.start(name)   # after the session cluster wrote its address file (_init_ray): jobs go there


def pytest_sessionfinish(session, exitstatus):
    for bg in _BG.values():
        bg.stop()                                      # a run cut short: no driver outlives the session
    from tests import probe_support

    probe_support.stop()


def pytest_terminal_summary(terminalreporter):
    if _BG:
        terminalreporter.write_line("background sweeps, from their start to their driver's end: " + ", ".join(
            f"{f} {bg.seconds:.0f} s" if bg.seconds is not None else f"{f} cut short" for f, bg in _BG.items()))


def pytest_unconfigure(config):
    if "ray" in sys.modules and sys.modules["ray"].is_initialized():
        sys.modules["ray"].shutdown()                  # started for the background sweeps but no test used ray_local
    if _JOB_ADDRESS is not None:                       # the address file _init_ray wrote: as it was before
        from ray._common.utils import get_ray_address_file, reset_ray_address

        if _PREV_ADDRESS is None:
            reset_ray_address()
        else:
            Path(get_ray_address_file(None)).write_text(_PREV_ADDRESS)
    for bg in _BG.values():
        shutil.rmtree(bg.root, ignore_errors=True)
    if _PG is not None:
        from tests.pg_support import remove_cluster

        remove_cluster(_PG)
    shutil.rmtree(SESSION_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def smollm2():
    from workers.loading.models import load_model

    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def pg_cluster():
    """The session's throwaway PostgreSQL (tests/pg_support.py): fails, never skips, without the binaries."""
    from tests.pg_support import PgUnavailable

    try:
        return _pg()
    except PgUnavailable as e:
        pytest.fail(str(e), pytrace=False)


def _init_ray():
    global _JOB_ADDRESS
    import ray

    if not ray.is_initialized():
        from tests.net_support import free_port

        # Jobs submitted to this cluster (tests/sweep_support.py, tests/orchestrator/test_cli_jobs.py) run
        # `python -m orchestrator.driver` with the cluster's environment: this venv's python, this checkout's code.
        bin_dir = str(Path(sys.executable).parent)
        os.environ["PATH"] = os.pathsep.join([bin_dir, os.environ.get("PATH", "")])
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
        # Ray's start-up chatter on stderr (its NPU probe's traceback on a box without the Ascend stack, the token
        # notice) goes to a file: started before the first test (pytest_collection_finish), nothing captures it
        with open(SESSION_HOME / "ray-start.log", "w") as log:
            saved = os.dup(2)
            os.dup2(log.fileno(), 2)
            try:
                ctx = ray.init(address="local", num_cpus=RAY_CPUS, resources={"NPU": 1}, include_dashboard=True,
                               dashboard_host="127.0.0.1", dashboard_port=free_port(), log_to_driver=False,
                               configure_logging=False)
            finally:
                os.dup2(saved, 2)
                os.close(saved)
        # A job's supervisor finds the cluster its driver joins through "auto": the address file `ray start`
        # writes, else ANY gcs_server running on this machine. ray.init writes no such file, so while
        # test_placement's probe cluster runs, a job submitted here could send its driver there (seen: a resumed
        # sweep's driver joined the probe and died with it). The file names this cluster for the session (and
        # whatever it named before is put back at the end; address="local" above never reads it).
        global _PREV_ADDRESS
        from ray._common.utils import get_ray_address_file
        from ray._private.utils import write_ray_address

        f = Path(get_ray_address_file(None))
        _PREV_ADDRESS = f.read_text() if f.exists() else None
        write_ray_address(ctx.address_info["gcs_address"])
        _JOB_ADDRESS = f"http://{ctx.dashboard_url}"
    return ray


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray cluster for the session: RAY_CPUS logical CPUs, and one custom ``NPU`` unit so the Ascend
    placement path (Ray sets ASCEND_RT_VISIBLE_DEVICES for it) is exercised on a CPU box; its job server (the
    dashboard's job API, ``ray_job_address``) on loopback. (Started at collection already when a background sweep
    will be read: pytest_collection_finish.)"""
    ray = _init_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def ray_job_address(ray_local) -> str:
    """The session cluster's job API (``ray job submit --address``; Ray's token authentication on, as on any
    Ray 2.60 cluster: this process and its children hold the token)."""
    return _JOB_ADDRESS


def _read(what):
    try:
        return what()
    except RuntimeError as e:
        pytest.fail(str(e), pytrace=False)


@pytest.fixture(scope="session")
def tiny_sweep(ray_local):
    """The session's real tiny SmolLM2 sweep through the Ray driver (tests/sweep_support.py: what it holds), read
    by the orchestrator and dashboard tests; it has run in the background since collection ended. Tests that add
    sweeps work on a copy (``copy_store``)."""
    from tests.sweep_support import shared_sweep

    return _read(lambda: shared_sweep(_background("shared", ray_local), RAY_TIMEOUT_S - 60))


@pytest.fixture(scope="session")
def tiny_sweep_resumed(ray_local):
    """A copy of the shared sweep's store, made right after it ran, resumed through the session cluster's job
    server by the shared sweep's background driver (``ctxsparse resume``, ``submit``, ``logs --follow``)."""
    from tests.sweep_support import resumed_sweep

    return _read(lambda: resumed_sweep(_background("shared", ray_local), RAY_TIMEOUT_S - 60))


@pytest.fixture(scope="session")
def pg_sweep(ray_local, pg_cluster):
    """The tiny sweep's dense setting and a failing fit on PostgreSQL with two evaluators (background)."""
    from tests.sweep_support import pg_sweep as read

    return _read(lambda: read(_background("pg", ray_local), pg_cluster, RAY_TIMEOUT_S - 60))


@pytest.fixture(scope="session")
def troubled_sweep(ray_local):
    """A latency-only sweep whose fitter dies every time or cannot record its units (background)."""
    from tests.sweep_support import troubled_sweep as read

    return _read(lambda: read(_background("troubled", ray_local), RAY_TIMEOUT_S - 60))
