"""Curvature of a model's loss as :class:`curvkit.linalg.operator.CurvatureOperator` objects.

* Exact operators (:mod:`curvkit.curvature.exact`): Hessian, GGN, type-2 Fisher, MC Fisher, empirical
  Fisher, with the convenience builders ``hessian``, ``ggn``, ``fisher``, ``mc_fisher``,
  ``empirical_fisher``; the output-space Fisher (:mod:`curvkit.curvature.output_space`); of an FSDP2-sharded
  model over the ranks' data: :func:`sharded_operator` (:mod:`curvkit.curvature.sharded`).
* Estimators updated batch by batch (:mod:`curvkit.curvature.estimators`: Kronecker and diagonal;
  :mod:`curvkit.curvature.ekfac`: eigenvalue-corrected Kronecker), the
  one-shot Kronecker factors (:mod:`curvkit.curvature.kronecker`) and the block-diagonal recursions
  (:mod:`curvkit.curvature.recursion`).
* :class:`CurvatureConfig` (:mod:`curvkit.curvature.config`): the options of the Kronecker statistics, one
  name and one default shared by every entry point.
* Metrics comparing an estimate with a reference (:mod:`curvkit.curvature.compare`).
"""

from curvkit.curvature.config import CurvatureConfig
from curvkit.curvature.diagonal_estimator import DiagonalEstimator
from curvkit.curvature.ekfac import EKFACEstimator, FirstBatchBasisWarning
from curvkit.curvature.estimator import CurvatureEstimator
from curvkit.curvature.estimators import KroneckerEstimator
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
from curvkit.curvature.sharded import sharded_operator

__all__ = [
    "BlockDiagonalCurvature",
    "CurvatureConfig",
    "CurvatureEstimator",
    "DiagonalEstimator",
    "EKFACEstimator",
    "EmpiricalFisherOperator",
    "ExactCurvatureOperator",
    "FirstBatchBasisWarning",
    "FisherOperator",
    "GGNOperator",
    "HessianOperator",
    "KroneckerEstimator",
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
    "sharded_operator",
]
