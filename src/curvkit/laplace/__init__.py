"""Laplace posteriors of neural networks (Botev's thesis, chapter 5; Ritter, Botev & Barber 2018).

* :class:`Laplace` - the one entry point: ``structure`` ``'kron'`` (Eq. 5.14) | ``'diag'`` | ``'full'``,
  ``subset`` ``'all'`` | ``'last_layer'`` | names, ``curvature`` ``'kflr'`` | ``'kfac'`` | ``'kfra'`` |
  ``'ggn'`` | ``'mc_fisher'`` | ...; ``fit`` over batches, N and the prior precision changeable afterwards,
  ``precision()``/``covariance()`` as curvature operators, ``sample``, ``predict`` (MC, Eq. 5.9, or the
  linearised GLM predictive), ``log_marginal_likelihood``, ``state_dict``.
* :mod:`curvkit.laplace.predictive` - the predictives; :mod:`curvkit.laplace.selection` - prior precision
  by marginal likelihood and the thesis's (N, prior precision) grid search on validation NLL.
"""

from curvkit.laplace.operators import BlockSumOperator
from curvkit.laplace.posterior import Laplace, log_likelihood
from curvkit.laplace.predictive import (
    functional_variance,
    glm_predictive,
    mc_predictive,
    predictive_function,
    predictive_nll,
)
from curvkit.laplace.selection import default_grids, grid_search, optimize_prior_precision

__all__ = [
    "BlockSumOperator",
    "Laplace",
    "default_grids",
    "functional_variance",
    "glm_predictive",
    "grid_search",
    "log_likelihood",
    "mc_predictive",
    "optimize_prior_precision",
    "predictive_function",
    "predictive_nll",
]
