"""Optimisers, all ``torch.optim.Optimizer`` subclasses on the conventions of :mod:`curvkit.optim.base`:
``Opt(params, *, model=..., **hyperparameters)``, ``step(closure=None, *, batch=None, **extras)``,
``curvature()``, ``posterior_mean()``, ``close()``, ``state_dict``.

* Mean-field Gaussian (MESU paper 000): :class:`MESU`, :class:`MESUNoReg`, :class:`BGD`, :class:`BBBSGD`.
* Bayesian filtering (Aitchison, paper 004): factorised :class:`BFNatGrad`, :class:`BFRMSProp`,
  :class:`BFRMSPropSS`, :class:`BFAdam`, :class:`BFAdamSS`; Kronecker :class:`KFNatGrad`, :class:`KFBayes`,
  :class:`KFWhiten`; the dense reference :class:`DenseKalmanFilter`.
* Natural gradient and Langevin dynamics (paper 003): :class:`KaldiNGD`, :class:`NaturalGradient`,
  :class:`SGLD`.

Each optimiser that estimates curvature returns it from ``curvature()`` in the engine's types
(:class:`curvkit.linalg.DiagonalOperator`, :class:`curvkit.linalg.KroneckerOperator`, ...).
"""

from curvkit.optim.base import CurvatureOptimizer
from curvkit.optim.bbb import BBBSGD
from curvkit.optim.bgd import BGD
from curvkit.optim.filters import (
    BFAdam,
    BFAdamSS,
    BFNatGrad,
    BFRMSProp,
    BFRMSPropSS,
    DenseKalmanFilter,
    KFBayes,
    KFNatGrad,
    KFWhiten,
)
from curvkit.optim.kaldi_ngd import KaldiNGD
from curvkit.optim.meanfield import MeanFieldOptimizer
from curvkit.optim.mesu import MESU, MESUNoReg
from curvkit.optim.natural_gradient import NaturalGradient
from curvkit.optim.second_order import GaussNewton
from curvkit.optim.sgld import SGLD

__all__ = [
    "BBBSGD",
    "BGD",
    "MESU",
    "SGLD",
    "BFAdam",
    "BFAdamSS",
    "BFNatGrad",
    "BFRMSProp",
    "BFRMSPropSS",
    "CurvatureOptimizer",
    "DenseKalmanFilter",
    "GaussNewton",
    "KFBayes",
    "KFNatGrad",
    "KFWhiten",
    "KaldiNGD",
    "MESUNoReg",
    "MeanFieldOptimizer",
    "NaturalGradient",
]
