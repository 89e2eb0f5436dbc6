"""Names every layer shares, defined once (stdlib only: importable without torch, Ray or a database).

``db/`` does not import ``workers``: where the store needs one of these it keeps a ``Literal`` of its own, and a
test checks that the two are the same.
"""
from __future__ import annotations

import hashlib

DENSE = "dense"                              # method of the always-present dense setting (an empty plan)
DEVICE_TYPES = ("cpu", "cuda", "npu")        # where a unit runs (Ray: CPUs, GPUs, the custom resource NPU)
RAY_RESOURCE = {"cuda": "GPU", "npu": "NPU"}  # the Ray resource of each accelerator device type
UNIT_KINDS = ("collect", "fit", "eval", "latency")
# latency rows' runtimes: our decode runtime dense / sparse, the dense half of a paired (interleaved) timing,
# Hugging Face generate and llama.cpp on the model's GGUF (the baselines)
RUNTIME_DENSE, RUNTIME_SPARSE, RUNTIME_DENSE_PAIRED, RUNTIME_HF, RUNTIME_LLAMA_CPP = (
    "ctxsparse-dense", "ctxsparse-sparse", "ctxsparse-dense-paired", "hf-generate", "llama.cpp")
# an eval unit's forward precision (``suites.matmul``): exact fp32; fp32 products on TF32 tensor cores (CUDA);
# the forward under bfloat16 autocast (CUDA, NPU: products and attention in bf16, norms, softmax and the residual
# stream in fp32)
MATMUL_FP32, MATMUL_TF32, MATMUL_BF16 = "fp32", "tf32", "bf16"
SHAPE_PREFIX = "shape:"                      # "shape:llama2-7b": the real shapes with random weights (GPU latency)
# the ``suite`` of a task's accuracy rows, the kind of task (workers.evals.tasks.task_kind): one multiple-choice
# task (the only ones the mean task accuracy averages), MMLU, LAMBADA, generation, other log-likelihood tasks,
# rolling log-likelihood (perplexity) tasks, and the rows of an lm-eval group
SUITE_MC, SUITE_MMLU, SUITE_LAMBADA, SUITE_GEN, SUITE_LOGLIK, SUITE_PPL, SUITE_GROUP = (
    "mc", "mmlu", "lambada", "gen", "loglik", "ppl", "group")


def is_shape(ref: str) -> bool:
    return ref.startswith(SHAPE_PREFIX)


def shape_name(ref: str) -> str:
    """``shape:llama2-7b`` -> ``llama2-7b``."""
    if not is_shape(ref):
        raise ValueError(f"{ref!r} is not a shape model (expected {SHAPE_PREFIX}NAME)")
    return ref[len(SHAPE_PREFIX):]


def shape_identity(name: str, d: int, D: int) -> tuple[str, str]:
    """(store name, fingerprint) of a random-weights shape of FFN dimensions ``d`` x ``D``.

    Kernel benchmark rows and sweep units of the same shape land on one model in the store only because both
    take their identity from here."""
    fp = hashlib.sha256(f"random-weights:{name}:{d}:{D}".encode()).hexdigest()
    return f"{name}-shape", fp
