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
every batch in that fixed basis. When the basis is the first batch's and further batches follow, the result
differs from EKFAC over the union of the batches (28-33 % on the models of issue 32), and the estimator says so
once with a :class:`FirstBatchBasisWarning`; one pass over the union takes its basis from the factors of all the
data: ``EKFACEstimator(model, lik, basis=kflr(model, lik, data)).update(data)``. Same scale and moving-average conventions as
:class:`~curvkit.curvature.estimators.CurvatureEstimator`.

Shared and tied weights (docs/architecture.md, "Shared and tied weights"). The per-sample gradient of a shared
parameter is the sum of its uses' (:meth:`~curvkit.curvature.estimators.KroneckerEstimator.shared_per_sample`),
so the scalings above are those of the true per-sample gradients of the tied parameter in any basis. The basis of
a dense sum block is its own eigenbasis. A block that is the SUM of two Kronecker terms ``G1 (x) A1 + G2 (x) A2``
(a tied head and embedding above ``SHARED_DENSE_LIMIT``) has no Kronecker eigenbasis, and EKFAC's form needs an
orthonormal Kronecker one (``s`` is the Frobenius-optimal diagonal only in an orthonormal basis; the pair's
generalised eigenvectors ``W_G (x) W_A`` are not orthogonal). Its basis is the eigenbasis of the Kronecker product
NEAREST to the pair in Frobenius norm (:func:`curvkit.linalg.factors.nearest_kronecker`, Van Loan & Pitsianis:
``G = x1 G1 + x2 G2``, ``A = y1 A1 + y2 A2`` from a 2 x 2 singular value problem), which is the pair's own
eigenbasis whenever the pair is a Kronecker product (one use without data, or proportional factors) and KFAC's
eigenbasis for one term; the scalings in it are the per-sample second moments as above (the defining property).
"""

from __future__ import annotations

import warnings
from typing import Any, Literal

import torch
from torch import Tensor, nn

from curvkit.curvature.config import (
    CurvatureConfig,
    Distribution,
    NormStructure,
    WeightSharing,
    renamed_method,
)
from curvkit.curvature.estimator import CurvatureEstimator
from curvkit.curvature.estimators import (
    KroneckerEstimator,
    KroneckerMethod,
    OptionWords,
    PerSample,
)
from curvkit.likelihoods import Likelihood
from curvkit.linalg.factors import nearest_kronecker
from curvkit.linalg.kron import KroneckerEigh, KroneckerOperator, KroneckerSpectralOperator, block_positions
from curvkit.linalg.operator import sub_layout
from curvkit.structure import _refuse_sharded_parameters
from curvkit.validation import Inputs, num_samples

__all__ = ["EKFACEstimator", "FirstBatchBasisWarning"]


class FirstBatchBasisWarning(UserWarning):
    """An :class:`EKFACEstimator` without ``basis=`` accumulates a batch in the eigenbasis of its FIRST batch's
    Kronecker factors (module docstring)."""

_BUDGET = 2**24  # scalars of per-sample projected gradients held at once


class EKFACEstimator(CurvatureEstimator):
    """EKFAC: the eigenbasis of Kronecker factors with per-direction second moments (module docstring).

    Args:
        model, likelihood: as :class:`~curvkit.curvature.estimators.KroneckerEstimator` (its layer support).
        method: the output-space vectors, ``kflr`` (default, exact for the GGN) | ``kfac`` | ``projection`` |
            ``empirical`` (``kfra`` has no per-sample vectors).
        basis: the Kronecker operator whose factors' eigenvectors are used (None: the first batch's factors).
        ema, seed, and the options of :class:`~curvkit.curvature.CurvatureConfig` (``mc_samples``,
            ``weight_sharing``, ``norm_structure``, ...; or ``config``): as the Kronecker estimator.
    """

    def __init__(self, model: nn.Module, likelihood: Likelihood,
                 curvature: Literal["kflr", "kfac", "projection", "empirical"] = "kflr", *,
                 basis: KroneckerOperator | None = None, ema: float | None = None, mc_samples: int = 1,
                 seed: int = 0, weight_sharing: WeightSharing = "expand", norm_structure: NormStructure = "full",
                 parameter_structure: NormStructure = "diag", distribution: Distribution = "rademacher",
                 config: CurvatureConfig | None = None,
                 method: Literal["kflr", "kfac", "projection", "empirical"] | None = None):
        method = renamed_method(curvature, method, "EKFACEstimator", "kflr")
        _refuse_sharded_parameters(model)  # FSDP2: the Kronecker estimator only (not verified here)
        if method == "kfra":
            raise ValueError("EKFAC needs per-sample output vectors; kfra propagates batch means only: use "
                             "'kflr', 'kfac', 'projection' or 'empirical'")
        self.vectors = KroneckerEstimator(model, likelihood, method, mc_samples=mc_samples, seed=seed,  # type: ignore[arg-type]
                                          keep_per_sample=True, weight_sharing=weight_sharing,
                                          norm_structure=norm_structure, parameter_structure=parameter_structure,
                                          distribution=distribution, config=config,
                                          option_words=OptionWords(dense=None))
        self.config = self.vectors.config
        if basis is not None and not isinstance(basis, KroneckerOperator):
            raise TypeError(f"basis must be a KroneckerOperator, got {type(basis).__name__}")
        self.basis = basis
        self._eigenbasis: tuple[KroneckerOperator, KroneckerOperator] | None = None  # (basis, its one-term form)
        self._basis_from_data = False  # the basis was taken from the first batch (warn at the next one)
        super().__init__(model, likelihood, ema)

    @property
    def method(self) -> KroneckerMethod:
        return self.vectors.method

    def _batch_statistics(self, X: Inputs, y: Tensor) -> tuple[list[Tensor], int, int]:
        est = self.vectors
        est.reset()
        est.update((X, y))
        if self.basis is None:
            self.basis = est.operator()  # the first batch's factors fix the eigenbasis
            self._basis_from_data = True
        elif self._basis_from_data:
            self._basis_from_data = False  # once per estimator
            warnings.warn("EKFACEstimator.update: this batch is accumulated in the eigenbasis of the FIRST batch's "
                          "Kronecker factors, so the result is not EKFAC over the union of the batches (it can differ "
                          "by tens of percent); for one pass over the union pass the factors of all the data as the "
                          f"basis: EKFACEstimator(model, likelihood, {self.method!r}, basis=KroneckerEstimator(model, "
                          f"likelihood, {self.method!r}).update(data).operator()).update(data)",
                          FirstBatchBasisWarning, stacklevel=4)
        if est.shared:
            est.operator()  # the blocks of a shared parameter's uses, summed into one (est.members)
        groups = est.members if est.shared else [[i] for i in range(len(est.blocks))]
        stats = []
        for members, b, e in zip(groups, self.basis.blocks, self.one_term_basis().eigh()):
            if len(members) == 1:
                stats.append(_projected_squares(est.per_sample[est.blocks[members[0]][1].label], e))
                continue
            ps = est.shared_per_sample(members, b)  # (V, B, P): the per-sample gradients of the block's parameters
            if b.pair:  # in the pair's (head's) view (out, in_aug)
                pos = block_positions(sub_layout(est.layout, b.names), b.weight_name, b.bias_name, b.index,
                                      ps.vectors.device)
                stats.append(_projected_matrices(ps.vectors[..., pos], ps.weights, e))
            else:
                stats.append(_projected_squares(ps, e))
        return stats, num_samples(X), est.num_terms

    def one_term_basis(self) -> KroneckerOperator:
        """The basis with every pair block (a sum of two Kronecker terms) replaced by the Kronecker product
        nearest to it (module docstring): the operator whose factors' eigenvectors EKFAC uses."""
        assert self.basis is not None
        if self._eigenbasis is None or self._eigenbasis[0] is not self.basis:
            blocks = [b.with_factors(*nearest_kronecker(b.G, b.A, *b.second, what=repr(b.name))) if b.second is not None
                      else b for b in self.basis.blocks]
            single = self.basis if not self.basis.has_pairs else KroneckerOperator(self.basis.layout, blocks)
            self._eigenbasis = (self.basis, single)
        return self._eigenbasis[1]

    def _stat_names(self) -> list[str]:
        if self.basis is not None:
            return [f"scalings of block {b.name!r}" for b in self.basis.blocks]
        return [f"scalings of block {spec.label!r}" for _, spec in self.vectors.blocks]

    def operator(self) -> KroneckerSpectralOperator:
        return self._operator(self._means(), self.scale())

    def _operator(self, means: list[Tensor], scale: float) -> KroneckerSpectralOperator:
        assert self.basis is not None
        return KroneckerSpectralOperator.in_eigenbasis_of(self.one_term_basis(), [m * scale for m in means])

    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        out["basis"] = None if self.basis is None else [(b.G, b.A) for b in self.one_term_basis().blocks]
        return out


def _projected_squares(ps: PerSample, e: KroneckerEigh) -> Tensor:
    """sum_n sum_v w_v (QG^T dW_{n,v} QA)^2 with dW_{n,v} = sum_r g_{n,v,r} a_{n,r}^T, (out, in_aug); for a
    low-rank G of rank r (``e.G_rest`` > 0) (r + 1, in_aug), the last row the complement's
    (:func:`_with_complement`).

    ``ps.inputs`` (B, R, in_aug) input rows, (B, R) token ids (QA is the identity: a one-hot row selects a
    column) or None (``ps.vectors`` are then the per-sample gradients (V, B, P) of a (1, P) block);
    ``ps.vectors`` (V, B, R, out) the output rows of each vector."""
    QG, QA = e.G_eigvecs, e.A_eigvecs
    dt = e.G_eigvals.dtype  # the basis's: the statistics dtype of a bf16/fp16 model's rows (curvkit.precision)
    inputs = ps.inputs.to(dt) if ps.inputs is not None and ps.inputs.is_floating_point() else ps.inputs
    ps = PerSample(inputs, ps.vectors.to(dt), ps.weights.to(dt))
    w = ps.weights
    if ps.inputs is None:  # dW = u (1, P); QG is (1, 1) with entry +-1
        pu = ps.vectors if QA is None else ps.vectors @ QA
        return torch.einsum("v,vbp->p", w, pu.square())[None, :]
    pg = ps.vectors @ QG  # (V, B, R, r): r = out, or the rank of a low-rank G
    if e.G_rest:  # the complement of span(QG): its projected rows, one more "row" that stands for G_rest rows
        rest = ps.vectors - pg @ QG.T  # (V, B, R, out): the rows' components off span(QG)
    if QA is None:  # token ids: sum the projected rows of each (sample, token) pair, then square
        out = _projected_counts(ps.inputs, pg, w, int(e.A_eigvals.numel()))
        return _with_complement(out, e, lambda: _projected_counts(ps.inputs, rest, w, out.shape[1]).sum(0))
    pa = ps.inputs @ QA  # (B, R, in_aug): a_hat projected
    R = pa.shape[1]
    if R == 1:  # a rank-one per-sample gradient: the square factorises
        out = torch.einsum("v,vbo,bi->oi", w, pg[:, :, 0].square(), pa[:, 0].square())
        return _with_complement(out, e, lambda: torch.einsum("v,vb,bi->i", w, rest[:, :, 0].square().sum(-1),
                                                             pa[:, 0].square()))
    out = _chunked_squares(pg, pa, w)
    return _with_complement(out, e, lambda: _complement_squares(rest, pa, w))


def _chunked_squares(pg: Tensor, pa: Tensor, w: Tensor) -> Tensor:
    """sum_n sum_v w_v (pg_{v,n}^T pa_n)^2, (rows, in_aug), from pg (V, B, R, rows) and pa (B, R, in_aug):
    the per-sample projected gradients (V, b, rows, in_aug) formed a chunk of samples at a time."""
    B = pa.shape[0]
    out = torch.zeros(pg.shape[-1], pa.shape[-1], dtype=pa.dtype, device=pa.device)
    step = max(1, _BUDGET // (pg.shape[0] * pg.shape[-1] * pa.shape[-1]))
    for s in range(0, B, step):
        M = torch.einsum("vbto,bti->vboi", pg[:, s:s + step], pa[s:s + step])
        out += torch.einsum("v,vboi->oi", w, M.square())
    return out


def _complement_squares(rest: Tensor, pa: Tensor, w: Tensor) -> Tensor:
    """sum_n sum_v w_v ||rest_{v,n}^T pa_n[:, j]||^2 for every column j, (in_aug,): the squared norms of the
    per-sample gradients' columns off span(QG), through the (R, R) Gram matrices of the rows, never an
    (out, in_aug) gradient per sample."""
    gram = torch.einsum("vbto,vbso->vbts", rest, rest)  # (V, B, R, R)
    return torch.einsum("v,vbts,bti,bsi->i", w, gram, pa, pa)


def _with_complement(out: Tensor, e: KroneckerEigh, complement: Any) -> Tensor:
    """``out`` (r, in_aug), and for a low-rank G (``e.G_rest`` > 0) one more row: ``complement()``, the total
    second moment along the complement of span(QG) for each input direction (in_aug,), divided by its
    ``G_rest`` dimensions. EKFAC's one value per complement direction (the spectral operator holds one row
    for all of them) that minimises the Frobenius distance is their mean; it is exactly 0 when the basis's G
    was built from the same rows (``kfac``/``empirical``/``projection`` on the batch of the basis: every row
    lies in span(QG)), up to rounding, which is clamped at 0."""
    if not e.G_rest:
        return out
    row = (complement() / e.G_rest).clamp_min(0)
    return torch.cat([out, row[None, :].to(out.dtype)])


def _projected_matrices(dW: Tensor, w: Tensor, e: KroneckerEigh) -> Tensor:
    """sum_n sum_v w_v (QG^T dW_{n,v} QA)^2 of per-sample gradient matrices ``dW`` (V, B, out, in_aug) (a pair
    block's, :meth:`EKFACEstimator._batch_statistics`), in chunks of samples."""
    QG, QA = e.G_eigvecs, e.A_eigvecs
    dW, w = dW.to(QG.dtype), w.to(QG.dtype)
    out = dW.new_zeros(dW.shape[-2], dW.shape[-1])
    step = max(1, _BUDGET // max(1, dW.shape[0] * dW.shape[-2] * dW.shape[-1]))
    for s in range(0, dW.shape[1], step):
        M = QG.T @ dW[:, s:s + step]
        M = M if QA is None else M @ QA
        out += torch.einsum("v,vboi->oi", w, M.square())
    return out


def _projected_counts(ids: Tensor, pg: Tensor, w: Tensor, vocab: int) -> Tensor:
    """The embedding case of :func:`_projected_squares`: ``dW_n`` has column ``v`` = the sum of the
    projected rows of the positions holding token v; (out, V) without a (B, out, V) tensor."""
    B = ids.shape[0]
    keep = ids >= 0
    keys = (torch.arange(B, device=ids.device)[:, None] * vocab + ids)[keep]
    uniq, inv = torch.unique(keys, return_inverse=True)
    acc = pg.new_zeros(pg.shape[0], uniq.numel(), pg.shape[-1]).index_add_(1, inv, pg[:, keep])
    sq = torch.einsum("v,vuo->uo", w, acc.square())  # (pairs, out)
    return pg.new_zeros(pg.shape[-1], vocab).index_add_(1, uniq % vocab, sq.T)
