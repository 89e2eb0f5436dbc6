"""SVDP, whitened low-rank SVD predictors (method ``svd``): per layer a rank-r whitened SVD of the gate (or of gate
and up) scores every FFN neuron, and a greedily calibrated per-neuron bias decides which run.

Reference: arXiv 2603.14110. The method's files:

  predictor.py    the predictor (``SVDPredictor``: proxy + bias > 0): the form a bundle stores
  calibration.py  the calibration on the second half of the tokens: per-neuron biases, the sequential and
                  superset filters
  fit.py          the factors, the damage and the fit (registered as method ``svd``)
"""
from workers.methods.svd import fit  # noqa: F401  (importing registers the method)
