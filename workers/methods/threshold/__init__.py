"""Threshold baseline, CATS-style (method ``threshold``): no predictor, the gate runs dense and each FFN neuron is kept
iff |act(gate)| passes a per-layer threshold calibrated to the target sparsity.

Reference: CATS (Lee et al., "CATS: Contextually-Aware Thresholding for Sparsity in Large Language Models", 2024).
The method's files:

  predictor.py   the predictor (``GateThreshold``) and its fit (registered as method ``threshold``)
"""
from workers.methods.threshold import predictor  # noqa: F401  (importing registers the method)
