"""Oracle, the upper bound (method ``oracle``): each token's true top set of FFN neurons by |act(gate)·up| (and of
heads by output norm), computed from the dense activations; it saves nothing at run time.

Reference: the existence study of Deja Vu (Liu et al., ICML 2023). The method's files:

  predictor.py   the MLP and head oracles (``OracleMLP``, ``OracleHeads``) and their fit (registered as method
                 ``oracle``)
"""
from workers.methods.oracle import predictor  # noqa: F401  (importing registers the method)
