"""The diagonal estimator: the diagonal of the GGN (exact, ``ggn``), of the type-2 Fisher with sampled labels
(``mc_fisher``) or of the empirical Fisher (``empirical``), summed over batches as
:class:`~curvkit.curvature.estimator.CurvatureEstimator` describes."""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from curvkit.curvature.config import renamed_method
from curvkit.curvature.estimator import CurvatureEstimator
from curvkit.likelihoods import Likelihood
from curvkit.linalg.operator import CurvatureOperator, DiagonalOperator
from curvkit.structure import (
    curvature_kernels,
)
from curvkit.validation import Inputs, integer, num_samples

__all__ = ["DiagonalEstimator"]

DiagonalMethod = Literal["ggn", "mc_fisher", "empirical"]


class DiagonalEstimator(CurvatureEstimator):
    """Diagonal curvature summed (or averaged) over data, as a :class:`DiagonalOperator`.

    ``method``: ``ggn`` (the exact GGN diagonal, = the type-2 Fisher's for the built-in heads; R batched
    backward passes per batch for Linear/Conv2d models), ``mc_fisher`` (squared per-example gradients at
    ``mc_samples`` labels sampled from the model, averaged), ``empirical`` (squared per-example gradients
    at the data labels: the empirical Fisher, EWC's choice). Scale and ``ema`` as
    :class:`CurvatureEstimator`. The batches draw their labels from one generator seeded ``seed``.
    ``statistics_dtype`` / ``compute_dtype``: as :class:`KroneckerEstimator` (:mod:`curvkit.precision`); each
    batch's diagonal is summed in the statistics dtype over its samples and over the batches.
    """

    def __init__(self, model: nn.Module, likelihood: Likelihood, curvature: DiagonalMethod = "ggn", *,
                 mc_samples: int = 1, ema: float | None = None, seed: int = 0, distributed: Any = None,
                 statistics_dtype: torch.dtype | None = None, compute_dtype: torch.dtype | None = None,
                 method: DiagonalMethod | None = None):
        method = renamed_method(curvature, method, "DiagonalEstimator", "ggn")
        if method not in ("ggn", "mc_fisher", "empirical"):
            raise ValueError(f"unknown diagonal method {method!r}; use 'ggn', 'mc_fisher' or 'empirical'")
        self.method = method
        self.mc_samples = integer("mc_samples", mc_samples)
        self._seeds = torch.Generator().manual_seed(int(seed) if distributed is None else distributed.seed(int(seed)))
        super().__init__(model, likelihood, ema, distributed, statistics_dtype, compute_dtype)

    def _batch_statistics(self, X: Inputs, y: Tensor) -> tuple[list[Tensor], int, int]:
        from curvkit.curvature.exact import EmpiricalFisherOperator, GGNOperator, MCFisherOperator

        lik = self.likelihood.with_reduction("sum")
        op: CurvatureOperator
        dtypes: dict[str, Any] = {"compute_dtype": self.compute_dtype, "statistics_dtype": self.statistics_dtype}
        if self.method == "ggn":
            op = GGNOperator(self.model, lik, (X, y), snapshot=False, **dtypes)
        elif self.method == "empirical":
            op = EmpiricalFisherOperator(self.model, lik, (X, y), snapshot=False, **dtypes)
        else:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
            op = MCFisherOperator(self.model, lik, (X, y), mc_samples=self.mc_samples, seed=seed, snapshot=False,
                                  **dtypes)
        with torch.no_grad(), curvature_kernels():  # the loss terms of the batch (counted positions)
            terms = self.likelihood.num_terms(self.model(X), y)
        return [op.diagonal().flat], num_samples(X), terms

    def _stat_names(self) -> list[str]:
        return ["diagonal"]

    def _reference_shapes(self) -> list[tuple[int, ...]] | None:
        return [(self.layout.dim,)]

    def operator(self) -> DiagonalOperator:
        return self._operator(self._means(), self.scale())

    def _operator(self, means: list[Tensor], scale: float) -> DiagonalOperator:
        return DiagonalOperator.from_flat(self.layout, means[0] * scale)
