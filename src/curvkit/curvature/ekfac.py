"""Eigenvalue-corrected Kronecker curvature (EKFAC; George, Laurent, Bouthillier, Ballas & Vincent 2018).

A Kronecker block ``G (x) A`` has the eigenvectors ``QG[:, i] (x) QA[:, j]`` and the eigenvalues
``lG_i lA_j``. EKFAC keeps the eigenvectors and replaces the eigenvalues by the curvature's own second
moments along them,

    s_ij = (1/N) sum_n sum_v w_v ( QG^T dW_{n,v} QA )_ij^2,        dW_{n,v} = sum_t g_{n,v,t} a_hat_{n,t}^T,

the per-sample gradient of output-space vector v (the estimator's method: the R columns of the output
Hessian's square root for ``kflr``, sampled-label gradients for ``kfac``, ...) of datum n summed over the
T output locations of a convolution (T = 1 for ``nn.Linear``). Among all operators that are diagonal in
that eigenbasis, ``s`` minimises the Frobenius distance to the block ``sum_n sum_v w_v vec(dW) vec(dW)^T``
that the per-sample rows represent (for ``kflr`` the exact GGN block); KFAC's ``lG lA`` is in general not
that minimiser. The operator is a :class:`~curvkit.linalg.kron.KroneckerSpectralOperator`, so damping,
inverses, log-determinants and the diagonal stay closed forms.

Two passes: the eigenbasis comes from Kronecker factors, given as ``basis`` (a
:class:`~curvkit.linalg.kron.KroneckerOperator`, e.g. ``kflr(model, lik, data)``) or, by default, the
factors of the first batch passed to :meth:`EKFACEstimator.update`; the scalings are then accumulated over
every batch in that fixed basis. Same scale and moving-average conventions as
:class:`~curvkit.curvature.estimators.CurvatureEstimator`.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from torch import Tensor, nn

from curvkit.curvature.estimators import CurvatureEstimator, KroneckerEstimator, KroneckerMethod
from curvkit.likelihoods import Likelihood
from curvkit.linalg.kron import KroneckerOperator, KroneckerSpectralOperator

__all__ = ["EKFACEstimator"]

_BUDGET = 2**24  # scalars of per-sample projected gradients held at once


class EKFACEstimator(CurvatureEstimator):
    """EKFAC: the eigenbasis of Kronecker factors with per-direction second moments (module docstring).

    Args:
        model, likelihood: as :class:`~curvkit.curvature.estimators.KroneckerEstimator` (its layer support).
        method: the output-space vectors, ``kflr`` (default, exact for the GGN) | ``kfac`` | ``projection`` |
            ``empirical`` (``kfra`` has no per-sample vectors).
        basis: the Kronecker operator whose factors' eigenvectors are used (None: the first batch's factors).
        ema, mc_samples, seed: as the Kronecker estimator.
    """

    def __init__(self, model: nn.Module, likelihood: Likelihood,
                 method: Literal["kflr", "kfac", "projection", "empirical"] = "kflr", *,
                 basis: KroneckerOperator | None = None, ema: float | None = None, mc_samples: int = 1,
                 seed: int = 0):
        if method == "kfra":
            raise ValueError("EKFAC needs per-sample output vectors; kfra propagates batch means only: use "
                             "'kflr', 'kfac', 'projection' or 'empirical'")
        self.vectors = KroneckerEstimator(model, likelihood, method, mc_samples=mc_samples, seed=seed,  # type: ignore[arg-type]
                                          keep_per_sample=True)
        if basis is not None and not isinstance(basis, KroneckerOperator):
            raise TypeError(f"basis must be a KroneckerOperator, got {type(basis).__name__}")
        self.basis = basis
        super().__init__(model, likelihood, ema)

    @property
    def method(self) -> KroneckerMethod:
        return self.vectors.method

    def _batch_statistics(self, X: Tensor, y: Tensor) -> tuple[list[Tensor], int]:
        est = self.vectors
        est.reset()
        est.update((X, y))
        if self.basis is None:
            self.basis = est.operator()  # the first batch's factors fix the eigenbasis
        stats = []
        for lay, e in zip(est.layers, self.basis.eigh()):
            a, V, w = est.per_sample[str(lay.weight)]  # (B*T, in_aug), (V, B*T, out), (V,)
            T = a.shape[0] // X.shape[0]
            stats.append(_projected_squares(a, V, w, e.G_eigvecs, e.A_eigvecs, T))
        return stats, int(X.shape[0])

    def _stat_names(self) -> list[str]:
        return [f"scalings of layer {lay.label!r}" for lay in self.vectors.layers]

    def operator(self) -> KroneckerSpectralOperator:
        return self._operator(self._means(), self.scale())

    def _operator(self, means: list[Tensor], scale: float) -> KroneckerSpectralOperator:
        assert self.basis is not None
        return KroneckerSpectralOperator.in_eigenbasis_of(self.basis, [m * scale for m in means])

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["basis"] = None if self.basis is None else [(b.G, b.A) for b in self.basis.blocks]
        return out


def _projected_squares(a: Tensor, V: Tensor, w: Tensor, QG: Tensor, QA: Tensor, T: int) -> Tensor:
    """sum_n sum_v w_v (QG^T dW_{n,v} QA)^2 with dW_{n,v} = sum_t g_{n,v,t} a_{n,t}^T, (out, in_aug).

    ``a`` (B*T, in_aug) and ``V`` (V, B*T, out) hold the rows of B samples times T locations."""
    pa = a @ QA  # (B*T, in_aug): a_hat projected
    pg = V @ QG  # (V, B*T, out)
    if T == 1:  # a rank-one per-sample gradient: the square factorises
        return torch.einsum("v,vbo,bi->oi", w, pg.square(), pa.square())
    B = a.shape[0] // T
    pa = pa.reshape(B, T, -1)
    pg = pg.reshape(pg.shape[0], B, T, -1)
    out = torch.zeros(QG.shape[0], QA.shape[0], dtype=a.dtype, device=a.device)
    step = max(1, _BUDGET // (pg.shape[0] * QG.shape[0] * QA.shape[0]))
    for s in range(0, B, step):  # per-sample projected gradients (V, b, out, in_aug), in chunks
        M = torch.einsum("vbto,bti->vboi", pg[:, s:s + step], pa[s:s + step])
        out += torch.einsum("v,vboi->oi", w, M.square())
    return out
