"""Bayesian-filtering optimisers (Aitchison 2018, "A unified theory of adaptive stochastic gradient
descent as Bayesian filtering", the July 2018 version).

Dense reference filter (paper Sec. 2.1, Eqs. 1-7), factorised filters without and with momentum
(Secs. 2.1.1-2.1.2) and Kronecker-factored filters (Sec. 2.1.3), all ``torch.optim.Optimizer`` subclasses with
a common interface: explicit loss scaling (``reduction``, ``batch_size``), lookahead bookkeeping (parameters
hold the prior mean, ``posterior_mean()`` swaps in the posterior mean), ``curvature()`` (the posterior
precision as a curvkit curvature operator), ``effective_lr()`` and ``close()`` (the Kronecker filters remove
their hooks).
"""

from curvkit.optim.filters.dense import DenseKalmanFilter
from curvkit.optim.filters.factorised import BFNatGrad, BFRMSProp, BFRMSPropSS
from curvkit.optim.filters.kfbayes import KFBayes, KFNatGrad
from curvkit.optim.filters.kfwhiten import KFWhiten
from curvkit.optim.filters.mapping import (
    adam_lr_from_eta,
    beta1_from_eta_p,
    eta_from_adam_lr,
    eta_p_from_beta1,
    regime,
    sgd_lr_from_sigma2,
    sigma2_from_sgd_lr,
    sigma2_from_weight_decay,
    weight_decay_from_sigma2,
)
from curvkit.optim.filters.momentum import BFAdam, BFAdamSS

__all__ = [
    "BFAdam",
    "BFAdamSS",
    "BFNatGrad",
    "BFRMSProp",
    "BFRMSPropSS",
    "DenseKalmanFilter",
    "KFBayes",
    "KFNatGrad",
    "KFWhiten",
    "adam_lr_from_eta",
    "beta1_from_eta_p",
    "eta_from_adam_lr",
    "eta_p_from_beta1",
    "regime",
    "sgd_lr_from_sigma2",
    "sigma2_from_sgd_lr",
    "sigma2_from_weight_decay",
    "weight_decay_from_sigma2",
]
