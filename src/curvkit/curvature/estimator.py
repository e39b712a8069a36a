"""The estimator protocol (kfac-jax's split): an **estimator** owns the statistics of one curvature structure and
how they are updated batch by batch; optimisers, Laplace posteriors and reports **consume** it through
:meth:`CurvatureEstimator.operator`, which returns a :class:`~curvkit.linalg.operator.CurvatureOperator`. A new
estimator is one class that implements :class:`CurvatureEstimator` (:mod:`.estimators`: Kronecker; :mod:`.ekfac`;
:mod:`.diagonal_estimator`).

Accumulation. Without ``ema`` the statistics are sums over every datum seen, so ``operator()`` is the
curvature of the whole data set (batches weighted by their size; correct for unequal batches). With
``ema = rho`` each update replaces the statistics by ``rho * old + (1 - rho) * batch mean`` (the first
update initialises them), the curvature "momentum" of thesis Sec. 4.5.

Scale. ``operator()`` has the scale of ``likelihood``'s loss over the data it describes: the per-sample
statistics times N (all data seen, or the last batch's size with ``ema``) for ``reduction='sum'``, times
N / M for ``'mean'`` with M the counted loss terms (positions without padding; M = N for (B, C) outputs).
The SAMPLE stays the unit of ``num_data``, of the means and of batching.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Self

import torch
from torch import Tensor, nn

from curvkit import precision
from curvkit.hf import require_wrapped
from curvkit.likelihoods import Likelihood
from curvkit.linalg.layout import ParamLayout
from curvkit.linalg.operator import CurvatureOperator
from curvkit.structure import (
    differentiable,
    require_ordinary_parameters,
    uncompiled,
)
from curvkit.validation import Inputs, iter_batches, unit_interval

__all__ = ["CurvatureEstimator", "Data"]

Data = tuple[Inputs, Tensor] | Iterable[tuple[Inputs, Tensor]]


def _check_likelihood(likelihood: Any) -> Likelihood:
    if not isinstance(likelihood, Likelihood):
        raise TypeError(f"likelihood must be a curvkit.likelihoods.Likelihood, got {type(likelihood).__name__}")
    return likelihood


class CurvatureEstimator:
    """Base class: statistics updated batch by batch (optionally as a moving average), an operator out.

    Subclasses implement ``_batch_statistics(X, y) -> (list of statistic tensors summed over the batch,
    batch size, loss terms)`` and ``_operator(stats, scale) -> CurvatureOperator`` from per-sample MEAN
    statistics. The loss terms are the batch's counted positions (``likelihood.num_terms``; = the batch
    size for (B, C) outputs without padding): ``reduction='mean'`` divides by their number over all the
    data, while the sample stays the unit of ``num_data``, of the means and of batching.

    Data-parallel (``distributed=`` a :class:`curvkit.distributed.Reducer`): every update's statistics
    (sums over the rank's batch), its batch size and its counted loss terms are all-reduced in one message
    before they are combined (:meth:`_reduce`), so the estimator holds the statistics of the union of the
    ranks' batches: sums of sums, and with ``ema`` the batch mean sum_r S_r / sum_r B_r, which weights
    unequal shards by their size; the ``'mean'`` scale divides by the union's counted terms, so padded
    shards with unequal counts are the union's (:mod:`curvkit.distributed.reducer`). The finiteness check runs on the reduced statistics, so a NaN on one rank makes every
    rank raise the same error. Every rank must call ``update``/``accumulate`` equally often.
    """

    def __init__(self, model: nn.Module, likelihood: Likelihood, ema: float | None = None, distributed: Any = None,
                 statistics_dtype: torch.dtype | None = None, compute_dtype: torch.dtype | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        model = uncompiled(model)
        require_wrapped(model, type(self).__name__)
        require_ordinary_parameters(model, type(self).__name__)
        dtype = precision.model_dtype(model)
        #: the dtype of the passes (None: the model's) and of the statistics (:mod:`curvkit.precision`)
        self.compute_dtype = None if compute_dtype is None else precision.compute_dtype(dtype, compute_dtype)
        self.statistics_dtype = precision.statistics_dtype(precision.compute_dtype(dtype, compute_dtype),
                                                           statistics_dtype)
        self.distributed = distributed
        self.model = model
        self.likelihood = _check_likelihood(likelihood)
        self.ema = None if ema is None else unit_interval("ema", ema, closed_left=True)
        self.layout = ParamLayout.from_module(model)
        self.reset()

    def reset(self) -> None:
        """Forget every statistic."""
        self._stats: list[Tensor] | None = None
        self.num_data = 0  # data points behind the statistics (the last batch's size with ema)
        self.num_terms = 0  # loss terms (counted positions) behind them (the last batch's with ema)
        self.num_updates = 0

    @differentiable()
    def update(self, data: Data) -> Self:
        """Add the statistics of ``data`` (an ``(X, y)`` pair or an iterable of pairs; ``X`` a tensor or a mapping
        of tensors, :mod:`curvkit.validation`); returns self."""
        for X, y in iter_batches(data, mappings=True):
            self._combine(*self._batch_statistics(X, y))
        return self

    def _combine(self, stats: list[Tensor], B: int, terms: int) -> None:
        # summed in float32 or wider (curvkit.precision); a statistic several blocks share stays one tensor
        stats = per_object(lambda t: t.to(self.statistics_dtype), stats)
        if self.distributed is not None:
            stats, B, terms = self._reduce(stats, B, terms)
        sums = per_object(lambda t: t.sum().reshape(1), stats)  # one finiteness check, one device sync
        if sums and not bool(torch.isfinite(torch.cat([s.to(sums[0].dtype) for s in sums])).all()):
            name = next(n for s, n in zip(sums, self._stat_names()) if not bool(torch.isfinite(s).all()))
            raise ValueError(f"{type(self).__name__}: the statistic {name} of this batch contains NaN or inf; "
                             "check the inputs and the model's parameters")
        if self.ema is None:
            self._stats = stats if self._stats is None else per_object(lambda a, b: a + b, self._stats, stats)
            self.num_data += B
            self.num_terms += terms
        else:
            means = per_object(lambda t: t / B, stats)
            rho = self.ema
            self._stats = means if self._stats is None else per_object(lambda a, b: rho * a + (1 - rho) * b,
                                                                       self._stats, means)
            self.num_data = B
            self.num_terms = terms
        self._stats = self._settled(self._stats)
        self.num_updates += 1

    def _settled(self, stats: list[Tensor]) -> list[Tensor]:
        """The accumulated statistics after an update, in the form they are kept in (a subclass may change the
        form of a statistic that has grown: a Gram matrix held as rows becomes dense)."""
        return stats

    def _stat_names(self) -> list[str]:
        return [f"#{i}" for i in range(len(self._stats or []))]

    def _symmetric(self, stats: list[Tensor]) -> list[bool]:
        """Which statistics are symmetric matrices (sent as upper triangles by :meth:`_reduce`)."""
        return [False] * len(stats)

    def _reduce(self, stats: list[Tensor], B: int, terms: int) -> tuple[list[Tensor], int, int]:
        """(sum over the ranks of ``stats``, of the batch sizes, of the loss terms): one all-reduce (class
        docstring); a statistic several blocks share travels once."""
        first = {id(t): i for i, t in reversed(list(enumerate(stats)))}
        own = sorted(first.values())
        count = stats[0].new_tensor([float(B), float(terms)])
        symmetric = self._symmetric(stats)
        out = self.distributed.sum_symmetric([*(stats[i] for i in own), count], [*(symmetric[i] for i in own), False],
                                             f"{type(self).__name__} statistics")
        summed = dict(zip(own, out))
        return [summed[first[id(t)]] for t in stats], round(float(out[-1][0])), round(float(out[-1][1]))

    def _means(self) -> list[Tensor]:
        if self._stats is None:
            raise ValueError(f"{type(self).__name__} has no statistics yet: call update(data) first")
        return list(self._stats) if self.ema is not None else per_object(lambda t: t / self.num_data, self._stats)

    def scale(self) -> float:
        """The factor on per-sample means: N for ``reduction='sum'``; N / M for ``'mean'``, M the loss terms
        (counted positions) of the data (= 1 for (B, C) outputs without padding)."""
        return float(self.num_data) * self.likelihood.scale(self.num_terms)

    def operator(self) -> CurvatureOperator:
        """The current curvature estimate (scale as the module docstring)."""
        return self._operator(self._means(), self.scale())

    def _batch_statistics(self, X: Inputs, y: Tensor) -> tuple[list[Tensor], int, int]:
        raise NotImplementedError

    def _operator(self, means: list[Tensor], scale: float) -> CurvatureOperator:
        raise NotImplementedError

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {"kind": type(self).__name__,
                "stats": None if self._stats is None else per_object(lambda t: t.clone(), self._stats),
                "num_data": self.num_data, "num_terms": self.num_terms, "num_updates": self.num_updates,
                "ema": self.ema}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != type(self).__name__:
            raise ValueError(f"state_dict is for {state.get('kind')!r}, not {type(self).__name__}")
        if state.get("ema") != self.ema:
            raise ValueError(f"state_dict has ema={state.get('ema')}, this estimator ema={self.ema}")
        stats = state["stats"]
        if stats is not None:
            ref = self._reference_shapes()
            if ref is not None and [tuple(t.shape) for t in stats] != ref:
                raise ValueError("state_dict statistics do not match this model's layers")
        self._stats = None if stats is None else per_object(lambda t: t.clone(), stats)
        self.num_data, self.num_updates = int(state["num_data"]), int(state["num_updates"])
        self.num_terms = int(state.get("num_terms", self.num_data))

    def _reference_shapes(self) -> list[tuple[int, ...]] | None:
        return None


def per_object(fn: Any, *lists: list[Any]) -> list[Any]:
    """``[fn(*items) for items in zip(*lists)]``, with ``fn`` called once per distinct combination of objects:
    blocks fed by one input (the q, k and v projections, an MLP's gate and up projections) share ONE input
    statistic tensor, and every step of the accumulation keeps it one (formed, reduced, summed, checkpointed
    once; the operator then holds one factor for them)."""
    done: dict[tuple[int, ...], Any] = {}
    out = []
    for items in zip(*lists):
        key = tuple(id(t) for t in items)
        if key not in done:
            done[key] = fn(*items)
        out.append(done[key])
    return out
