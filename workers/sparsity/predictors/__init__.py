"""Sparsity predictors. Each method lives in one module (or a folder of workers.methods) and registers itself by name
(see base.REGISTRY)."""
from workers.sparsity.predictors.base import (  # noqa: F401
    CAPTURES, FIT_COST, FIT_COSTS, REGISTRY, FitContext, HeadPredictor, MLPPredictor, SparsityPlan,
    check_option_names, fit_method, get_method, register,
)
# importing registers; kept explicit so a sweep can name any of them (the methods kept whole in their own folders,
# workers.methods, register with it)
from workers.sparsity.predictors import (  # noqa: F401,E402
    dejavu, input_sparsity, oracle, static, svd, threshold,
)
import workers.methods  # noqa: F401,E402
