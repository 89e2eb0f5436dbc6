"""Sparsity predictors. Each method lives in one module and registers itself by name (see base.REGISTRY)."""
from workers.sparsity.predictors.base import (  # noqa: F401
    CAPTURES, FIT_COST, FIT_COSTS, REGISTRY, FitContext, HeadPredictor, MLPPredictor, SparsityPlan,
    check_option_names, fit_method, get_method, register,
)
# importing registers; kept explicit so a sweep can name any of them
from workers.sparsity.predictors import (  # noqa: F401,E402
    dejavu, input_sparsity, larosa, oracle, rsparse, static, svd, threshold,
)
