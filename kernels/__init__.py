"""ctxsparse kernels: sparse FFN and head-sparse attention ops for contextual sparsity.

Backends, which ``kernels.ops`` dispatches to by device (``CTXSPARSE_KERNELS`` forces one; ``ops.OPS`` is the
table of ops, and an op a backend lacks runs the reference):
  Triton     CUDA (``ffn_triton``, ``attn_triton``, ``input_sparse_triton``, ``decode_attn_triton``; the
             device-side top-k ``select_triton``); on the CPU under ``TRITON_INTERPRET=1`` for the tests;
  CPU        ``kernels.cpu``: row kernels that read only the active rows in place (a small C file compiled on
             first use, torch primitives where there is no compiler);
  NPU        ``kernels.npu``: ``index_select`` + dense matmuls (Ascend; runs on any torch device);
  reference  ``kernels.reference``: plain torch, the signature and result every backend is tested against.
``kernels.modules`` has nn.Module drop-ins. Importing this package imports torch only (Triton is imported when
a CUDA op first runs).
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
    topk_select,
    topk_threshold,
    union_active,
)
