"""CPU backend: sparse FFN / projection ops that read only the active weight rows, in place.

Same signatures and outputs as kernels.reference (and kernels.ffn_triton / attn_triton), plus
:func:`input_sparse_linear` and :func:`token_sparse_ffn`. Nothing gathers the active rows into a copy:

* output sparsity (gate/up/fc1/qkv): one dot product per active row of ``W`` [N, d] (``rows_dot``), each row read
  once for the B tokens that share the set;
* the down / output projection and input sparsity: a weighted sum of rows of ``Wᵀ`` [in, out] (``rows_axpy``),
  per token (bags) or shared by the batch;
* input sparsity (:func:`input_sparse_linear_segments`): the rows of ``Wᵀ`` of the active inputs, found and
  streamed in one call, each output segment (fused QKV, gate|up) with its own threshold, scalar or one per input
  channel (WINA's |x_i|·‖W[:, i]‖ > t is |x_i| > t/‖W[:, i]‖: the product itself unchanged);
* :func:`threshold_ffn`: the FFN after a dense first projection, only the up/down rows of the neurons whose
  |act(gate)| passes a threshold (1/3 + 2/3·(1 - s) of a gated FFN's rows).

Both come from a small C file (``cpu_native.c``, fp32, OpenMP, compiled with the machine's C compiler on first
use for the instruction set ``CTXSPARSE_CPU_ISA`` asks for (kernels.isa: native, avx2 or scalar) and cached under
``$CTXSPARSE_HOME``/``~/.cache/ctxsparse``). Where there is no compiler or the build fails, a
:class:`NativeBuildWarning` (once per library) gives the compiler's message; ``CTXSPARSE_CPU_NATIVE=0`` chooses the
fallback knowingly, without one. Then, and for other dtypes, the same ops run on torch primitives:
``F.embedding_bag`` for the row sums (no copy; one thread per bag) and ``index_select`` + ``F.linear`` for the row
dots (a gathered copy). ``native_available()`` says which one runs; kernels.native.native_status / describe what
was built, for which instruction set, or why not (every native library: this one and kernels.cpu_quant's). Dense
products at full density use the same kernels over every row (``dense_ffn``): on a 2-core CPU they read the
weights faster than MKL's GEMV (see ``benchmarks/cpu_ops.py``).
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path

import torch
import torch.nn.functional as F

from . import isa as _isa
from . import reference as _ref
from .common import ACTS, MAX_BATCH, act_code, apply_act, group_rows, query_heads, valid_mask

_SRC = Path(__file__).with_name("cpu_native.c")
# linked into every native library: cs_isa() says what the compiler targeted (512 / 2 / 1 / 0)
_ISA_SRC = Path(__file__).with_name("cpu_isa.c")
ISA_OF_CODE = {512: "avx512", 2: "avx2", 1: "neon", 0: "scalar"}
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
NATIVE_ENV = "CTXSPARSE_CPU_NATIVE"     # "0": no native library (the torch fallback, chosen: no warning)
LIBRARIES = ("cpu_native", "cpu_quant")
# a library's parts: the C files its source includes by a quoted name (cpu_quant.c, one translation unit of them)
_PART_RE = re.compile(rb'^[ \t]*#[ \t]*include[ \t]+"([^"/]+\.c)"', re.M)


class NativeBuildWarning(RuntimeWarning):
    """A native CPU library did not build or load: its ops run on the torch fallback (much slower)."""


class NativeBuildError(RuntimeError):
    """Why a native library is not there (the compiler's message, trimmed)."""


def _flags() -> list[str]:
    """Compiler flags; ``CTXSPARSE_CPU_CFLAGS`` adds some (e.g. ``-DPF_DIST=8`` when tuning the prefetch)."""
    return _FLAGS + os.environ.get("CTXSPARSE_CPU_CFLAGS", "").split()


def native_flags(isa: str | None = None, extra_flags=()) -> list[str]:
    """Every flag a native library is compiled with: the common ones, those of the instruction-set build ``isa``
    (kernels.isa; default: the one ``CTXSPARSE_CPU_ISA`` asks for, a ValueError for an unknown one) and
    ``extra_flags`` (the library's own)."""
    return _flags() + list(_isa.build_flags(isa)) + list(extra_flags)


_LIB = None
_LIB_TRIED = False
_LIB_STATUS: dict | None = None         # the default library's status (library_status)
_WARNED: set[str] = set()               # libraries whose failure was reported
_LOCK = threading.Lock()
_WARN_LOCK = threading.Lock()
_ENV = os.environ


# ---------------------------------------------------------------------------------------------------------
# the native library
def _cache_dir() -> Path:
    base = os.environ.get("CTXSPARSE_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "ctxsparse")
    return Path(base) / "cpu_kernels"


def _cpu_tag() -> str:
    """-march=native: the build is only valid on CPUs with the same feature flags."""
    return platform.machine() + " " + " ".join(sorted(_isa.cpu_flags()))


def native_disabled() -> bool:
    """``CTXSPARSE_CPU_NATIVE=0``: the native libraries are not built nor loaded (the fallback, knowingly)."""
    return _ENV.get(NATIVE_ENV) == "0"


def _trim(text: str, lines: int = 10, chars: int = 1200) -> str:
    """A compiler's output, readable: its error lines (else its last lines), at most ``chars`` characters."""
    ls = [l.rstrip() for l in (text or "").splitlines() if l.strip()]
    errs = [l for l in ls if "error" in l.lower() or "fatal" in l.lower()]
    out = "\n".join(errs[:lines] if errs else ls[-lines:])
    return (out[:chars] + " [...]") if len(out) > chars else (out or "(the compiler printed nothing)")


def _parts(src: Path) -> list[Path]:
    """The C files ``src`` includes by a quoted name, in order: the parts it compiles as one translation unit
    (kernels/cpu_quant.c's cpu_quant_*.c; cpu_native.c's cpu_head.c)."""
    return [src.parent / m.decode() for m in _PART_RE.findall(src.read_bytes())]


def _compile(src: Path, flags: list[str]) -> Path:
    """The cached build of ``src`` (+ cpu_isa.c) with ``flags``; NativeBuildError says why there is none. The
    cache key hashes ``src``, its parts (:func:`_parts`), cpu_isa.c and every header beside them."""
    cc_env = os.environ.get("CC")
    cc = cc_env or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        raise NativeBuildError("no C compiler found (CC is unset and neither cc nor gcc is on PATH)")
    if not src.exists() or not _ISA_SRC.exists():
        raise NativeBuildError(f"{src.name} or {_ISA_SRC.name} is missing beside the package")
    srcs = [src, *_parts(src)]
    missing = [p.name for p in srcs if not p.exists()]
    if missing:
        raise NativeBuildError(f"{', '.join(missing)} (included by {src.name}) missing beside the package")
    text = (b"".join(p.read_bytes() for p in srcs) + _ISA_SRC.read_bytes()
            + b"".join(h.read_bytes() for h in sorted(src.parent.glob("*.h"))))
    key = hashlib.sha256(text + " ".join(flags).encode() + _cpu_tag().encode() + cc.encode()).hexdigest()[:16]
    out = _cache_dir() / f"{src.stem}-{key}.so"
    if out.exists():
        return out
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
        os.close(fd)
    except OSError as e:
        raise NativeBuildError(f"the kernel cache {out.parent} is not writable: {e}") from None
    try:
        cmd = [*shlex.split(cc), *flags, "-o", tmp, str(src), str(_ISA_SRC), "-lm"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            raise NativeBuildError(f"the C compiler {cc!r} did not run: {e}") from None
        if r.returncode != 0:
            raise NativeBuildError(f"{cc} exited with status {r.returncode}:\n{_trim(r.stderr or r.stdout)}")
        os.replace(tmp, out)              # atomic: concurrent builders publish the same file
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _warn_once(name: str, build: str, error: str) -> None:
    with _WARN_LOCK:
        if name in _WARNED:
            return
        _WARNED.add(name)
    warnings.warn(f"the native CPU library {name} ({build} build, kernels/{name}.c) is not available: {error}\n"
                  f"Its ops run on the torch fallback instead (much slower). Fix the C compiler, or set "
                  f"{NATIVE_ENV}=0 to choose the fallback without this warning.", NativeBuildWarning, stacklevel=4)


def compile_native(src: Path, extra_flags=(), *, isa: str | None = None) -> Path | None:
    """Compile ``src`` (a C file beside this module, with the headers and the parts it includes beside it, linked
    with cpu_isa.c) for the instruction-set build ``isa`` (kernels.isa; default: ``CTXSPARSE_CPU_ISA``'s) into a
    shared library cached by the content of the sources, the flags, the compiler and the CPU. None where there is
    no compiler or the build fails, after a :class:`NativeBuildWarning` (once per library) with the compiler's
    message; None, silently, with ``CTXSPARSE_CPU_NATIVE=0``."""
    flags = native_flags(isa, extra_flags)
    if native_disabled():
        return None
    try:
        return _compile(src, flags)
    except NativeBuildError as e:
        _warn_once(src.stem, _isa.requested() if isa is None else isa, str(e))
        return None


def load_native(src: Path, setup, extra_flags=(), *, isa: str | None = None) -> tuple[ctypes.CDLL | None, dict]:
    """(the library of ``src`` built for ``isa``, its status) -- the library loaded, ``setup(lib)`` given its
    argument types, its ``cs_isa()`` read; else (None, a status with the error) after a warning, once per
    library. The status: ``built``, ``isa`` (what the compiler targeted: avx512, avx2, neon, scalar; None when
    not built), ``error`` (None when built), ``requested`` (the build asked for) and ``flags``."""
    requested = _isa.requested() if isa is None else isa
    flags = native_flags(isa, extra_flags)
    st = {"built": False, "isa": None, "error": None, "requested": requested, "flags": " ".join(flags)}
    try:
        path = _compile(src, flags)
        try:
            lib = ctypes.CDLL(str(path))
            lib.cs_isa.argtypes, lib.cs_isa.restype = [], ctypes.c_int
            built_for = library_isa(lib)
            setup(lib)
        except (OSError, AttributeError) as e:
            raise NativeBuildError(f"the built library {path.name} does not load: {e}") from None
    except NativeBuildError as e:
        st["error"] = str(e)
        _warn_once(src.stem, requested, str(e))
        return None, st
    st.update(built=True, isa=built_for, path=str(path))
    return lib, st


def library_isa(lib: ctypes.CDLL) -> str:
    """What a loaded native library was compiled for: "avx512", "avx2", "neon" or "scalar" (its cs_isa())."""
    code = int(lib.cs_isa())
    return ISA_OF_CODE.get(code, f"unknown ({code})")


def _setup(lib: ctypes.CDLL) -> None:
    P, I64, I = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    lib.cs_rows_dot.argtypes = [P, P, P, I64, I64, P, I64, I64, P, I64, I, P, P, I]
    lib.cs_rows_axpy.argtypes = [P, I64, I64, I64, P, P, I64, P, I64, I, P, P, P, I]
    lib.cs_input_sparse_seg.argtypes = [P, I64, I64, I64, P, I64, I, P, P, P, P, P, P, I64, I]
    lib.cs_pair_dot.argtypes = [P, P, I64, I64, P, P, I64, P, P, I]
    lib.cs_ffn.argtypes = [P, P, P, P, P, I64, I64, P, I64, P, I64, I, P, P, I]
    lib.cs_ffn_thr.argtypes = [P, I64, ctypes.c_float, I, P, P, P, P, P, I64, P, I64, P, P, P, P, P, I]
    lib.cs_topk_threshold.argtypes = [P, I64, I64, I64, I, P]
    lib.cs_head_screen.argtypes = [P, P, I64, I64, P, I64, P, I]
    lib.cs_topk_index.argtypes = [P, I64, I64, I64, P, I]
    F = ctypes.c_float
    lib.cs_add_rmsnorm.argtypes = [P, P, P, P, P, I64, I64, F, I]
    lib.cs_add_rmsnorm.restype = None
    lib.cs_decode_attn.argtypes = [P, I64, I64, P, I64, I64, P, I64, I64, P, P, I64, I64, I64, I64, I64, P, P, P,
                                   P, F, P, I64, P, I64, I64, I64, I64, I64, I64, I64, I]
    lib.cs_decode_attn.restype = I
    for f in (lib.cs_rows_dot, lib.cs_rows_axpy, lib.cs_input_sparse_seg, lib.cs_pair_dot, lib.cs_ffn,
              lib.cs_topk_threshold, lib.cs_head_screen, lib.cs_topk_index):
        f.restype = I
    lib.cs_ffn_thr.restype = I64


def _native():
    global _LIB, _LIB_TRIED, _LIB_STATUS
    if _ENV.get(NATIVE_ENV) == "0":
        return None
    if not _LIB_TRIED:
        with _LOCK:
            if not _LIB_TRIED:
                _LIB, _LIB_STATUS = load_native(_SRC, _setup)     # ValueError for an unknown CTXSPARSE_CPU_ISA
                _LIB_TRIED = True
    return _LIB


def reload_native() -> None:
    """Forget the loaded native libraries (this module's and kernels.cpu_quant's), their status and the
    warnings given: the next op loads the build ``CTXSPARSE_CPU_ISA`` asks for now (built, or from the cache).
    How the tests run every instruction set in one process; objects that hold a library (a
    kernels.cpu_quant.LayerStack) keep theirs."""
    global _LIB, _LIB_TRIED, _LIB_STATUS
    with _LOCK:
        _LIB, _LIB_TRIED, _LIB_STATUS = None, False, None
    with _WARN_LOCK:
        _WARNED.clear()
    cq = sys.modules.get(__package__ + ".cpu_quant")
    if cq is not None:
        cq._forget()


def library_status() -> dict | None:
    """The status (load_native's) of this module's library; None before its first use."""
    return _LIB_STATUS


def native_available() -> bool:
    """True when the compiled kernels run (else the torch-primitive fallback)."""
    return _native() is not None


_F32 = torch.float32


def _ok(t) -> bool:
    return t is None or (t.dtype is _F32 and t.is_cpu and t.is_contiguous())


def _use_native(a, b=None, c=None, d=None, e=None, f=None, *, rows_t=None) -> bool:
    """fp32 CPU tensors, contiguous (``rows_t``: rows may be strided, elements of a row contiguous). Written out
    (no generator): it runs once per op, per layer and token."""
    if not (_ok(a) and _ok(b) and _ok(c) and _ok(d) and _ok(e) and _ok(f)):
        return False
    if rows_t is not None and not (rows_t.dtype is _F32 and rows_t.is_cpu and rows_t.stride(1) == 1):
        return False
    return _native() is not None


def _p(t):
    return None if t is None else t.data_ptr()


def _check(rc: int) -> None:
    if rc != 0:
        raise IndexError("an active index is outside the weight's rows")


def _idx64(idx, count):
    """(active rows int64 [k], k): the valid prefix of the index buffer (reading count is free on the CPU)."""
    if count is None:
        k = idx.shape[0]
        return (idx if idx.dtype is torch.int64 and idx.is_contiguous() else idx.to(torch.int64).contiguous()), k
    k = max(0, min(idx.shape[0], int(count)))
    return idx[:k].to(torch.int64).contiguous(), k


def _cd(x):
    """Intermediate dtype: fp64 for fp64 inputs (the tests' ground truth), else fp32."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _threads() -> int:
    return max(1, torch.get_num_threads())


# ---------------------------------------------------------------------------------------------------------
# primitives
def rows_dot(x, w, rows, kpad, *, w2=None, bias=None, act="none", scale=None):
    """out [B, kpad] fp32: out[:, j] = act(x @ w[rows[j]] + bias[rows[j]]) (* x @ w2[rows[j]]) (* scale[:, j]) for
    j < len(rows), 0 beyond. ``rows`` int64 [k] (None: rows 0..kpad-1)."""
    B, d = x.shape
    k = kpad if rows is None else rows.shape[0]
    x = x.contiguous()
    scale = scale.contiguous() if scale is not None else None
    if _use_native(x, w, w2, bias, scale):
        out = torch.empty(B, kpad, dtype=torch.float32)
        _check(_native().cs_rows_dot(_p(w), _p(w2), _p(bias), w.shape[0], d, _p(rows), k, kpad, _p(x), B,
                                     act_code(act), _p(scale), _p(out), _threads()))
        return out
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    r = torch.arange(k) if rows is None else rows
    z = F.linear(x.to(cd), w.index_select(0, r).to(cd), bias.index_select(0, r).to(cd) if bias is not None else None)
    h = apply_act(z, act)
    if w2 is not None:
        h = h * F.linear(x.to(cd), w2.index_select(0, r).to(cd))
    out = torch.zeros(B, kpad, dtype=cd)
    out[:, :k] = h
    if scale is not None:
        out = out * scale.to(cd)
    return out


def rows_axpy(weights, w_t, rows, *, bias=None, offsets=None):
    """Weighted sums of rows of ``w_t`` [in, out] -> [B, out].

    Shared set (``offsets`` None): ``weights`` [B, K] (K >= len(rows)), y[b] = sum_j weights[b, j] · w_t[rows[j]]
    (``rows`` None: every row, K = in). Per-token bags: ``weights`` [P] and ``rows`` [P] flat, ``offsets`` [B + 1]
    int64 (bag b = offsets[b]:offsets[b+1]).
    """
    n = w_t.shape[1]
    shared = offsets is None
    if shared:
        B, K = weights.shape
        k = w_t.shape[0] if rows is None else rows.shape[0]
        off = torch.tensor([0, k], dtype=torch.int64)
    else:
        B = offsets.shape[0] - 1
        off = offsets.to(torch.int64).contiguous()
    weights = weights.contiguous()
    if _use_native(weights, bias, rows_t=w_t):
        nt = _threads()
        wts = weights
        y = torch.empty(B, n, dtype=torch.float32)
        scratch = torch.empty(nt * B * n if nt > 1 and (shared or B < nt) else 1, dtype=torch.float32)
        _check(_native().cs_rows_axpy(_p(w_t), w_t.shape[0], n, w_t.stride(0), _p(rows), _p(wts),
                                      K if shared else 0, _p(off), B, int(shared), _p(bias), _p(y), _p(scratch), nt))
        return y
    cd = torch.float64 if torch.float64 in (weights.dtype, w_t.dtype) else torch.float32
    if shared and rows is None:
        y = weights.to(cd) @ w_t.to(cd)
        return y + bias.to(cd) if bias is not None else y
    if shared:
        inp = rows.repeat(B)
        psw = weights[:, :k].reshape(-1)
        off = torch.arange(B, dtype=torch.int64) * k
    else:
        inp, psw, off = rows, weights, off[:-1]
    y = F.embedding_bag(inp, w_t.to(cd), off, per_sample_weights=psw.to(cd), mode="sum")
    return y + bias.to(cd) if bias is not None else y


def ffn_rows(x, w_gate, w_up, w_down_t, rows, act, *, b_up=None, b_down=None):
    """The FFN over the neurons ``rows`` (int64 [k]; None: all) for a batch sharing them, in one pass: per active
    neuron its gate/up (or fc1) dot products and at once its row of W_downᵀ, each thread on its own neurons.
    ``w_gate`` None: non-gated MLP (act(fc1 + b_up)). Returns [B, d] fp32 (None if the native kernels do not
    run for these tensors)."""
    x = x.contiguous()
    if not _use_native(x, w_gate, w_up, w_down_t, b_up, b_down):
        return None
    B, d = x.shape
    k = w_up.shape[0] if rows is None else rows.shape[0]
    nt = _threads()
    y = torch.empty(B, d, dtype=_F32)
    scratch = torch.empty(nt * B * d if nt > 1 else 1, dtype=_F32)
    _check(_native().cs_ffn(w_gate.data_ptr() if w_gate is not None else None, w_up.data_ptr(), _p(b_up),
                            w_down_t.data_ptr(), _p(b_down), w_up.shape[0], d, _p(rows), k, x.data_ptr(), B,
                            ACTS[act], y.data_ptr(), scratch.data_ptr(), nt))
    return y


def linear(x, w, bias=None):
    """x @ wᵀ (+ bias) for a few tokens (w [out, in]): the row kernel over every row where it runs (it reads the
    weights faster than MKL's GEMV on a small CPU), else ``F.linear``."""
    if x.shape[0] <= MAX_BATCH and _use_native(x.contiguous(), w, bias):
        return rows_dot(x, w, None, w.shape[0], bias=bias)
    return F.linear(x, w, bias)


def linear_t(x, w_t, bias=None):
    """x @ w_t (+ bias) with w_t = Wᵀ [in, out]: a weighted sum of every row of w_t, else a matmul."""
    if x.shape[0] <= MAX_BATCH and _use_native(x.contiguous(), w_t, bias):
        return rows_axpy(x, w_t, None, bias=bias)
    y = x @ w_t
    return y + bias if bias is not None else y


# ---------------------------------------------------------------------------------------------------------
# ops with kernels.reference's signatures
def gated_gather_gemv(x, w_gate, w_up, idx, count=None, act="silu", out_dtype=None, *, config=None):
    rows, _ = _idx64(idx, count)
    return rows_dot(x, w_gate, rows, idx.shape[0], w2=w_up, act=act).to(out_dtype or x.dtype)


def gather_gemv(x, w, idx, count=None, act="none", bias=None, scale=None, out_dtype=None, *, config=None):
    rows, _ = _idx64(idx, count)
    return rows_dot(x, w, rows, idx.shape[0], bias=bias, act=act, scale=scale).to(out_dtype or x.dtype)


def gather_down(h, w_t, idx, count=None, bias=None, group=1, *, out_dtype=None, config=None):
    K = idx.shape[0]
    rows, k = _idx64(idx, count)
    if group > 1:
        rows = group_rows(rows, torch.ones(k, dtype=torch.bool), group)
    y = rows_axpy(h.reshape(h.shape[0], K * group), w_t, rows, bias=bias)
    return y.to(out_dtype or w_t.dtype)


def sequential_gate_filter(x, w_gate, idx, count=None, act="silu", threshold=0.0, *, config=None):
    a = gather_gemv(x, w_gate, idx, count, act, out_dtype=_cd(x))
    keep = valid_mask(idx, count) & (a.abs() > threshold).any(dim=0)
    idx2, count2, a2 = _ref.compact(keep, idx, a)
    return a2, idx2, count2


def sparse_ffn(x, w_gate, w_up, w_down_t, idx, count=None, act="silu", threshold=None, *, path=None, config=None):
    if threshold is not None:
        a2, idx2, count2 = sequential_gate_filter(x, w_gate, idx, count, act, threshold)
        h = gather_gemv(x, w_up, idx2, count2, scale=a2, out_dtype=_cd(x))
        return gather_down(h, w_down_t, idx2, count2, out_dtype=x.dtype)
    y = ffn_rows(x, w_gate, w_up, w_down_t, _idx64(idx, count)[0], act)
    if y is not None:
        return y.to(x.dtype)
    h = gated_gather_gemv(x, w_gate, w_up, idx, count, act, out_dtype=_cd(x))
    return gather_down(h, w_down_t, idx, count, out_dtype=x.dtype)


def sparse_mlp(x, w_fc1, b_fc1, w_fc2_t, b_fc2, idx, count=None, act="relu", *, path=None, config=None):
    y = ffn_rows(x, None, w_fc1, w_fc2_t, _idx64(idx, count)[0], act, b_up=b_fc1, b_down=b_fc2)
    if y is not None:
        return y.to(x.dtype)
    h = gather_gemv(x, w_fc1, idx, count, act=act, bias=b_fc1, out_dtype=_cd(x))
    return gather_down(h, w_fc2_t, idx, count, bias=b_fc2, out_dtype=x.dtype)


def dense_ffn(x, w_gate, w_up, w_down_t, act="silu", mask=None):
    """Dense FFN through the same kernels over every neuron (``mask`` [D] keeps the masked-in neurons only)."""
    rows = None if mask is None else mask.nonzero().reshape(-1)
    y = ffn_rows(x, w_gate, w_up, w_down_t, rows, act)
    return y.to(x.dtype) if y is not None else _ref.dense_ffn(x, w_gate, w_up, w_down_t, act, mask)


def dense_mlp(x, w_fc1, b_fc1, w_fc2_t, b_fc2, act="relu", mask=None):
    rows = None if mask is None else mask.nonzero().reshape(-1)
    y = ffn_rows(x, None, w_fc1, w_fc2_t, rows, act, b_up=b_fc1, b_down=b_fc2)
    return y.to(x.dtype) if y is not None else _ref.dense_mlp(x, w_fc1, b_fc1, w_fc2_t, b_fc2, act, mask)


def head_sparse_qkv(x, w_qkv, q_idx, q_count, kv_idx, kv_count, n_heads, n_kv_heads, head_dim, bias=None,
                    *, config=None):
    B = x.shape[0]
    outs = []
    for part_idx, part_count, off in ((q_idx, q_count, 0), (kv_idx, kv_count, n_heads),
                                      (kv_idx, kv_count, n_heads + n_kv_heads)):
        heads, k = _idx64(part_idx, part_count)
        rows = group_rows(heads + off, torch.ones(k, dtype=torch.bool), head_dim)
        z = rows_dot(x, w_qkv, rows, part_idx.shape[0] * head_dim, bias=bias)
        outs.append(z.to(x.dtype).view(B, part_idx.shape[0], head_dim))
    return tuple(outs)


def head_sparse_out(attn, w_o_t, q_idx, q_count=None, head_dim=None, bias=None, *, config=None):
    B = attn.shape[0]
    return gather_down(attn.reshape(B, -1), w_o_t, q_idx, q_count, bias=bias, group=head_dim,
                       out_dtype=attn.dtype)


# ---------------------------------------------------------------------------------------------------------
# decode-step glue: norms and attention (kernels.reference's functions, in C for fp32)
def rms_norm(x, w, eps: float, one_plus: bool = False):
    if x.dim() != 2 or not _use_native(x, w):
        return _ref.rms_norm(x, w, eps, one_plus)
    h = torch.empty_like(x)
    _native().cs_add_rmsnorm(x.data_ptr(), None, None, w.data_ptr(), h.data_ptr(), x.shape[0], x.shape[1],
                             eps, int(one_plus))
    return h


def add_rms_norm(x, y, w, eps: float, one_plus: bool = False):
    if x.dim() != 2 or x.shape != y.shape or not _use_native(x, y, w):
        return _ref.add_rms_norm(x, y, w, eps, one_plus)
    xo, h = torch.empty_like(x), torch.empty_like(x)
    _native().cs_add_rmsnorm(x.data_ptr(), y.data_ptr(), xo.data_ptr(), w.data_ptr(), h.data_ptr(), x.shape[0],
                             x.shape[1], eps, int(one_plus))
    return xo, h


def _rows_f32(t) -> bool:
    return t.dtype is _F32 and t.is_cpu and t.stride(-1) == 1


def decode_attention(q, k, v, k_cache, v_cache, pos, cos_t=None, sin_t=None, q_norm=None, k_norm=None,
                     eps: float = 1e-6, window=None, q_idx=None, q_count=None, n_heads=None, valid=None, *,
                     config=None):
    """kernels.reference.decode_attention in one native call (fp32; other dtypes and per-position masks take
    the reference)."""
    args = (q, k, v, k_cache, v_cache, pos, cos_t, sin_t, q_norm, k_norm, eps, window, q_idx, q_count, n_heads)
    if (valid is not None or _native() is None or not (_rows_f32(q) and _rows_f32(k) and _rows_f32(v))
            or not (_ok(k_cache) and _ok(v_cache) and _ok(cos_t) and _ok(sin_t) and _ok(q_norm) and _ok(k_norm))):
        return _ref.decode_attention(*args, valid=valid)
    B, S, hd = q.shape
    KV = k.shape[1]
    H = query_heads(S, q_idx, n_heads)
    idx, n_active = (None, S) if q_idx is None else _idx64(q_idx, q_count)
    out = torch.empty(B, S * hd, dtype=q.dtype)
    rc = _native().cs_decode_attn(
        q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), v.data_ptr(), v.stride(0),
        v.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        k_cache.shape[2], int(pos), _p(cos_t), _p(sin_t), _p(q_norm), _p(k_norm), eps, _p(idx), n_active,
        out.data_ptr(), out.stride(0), B, S, KV, H, hd, int(window or 0), _threads())
    if rc != 0:
        raise IndexError("decode_attention: position or query head outside the cache / head range")
    return out


# ---------------------------------------------------------------------------------------------------------
# input sparsity and per-token sets
def head_screen(z, screen: "_ref.HeadScreen"):
    """kernels.reference.head_screen (every vocabulary row's screen score from int8 tiles): the C kernel."""
    z = z.to(_F32).contiguous()
    if z.dim() != 2 or z.shape[1] != screen.rank:
        raise ValueError(f"z must be [B, {screen.rank}], got {tuple(z.shape)}")
    if not _use_native(z):
        return _ref.head_screen(z, screen)
    out = torch.empty(z.shape[0], screen.vocab, dtype=_F32)
    _check(_native().cs_head_screen(_p(screen.codes), _p(screen.scale), screen.vocab, screen.rank, _p(z),
                                    z.shape[0], _p(out), _threads()))
    return out


def topk_index(x, k: int):
    """kernels.reference.topk_index (each row's k largest, unsorted, ties by lowest index): a selection in C."""
    x = x.to(_F32).contiguous()
    B, n = x.shape
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in [1, n={n}]")
    if not _use_native(x):
        return _ref.topk_index(x, k)
    out = torch.empty(B, k, dtype=torch.int64)
    _check(_native().cs_topk_index(_p(x), B, n, k, _p(out), _threads()))
    return out


def topk_threshold(x, k, nseg=1):
    """kernels.reference.topk_threshold (each row's threshold keeping its k largest |x|): a quickselect in C."""
    xc = x[None] if x.dim() == 1 else x
    B, n = xc.shape
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be in [1, n={n}]")
    if not _use_native(xc):
        return _ref.topk_threshold(x, k, nseg)
    out = torch.empty(B, nseg, dtype=_F32)
    _check(_native().cs_topk_threshold(_p(xc), B, n, k, nseg, _p(out)))
    return out


def input_sparse_linear(x, w_t, threshold, bias=None, *, config=None, counts=None):
    """y = (x · [|x| > t]) @ w_t (+ bias): only the rows of ``w_t`` = Wᵀ [in, out] of the active inputs are read
    (each once for the batch). x [B, in]; ``threshold`` a float, a one-element tensor, or a tensor [in] of one
    threshold per input channel (WINA: t / ‖W[:, i]‖₂, see :func:`input_sparse_linear_segments`). ``counts``: a
    float64 CPU tensor of one element to which the number of active (token, input) entries is added. Returns
    [B, out] in x's dtype."""
    if x.dim() != 2 or w_t.dim() != 2 or x.shape[1] != w_t.shape[0]:
        raise ValueError(f"x must be [B, in] and w_t [in, out]; got {tuple(x.shape)} and {tuple(w_t.shape)}")
    return input_sparse_linear_segments(x, w_t, [threshold], [w_t.shape[1]], bias, counts=counts)


_SEGS: dict = {}


def _seg_bounds(sizes) -> torch.Tensor:
    key = tuple(sizes)
    t = _SEGS.get(key)
    if t is None:
        t = torch.tensor([0, *torch.tensor(key).cumsum(0).tolist()], dtype=torch.int64)
        _SEGS[key] = t
    return t


def _seg_thresholds(thresholds, nseg: int, n_in: int):
    """(scalar thresholds fp32 [nseg] or None, per-channel thresholds fp32 [nseg, in] or None)."""
    if isinstance(thresholds, torch.Tensor):
        if thresholds.dim() == 2:
            if thresholds.shape != (nseg, n_in):
                raise ValueError(f"per-channel thresholds must be [{nseg}, {n_in}], got {tuple(thresholds.shape)}")
            return None, thresholds.to(device="cpu", dtype=_F32).contiguous()
        if thresholds.numel() != nseg:
            raise ValueError(f"{nseg} threshold(s) expected, got {thresholds.numel()}")
        return thresholds.to(device="cpu", dtype=_F32).reshape(nseg).contiguous(), None
    thresholds = list(thresholds)
    if len(thresholds) != nseg:
        raise ValueError(f"{nseg} threshold(s) expected, got {len(thresholds)}")
    per = [isinstance(t, torch.Tensor) and t.numel() > 1 for t in thresholds]
    if not any(per):
        return torch.tensor([float(t) for t in thresholds], dtype=_F32), None
    rows = []
    for t, p in zip(thresholds, per):
        if p and t.numel() != n_in:
            raise ValueError(f"a per-channel threshold needs {n_in} entries, got {t.numel()}")
        rows.append(t.reshape(n_in).to(device="cpu", dtype=_F32) if p else torch.full((n_in,), float(t), dtype=_F32))
    return None, torch.stack(rows)


def input_sparse_linear_segments(x, w_t, thresholds, sizes, bias=None, *, config=None, counts=None, topk=None):
    """Projections sharing x with Wᵀ concatenated along out (fused QKV): segment j (``sizes[j]`` columns) keeps
    input i iff |x_i| > its threshold, ``thresholds[j]``: a float / one-element tensor, or a tensor [in] (one
    threshold per input channel). ``thresholds`` may also be one tensor [nseg] or [nseg, in]. ``topk`` (then
    ``thresholds`` None): every segment keeps each token's own ``topk`` largest |x_i| (the threshold of
    ``topk_threshold``, computed in the kernel). The active rows are read once, in place, each token adding its
    own active segments. ``counts``: float64 CPU tensor [nseg] to which the active (token, input) entries of each
    segment are added."""
    sizes = [int(s) for s in sizes]
    if x.dim() != 2 or w_t.dim() != 2 or x.shape[1] != w_t.shape[0]:
        raise ValueError(f"x must be [B, in] and w_t [in, out]; got {tuple(x.shape)} and {tuple(w_t.shape)}")
    if sum(sizes) != w_t.shape[1]:
        raise ValueError(f"segment sizes {sizes} must sum to out = {w_t.shape[1]}")
    nseg = len(sizes)
    if not 1 <= nseg <= 8:
        raise ValueError(f"1 to 8 segments, got {nseg}")
    B, n_in = x.shape
    n = w_t.shape[1]
    if (topk is None) == (thresholds is None):
        raise ValueError("give thresholds or topk, not both")
    if topk is not None and not 1 <= topk <= n_in:
        raise ValueError(f"topk={topk} must be in [1, in={n_in}]")
    thr, tvec = _seg_thresholds(thresholds, nseg, n_in) if topk is None else (None, None)
    xc = x.contiguous()
    if counts is not None and not (counts.dtype == torch.float64 and counts.is_cpu and counts.is_contiguous()
                                   and counts.numel() == nseg):
        raise ValueError(f"counts must be a contiguous float64 CPU tensor of {nseg} element(s)")
    if _use_native(xc, bias, rows_t=w_t):
        y = torch.empty(B, n, dtype=_F32)
        rc = _native().cs_input_sparse_seg(_p(w_t), n_in, n, w_t.stride(0), _p(xc), B, nseg, _p(_seg_bounds(sizes)),
                                           _p(thr), _p(tvec), _p(bias), _p(y), _p(counts), topk or 0, _threads())
        if rc != 0:
            raise RuntimeError("input-sparse kernel failed (segment bounds or memory)")
        return y.to(x.dtype)
    t_tok = None if topk is None else _ref.topk_threshold(x, topk)   # [B, 1]: each token's own
    outs, lo = [], 0
    for j, s in enumerate(sizes):
        t = t_tok if t_tok is not None else tvec[j] if tvec is not None else thr[j]
        keep = x.abs() > t.to(x.dtype if x.dtype == torch.float64 else _F32)
        if counts is not None:
            counts[j] += float(keep.sum())
        tok, rows = keep.nonzero(as_tuple=True)
        offsets = torch.zeros(B + 1, dtype=torch.int64)
        offsets[1:] = torch.bincount(tok, minlength=B).cumsum(0)
        b = None if bias is None else bias[lo:lo + s]
        outs.append(rows_axpy(x[tok, rows], w_t[:, lo:lo + s], rows, bias=b, offsets=offsets))
        lo += s
    return torch.cat(outs, dim=1).to(x.dtype)


def threshold_ffn(x, z, w_up, w_down_t, threshold, act, *, b_act=None, b_score=None, b_down=None, stat=None):
    """The FFN after its first projection ``z`` = x W1ᵀ [B, D] (gate, or fc1 without its bias) was computed
    dense: a = act(z + b_act), token b keeps neuron j iff |act(z + b_score)| > ``threshold`` (``b_score is
    b_act``: the same activation), y_b = b_down + Σ_{j kept by b} a_bj (· <w_up[j], x_b> when ``w_up`` is given:
    gated) · w_down_t[j]. Only the rows of ``w_up`` and ``w_down_t`` of the neurons some token keeps are read.
    ``stat``: a float64 CPU tensor (one element) to which the number of neurons read is added.
    Returns (y [B, d] in x's dtype, neurons read) or None where the native kernels do not run."""
    xc, zc = x.contiguous(), z.contiguous()
    if not _use_native(xc, zc, w_up, w_down_t, b_act, b_score) or not _ok(b_down):
        return None
    if stat is not None and not (stat.dtype == torch.float64 and stat.is_cpu):
        raise ValueError("stat must be a float64 CPU tensor")
    B, d = xc.shape
    D = zc.shape[1]
    nt = _threads()
    y = torch.empty(B, d, dtype=_F32)
    coef = torch.empty(B * D, dtype=_F32)
    lst = torch.empty(D, dtype=torch.int64)
    scratch = torch.empty(nt * B * d if nt > 1 else 1, dtype=_F32)
    same = b_score is b_act
    k = _native().cs_ffn_thr(_p(zc), D, float(threshold), act_code(act), _p(b_act),
                             _p(b_act) if same else _p(b_score), _p(w_up), _p(w_down_t), _p(b_down), d, _p(xc), B,
                             _p(y), _p(coef), _p(lst), _p(scratch), _p(stat), nt)
    return y.to(x.dtype), int(k)


def token_sparse_ffn(x, w_up, w_down_t, mask, act, w_gate=None, b_up=None, b_down=None, filter_threshold=None):
    """kernels.token_sparse.token_sparse_ffn on the row kernels: each token's selected neurons only, the down
    projection as per-token bags over W_downᵀ. Same arguments and returns (y, pairs first, pairs kept)."""
    if x.dim() != 2 or mask.shape != (x.shape[0], w_up.shape[0]):
        raise ValueError(f"x must be [T, d] and mask [T, D]; got {tuple(x.shape)} and {tuple(mask.shape)}")
    T, d = x.shape
    tok, cols = mask.nonzero(as_tuple=True)
    n_first = tok.numel()
    first = w_gate if w_gate is not None else w_up
    a = _pair_dots(x, first, tok, cols, b_up if w_gate is None else None)
    a = apply_act(a, act)
    if filter_threshold is not None:
        keep = a.abs() > filter_threshold
        tok, cols, a = tok[keep], cols[keep], a[keep]
    h = a * _pair_dots(x, w_up, tok, cols, None) if w_gate is not None else a
    offsets = torch.zeros(T + 1, dtype=torch.int64)
    offsets[1:] = torch.bincount(tok, minlength=T).cumsum(0)
    y = rows_axpy(h.to(w_down_t.dtype), w_down_t, cols, bias=b_down, offsets=offsets)
    return y.to(x.dtype), n_first, tok.numel()


def _pair_dots(x, w, tok, cols, bias):
    """<x[tok[p]], w[cols[p]]> (+ bias[cols[p]]) for every selected (token, neuron) pair, token by token."""
    xc = x.contiguous()
    if _use_native(xc, w, bias):
        out = torch.empty(tok.numel(), dtype=torch.float32)
        _check(_native().cs_pair_dot(_p(w), _p(bias), w.shape[0], w.shape[1], _p(tok.contiguous()),
                                     _p(cols.contiguous()), tok.numel(), _p(xc), _p(out), _threads()))
        return out
    cd = torch.float64 if x.dtype == torch.float64 else torch.float32
    z = (x.to(cd)[tok] * w.to(cd)[cols]).sum(-1)
    return z + bias.to(cd)[cols] if bias is not None else z

