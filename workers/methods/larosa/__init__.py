"""LaRoSA, layerwise rotated sparse activation (method ``larosa``): each block input rotated by its calibration
PCA, folded into the weights, and each token keeps its top-k rotated entries.

Reference: Liu et al., "LaRoSA: Enhancing LLM Efficiency via Layerwise Rotated Sparse Activation", ICML 2025
(arXiv 2507.01299; code alibaba/EfficientAI, ``larosa/``). The method's files:

  rotations.py   the input groups, the residual stream's bases and the bytes the rotations cost
  part.py        its plan part (``RotatedPlan``, kind ``larosa``): the bundle form and the forms below
  masked.py      the masked form on a Hugging Face model (accuracy rows)
  runtime.py     the decode runtime's form (rotations folded into the weights, the step's top-k paths)
  fit.py         the fit from the calibration covariances (registered as method ``larosa``)
"""
from workers.methods.larosa import fit, part  # noqa: F401  (importing registers the method and its part)
