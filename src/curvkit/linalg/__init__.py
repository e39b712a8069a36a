"""Linear algebra on parameter space: layouts, the curvature operator types, Kronecker algebra,
Krylov methods (Lanczos, CG) and stochastic trace estimators."""

from curvkit.linalg.layout import ParamLayout
from curvkit.linalg.operator import (
    CurvatureOperator,
    DenseOperator,
    DiagonalOperator,
    FunctionOperator,
    IdentityOperator,
    ScaledSumOperator,
)

__all__ = [
    "CurvatureOperator",
    "DenseOperator",
    "DiagonalOperator",
    "FunctionOperator",
    "IdentityOperator",
    "ParamLayout",
    "ScaledSumOperator",
]
