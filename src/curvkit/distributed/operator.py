"""Curvature operators over data sharded across ranks: :class:`DistributedOperator`.

Each rank builds the operator of its own shard (any :class:`~curvkit.linalg.operator.CurvatureOperator`,
e.g. ``GGNOperator(model, lik, local_data)``); the wrapper is the operator of the union of the shards and
returns the same numbers on every rank.

The math. An exact operator of a loss with weight w over N points is C = w sum_n C_n. Rank r's operator
is C_r = w_r sum_{n in r} C_n with w_r = 1 ('sum') or 1/N_r ('mean'), so

    C = sum_r c_r C_r,   c_r = 1 ('sum'),   c_r = N_r / N ('mean', N = sum_r N_r, all-reduced once),

with N_r the rank's loss terms (``num_terms``: counted positions for outputs with positions and padding).
A rank whose every target is padding has no mean of its own (its ``'mean'`` operator is refused): build
every rank's operator with ``reduction='sum'`` and pass ``weight=1 / N`` (N = ``distributed.sum_int`` of
the ranks' ``num_terms``).

Everything LINEAR in C is computed locally on the shard, scaled by c_r and all-reduced (one message):
products ``C @ M``, quadratic forms, the exact diagonal, ``to_dense``, the exact trace, and Hutchinson's
trace and diagonal with probes shared by every rank (the generator is synchronised from rank 0, or a
shared one is created when none is given). Everything NONLINEAR (Lanczos eigenvalues, CG ``solve`` and
``inverse``, SLQ log-determinants, Hutch++'s QR, the dense log-determinant) runs the base class's
algorithm on the all-reduced products; since every rank then sees identical products and identical
start vectors, every rank computes identical iterates.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor

from curvkit.distributed.reducer import Reducer
from curvkit.linalg.operator import CurvatureOperator, DiagonalOperator, TraceMethod

__all__ = ["DistributedOperator"]


class DistributedOperator(CurvatureOperator):
    """The operator of the union of every rank's shard (module docstring).

    Args:
        local: this rank's operator, built on its shard (the same model and parameters on every rank).
        distributed: the :class:`Reducer`.
        weight: c_r explicitly; by default N_r/N for an exact operator of a ``'mean'`` loss (its
            ``num_terms``, the counted loss terms, and ``likelihood.reduction``) and 1 otherwise (the
            operators are summed).
    """

    def __init__(self, local: CurvatureOperator, distributed: Reducer, weight: float | None = None):
        if not isinstance(local, CurvatureOperator):
            raise TypeError(f"local must be a CurvatureOperator, got {type(local).__name__}")
        if not isinstance(distributed, Reducer):
            raise TypeError(f"distributed must be a curvkit.distributed.Reducer, got {type(distributed).__name__}")
        super().__init__(local.layout, local.dtype, local.device)
        self.local = local
        self.reducer = distributed
        distributed.check_same((local.layout.names, tuple(tuple(s) for s in local.layout.shapes)),
                               "the operator's parameter layout")
        n_local = getattr(local, "num_data", None)
        lik = getattr(local, "likelihood", None)
        self.num_data = distributed.sum_int(n_local) if n_local is not None else None
        if weight is not None:
            self.weight = float(weight)
        elif n_local is not None and lik is not None and getattr(lik, "reduction", None) == "mean":
            terms = getattr(local, "num_terms", n_local)  # loss terms: positions that are not padding
            self.weight = float(terms) / float(distributed.sum_int(terms))  # the same collective on every rank
        else:
            self.weight = 1.0

    def __repr__(self) -> str:
        return f"DistributedOperator({self.local!r}, rank={self.reducer.rank}/{self.reducer.world_size})"

    def _reduce(self, t: Tensor) -> Tensor:
        out = t * self.weight if self.weight != 1.0 else t.clone()
        return self.reducer.all_reduce_([out], f"{type(self.local).__name__} product")[0]

    def _generator(self, generator: torch.Generator | None) -> torch.Generator:
        if generator is None:
            return self.reducer.shared_generator(self.local.device)
        return self.reducer.sync_generator(generator)

    # ------------------------------------------------------------------ linear in C: local, scaled, summed
    def _matmat(self, M: Tensor) -> Tensor:
        return self._reduce(self.local._matmat(M))

    def quadratic_form(self, M: Tensor) -> Tensor:
        return self._reduce(self.local.quadratic_form(M))

    def _exact_diagonal(self) -> DiagonalOperator:
        return DiagonalOperator.from_flat(self.layout, self._reduce(self.local.diagonal().flat))

    def diagonal(self, method: Literal["exact", "hutchinson"] = "exact", num_probes: int = 100,
                 generator: torch.Generator | None = None, **kwargs: Any) -> DiagonalOperator:
        if method == "exact":
            return DiagonalOperator.from_flat(self.layout,
                                              self._reduce(self.local.diagonal("exact", **kwargs).flat))
        if method == "hutchinson":
            gen = self._generator(generator)
            local = self.local.diagonal("hutchinson", num_probes=num_probes, generator=gen)  # type: ignore[call-arg]
            return DiagonalOperator.from_flat(self.layout, self._reduce(local.flat))
        raise ValueError(f"unknown diagonal method {method!r}; use 'exact' or 'hutchinson'")

    def to_dense(self) -> Tensor:
        return self._reduce(self.local.to_dense())

    def trace(self, method: TraceMethod = "exact", num_probes: int = 100, generator: torch.Generator | None = None,
              distribution: Literal["rademacher", "gaussian"] = "rademacher", **kwargs: Any) -> Tensor:
        """``exact`` and ``hutchinson``: the local trace (shared probes), scaled and summed (one scalar
        all-reduce); ``hutch++``: the base algorithm on the all-reduced products."""
        if method == "exact":
            return self._reduce(self.local.trace("exact", **kwargs))
        if method == "hutchinson":
            gen = self._generator(generator)
            return self._reduce(self.local.trace("hutchinson", num_probes=num_probes, generator=gen,
                                                 distribution=distribution, **kwargs))
        if method == "hutch++":
            return super().trace(method, num_probes, self._generator(generator), distribution)
        raise ValueError(f"unknown trace method {method!r}; use 'exact', 'hutchinson' or 'hutch++'")

    # ------------------------------------------------------------------ nonlinear: base algorithms, shared start
    def eigenvalues(self, k: int = 1, which: Literal["largest", "smallest"] = "largest",
                    num_iter: int | None = None, generator: torch.Generator | None = None) -> Tensor:
        return super().eigenvalues(k, which, num_iter, self._generator(generator))

    def logdet(self, damping: float = 0.0, *, method: Literal["exact", "slq"] = "exact", num_probes: int = 30,
               num_iter: int = 60, generator: torch.Generator | None = None) -> Tensor:
        gen = self._generator(generator) if method == "slq" else generator
        return super().logdet(damping, method=method, num_probes=num_probes, num_iter=num_iter, generator=gen)
