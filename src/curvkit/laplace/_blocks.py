"""The posterior blocks of a Laplace approximation: one parameter group each, with its own structure.

Each block holds per-datum MEAN curvature statistics and turns them, for a pseudo-data count N and prior
precisions lambda (one per layer, a tensor ``lam`` indexed by layer), into the block's precision,
covariance, log-determinant, samples and its terms of the linearised (GLM) predictive variance
``J Sigma J^T`` (:mod:`curvkit.laplace._glm`). Nothing is recomputed from data when N or lambda change.

* :class:`KroneckerBlock` - the Kronecker blocks ``G_j (x) A_j`` that share parameters (the engine's blocks of
  :mod:`curvkit.layerkinds`: a Linear or convolution layer's ``[W | b]``, one block per convolution group or
  per query/key/value row slice of a packed attention weight, an embedding's ``W^T`` with a DIAGONAL input
  factor, and ``factored=False`` blocks ``[[g]] (x) A`` of normalisation layers and raw parameters), each read
  through its ``index``. A factored block's precision is ``(sqrt(N) G + sqrt(lam)/pi I) (x) (sqrt(N) A +
  pi sqrt(lam) I)`` (thesis Eq. 5.14 in PyTorch's output-first layout; ``pi = 1`` is the thesis's omega = 1,
  ``balance=True`` the trace-norm split of Eq. 4.27) or, with ``form='exact'``, ``N G (x) A + lam I`` through
  the factors' eigendecompositions. A ``factored=False`` block has no factors to split the prior between:
  its precision is ``N g A + lam I`` in both forms (the thesis's "standard Laplace" of the BatchNorm
  parameters, Sec. 5.2.4).
* :class:`DiagonalBlock` - precision ``N diag(F) + lam`` (thesis Eq. 5.11 with its typo fixed).
* :class:`DenseBlock` - precision ``N F + diag(lam)`` (full Laplace of small nets).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from curvkit.laplace._glm import FactoredTerm, GLMTerm, GradTerm, SpectralTerm, SumTerm
from curvkit.linalg.kron import (
    BlockIndex,
    FactoredPairInverse,
    KroneckerOperator,
    KroneckerPairEigh,
    LowRankFactor,
    factor_state,
    index_state,
    psd_eigh,
)
from curvkit.linalg.kron import KroneckerBlock as KFactors
from curvkit.linalg.krylov import NotPositiveDefiniteError
from curvkit.linalg.layout import ParamLayout
from curvkit.linalg.operator import CurvatureOperator, DenseOperator, DiagonalOperator

__all__ = ["DenseBlock", "DiagonalBlock", "KroneckerBlock", "PosteriorBlock", "factors_state"]


def _chol(M: Tensor, what: str) -> Tensor:
    L, info = torch.linalg.cholesky_ex(0.5 * (M + M.T))
    if int(info) != 0:
        raise NotPositiveDefiniteError(f"{what} is not positive definite; increase the prior precision or N")
    return L


def _g_inverse(LG: Any, what: str) -> Any:
    """``P_G^{-1}`` from :meth:`KroneckerBlock._cholesky`'s output-side entry: a Cholesky factor, or the damped
    :class:`~curvkit.linalg.kron.LowRankFactor` itself (a vocabulary-sized output: its thin inverse)."""
    if isinstance(LG, LowRankFactor):
        return LG.inverse(what)
    SG = torch.cholesky_inverse(LG)
    return 0.5 * (SG + SG.T)


def _g_half_solve(LG: Any, Z: Tensor, what: str) -> Tensor:
    """``L_G^{-T} Z`` for Z (S, out, in_aug) (a draw with covariance ``P_G^{-1}`` on the output side); a
    low-rank ``P_G`` uses its symmetric inverse square root ``U diag(s^-1/2) U^T + c^-1/2 (I - U U^T)``."""
    if isinstance(LG, LowRankFactor):
        return (Z.transpose(1, 2) @ LG.power(-0.5, what)).transpose(1, 2)
    return torch.linalg.solve_triangular(LG.T, Z, upper=True)


def _positive_vector(v: Tensor, what: str) -> Tensor:
    if not bool((v > 0).all()):
        raise NotPositiveDefiniteError(f"{what} is not positive definite; increase the prior precision or N")
    return v


def _generalised_eigvals(M1: Tensor, M2: Tensor) -> tuple[Tensor, Tensor]:
    """(eigenvalues w of ``M2^{-1/2} M1 M2^{-1/2}``, log det M2) for symmetric M1 and positive definite M2,
    either a vector (diagonal), differentiable in both (the marginal likelihood's gradient in N and lambda)."""
    if M2.dim() == 1:
        s = _positive_vector(M2, "a damped factor").rsqrt()
        w = M1 * s * s if M1.dim() == 1 else torch.linalg.eigvalsh(s[:, None] * M1 * s[None, :])
        return w, torch.log(M2).sum()
    L = _chol(M2, "a damped factor")
    Li = torch.linalg.solve_triangular(L, torch.eye(L.shape[0], dtype=L.dtype, device=L.device), upper=False)
    M1d = torch.diag(M1) if M1.dim() == 1 else M1
    return torch.linalg.eigvalsh(Li @ M1d @ Li.T), 2 * torch.log(L.diagonal()).sum()


def _pair_logdet(b: KFactors, pi: float, N: Tensor, lam: Tensor) -> Tensor:
    """``log det`` of a pair block's factored-form precision (:meth:`KroneckerBlock._pair`),
    ``in_aug log det G2' + out log det A2' + sum_ij log(g_i a_j + 1)`` with g, a the generalised eigenvalues of
    ``(N G, G2')`` and ``(A, A2')`` (:class:`~curvkit.linalg.kron.KroneckerPairEigh`), written with
    differentiable operations in N and lambda. A low-rank G ``U diag(s) U^T`` (c = 0) gives its r nonzero
    ``g`` from the r x r matrix ``(U sqrt(N s))^T G2'^{-1} (U sqrt(N s))``; the other ``out - r`` are 0 and add
    nothing."""
    G2d, A2d = _damped_second(b, pi, N.sqrt(), lam.sqrt())
    a, ldA = _generalised_eigvals(b.A, A2d)
    if isinstance(b.G, LowRankFactor):
        if b.G.c != 0:
            raise ValueError(f"{b.name!r}: a low-rank first output factor of a pair must be exactly low rank (c = 0)")
        K = b.G.U * (N * b.G.s.clamp_min(0)).sqrt()
        if G2d.dim() == 1:
            W = K * _positive_vector(G2d, "a damped factor").rsqrt()[:, None]
            ldG = torch.log(G2d).sum()
        else:
            L = _chol(G2d, "a damped factor")
            W = torch.linalg.solve_triangular(L, K, upper=False)
            ldG = 2 * torch.log(L.diagonal()).sum()
        g = torch.linalg.eigvalsh(W.T @ W)
    else:
        g, ldG = _generalised_eigvals(N * b.G, G2d)
    return b.in_dim * ldG + b.out_dim * ldA + torch.log1p(torch.outer(g, a)).sum()


def _damped_second(b: KFactors, pi: float, sN: Any, sl: Any) -> tuple[Tensor, Tensor]:
    """A pair block's second term with the prior (Eq. 5.14 applied to it): ``(sqrt(N) G2 + sqrt(lam)/pi I,
    sqrt(N) A2 + pi sqrt(lam) I)`` from ``sN = sqrt(N)`` and ``sl = sqrt(lam)`` (floats or tensors: the
    marginal likelihood differentiates through them); a vector factor stays a vector."""
    assert b.second is not None

    def shifted(M: Tensor, c: Any) -> Tensor:
        return sN * M + c * (torch.ones_like(M) if M.dim() == 1 else torch.eye(M.shape[0], dtype=M.dtype,
                                                                               device=M.device))

    return shifted(b.second[0], sl / pi), shifted(b.second[1], pi * sl)


def factors_state(b: KFactors) -> dict[str, Any]:
    """One Kronecker block's factors, names, view and second term as plain tensors (a state_dict's form)."""
    return {"G": factor_state(b.G), "A": b.A, "weight": b.weight_name, "bias": b.bias_name,
            "index": index_state(b.index), "label": b.label, "factored": b.factored, "second": b.second}


class PosteriorBlock:
    """Base class (module docstring). ``layout`` is the block's own parameter layout; ``layers`` the
    indices (into the posterior's per-layer prior precisions) of the layer of each of its parameters."""

    layout: ParamLayout

    def __init__(self, layout: ParamLayout, layers: Sequence[int], dtype: torch.dtype, device: torch.device):
        if len(layers) != len(layout.names):
            raise ValueError("one layer index per parameter is needed")
        self.layout, self.layers = layout, list(layers)
        self.dtype, self.device = dtype, device
        self._cache: dict[str, Any] = {}

    @property
    def dim(self) -> int:
        return self.layout.dim

    def prior_vector(self, lam: Tensor) -> Tensor:
        """The prior precision of every parameter of the block, flat (d_b,)."""
        return torch.cat([lam[i].expand(n) for i, n in zip(self.layers, self.layout.numels)])

    def _cached(self, key: tuple[Any, ...], build: Any) -> Any:
        if self._cache.get("key") != key:
            self._cache = {"key": key, "value": build()}
        return self._cache["value"]

    # interface -------------------------------------------------------------------------------------
    def precision(self, N: float, lam: Tensor) -> CurvatureOperator:
        raise NotImplementedError

    def covariance(self, N: float, lam: Tensor) -> CurvatureOperator:
        raise NotImplementedError

    def logdet(self, N: Tensor, lam: Tensor) -> Tensor:
        """log det of the block's precision; differentiable in N and lam."""
        raise NotImplementedError

    def sample(self, N: float, lam: Tensor, num_samples: int, generator: torch.Generator | None) -> Tensor:
        """(S, d_b) zero-mean draws with the block's covariance, flat in the block's layout."""
        raise NotImplementedError

    def generic_term(self, N: float, lam: Tensor) -> GLMTerm:
        """The block's GLM term on Jacobian rows (k, B, d_b) of its parameters (flat, its layout)."""
        raise NotImplementedError

    def state(self) -> dict[str, Any]:
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------- Kronecker
class KroneckerBlock(PosteriorBlock):
    """Kronecker blocks ``factors`` (per-datum, :class:`curvkit.linalg.kron.KroneckerBlock`, sharing one
    layer's prior precision) over the parameters of ``layout`` (every entry in exactly one block). ``inputs``:
    a list shared by the posterior's Kronecker blocks, where each keeps the eigendecompositions of its input
    factors for the others (:attr:`_eigen`)."""

    def __init__(self, layout: ParamLayout, layer: int, factors: Sequence[KFactors], form: str = "factored",
                 balance: bool = False, inputs: list[Any] | None = None):
        factors = list(factors)
        if not factors:
            raise ValueError("a Kronecker posterior block needs at least one Kronecker block")
        super().__init__(layout, [layer] * len(layout.names), factors[0].G.dtype, factors[0].G.device)
        if form not in ("factored", "exact"):
            raise ValueError(f"prior_form must be 'factored' (thesis Eq. 5.14) or 'exact', got {form!r}")
        self.form, self.layer, self.factors = form, layer, factors
        self._inputs: list[tuple[Tensor, tuple[Tensor, Tensor]]] = [] if inputs is None else inputs
        KroneckerOperator(layout, factors)  # checks the blocks against the layout: shapes, every entry once
        if form == "exact":
            for b in factors:
                b.single("Kronecker Laplace with prior_form='exact' (N C + lam I has no closed form for a sum of two "
                         "Kronecker terms; prior_form='factored' takes it)")
        self.balance = bool(balance)
        self.pis = [self._pi(b) for b in factors]
        self.views = [BlockIndex(layout, b.weight_name, b.bias_name, self.device, b.index) for b in factors]

    def _pi(self, b: KFactors) -> float:
        """The trace-norm split of Eq. 4.27 (``balance``), 1 otherwise (omega = 1 of Eq. 5.14)."""
        if not (self.balance and b.factored):
            return 1.0
        G, A = b.second if b.second is not None else (b.G, b.A)  # a pair: the term that carries the prior
        tG = float(G.sum() if G.dim() == 1 else G.trace()) / b.out_dim
        tA = float(A.sum() if A.dim() == 1 else A.trace()) / b.in_dim
        return math.sqrt(tA / tG) if tG > 0 and tA > 0 else 1.0

    @functools.cached_property
    def _eigen(self) -> list[tuple[Tensor, Tensor, Tensor, Tensor | None]]:
        """Per block ``(lG, QG, lA, QA)``, eigenvalues clamped at 0 (QA None: a diagonal A, its eigenvectors
        the identity), computed on first use - the exact form and the factored form's log-determinant need
        them, the factored form's sampling and predictives do not. :func:`curvkit.linalg.kron.psd_eigh`
        retries in float64 where LAPACK fails on the repeated zero eigenvalues of a rank-deficient factor
        (MNIST's always-zero border pixels in A). A low-rank G gives its thin eigendecomposition (QG = U,
        (out, r)); its complement is :attr:`_rest`. Blocks fed by one input (q, k and v projections, LoRA's
        ``lora_A`` on q and v of every layer) have equal input factors, decomposed once (an O(n^2) comparison
        against the posterior's earlier ones of the same size, ``inputs``, for an O(n^3) eigendecomposition)."""
        out: list[tuple[Tensor, Tensor, Tensor, Tensor | None]] = []
        inputs = self._inputs
        for b in self.factors:
            if b.pair:  # no Kronecker eigenbasis (:meth:`_pair`); refused with prior_form='exact'
                continue
            if isinstance(b.G, LowRankFactor):
                lG, QG = b.G.s.clamp_min(0), b.G.U
            else:
                lG, QG = psd_eigh(b.G)
            if b.diagonal_input:
                out.append((lG, QG, b.A.clamp_min(0), None))
            else:
                eig = next((e for A, e in inputs if A is b.A or (A.shape == b.A.shape and torch.equal(A, b.A))), None)
                if eig is None:
                    eig = psd_eigh(b.A)
                    inputs.append((b.A, eig))
                out.append((lG, QG, *eig))
        return out

    @functools.cached_property
    def _rest(self) -> list[tuple[int, float]]:
        """Per block the complement of a low-rank G's span: (its dimension out - r, G's eigenvalue c there);
        (0, 0.0) for a dense G."""
        return [(b.G.complement, max(b.G.c, 0.0)) if isinstance(b.G, LowRankFactor) else (0, 0.0)
                for b in self.factors]

    def _eye(self, n: int) -> Tensor:
        return torch.eye(n, dtype=self.dtype, device=self.device)

    def _pair(self, j: int, N: float | Tensor, lam: Tensor) -> KroneckerPairEigh:
        """A pair block's precision in the factored form, the prior carried by the second term (Eq. 5.14 applied
        to it): ``N G (x) A + (sqrt(N) G2 + sqrt(lam)/pi I) (x) (sqrt(N) A2 + pi sqrt(lam) I)``, through
        :class:`~curvkit.linalg.kron.KroneckerPairEigh` (cached per N and lambda)."""
        b, pi = self.factors[j], self.pis[j]
        n, l = float(N), float(lam[self.layer])

        def build() -> KroneckerPairEigh:
            G1 = b.G * n if isinstance(b.G, LowRankFactor) else n * b.G
            return KroneckerPairEigh.of(G1, b.A, *_damped_second(b, pi, math.sqrt(n), math.sqrt(l)),
                                        what=repr(b.name))

        return self._cached(("pair", j, n, l), build)  # type: ignore[no-any-return]

    def damped(self, N: float, lam: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per block the precision factors ``(P_G, P_A)`` of the factored form (Eq. 5.14; ``P_A`` a vector for
        a diagonal A); a ``factored=False`` block gives ``([[1]], N g A + lam I)``."""
        sN, l = math.sqrt(N), float(lam[self.layer])
        sl = math.sqrt(l)
        out = []
        for b, pi in zip(self.factors, self.pis):
            if b.second is not None:  # N G (x) A; the prior rides on the second term (:meth:`_pair`)
                out.append((b.G * N if isinstance(b.G, LowRankFactor) else N * b.G, b.A))
                continue
            if not b.factored:
                g = float(b.G[0, 0])
                PA = N * g * b.A + (l if b.diagonal_input else l * self._eye(b.in_dim))
                out.append((self._eye(1), PA))
                continue
            PA = sN * b.A + (pi * sl if b.diagonal_input else pi * sl * self._eye(b.in_dim))
            PG = ((b.G * sN).shifted(sl / pi) if isinstance(b.G, LowRankFactor)  # type: ignore[attr-defined]
                  else sN * b.G + (sl / pi) * self._eye(b.out_dim))
            out.append((PG, PA))
        return out

    def _cholesky(self, N: float, lam: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per block the Cholesky factors of ``(P_G, P_A)`` (a diagonal ``P_A`` stays a vector; a low-rank
        ``P_G`` stays itself: :func:`_g_inverse` and :func:`_g_half_solve` read both forms)."""
        def build() -> list[tuple[Tensor, Tensor]]:
            out = []
            for b, (PG, PA) in zip(self.factors, self.damped(N, lam)):
                if b.pair:  # no Cholesky factors: :meth:`_pair`
                    out.append((PG, PA))
                    continue
                LG = PG if isinstance(PG, LowRankFactor) else _chol(PG, f"the output factor of {b.name!r}")
                LA = (_positive_vector(PA, f"the input factor of {b.name!r}").sqrt() if PA.dim() == 1
                      else _chol(PA, f"the input factor of {b.name!r}"))
                out.append((LG, LA))
            return out

        return self._cached(("chol", N, float(lam[self.layer])), build)  # type: ignore[no-any-return]

    def _spectra(self, N: float, lam: Tensor) -> list[Tensor]:
        """Per block the (out, in_aug) eigenvalues ``N lG lA^T + lam`` of the exact form."""
        return [N * torch.outer(lG, lA) + lam[self.layer] for lG, _, lA, _ in self._eigen]

    def precision(self, N: float, lam: Tensor) -> CurvatureOperator:
        if self.form == "factored":
            blocks = [KFactors.from_gram(PG, PA, b.weight_name, b.bias_name, index=b.index, label=b.label,
                                         factored=b.factored, second=None if b.second is None else _damped_second(
                                             b, pi, math.sqrt(N), math.sqrt(float(lam[self.layer]))))
                      for b, pi, (PG, PA) in zip(self.factors, self.pis, self.damped(N, lam))]
            return KroneckerOperator(self.layout, blocks)
        blocks = [KFactors.from_gram(b.G, b.A, b.weight_name, b.bias_name, scale_G=N, index=b.index, label=b.label,
                                     factored=b.factored) for b in self.factors]
        return KroneckerOperator(self.layout, blocks, damping=float(lam[self.layer]))

    def covariance(self, N: float, lam: Tensor) -> CurvatureOperator:
        if self.form == "exact":
            return self.precision(N, lam).inverse()
        if any(b.pair for b in self.factors):
            return FactoredPairInverse(self.precision(N, lam))  # type: ignore[arg-type]
        blocks = []
        for b, (LG, LA) in zip(self.factors, self._cholesky(N, lam)):
            iA = 1.0 / LA**2 if LA.dim() == 1 else torch.cholesky_inverse(LA)
            blocks.append(KFactors.from_gram(_g_inverse(LG, f"the output factor of {b.name!r}"), iA, b.weight_name,
                                             b.bias_name,
                                             index=b.index, label=b.label, factored=b.factored))
        return KroneckerOperator(self.layout, blocks)

    def logdet(self, N: Tensor, lam: Tensor) -> Tensor:
        l = lam[self.layer]
        total = torch.zeros((), dtype=self.dtype, device=self.device)
        eigen = iter(self._eigen)
        for b, pi, (rest, c) in zip(self.factors, self.pis, self._rest):
            if b.pair:
                total = total + _pair_logdet(b, pi, N, l)
                continue
            lG, _, lA, _ = next(eigen)
            if self.form == "exact" or not b.factored:  # the exact spectrum N lG lA^T + lam
                total = total + torch.log(N * torch.outer(lG, lA) + l).sum()
                if rest:  # a low-rank G's complement: eigenvalue c, multiplicity out - r
                    total = total + rest * torch.log(N * c * lA + l).sum()
            else:  # det(P_G (x) P_A) = det(P_G)^in_aug det(P_A)^out
                sN, sl = N.sqrt(), l.sqrt()
                total = (total + b.in_dim * torch.log(sN * lG + sl / pi).sum()
                         + b.out_dim * torch.log(sN * lA + pi * sl).sum())
                if rest:
                    total = total + b.in_dim * rest * torch.log(sN * c + sl / pi)
        return total

    def sample(self, N: float, lam: Tensor, num_samples: int, generator: torch.Generator | None) -> Tensor:
        """Per block ``W_hat = L_G^{-T} Z L_A^{-1}`` (factored: Cov(vec_row W_hat) = P_G^{-1} (x) P_A^{-1}) or
        ``QG (Z / sqrt(N lG lA^T + lam)) QA^T`` (exact), written into the block's entries. A low-rank G (U,
        its complement eigenvalue c): ``P_G^{-1/2} Z L_A^{-1}`` (factored) or, exact, the span's draw
        ``U ((U^T Z) / sqrt(N s lA^T + lam)) QA^T`` plus the complement's ``(I - U U^T) Z QA diag((N c lA +
        lam)^-1/2) QA^T``."""
        out = torch.empty(num_samples, self.dim, dtype=self.dtype, device=self.device)
        exact = self.form == "exact"
        chol = None if exact else self._cholesky(N, lam)
        spectra = self._spectra(N, lam) if exact else None
        for j, (b, view) in enumerate(zip(self.factors, self.views)):
            Z = torch.randn(num_samples, b.out_dim, b.in_dim, dtype=self.dtype, device=self.device,
                            generator=generator)
            if b.pair:  # W_G [Z / sqrt(g a^T + 1)] W_A^T (KroneckerPairEigh.sample)
                view.scatter(self._pair(j, N, lam).sample(Z.permute(1, 2, 0)), out.T)
                continue
            if chol is not None:
                LG, LA = chol[j]
                X = _g_half_solve(LG, Z, f"the output factor of {b.name!r}")
                X = X / LA if LA.dim() == 1 else torch.linalg.solve_triangular(LA, X, upper=False, left=False)
            else:
                assert spectra is not None
                _, QG, lA, QA = self._eigen[j]
                rest, c = self._rest[j]
                if rest:  # Z's coordinates in span(U) and its (independent) projection on the complement
                    Zt = QG.T @ Z
                    X = QG @ (Zt / spectra[j].sqrt()) + (Z - QG @ Zt) * (N * c * lA + lam[self.layer]).rsqrt()
                else:
                    X = QG @ (Z / spectra[j].sqrt())
                X = X if QA is None else X @ QA.T
            view.scatter(X.permute(1, 2, 0), out.T)
        return out

    def glm_terms(self, N: float, lam: Tensor) -> list[GLMTerm | None]:
        """One GLM term per Kronecker block, in :attr:`factors` order (:mod:`curvkit.laplace._glm`; None for a
        sum of two terms, whose rows are Jacobian rows: :meth:`generic_term`): a
        ``factored=False`` block's Jacobian rows are per-sample gradients against ``(N g A + lam I)^{-1}`` (both
        forms), a factored block's are its output rows against the inverse factors or the exact spectrum."""
        terms: list[GLMTerm | None] = []
        spectra = self._spectra(N, lam) if self.form == "exact" else None
        for j, (b, (_, PA)) in enumerate(zip(self.factors, self.damped(N, lam))):
            if b.pair:  # no term of its own: its Jacobian rows come from both uses (generic_term)
                terms.append(None)
                continue
            if not b.factored:
                terms.append(GradTerm(chol=_chol(PA, f"the block of {b.name!r}")) if PA.dim() == 2 else
                             GradTerm(inverse=1.0 / _positive_vector(PA, f"the block of {b.name!r}")))
            elif spectra is not None:
                _, QG, lA, QA = self._eigen[j]
                span = SpectralTerm(QG, QA, 1.0 / spectra[j])
                rest, c = self._rest[j]
                if not rest:
                    terms.append(span)
                    continue
                # a low-rank G: the complement (I - U U^T) (x) (N c A + lam I)^{-1} as a factored term
                PA = N * c * lA + lam[self.layer]
                LA = PA.sqrt() if QA is None else _chol((QA * PA) @ QA.T, f"the input factor of {b.name!r}")
                terms.append(SumTerm([span, FactoredTerm(LowRankFactor(QG, QG.new_zeros(QG.shape[1]), 1.0), LA)]))
            else:
                LG, LA = self._cholesky(N, lam)[j]
                terms.append(FactoredTerm(_g_inverse(LG, f"the output factor of {b.name!r}"), LA))
        return terms

    def generic_term(self, N: float, lam: Tensor) -> GLMTerm:
        if any(b.pair for b in self.factors):  # the covariance applied to the rows, never a P x P matrix
            return GradTerm(operator=self.covariance(N, lam))
        return GradTerm(dense=self.covariance(N, lam).to_dense())

    def state(self) -> dict[str, Any]:
        return {"blocks": [factors_state(b) for b in self.factors]}


# ---------------------------------------------------------------------------------------------- diagonal
class DiagonalBlock(PosteriorBlock):
    """Diagonal curvature ``f`` (flat, the block's layout) of one layer's parameters."""

    def __init__(self, layout: ParamLayout, layers: Sequence[int], f: Tensor):
        super().__init__(layout, layers, f.dtype, f.device)
        if f.shape != (layout.dim,):
            raise ValueError(f"diagonal of shape {tuple(f.shape)}, expected ({layout.dim},)")
        self.f = f.clamp_min(0)

    def _prec(self, N: float | Tensor, lam: Tensor) -> Tensor:
        return N * self.f + self.prior_vector(lam)

    def precision(self, N: float, lam: Tensor) -> CurvatureOperator:
        return DiagonalOperator.from_flat(self.layout, self._prec(N, lam))

    def covariance(self, N: float, lam: Tensor) -> CurvatureOperator:
        return self.precision(N, lam).inverse()

    def variances(self, N: float, lam: Tensor) -> Tensor:
        """The posterior variances (d_b,), flat in the block's layout."""
        return 1.0 / _positive_vector(self._prec(N, lam), "the diagonal posterior precision")

    def logdet(self, N: Tensor, lam: Tensor) -> Tensor:
        return torch.log(self._prec(N, lam)).sum()

    def sample(self, N: float, lam: Tensor, num_samples: int, generator: torch.Generator | None) -> Tensor:
        z = torch.randn(num_samples, self.dim, dtype=self.dtype, device=self.device, generator=generator)
        return z * self.variances(N, lam).sqrt()

    def generic_term(self, N: float, lam: Tensor) -> GLMTerm:
        return GradTerm(inverse=self.variances(N, lam))

    def state(self) -> dict[str, Any]:
        return {"f": self.f}


# ---------------------------------------------------------------------------------------------- dense
class DenseBlock(PosteriorBlock):
    """Dense curvature ``F`` (d_b, d_b) of a parameter group (flat, the block's layout)."""

    def __init__(self, layout: ParamLayout, layers: Sequence[int], F: Tensor):
        super().__init__(layout, layers, F.dtype, F.device)
        if F.shape != (layout.dim, layout.dim):
            raise ValueError(f"dense curvature of shape {tuple(F.shape)}, expected ({layout.dim}, {layout.dim})")
        self.F = 0.5 * (F + F.T)
        self.eig = torch.linalg.eigvalsh(self.F).clamp_min(0)
        self.single_prior = len(set(self.layers)) == 1

    def _matrix(self, N: float, lam: Tensor) -> Tensor:
        return N * self.F + torch.diag(self.prior_vector(lam))

    def _cholesky(self, N: float, lam: Tensor) -> Tensor:
        key = ("chol", N, tuple(float(lam[i]) for i in sorted(set(self.layers))))
        return self._cached(key, lambda: _chol(self._matrix(N, lam), "the dense posterior precision"))  # type: ignore[no-any-return]

    def precision(self, N: float, lam: Tensor) -> CurvatureOperator:
        return DenseOperator(self.layout, self._matrix(N, lam))

    def covariance(self, N: float, lam: Tensor) -> CurvatureOperator:
        C = torch.cholesky_inverse(self._cholesky(N, lam))
        return DenseOperator(self.layout, 0.5 * (C + C.T))

    def logdet(self, N: Tensor, lam: Tensor) -> Tensor:
        if self.single_prior:
            return torch.log(N * self.eig + lam[self.layers[0]]).sum()
        P = N * self.F + torch.diag(self.prior_vector(lam))
        return 2 * torch.linalg.cholesky(0.5 * (P + P.T)).diagonal().log().sum()

    def sample(self, N: float, lam: Tensor, num_samples: int, generator: torch.Generator | None) -> Tensor:
        z = torch.randn(self.dim, num_samples, dtype=self.dtype, device=self.device, generator=generator)
        return torch.linalg.solve_triangular(self._cholesky(N, lam).T, z, upper=True).T

    def generic_term(self, N: float, lam: Tensor) -> GLMTerm:
        return GradTerm(chol=self._cholesky(N, lam))

    def state(self) -> dict[str, Any]:
        return {"F": self.F}
