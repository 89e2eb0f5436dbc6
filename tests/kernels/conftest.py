"""Kernel tests run the Triton kernels on the GPU when there is one, else on the CPU through
Triton's interpreter. TRITON_INTERPRET must be set before triton is first imported."""
import os

import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import secrets  # noqa: E402

import pytest  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture
def gen():
    """A fresh random generator per test; the seed is shown on failure."""
    seed = secrets.randbelow(2**31)
    g = torch.Generator(device="cpu").manual_seed(seed)
    return g


@pytest.fixture
def poison(monkeypatch):
    """Every output/workspace of the Triton ops starts as NaN (floats) or -7777 (ints)."""
    from kernels import common

    def empty(shape, device, dtype):
        t = torch.empty(shape, device=device, dtype=dtype)
        if dtype.is_floating_point:
            t.fill_(float("nan"))
        else:
            t.fill_(-7777 if dtype != torch.int8 else -77)
        return t

    monkeypatch.setattr(common, "empty", empty)
