"""Sparsity predictors. Each method lives in one module and registers itself by name (see base.REGISTRY)."""
from workers.predictors.base import (  # noqa: F401
    REGISTRY, FitContext, HeadPredictor, MLPPredictor, SparsityPlan, fit_method, get_method, register,
)


def _load_builtin() -> None:
    # importing registers; kept explicit so a sweep can name any of them
    from workers.predictors import oracle, static, threshold  # noqa: F401
    for optional in ("svd", "dejavu"):
        try:
            __import__(f"workers.predictors.{optional}")
        except ModuleNotFoundError as e:  # only while a method's module does not exist yet
            if e.name != f"workers.predictors.{optional}":
                raise


_load_builtin()
