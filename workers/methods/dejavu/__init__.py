"""Deja Vu, learned contextual sparsity (method ``dejavu``): a rank-r predictor per layer scores every FFN neuron (and,
with ``attn_sparsity``, every attention head) from the block input, and each token keeps its top-k.

Reference: Liu et al., "Deja Vu: Contextual Sparsity for Efficient LLMs at Inference Time", ICML 2023; code
FMInference/DejaVu, ``sparse_predictor/``. The method's files:

  predictor.py   the MLP and head predictor modules (``fc2(fc1(x))``, top-k): the form a bundle stores
  fit.py         labels, loss, regression start and training (registered as method ``dejavu``)
"""
from workers.methods.dejavu import fit  # noqa: F401  (importing registers the method)
