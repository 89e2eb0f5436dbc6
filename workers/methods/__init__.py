"""Sparsity methods, one folder each: a method's fit, its predictors or plan part (workers.sparsity.parts) and their
forms (bundle, masked, runtime) side by side; the shared interfaces and the registry are
workers.sparsity.predictors.base. Importing registers every method (and every part type)."""
from workers.methods import dejavu, head, larosa, oracle, rsparse, static, svd, teal, threshold  # noqa: F401
