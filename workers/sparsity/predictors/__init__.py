"""Sparsity predictors: the shared base (what every predictor and plan is, the registry a sweep names methods from,
see base.REGISTRY), re-exported here. The methods themselves live in folders of workers.methods; importing this
package registers them."""
from workers.sparsity.predictors.base import (  # noqa: F401
    CAPTURES, FIT_COST, FIT_COSTS, REGISTRY, FitContext, HeadPredictor, MLPPredictor, SparsityPlan,
    check_option_names, fit_method, get_method, register,
)
import workers.methods  # noqa: F401,E402  (registers every method)
