"""Sparsity methods kept whole, one folder each: the fit, the plan part (workers.sparsity.parts) and its forms
(bundle, masked, runtime) of a method side by side. Importing registers every method and its part type."""
from workers.methods import larosa, rsparse  # noqa: F401
