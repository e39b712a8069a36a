"""Curvature statistics of a Laplace posterior, gathered batch by batch (thesis Sec. 5.1.1).

Every source keeps SUMS over all data seen and hands out per-datum MEANS, so the posterior precision
``N * mean + prior`` can be formed for any pseudo-data count N later (thesis Eq. 5.7/5.14: N and the prior
precision are hyperparameters changed without recomputing curvature). Batches of unequal size are weighted
by their size; with data augmentation every augmented copy counts as one datum of the mean and the caller
sets N to the size of the data set.

* :class:`KroneckerSource` - per Linear/Conv2d layer ``G_l (x) A_l`` from
  :class:`~curvkit.curvature.estimators.KroneckerEstimator` (``kflr``, ``kfac`` with ``mc_samples`` labels,
  ``kfra``, ``projection``, ``empirical``).
* :class:`DiagonalSource` - the diagonal of the GGN (``ggn``), of the Monte Carlo Fisher with sampled labels
  (``mc_fisher``: per-example squared gradients, thesis Eq. 5.10) or of the empirical Fisher, from
  :class:`~curvkit.curvature.diagonal_estimator.DiagonalEstimator`.
* :class:`DenseSource` - the dense curvature of a parameter group (``full`` Laplace of small nets, a
  BatchNorm layer's parameters) from the exact operators' ``to_dense()``, batch by batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor, nn

from curvkit import layerkinds
from curvkit.curvature import estimators
from curvkit.curvature.diagonal_estimator import DiagonalEstimator
from curvkit.curvature.estimators import (
    KroneckerEstimator,
    OptionWords,
    wide_blocks,
)
from curvkit.curvature.exact import EmpiricalFisherOperator, GGNOperator, MCFisherOperator
from curvkit.laplace._subset import only_trainable
from curvkit.likelihoods import Likelihood
from curvkit.linalg.kron import KroneckerBlock as KFactors
from curvkit.structure import read_model
from curvkit.validation import Inputs, num_samples

__all__ = ["DenseSource", "DiagonalSource", "KroneckerSource"]

KRON_METHODS = ("kflr", "kfac", "kfra", "projection", "empirical")
#: the estimator's refusals in Laplace's words (``curvature=``; Laplace has no ``output_factor``)
_WORDS = OptionWords(sampled="curvature='kfac', 'empirical' or 'projection'", dense=None)
logger = logging.getLogger(__name__)
ELEMENT_METHODS = ("ggn", "mc_fisher", "empirical")


class KroneckerSource:
    """Kronecker blocks of the parameters ``names`` from a KroneckerEstimator: every block of every layer kind
    (:mod:`curvkit.layerkinds`: ``[W | b]`` of Linear and convolutions, one block per convolution group and
    per query/key/value row slice, an embedding's ``W^T`` with a diagonal input factor, the exact or diagonal
    blocks (``factored=False``) of normalisation layers and raw parameters)."""

    def __init__(self, model: nn.Module, likelihood: Likelihood, names: Sequence[str], method: str,
                 mc_samples: int, seed: int, options: dict[str, Any] | None = None, default: bool = False):
        self.names = list(names)
        with only_trainable(model, self.names):
            if default and method == "kflr":  # the default; a vocabulary-sized output takes kfac (exactly low rank)
                wide = wide_blocks(layerkinds.plan(read_model(model), "Laplace(structure='kron')"))
                if wide:
                    method = "kfac"
                    logger.info("Laplace: curvature='kfac' (not the default 'kflr'): block(s) %s have more than %d "
                                "outputs, where KFLR's output factor would be dense and full rank", wide,
                                estimators.LOW_RANK_OUTPUTS)
            #: the curvature source in use
            self.method = method
            # 'sum': the operator is the curvature of the summed loss (every position of every sample), which
            # factors() divides by the number of samples: the per-datum curvature of thesis Eq. 5.7
            options = dict(options or {})
            if "config" not in options:
                options["mc_samples"] = mc_samples
            self.estimator = KroneckerEstimator(model, likelihood.with_reduction("sum"), method,  # type: ignore[arg-type]
                                                seed=seed, option_words=_WORDS, **options)
        # raw parameters need per-sample copies, an upcast copy of the model its own pass: the estimator's pass
        self.own_pass = (any(lp.handler.per_sample_copies for lp in self.estimator.plans)
                         or self.estimator.compute_dtype is not None)

    def update(self, X: Inputs, y: Tensor) -> Tensor | None:
        """Add the batch's statistics; returns the model's (detached) output of the forward pass they used
        (None when the estimator ran its own pass: raw parameters need per-sample copies)."""
        est = self.estimator
        with only_trainable(est.model, self.names):  # no graph through parameters the posterior leaves out
            if self.own_pass:
                est.update((X, y))
                return None
            with est.capture() as cap, torch.enable_grad():
                cap.batch = num_samples(X)
                f = est.model(X)
            est.accumulate(cap, f, y)
        return f.detach()

    def blocks(self) -> list[KFactors]:
        """The per-datum blocks (``G`` divided by the number of samples; ``A`` is a per-sample mean
        already): the per-datum curvature is ``blockdiag G (x) A``. The operator's input factors are symmetric
        already and kept as they are (no copy; blocks fed by one input share one, as in the operator)."""
        est = self.estimator
        n = float(est.num_data)
        return [KFactors.from_gram(b.G, b.A, b.weight_name, b.bias_name, scale_G=1.0 / n, index=b.index,
                                   label=b.label, factored=b.factored, second=b.second, symmetric_A=True)
                for b in est.operator().blocks]


class DiagonalSource:
    """Per-datum mean diagonal curvature of the parameters ``names``."""

    def __init__(self, model: nn.Module, likelihood: Likelihood, names: Sequence[str], method: str,
                 mc_samples: int, seed: int, **options: Any):
        self.model, self.names = model, list(names)
        with only_trainable(model, self.names):  # 'sum' divided by the samples: per-datum (mean())
            self.estimator = DiagonalEstimator(model, likelihood.with_reduction("sum"), method,  # type: ignore[arg-type]
                                               mc_samples=mc_samples, seed=seed, **options)

    def update(self, X: Inputs, y: Tensor) -> None:
        with only_trainable(self.model, self.names):
            self.estimator.update((X, y))

    def mean(self) -> dict[str, Tensor]:
        """Per-datum diagonal: the summed curvature over the samples seen."""
        op = self.estimator.operator()
        n = float(self.estimator.num_data)
        return {name: t / n for name, t in zip(op.layout.names, op.tensors)}


class DenseSource:
    """Per-datum mean dense curvature (d, d) of the parameters ``names`` (flat ``named_parameters()`` order)."""

    def __init__(self, model: nn.Module, likelihood: Likelihood, names: Sequence[str], method: str,
                 mc_samples: int, seed: int, statistics_dtype: torch.dtype | None = None,
                 compute_dtype: torch.dtype | None = None, distributed: Any = None):
        if method not in ELEMENT_METHODS:
            raise ValueError(f"unknown dense curvature {method!r}; use one of {ELEMENT_METHODS}")
        self.model, self.names, self.method = model, list(names), method
        self.likelihood = likelihood.with_reduction("sum")
        self.mc_samples = int(mc_samples)
        self.distributed = distributed
        self._seeds = torch.Generator().manual_seed(int(seed) if distributed is None else distributed.seed(int(seed)))
        self.total: Tensor | None = None
        self.count = 0
        self.dtypes: dict[str, Any] = {"statistics_dtype": statistics_dtype, "compute_dtype": compute_dtype}

    def update(self, X: Inputs, y: Tensor) -> None:
        with only_trainable(self.model, self.names):
            op: Any
            if self.method == "ggn":
                op = GGNOperator(self.model, self.likelihood, (X, y), snapshot=False, **self.dtypes)
            elif self.method == "empirical":
                op = EmpiricalFisherOperator(self.model, self.likelihood, (X, y), snapshot=False, **self.dtypes)
            else:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
                op = MCFisherOperator(self.model, self.likelihood, (X, y), mc_samples=self.mc_samples, seed=seed,
                                      snapshot=False, **self.dtypes)
            D = op.to_dense()
        if not bool(torch.isfinite(D).all()):
            raise ValueError("the dense curvature of this batch contains NaN or inf; check the inputs and the model")
        self.total = D if self.total is None else self.total + D
        self.count += num_samples(X)

    def mean(self) -> Tensor:
        """The per-datum mean; with ``distributed`` the union's (the ranks' sums and counts all-reduced once,
        here: call it once per fit)."""
        if self.total is None:
            raise ValueError("no data seen yet")
        total, count = self.total, self.count
        if self.distributed is not None:
            n = total.new_tensor([float(count)], dtype=torch.float64)  # exact beyond float32's 2^24
            total, n = self.distributed.sum_symmetric([total, n], [True, False], "Laplace dense curvature")
            count = round(float(n[0]))
        M = total / count
        return 0.5 * (M + M.T)
