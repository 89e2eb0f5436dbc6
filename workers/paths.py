"""Where ctxsparse keeps its caches, and how a cache entry is published atomically."""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path


def home() -> Path:
    """Base folder for caches: ``$CTXSPARSE_HOME`` or ``~/.cache/ctxsparse``."""
    base = os.environ.get("CTXSPARSE_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "ctxsparse")
    path = Path(base)
    path.mkdir(parents=True, exist_ok=True)
    return path


def model_cache() -> Path:
    """Cache of the packaged model weights (assembled GGUFs, their float safetensors conversions), every entry
    keyed by the content it was made from: ``$CTXSPARSE_MODEL_CACHE`` or ``home()/models``. A separate variable
    so that runs with their own ``CTXSPARSE_HOME`` (the test suite) can still share it."""
    base = os.environ.get("CTXSPARSE_MODEL_CACHE")
    path = Path(base) if base else home() / "models"
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_json_atomic(path: Path, obj) -> None:
    """Write ``obj`` as JSON to ``path`` through a per-process temporary file and one rename: a reader sees the
    old file or the whole new one, and two processes writing the same key do not share a temporary file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(obj))
    os.replace(tmp, path)


@contextlib.contextmanager
def atomic_dir(final: Path):
    """Yield a scratch folder beside ``final``; on success it is renamed to ``final`` in one step.

    A crash or exception leaves only a ``.tmp-*`` folder (removed here on exceptions), never a
    folder at ``final`` that looks complete. If another process published ``final`` first, ours is
    discarded and theirs kept (same key, same content).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        try:
            os.rename(tmp, final)
        except OSError:
            if not final.exists():
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextlib.contextmanager
def exclusive(lock_path: Path):
    """Hold an exclusive advisory lock on ``lock_path`` (created if missing) for the block: the processes of one
    node that would build the same cache entry at once (a sweep's actors starting together) take turns, so one
    builds it and the others find it made. The lock goes with the holder's process, a killed one included."""
    lock_path = Path(lock_path)
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)
