"""Input sparsity, TEAL and WINA (methods ``teal`` and ``wina``): no predictor, each projection of a decoder layer
drops the inputs whose score falls below its calibrated threshold (TEAL: |x_i|; WINA: |x_i|·‖W[:, i]‖₂).

References: Liu et al., "Training-free activation sparsity in large language models", ICLR 2025 (code
FasterDecoding/TEAL); WINA (2025). The calibration (workers.sparsity.input_thresholds), the allocation inside a
layer (workers.sparsity.input_allocation) and the execution (workers.sparsity.input_sparse) stay in
workers.sparsity: R-Sparse shares the calibration and the execution. The method's files:

  fit.py         the fit of both (registered as methods ``teal`` and ``wina``)
"""
from workers.methods.teal import fit  # noqa: F401  (importing registers the methods)
