"""Linear algebra on parameter space: layouts, the curvature operator types, Kronecker algebra,
Krylov methods (Lanczos, CG) and stochastic trace estimators."""

from curvkit.linalg.kron import KroneckerBlock, KroneckerOperator
from curvkit.linalg.krylov import conjugate_gradient, lanczos, lanczos_eigenvalues
from curvkit.linalg.layout import ParamLayout
from curvkit.linalg.operator import (
    CurvatureOperator,
    DenseOperator,
    DiagonalOperator,
    FunctionOperator,
    IdentityOperator,
    ScaledSumOperator,
)
from curvkit.linalg.trace import hutchinson, hutchpp

__all__ = [
    "CurvatureOperator",
    "DenseOperator",
    "DiagonalOperator",
    "FunctionOperator",
    "IdentityOperator",
    "KroneckerBlock",
    "KroneckerOperator",
    "ParamLayout",
    "ScaledSumOperator",
    "conjugate_gradient",
    "hutchinson",
    "hutchpp",
    "lanczos",
    "lanczos_eigenvalues",
]
