"""Static, the non-contextual lower bound (method ``static``): one fixed FFN neuron set (and head set) per layer, the
same for every token, chosen by mean importance on the calibration tokens (what a structured-pruning baseline keeps).
The method's files:

  predictor.py   the fixed-importance predictors (``StaticMLP``, ``StaticHeads``) and their fit (registered as
                 method ``static``)
"""
from workers.methods.static import predictor  # noqa: F401  (importing registers the method)
