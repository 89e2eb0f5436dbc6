"""The interpreter runs a kernel's Python, not its compilation: every Triton kernel of kernels/ is compiled here for
sm_90 with its GPU launch options (tests/kernels/sm90_compile.py: Triton's own LLVM and ptxas, no GPU needed), in a
fresh process without TRITON_INTERPRET and with an empty Triton cache (nothing from an earlier run is reused)."""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.kernels import sm90_compile as S

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_has_a_compile_case():
    """A kernel launched anywhere in kernels/ without a case in sm90_compile.CASES, or a @triton.jit helper that no
    compiled kernel calls, is named here (before the compile below spends half a minute)."""
    compiled = {f"{c.module}.{c.kernel}" for c in S.cases()}
    assert S.uncovered(compiled) == ([], [])
    # the check itself: a kernel dropped from the cases is reported, and so are the helpers only it calls
    missing, orphans = S.uncovered(compiled - {"decode_attn_triton._decode_attn_kernel"})
    assert missing == ["decode_attn_triton._decode_attn_kernel"] and orphans == ["decode_attn_triton._prep"]


def test_kernels_compile_for_hopper():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    with tempfile.TemporaryDirectory(prefix="ctxsparse-triton-cache-") as cache:
        env["TRITON_CACHE_DIR"] = cache
        r = subprocess.run([sys.executable, "-m", "tests.kernels.sm90_compile"], cwd=ROOT, env=env,
                           capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
