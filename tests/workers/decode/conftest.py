"""Decode tests run at one torch thread, restored after.

The tests of the quantized CPU decode (test_quant_decode.py, test_native_layer.py, test_quant_input_sparse.py,
test_quant_output_sparse.py) take the ``cpu_isa`` fixture: each case runs on one instruction-set build of the
native CPU kernels, set and checked before it starts (tests/kernels/isa_support.py). ``CTXSPARSE_TEST_ISAS``
chooses the builds (default: every one this CPU runs, kernels.isa.runnable()); the tests marked ``every_isa`` run
on each of them, the others on the native build.
"""
import pytest
import torch

from tests.kernels import isa_support


def pytest_configure(config):
    config.addinivalue_line("markers", isa_support.MARK_HELP)


def pytest_generate_tests(metafunc):
    isa_support.generate(metafunc)


def pytest_collection_modifyitems(config, items):
    isa_support.deselect(config, items)


@pytest.fixture
def cpu_isa(request):
    """This case's instruction-set build, loaded and checked (tests/kernels/isa_support.py)."""
    with isa_support.build(request.param) as name:
        yield name


@pytest.fixture(autouse=True)
def _one_thread():
    """Decode tests run at one torch thread (the CPU kernels' and the timings' setting), restored after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
