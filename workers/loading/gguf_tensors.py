"""The matrices of a GGUF file as raw quantized blocks (kernels.quant.QuantWeight), read with gguf-py's reader:
nothing is dequantized. Only 2-D tensors are returned (norm vectors and biases come from the loaded model).

    g = read_gguf_matrices(path)        # GGUFMatrices(architecture, {gguf name: QuantWeight}, types histogram)
    g.matrices["blk.0.ffn_up.weight"].shape    # (out, in) as the model uses it

The blocks are copied into memory (the file's memory map is not kept). Reading parses the file's metadata too
(``open_gguf``): about 1 s for SmolLM2-135M, 5-6 s for Gemma-3-270M (its 262k-token vocabulary) on a 2-core VM.
"""
from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kernels.quant import QuantWeight, format_of


@dataclass(frozen=True)
class GGUFMatrices:
    architecture: str                       # general.architecture ("llama", "gemma3", ...)
    matrices: dict = field(default_factory=dict)     # name -> QuantWeight [out, in]
    types: dict = field(default_factory=dict)        # tensor type name -> count (every tensor of the file)


@functools.cache
def _plain_reader_class():
    import gguf

    class PlainReader(gguf.GGUFReader):
        """gguf-py's reader whose fields and tensors are views of one plain array over the file's memory map
        instead of ``np.memmap`` slices: numpy's memmap subclass costs two Python calls per slice, and a vocabulary
        is two slices per token (Gemma-3: 20 s -> 6.5 s to parse on a 2-core VM, and its tokens read 40× faster).
        The values are the same bytes; only the array type differs."""

        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            itemsize = int(np.empty([], dtype=dtype).itemsize)
            arr = plain[offset:offset + itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return PlainReader


def open_gguf(path: str | Path):
    """The parsed GGUF at ``path`` (a ``gguf.GGUFReader``: fields, tensors), read-only over its memory map."""
    return _plain_reader_class()(str(path))


def read_gguf_matrices(path: str | Path) -> GGUFMatrices:
    r = open_gguf(path)
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
