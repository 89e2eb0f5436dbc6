"""One SmolLM2 calibration capture shared by the predictor tests (test_svd.py, test_dejavu.py): the same 2048
LAMBADA calibration tokens (4 windows of 512), every component of layers 3, 4 and 15. A capture is a full forward
pass whatever layers it records (~20 s for these tokens on a 2-core CPU), so the modules share one."""
from __future__ import annotations

import pytest

CALIB_LAYERS = [3, 4, 15]


@pytest.fixture(scope="session")
def smollm2_calib_cache(smollm2, tmp_path_factory):
    from workers.loading.data import token_windows
    from workers.sparsity.capture import capture_activations

    toks = token_windows(smollm2.tokenizer, "lambada", "calib", 2048, 512)
    return capture_activations(smollm2, toks, layers=CALIB_LAYERS, root=tmp_path_factory.mktemp("calib-acts"),
                               progress=False)
