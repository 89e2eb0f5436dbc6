"""The interpreter runs a kernel's Python, not its compilation: every Triton kernel of kernels/ is compiled here for
sm_90 with its GPU launch options (tests/kernels/sm90_compile.py: Triton's own LLVM and ptxas, no GPU needed), in a
fresh process without TRITON_INTERPRET and with an empty Triton cache (nothing from an earlier run is reused),
started when collection ends so that it compiles beside the other tests (tests/probe_support.py)."""
import pytest

from tests.kernels import sm90_compile as S


def test_every_kernel_has_a_compile_case():
    """A kernel launched anywhere in kernels/ without a case in sm90_compile.CASES, or a @triton.jit helper that no
    compiled kernel calls, is named here (before the compile below spends half a minute)."""
    compiled = {f"{c.module}.{c.kernel}" for c in S.cases()}
    assert S.uncovered(compiled) == ([], [])
    # the check itself: a kernel dropped from the cases is reported, and so are the helpers only it calls
    missing, orphans = S.uncovered(compiled - {"decode_attn_triton._decode_attn_kernel"})
    assert missing == ["decode_attn_triton._decode_attn_kernel"] and orphans == ["decode_attn_triton._prep"]


@pytest.fixture
def sm90_compiled() -> str:
    """The compile's output; its process started when collection ended (tests/probe_support.py)."""
    from tests import probe_support

    return probe_support.output("sm90_compiled")


def test_kernels_compile_for_hopper(sm90_compiled):
    assert "OK" in sm90_compiled
