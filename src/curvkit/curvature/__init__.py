"""Curvature of a model's loss as :class:`curvkit.linalg.operator.CurvatureOperator` objects.

* Exact operators (:mod:`curvkit.curvature.exact`): Hessian, GGN, type-2 Fisher, MC Fisher, empirical
  Fisher, with the convenience builders ``hessian``, ``ggn``, ``fisher``, ``mc_fisher``,
  ``empirical_fisher``; the output-space Fisher (:mod:`curvkit.curvature.output_space`).
* Kronecker-factored approximations (:mod:`curvkit.curvature.kronecker`) and the block-diagonal
  recursions (:mod:`curvkit.curvature.recursion`).
"""

from curvkit.curvature.exact import (
    EmpiricalFisherOperator,
    ExactCurvatureOperator,
    FisherOperator,
    GGNOperator,
    HessianOperator,
    MCFisherOperator,
    OutputFactorOperator,
    empirical_fisher,
    fisher,
    ggn,
    hessian,
    hessian_trace,
    mc_fisher,
    piecewise_linear_reason,
)
from curvkit.curvature.kronecker import empirical_kfac, kfac, kflr, kfra
from curvkit.curvature.output_space import output_fisher, output_fisher_sqrt
from curvkit.curvature.recursion import BlockDiagonalCurvature, blockdiag_ggn, blockdiag_hessian

__all__ = [
    "BlockDiagonalCurvature",
    "EmpiricalFisherOperator",
    "ExactCurvatureOperator",
    "FisherOperator",
    "GGNOperator",
    "HessianOperator",
    "MCFisherOperator",
    "OutputFactorOperator",
    "blockdiag_ggn",
    "blockdiag_hessian",
    "empirical_fisher",
    "empirical_kfac",
    "fisher",
    "ggn",
    "hessian",
    "hessian_trace",
    "kfac",
    "kflr",
    "kfra",
    "mc_fisher",
    "output_fisher",
    "output_fisher_sqrt",
    "piecewise_linear_reason",
]
