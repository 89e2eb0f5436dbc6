"""ctxsparse kernels: sparse FFN and head-sparse attention ops for contextual sparsity.

Backends: Triton (CUDA; CPU via TRITON_INTERPRET=1), the index_select path (Ascend NPU, any device),
and a torch reference. ``kernels.ops`` dispatches by device; ``kernels.modules`` has nn.Module drop-ins.
Importing this package imports torch only (Triton is imported when a CUDA op first runs).
The index-buffer convention is documented in ``kernels.common``.
"""
from .common import ACTS, MAX_BATCH  # noqa: F401
from .ops import (  # noqa: F401
    backend_name,
    compact,
    gated_gather_gemv,
    gather_down,
    gather_gemv,
    head_sparse_out,
    head_sparse_qkv,
    input_sparse_linear,
    input_sparse_linear_segments,
    kv_heads_for,
    sequential_gate_filter,
    sparse_ffn,
    sparse_mlp,
    union_active,
)
