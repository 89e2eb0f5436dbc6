"""The matrices of a GGUF file as raw quantized blocks (kernels.quant.QuantWeight), read with gguf-py's reader:
nothing is dequantized. Only 2-D tensors are returned (norm vectors and biases come from the loaded model).

    g = read_gguf_matrices(path)        # GGUFMatrices(architecture, {gguf name: QuantWeight}, types histogram)
    g.matrices["blk.0.ffn_up.weight"].shape    # (out, in) as the model uses it

The blocks are copied into memory (the file's memory map is not kept). Reading parses the file's metadata too:
about 3 s for SmolLM2-135M, 15-20 s for Gemma-3-270M (its 262k-token vocabulary) on a 2-core VM.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kernels.quant import QuantWeight, format_of


@dataclass(frozen=True)
class GGUFMatrices:
    architecture: str                       # general.architecture ("llama", "gemma3", ...)
    matrices: dict = field(default_factory=dict)     # name -> QuantWeight [out, in]
    types: dict = field(default_factory=dict)        # tensor type name -> count (every tensor of the file)


def read_gguf_matrices(path: str | Path) -> GGUFMatrices:
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    f = r.get_field("general.architecture")
    arch = bytes(f.parts[f.data[0]]).decode() if f is not None else ""
    types = collections.Counter(t.tensor_type.name for t in r.tensors)
    mats = {}
    for t in r.tensors:
        if len(t.shape) != 2:
            continue
        fmt = format_of(t.tensor_type)
        cols, rows = (int(s) for s in t.shape)          # ggml order: ne0 = columns
        data = np.asarray(t.data).view(np.uint8).reshape(rows, -1)
        mats[t.name] = QuantWeight.of(fmt, data, cols)
    return GGUFMatrices(arch, mats, dict(types))
