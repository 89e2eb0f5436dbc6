"""One definition of each shared name (workers.names), and the store's copies checked against it."""
from __future__ import annotations

import subprocess
import sys
from typing import get_args

import pytest

from workers import names


def test_the_names():
    assert names.DENSE == "dense"
    assert names.DEVICE_TYPES == ("cpu", "cuda", "npu")
    assert names.UNIT_KINDS == ("collect", "fit", "eval", "latency")
    assert names.SHAPE_PREFIX == "shape:"
    assert names.is_shape("shape:llama2-7b") and not names.is_shape("smollm2-135m")
    assert names.shape_name("shape:llama2-7b") == "llama2-7b"
    with pytest.raises(ValueError, match="not a shape model"):
        names.shape_name("smollm2-135m")


def test_shape_identity_recipe():
    import hashlib

    name, fp = names.shape_identity("llama2-7b", 4096, 11008)
    assert name == "llama2-7b-shape"
    assert fp == hashlib.sha256(b"random-weights:llama2-7b:4096:11008").hexdigest()
    assert names.shape_identity("llama2-7b", 4096, 11009)[1] != fp


def test_importable_without_torch_ray_or_a_database():
    code = ("import sys, workers.names; "
            "heavy = {'torch', 'ray', 'sqlalchemy', 'pydantic'} & set(sys.modules); assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_store_keeps_the_same_device_types():
    """db/ imports no workers: its Literal is a copy, checked here."""
    from db.schemas import DeviceType

    assert sorted(get_args(DeviceType)) == sorted(names.DEVICE_TYPES)


def test_the_front_keeps_the_same_names():
    """db/ imports no workers: the names db.front reads in the rows are copies, checked here."""
    from db.front import settings

    assert settings.DENSE == names.DENSE and settings.SUITE_MC == names.SUITE_MC
    assert (settings.RUNTIME_DENSE_PAIRED, settings.RUNTIME_HF, settings.RUNTIME_LLAMA_CPP) == (
        names.RUNTIME_DENSE_PAIRED, names.RUNTIME_HF, names.RUNTIME_LLAMA_CPP)


def test_the_unit_configs_keep_the_same_names():
    """db/ imports no workers: the kinds and precisions of the typed unit configs (db.units) are copies."""
    from db import units

    assert units.UNIT_KINDS == names.UNIT_KINDS
    assert get_args(units.Matmul) == (names.MATMUL_FP32, names.MATMUL_TF32, names.MATMUL_BF16)


def test_actors_and_spec_take_the_names():
    from orchestrator.spec import DeviceType as SpecDevice
    from workers.actors import DeviceType as ActorDevice, UnitTask

    assert get_args(SpecDevice) == get_args(ActorDevice) == names.DEVICE_TYPES
    assert get_args(UnitTask.model_fields["kind"].annotation) == names.UNIT_KINDS
