"""Things every backend shares: activation names, argument checks, the index-buffer convention.

Activations: ``ACTS`` is the one table of names the kernels know (its codes are the Triton kernels' ``ACT``
constexpr, see ``kernels._tl_common._act``); ``apply_act`` is their torch definition. ``gelu`` is the exact erf
GeLU, ``gelu_tanh`` its tanh approximation.

Index-buffer convention (all backends, all ops)
------------------------------------------------
* ``idx``: 1-D int32 or int64 tensor of fixed length ``K`` (the buffer size, a static shape) on the
  same device as the weights. For the FFN ops the entries are neuron (row) ids in ``[0, D)``; for the
  head ops they are head ids.
* ``count``: ``None`` (all ``K`` entries are valid: a fixed k per layer, e.g. a top-k output) or an
  int32/int64 tensor of shape ``[1]`` on the device holding how many leading entries of ``idx`` are
  valid (``0 <= count <= K``). Entries ``idx[count:]`` are never read, so any padding works.
* Outputs indexed by position ``j`` (``h[:, j]``) are written for every ``j < K``; positions
  ``j >= count`` hold 0. Nothing on the host reads ``count``: no sync, fixed shapes, so every op is
  CUDA-graph capturable.
* Batch ``B`` (rows of ``x``) shares one index set: pass the union of the tokens' active sets
  (``union_active``). Sparse kernels take ``1 <= B <= MAX_BATCH``.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

ACTS = {"none": 0, "relu": 1, "silu": 2, "gelu_tanh": 3, "gelu": 4}
MAX_BATCH = 8
FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


class Prologue(NamedTuple):
    """What a projection does to its input before the product, fused into the input-sparse kernels where they
    can (``input_sparse_linear_segments(..., prologue=)``), composed from the reference ops elsewhere: ``kind``
    "rms" (Llama's RMS norm, ``weight`` [in] in x's dtype), "rms1p" (Gemma's, ``weight`` = 1 + w in fp32),
    "act_mul" (act(gate) * up of a packed [B, 2 * in] gate|up input, ``act`` a name in ACTS)."""
    kind: str
    weight: torch.Tensor | None = None
    eps: float = 0.0
    act: str = "none"


PROLOGUES = {"rms": 1, "rms1p": 2, "act_mul": 3}   # the Triton kernels' XPRO codes (0: none)


def prologue_in(x: torch.Tensor, p: Prologue | None) -> int:
    """The product's input width for an x of width x.shape[-1] under prologue ``p`` (act_mul halves it);
    ValueError for an unknown kind or activation."""
    if p is None:
        return x.shape[-1]
    if p.kind not in PROLOGUES:
        raise ValueError(f"prologue kind must be one of {sorted(PROLOGUES)}, got {p.kind!r}")
    if p.kind == "act_mul":
        act_code(p.act)
        return x.shape[-1] // 2
    assert p.weight is not None and p.weight.shape == (x.shape[-1],), "an RMS prologue needs a weight [in]"
    return x.shape[-1]


def next_pow2(n: int) -> int:
    """The smallest power of two >= ``n`` (1 for n <= 1): block sizes, paddings, batch pads."""
    return 1 << (max(1, int(n)) - 1).bit_length()


def empty(shape, device, dtype) -> torch.Tensor:
    """Every output / workspace of the Triton ops is allocated here (tests swap in a poisoning
    version to check that every element is written)."""
    return torch.empty(shape, device=device, dtype=dtype)


def act_code(act: str) -> int:
    if act not in ACTS:
        raise ValueError(f"unknown activation {act!r}; expected one of {sorted(ACTS)}")
    return ACTS[act]


def apply_act(v: torch.Tensor, act: str) -> torch.Tensor:
    act_code(act)
    if act == "relu":
        return torch.relu(v)
    if act == "silu":
        return torch.nn.functional.silu(v)
    if act == "gelu_tanh":
        return torch.nn.functional.gelu(v, approximate="tanh")
    if act == "gelu":
        return torch.nn.functional.gelu(v)
    return v


def query_heads(S: int, q_idx, n_heads: int | None) -> int:
    """The model's query-head count for a decode attention call with ``S`` query slots: ``S`` itself when every
    head is given (``q_idx`` None), else ``n_heads`` (compact active heads), which must then be given."""
    if q_idx is None:
        return S
    if n_heads is None:
        raise ValueError("decode_attention: compact query heads (q_idx) need n_heads")
    return n_heads


def check_x(x: torch.Tensor, d: int, max_batch: int | None = MAX_BATCH) -> None:
    assert x.dim() == 2, f"x must be [B, d], got {tuple(x.shape)}"
    assert x.shape[1] == d, f"x has d={x.shape[1]}, weights have d={d}"
    assert x.dtype in FLOAT_DTYPES, f"unsupported dtype {x.dtype}"
    if max_batch is not None:
        assert 1 <= x.shape[0] <= max_batch, f"batch {x.shape[0]} outside 1..{max_batch}"


def check_weight(w: torch.Tensor, name: str, d: int, dtype: torch.dtype, device) -> None:
    assert w.dim() == 2, f"{name} must be 2-D"
    assert w.shape[1] == d, f"{name} must be [N, {d}], got {tuple(w.shape)}"
    assert w.dtype == dtype, f"{name} dtype {w.dtype} != x dtype {dtype}"
    assert w.device == device, f"{name} on {w.device}, x on {device}"
    assert w.is_contiguous(), f"{name} must be contiguous (row-major [N, d])"


def check_idx(idx: torch.Tensor, count: torch.Tensor | None, device) -> None:
    assert idx.dim() == 1, "idx must be 1-D"
    assert idx.dtype in (torch.int32, torch.int64), f"idx dtype {idx.dtype} must be int32/int64"
    assert idx.device == device, f"idx on {idx.device}, data on {device}"
    assert idx.is_contiguous(), "idx must be contiguous"
    if count is not None:
        assert count.numel() == 1 and count.dtype in (torch.int32, torch.int64), "count must be an int tensor of shape [1]"
        assert count.device == device, f"count on {count.device}, data on {device}"


def valid_mask(idx: torch.Tensor, count: torch.Tensor | None) -> torch.Tensor:
    """[K] bool, True for positions j < count. Device-side, no sync."""
    k = idx.shape[0]
    if count is None:
        return torch.ones(k, dtype=torch.bool, device=idx.device)
    return torch.arange(k, device=idx.device) < count.reshape(()).to(torch.int64)


def group_rows(idx: torch.Tensor, valid: torch.Tensor, group: int) -> torch.Tensor:
    """Row ids for position j of a grouped index: idx[j // group] * group + j % group (invalid -> 0)."""
    safe = torch.where(valid, idx.long(), torch.zeros_like(idx, dtype=torch.long))
    if group == 1:
        return safe
    r = torch.arange(group, device=idx.device)
    return (safe[:, None] * group + r[None, :]).reshape(-1)
