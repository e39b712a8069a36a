"""Kronecker factor algebra (thesis Sec. 4.2, Eqs. 4.2-4.3): the row-major Kronecker product
``(G (x) A) vec_row(X) = vec_row(G X A^T)``, symmetric eigendecompositions that survive rank-deficient
factors, the low-rank output factor of a vocabulary-sized layer (:class:`LowRankFactor`), the eigenpairs of one
Kronecker block (:class:`KroneckerEigh`) and of a sum of two (:class:`KroneckerPairEigh`). No layout, no blocks:
:mod:`.block_index` maps blocks to parameters, :mod:`.blocks` holds them, :mod:`.kron` makes operators."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, cast

import torch
from torch import Tensor

from curvkit.linalg.krylov import NotPositiveDefiniteError
from curvkit.validation import check_damping


# ---------------------------------------------------------------------------------------------- helpers
def vec_row(X: Tensor) -> Tensor:
    """Row-major vectorisation of the last two dimensions: (..., m, n) -> (..., m*n)."""
    return X.reshape(*X.shape[:-2], X.shape[-2] * X.shape[-1])


def kron_matvec(G: Tensor, A: Tensor, X: Tensor) -> Tensor:
    """``(G (x) A) vec_row(X)`` without forming the Kronecker product, returned as a matrix.

    Identity (row-major vec): ``(G (x) A) vec_row(X) = vec_row(G X A^T)``.

    Args:
        G: (m, m) output-side factor.  A: (n, n) input-side factor.
        X: (..., m, n), any number of leading batch dimensions.
    Returns:
        (..., m, n) tensor ``G X A^T`` (equal to ``G X A`` for symmetric A).
    """
    if X.dim() < 2 or X.shape[-2] != G.shape[0] or X.shape[-1] != A.shape[0]:
        raise ValueError(f"kron_matvec: X must have shape (..., {G.shape[0]}, {A.shape[0]}) to match "
                         f"G {tuple(G.shape)} and A {tuple(A.shape)}, got {tuple(X.shape)}")
    return G @ X @ A.transpose(-1, -2)


def _sym_tol(dtype: torch.dtype) -> float:
    return 1e3 * torch.finfo(dtype).eps if dtype.is_floating_point else 0.0


def _check_square_symmetric(M: Tensor, what: str) -> None:
    if not isinstance(M, Tensor):
        raise TypeError(f"{what} must be a torch.Tensor, got {type(M).__name__}")
    if M.dim() != 2 or M.shape[0] != M.shape[1] or M.shape[0] == 0:
        raise ValueError(f"{what} must be a non-empty square matrix, got shape {tuple(M.shape)}")
    if not M.dtype.is_floating_point:
        raise ValueError(f"{what} must be a floating-point matrix, got dtype {M.dtype}")
    if not bool(torch.isfinite(M).all()):
        raise ValueError(f"{what} contains NaN or inf entries")
    scale = float(M.abs().max())
    asym = float((M - M.T).abs().max())
    if asym > _sym_tol(M.dtype) * max(1.0, scale):
        raise ValueError(f"{what} must be symmetric (max |M - M^T| = {asym:.3g} relative to max |M| = "
                         f"{scale:.3g}); symmetrise it with 0.5 * (M + M.T)")


def _symmetrise(M: Tensor, c: float = 0.5) -> Tensor:
    """``c * (M + M^T)`` for a square M, a new tensor, bitwise equal to the plain expression (each entry is the
    same two-term sum times c; addition commutes). Written as ``M^T`` made contiguous (torch's blocked
    transpose copy), then ``+ M`` and ``* c`` in place: ``M + M.T`` reads the transpose with stride n, a cache
    miss per element; on this 2-core CPU a 5,632-wide factor takes 0.27-0.30 s this way against 0.72-0.75 s plain and
    0.87 s for the earlier tile-by-tile loop (2,048 wide: 0.03-0.04 / 0.06 / 0.35 s; best of 7, loaded machine)."""
    if M.dim() != 2 or M.shape[0] != M.shape[1] or M.shape[0] <= _SMALL_SYMMETRISE:
        return (M + M.T).mul_(c)
    return M.T.clone(memory_format=torch.contiguous_format).add_(M).mul_(c)


#: Up to this size ``(M + M^T) * c`` in two passes is faster than the transposed copy (one thread, float32,
#: 2026-11-29: 129 wide 18 against 26 us, 385 wide 99 against 189 us, 513 wide 207 against 255 us; 1,025 wide
#: 1.85 against 1.03 ms). The same entries either way.
_SMALL_SYMMETRISE = 768


def _symmetrise_(M: Tensor, c: float = 0.5, tile: int = 512) -> Tensor:
    """:func:`_symmetrise` IN PLACE: ``M <- c * (M + M^T)``, bitwise the same entries (each is the same two-term
    sum times c), with no second n x n matrix: square tiles are paired across the diagonal, so the only
    temporary is one ``tile x tile`` block. For factors handed over by their owner (an estimator's statistics
    that are not used again, ``KroneckerEstimator.operator(release=True)``): a 5,632-wide float32 factor is
    127 MB, and a TinyLlama's 22 layers hold 10.5 GB of them. Returns M."""
    if M.dim() != 2 or M.shape[0] != M.shape[1]:
        raise ValueError(f"_symmetrise_ needs a square matrix, got shape {tuple(M.shape)}")
    n = M.shape[0]
    for lo in range(0, n, tile):
        hi = min(lo + tile, n)
        diag = M[lo:hi, lo:hi]
        diag.copy_(diag.T.clone(memory_format=torch.contiguous_format).add_(diag).mul_(c))
        for lo2 in range(hi, n, tile):
            hi2 = min(lo2 + tile, n)
            upper, lower = M[lo:hi, lo2:hi2], M[lo2:hi2, lo:hi]
            s = lower.T.clone(memory_format=torch.contiguous_format).add_(upper).mul_(c)
            upper.copy_(s)
            lower.copy_(s.T)
    return M


def stable_eigh(M: Tensor, what: str = "matrix") -> tuple[Tensor, Tensor]:
    """``torch.linalg.eigh`` of a symmetric matrix that does not give up on rank-deficient input.

    LAPACK's divide-and-conquer ``eigh`` can fail to converge on the many repeated (zero) eigenvalues of a
    rank-deficient Gram matrix, in float32 in particular (seen on the 785 x 785 input factor of an MNIST
    MLP: the border pixels are always 0). Fallbacks, in order: float64; float64 with a jitter of
    1e-8 * mean(diag M) on the diagonal, subtracted from the eigenvalues again. Results are returned in
    M's dtype; raises ValueError naming ``what`` if every attempt fails or gives NaN/inf.
    """
    scale = float(M.diagonal().abs().mean().clamp(min=1e-30))
    err: Exception | None = None
    for dtype, jitter in ((M.dtype, 0.0), (torch.float64, 0.0), (torch.float64, 1e-8)):
        A = M.to(dtype)
        if jitter:
            A = A + (jitter * scale) * torch.eye(A.shape[0], dtype=dtype, device=A.device)
        try:
            w, V = torch.linalg.eigh(A)
        except RuntimeError as exc:  # torch.linalg.LinAlgError is a RuntimeError
            err = exc
            continue
        if bool(torch.isfinite(w).all()) and bool(torch.isfinite(V).all()):
            return (w - jitter * scale).to(M.dtype), V.to(M.dtype)
    raise ValueError(f"eigendecomposition of the {tuple(M.shape)} {what} failed ({err}); it may contain inf/NaN "
                     "or be far from symmetric") from err


def psd_eigh(C: Tensor, previous: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Eigenvalues (clamped at 0) and eigenvectors of a symmetric PSD factor C (n, n), in C's dtype:
    :func:`stable_eigh` (float64 and jitter fallbacks for the repeated zero eigenvalues
    of a rank-deficient covariance), then, if that fails too, the ``previous`` eigenbasis with
    d = diag(V^T C V) (what the kept-basis update of KFWhiten uses between refreshes anyway)."""
    try:
        w, V = stable_eigh(C, "Kronecker factor")
    except ValueError:
        if previous is None:
            raise
        return ((C @ previous) * previous).sum(0).clamp(min=0), previous
    return w.clamp(min=0), V


# ---------------------------------------------------------------------------------------------- low-rank factors
class LowRankFactor:
    """A symmetric (n, n) factor held as a thin eigendecomposition, never as an (n, n) matrix:

        M = U diag(s) U^T + c (I - U U^T),   U (n, r) orthonormal columns, s (r,), c a scalar,

    i.e. eigenvalues ``s`` on span(U) and ``c`` (multiplicity n - r) on its complement. The output factor of a
    layer with a huge output dimension (a language model's vocabulary) is ``G = (1/N) S S^T`` with ``S``
    (n, k) the k << n back-propagated sampled vectors (KFAC-MC, empirical Fisher): exactly rank <= k, c = 0
    (``docs/architecture.md``, "Low-rank output factors"). Every function of M stays in this form
    (``f(M) = U f(s) U^T + f(c) (I - U U^T)``): damping is ``s + d, c + d``, the inverse ``1/s, 1/c``.

    It offers what :class:`KroneckerBlock` and :class:`KroneckerOperator` ask of a factor: ``shape``,
    ``dtype``, ``device``, ``dim()``, ``M @ X`` (O(n r) per column), ``diagonal()``, ``trace()``, ``T``,
    scalar ``*``; :func:`_dense` forms the matrix only where a dense result is requested (``to_dense``).
    """

    def __init__(self, U: Tensor, s: Tensor, c: float = 0.0):
        if not isinstance(U, Tensor) or U.dim() != 2 or U.shape[1] > U.shape[0]:
            raise ValueError(f"LowRankFactor: U must be an (n, r) tensor with r <= n, got "
                             f"{tuple(U.shape) if isinstance(U, Tensor) else type(U).__name__}")
        if not isinstance(s, Tensor) or s.shape != (U.shape[1],) or s.dtype != U.dtype or s.device != U.device:
            raise ValueError(f"LowRankFactor: s must be an ({U.shape[1]},) tensor of U's dtype and device, got "
                             f"{tuple(s.shape) if isinstance(s, Tensor) else type(s).__name__}")
        if not (bool(torch.isfinite(U).all()) and bool(torch.isfinite(s).all()) and math.isfinite(float(c))):
            raise ValueError("LowRankFactor: U, s and c must be finite")
        self.U, self.s, self.c = U, s, float(c)

    @classmethod
    def from_rows(cls, R: Tensor, scale: float = 1.0) -> LowRankFactor:
        """``scale * R^T R`` for rows R (k, n) without forming it: a thin QR ``R^T = Q T`` (Q (n, k)) and the
        (k, k) eigendecomposition ``T T^T = P diag(w) P^T`` give ``U = Q P``, ``s = scale * w``. Eigenvalues
        at rounding level (``<= k * eps * max w``: a rank-deficient R) are dropped, so U has exactly
        orthonormal columns; c = 0."""
        k, n = R.shape
        if k >= n:  # no thinner form: the full eigendecomposition of the (n, n) Gram matrix
            w, V = stable_eigh(R.T @ R, "low-rank factor")
            return cls(V, w.clamp(min=0) * scale)
        Q, T = torch.linalg.qr(R.T)  # (n, k), (k, k)
        w, P = stable_eigh(T @ T.T, "low-rank factor")
        keep = w > k * torch.finfo(w.dtype).eps * float(w.abs().max().clamp(min=torch.finfo(w.dtype).tiny))
        return cls(Q @ P[:, keep], w[keep] * scale)

    @property
    def shape(self) -> torch.Size:
        n = self.U.shape[0]
        return torch.Size((n, n))

    @property
    def dtype(self) -> torch.dtype:
        return self.U.dtype

    @property
    def device(self) -> torch.device:
        return self.U.device

    @property
    def rank(self) -> int:
        """r, the number of eigenvalues held explicitly."""
        return int(self.U.shape[1])

    @property
    def complement(self) -> int:
        """n - r, the multiplicity of the eigenvalue c."""
        return int(self.U.shape[0] - self.U.shape[1])

    @property
    def T(self) -> LowRankFactor:  # as Tensor.T
        return self

    def dim(self) -> int:
        return 2

    def __matmul__(self, X: Tensor) -> Tensor:
        """``M X`` for X (n, ...) = ``U ((s - c) * U^T X) + c X``."""
        if X.shape[0] != self.U.shape[0]:
            raise ValueError(f"LowRankFactor of size {self.U.shape[0]} @ X: X must have {self.U.shape[0]} rows, "
                             f"got shape {tuple(X.shape)}")
        Y = self.U @ ((self.s - self.c)[:, None] * (self.U.T @ X.reshape(X.shape[0], -1)))
        out = Y if self.c == 0 else Y + self.c * X.reshape(X.shape[0], -1)
        return out.reshape(X.shape)

    def __rmatmul__(self, X: Tensor) -> Tensor:
        """``X M`` for X (..., n) (M is symmetric): ``((X U) * (s - c)) U^T + c X``."""
        if X.shape[-1] != self.U.shape[0]:
            raise ValueError(f"X @ LowRankFactor of size {self.U.shape[0]}: X must have {self.U.shape[0]} columns, "
                             f"got shape {tuple(X.shape)}")
        Y = ((X @ self.U) * (self.s - self.c)) @ self.U.T
        return Y if self.c == 0 else Y + self.c * X

    @classmethod
    def scalar(cls, n: int, c: float, like: Tensor) -> LowRankFactor:
        """``c I`` of size n (rank 0: no vector held), in ``like``'s dtype and device."""
        return cls(like.new_zeros(n, 0), like.new_zeros(0), c)

    def diagonal(self) -> Tensor:
        return (self.U * self.U) @ (self.s - self.c) + self.c

    def trace(self) -> Tensor:
        return self.s.sum() + self.c * self.complement

    def frobenius(self) -> float:
        return math.sqrt(float((self.s * self.s).sum()) + self.c**2 * self.complement)

    def __mul__(self, a: float) -> LowRankFactor:
        a = float(a)
        return LowRankFactor(self.U, a * self.s, a * self.c)

    __rmul__ = __mul__

    def shifted(self, d: float) -> LowRankFactor:
        """``M + d I``."""
        return LowRankFactor(self.U, self.s + d, self.c + d)

    def power(self, p: float, what: str) -> LowRankFactor:
        """``M^p`` (``p < 0``: raises :class:`NotPositiveDefiniteError` naming ``what`` unless M is positive
        definite; ``p = -1/2`` is the symmetric square root of the inverse, a sampler of ``N(0, M^{-1})``)."""
        if not (bool((self.s > 0).all()) and (self.c > 0 or self.complement == 0)):
            raise NotPositiveDefiniteError(f"factor {what} is not positive definite after damping; increase the "
                                           "damping")
        return LowRankFactor(self.U, self.s ** p, self.c ** p if self.c > 0 else 0.0)

    def state(self) -> dict[str, Tensor | float]:
        """``{"U", "s", "c"}`` (tensors and a number: ``torch.load(weights_only=True)`` reads them)."""
        return {"U": self.U, "s": self.s, "c": self.c}

    def inverse(self, what: str) -> LowRankFactor:
        """``M^{-1}`` (raises :class:`NotPositiveDefiniteError` naming ``what`` unless M is positive definite)."""
        if not (bool((self.s > 0).all()) and (self.c > 0 or self.complement == 0)):
            raise NotPositiveDefiniteError(f"factor {what} is not positive definite after damping; increase the "
                                           "damping")
        return LowRankFactor(self.U, 1.0 / self.s, 1.0 / self.c if self.c > 0 else 0.0)

    def to_dense(self) -> Tensor:
        """The (n, n) matrix (only where a dense result is asked for)."""
        D = (self.U * (self.s - self.c)) @ self.U.T
        return D + self.c * torch.eye(D.shape[0], dtype=D.dtype, device=D.device) if self.c else D

    def __repr__(self) -> str:
        return f"LowRankFactor(n={self.U.shape[0]}, rank={self.rank}, c={self.c:g})"


def factor_state(M: Any) -> Any:
    """A factor in a form a ``weights_only=True`` checkpoint holds: a tensor stays a tensor, a
    :class:`LowRankFactor` becomes its :meth:`LowRankFactor.state`."""
    return M.state() if isinstance(M, LowRankFactor) else M


def factor_from_state(state: Any, device: torch.device | str | None = None) -> Any:
    """The inverse of :func:`factor_state` (moved to ``device`` when given)."""
    if isinstance(state, Mapping):
        U, s = state["U"], state["s"]
        return LowRankFactor(U.to(device) if device is not None else U, s.to(device) if device is not None else s,
                             float(state["c"]))
    return state.to(device) if device is not None else state


def _dense(M: Any) -> Tensor:
    """A factor as a dense tensor (a vector stays a vector)."""
    return M.to_dense() if isinstance(M, LowRankFactor) else M


@dataclass
class KroneckerEigh:
    """Eigendecompositions of one block's factors: ``G = QG diag(lG) QG^T``, ``A = QA diag(lA) QA^T``.

    The block ``G (x) A + delta I`` has eigenvalues ``outer(lG, lA) + delta`` (row-major (out, in_aug)) with
    eigenvectors ``vec_row(QG[:, i] QA[:, j]^T)``. ``A_eigvecs`` is None for a diagonal input factor (its
    eigenvectors are the identity, never formed).

    A :class:`LowRankFactor` G has ``G_eigvecs`` U (out, r) and ``G_rest`` = out - r > 0: the eigenvalue
    ``G_rest_value`` on the complement of span(U), its eigenvectors never formed. A block's spectrum then
    has one more row (:attr:`G_values`), the complement's, which stands for ``G_rest`` rows.
    """

    G_eigvals: Tensor
    G_eigvecs: Tensor
    A_eigvals: Tensor
    A_eigvecs: Tensor | None
    G_rest: int = 0
    G_rest_value: float = 0.0

    @property
    def G_values(self) -> Tensor:
        """The rows of the block's spectrum: ``G_eigvals``, then ``G_rest_value`` when ``G_rest > 0``."""
        if not self.G_rest:
            return self.G_eigvals
        return torch.cat([self.G_eigvals, self.G_eigvals.new_full((1,), self.G_rest_value)])

    def eigenvalues(self, damping: float = 0.0) -> Tensor:
        """(rows, in_aug) eigenvalues of ``G (x) A + damping I`` (rows of :attr:`G_values`; the last row
        counts ``G_rest`` times when ``G_rest > 0``)."""
        return torch.outer(self.G_values, self.A_eigvals) + damping


def _spectrum_sum(e: KroneckerEigh, lam: Tensor) -> Tensor:
    """The sum of a block's spectrum ``lam`` (rows of ``e.G_values``), the complement row ``e.G_rest`` times."""
    if not e.G_rest:
        return lam.sum()
    return lam[:-1].sum() + e.G_rest * lam[-1].sum()


def _spectrum_values(e: KroneckerEigh, lam: Tensor, k: int) -> Tensor:
    """A block's spectrum as a flat vector, the complement row repeated ``min(G_rest, k)`` times (enough for
    the k largest or smallest eigenvalues)."""
    if not e.G_rest:
        return lam.reshape(-1)
    return torch.cat([lam[:-1].reshape(-1), lam[-1].repeat(min(e.G_rest, max(int(k), 1)))])


def _complement_apply(e: KroneckerEigh, X: Tensor, row: Tensor) -> Tensor:
    """``(I - U U^T) X[:, :, j] QA diag(row) QA^T`` for every column j of X (out, in_aug, k): the block's
    function on the complement of a low-rank G's span (U = ``e.G_eigvecs``)."""
    U, QA = e.G_eigvecs, e.A_eigvecs
    P = X - _sandwich(U, _sandwich(U.T, X, None), None)
    return _sandwich(None, _sandwich(None, P, QA) * row[None, :, None], _transpose(QA))


def _check_diagonal_factor(a: Tensor, what: str) -> None:
    if not a.dtype.is_floating_point or a.numel() == 0:
        raise ValueError(f"{what} must be a non-empty floating-point vector, got dtype {a.dtype} shape {tuple(a.shape)}")
    if not bool(torch.isfinite(a).all()):
        raise ValueError(f"{what} contains NaN or inf entries")


def _read(scalars: list[Tensor]) -> list[float]:
    """The values of 0-d tensors (of one device and dtype) with ONE read of the device, not one per scalar (each
    read stalls a GPU's queue)."""
    return torch.stack(scalars).tolist() if scalars else []


def _trace(M: Tensor) -> Tensor:
    """Trace of a factor (a vector is a diagonal factor)."""
    return M.sum() if M.dim() == 1 else M.trace()


def _fro(M: Tensor | LowRankFactor) -> float:
    if isinstance(M, LowRankFactor):
        return M.frobenius()
    return float(torch.linalg.vector_norm(M)) if M.dim() == 1 else float(torch.linalg.matrix_norm(M))


def _diag(M: Tensor) -> Tensor:
    return M if M.dim() == 1 else M.diagonal()


def _shift(M: Tensor, d: float) -> Tensor:
    """``M + d I`` in M's form (a vector: a diagonal factor; a :class:`LowRankFactor` stays one), a new tensor:
    a copy with d added to its diagonal (two passes, no identity matrix formed; the same entries as
    ``M + d * I``)."""
    if isinstance(M, LowRankFactor):
        return cast(Tensor, M.shifted(d))
    if M.dim() == 1:
        return M + d
    out = M.clone()
    out.diagonal().add_(d)
    return out


def _spd_inverse(M: Tensor, what: str) -> Tensor:
    if isinstance(M, LowRankFactor):
        return cast(Tensor, M.inverse(what))
    if M.dim() == 1:  # a diagonal factor
        if not bool((M > 0).all()):
            raise NotPositiveDefiniteError(f"factor {what} is not positive definite after damping; increase the damping")
        return 1.0 / M
    L, info = torch.linalg.cholesky_ex(M)
    if int(info) != 0:
        raise NotPositiveDefiniteError(f"factor {what} is not positive definite after damping; increase the damping")
    return _symmetrise(torch.cholesky_inverse(L))


# ---------------------------------------------------------------------------------------------- sums of two terms
@dataclass
class KroneckerPairEigh:
    """The exact damped inverse of a SUM of two Kronecker terms on one matrix view (a parameter used in two
    places, e.g. a tied embedding and output layer, each use contributing its own ``G_i (x) A_i``):

        M = G1 (x) A1 + G2' (x) A2',   G2' = G2 + (k / pi) I,  A2' = A2 + pi k I   (k = sqrt(delta)),

    i.e. the damping of Eq. 4.25 carried by the second term (factored; ``delta = 0`` needs G2 and A2
    positive definite). Generalised eigendecompositions of the two factor pairs,

        W_G^T G2' W_G = I,  W_G^T G1 W_G = diag(g);   W_A^T A2' W_A = I,  W_A^T A1 W_A = diag(a)

    (a Cholesky factor ``G2' = L L^T`` and the eigendecomposition of ``L^{-1} G1 L^{-T} = Q diag(g) Q^T``,
    ``W_G = L^{-T} Q``), give ``M = (W_G (x) W_A)^{-T} (g a^T + 1) (W_G (x) W_A)^{-1}`` exactly, so

        M^{-1} vec_row(X) = vec_row(W_G [(W_G^T X W_A) / (g a^T + 1)] W_A^T),
        log det M = in_aug log det G2' + out log det A2' + sum_ij log(g_i a_j + 1),

    and ``W_G [Z / sqrt(g a^T + 1)] W_A^T`` (Z standard normal) is a draw of ``N(0, M^{-1})``. A diagonal A
    (a vector) stays a vector where both terms' A are diagonal.

    A vocabulary-sized output (GPT-2's tied embedding and head, seen in the head's (V, D) view: the head's G1
    a :class:`LowRankFactor` ``U diag(s) U^T`` (c = 0), the embedding's G2 the diagonal of token counts) stays
    thin: with ``S = G2'^{-1/2}`` (a vector) and the thin eigendecomposition ``S U diag(s) U^T S = Q diag(g) Q^T``
    (Q (V, r)), ``W_G = S Q`` on the span and the whitened complement ``S (I - Q Q^T) S`` has eigenvalue 0 in
    G, so the sum's spectrum there is 1:
    ``M^{-1} X = W_G [(W_G^T X W_A) / (g a^T + 1)] W_A^T + S (I - Q Q^T) S X W_A W_A^T`` (O(V r) per column). Three or more terms have no such closed form
    (the damping identity is already a third term, which is why it rides on the second): a block holds at most
    two (:attr:`~curvkit.linalg.blocks.KroneckerBlock.second`), and EXACT damping, the third, goes through the
    operator's generic routes (conjugate gradients on the block, dense or SLQ log-determinants).
    """

    WG: Tensor  # (out, out)
    WA: Tensor  # (in_aug, in_aug), or the (in_aug,) scaling of a diagonal pair
    g: Tensor  # (out,)
    a: Tensor  # (in_aug,)
    logdet_base: Tensor  # in_aug log det G2' + out log det A2'
    rest_scale: Tensor | None = None  # a thin low-rank G1: S = G2'^{-1/2} (out,), the complement's scaling
    span: Tensor | None = None  # ... and Q (out, r), W_G = S Q

    @classmethod
    def of(cls, G1: Tensor, A1: Tensor, G2: Tensor, A2: Tensor, damping: float = 0.0, pi: float = 1.0,
           what: str = "block") -> KroneckerPairEigh:
        k = math.sqrt(check_damping(damping))
        G2d, A2d = _shift(G2, k / pi), _shift(A2, pi * k)
        WA, a, ldA = _generalised_eigh(A1, A2d, f"input factor of {what}")
        if isinstance(G1, LowRankFactor) and G2d.dim() == 1:  # thin (class docstring)
            if G1.c != 0:
                raise ValueError(f"{what}: a low-rank first output factor must be exactly low rank (c = 0), got "
                                 f"c = {G1.c:g}")
            if not bool((G2d > 0).all()):
                raise NotPositiveDefiniteError(f"the damped output factor of {what} is not positive definite; "
                                               "increase the damping")
            S = G2d.rsqrt()
            Q = LowRankFactor.from_rows((S[:, None] * G1.U * G1.s.clamp_min(0).sqrt()).T)
            return cls(S[:, None] * Q.U, WA, Q.s, a, A2d.shape[0] * torch.log(G2d).sum() + G2d.shape[0] * ldA,
                       S, Q.U)
        WG, g, ldG = _generalised_eigh(_dense(G1), G2d, f"output factor of {what}")
        return cls(WG, WA, g, a, A2d.shape[0] * ldG + G2d.shape[0] * ldA)

    def spectrum(self) -> Tensor:
        """(out, in_aug) eigenvalues ``g a^T + 1`` of the whitened sum."""
        return torch.outer(self.g, self.a) + 1.0

    def solve(self, X: Tensor) -> Tensor:
        """``M^{-1}`` applied to every column of X (out, in_aug, k)."""
        Y = self._out(self._in(X) / self.spectrum()[:, :, None])
        if self.span is None:
            return Y
        S = self.rest_scale[:, None, None]  # type: ignore[index]
        P = self._complement(S * X)
        return Y + S * self._a_side(self._a_side(P, True), False)

    def logdet(self) -> Tensor:
        return self.logdet_base + torch.log(self.spectrum()).sum()

    def sample(self, Z: Tensor) -> Tensor:
        """Draws of ``N(0, M^{-1})`` from standard normal Z (out, in_aug, k) (a thin low-rank G1: Z's
        coordinates in span(Q) and its independent projection on the complement)."""
        if self.span is None:
            return self._out(Z / self.spectrum().sqrt()[:, :, None])
        Zt = _sandwich(self.span.T, Z, None)
        inside = self._out(Zt / self.spectrum().sqrt()[:, :, None])
        S = self.rest_scale[:, None, None]  # type: ignore[index]
        return inside + S * self._a_side(self._complement(Z), False)

    def _complement(self, X: Tensor) -> Tensor:
        """``(I - Q Q^T) X`` per column."""
        assert self.span is not None
        return X - _sandwich(self.span, _sandwich(self.span.T, X, None), None)

    def _a_side(self, X: Tensor, transpose: bool) -> Tensor:
        """``X W_A`` (``transpose``) or ``X W_A^T`` per column."""
        WA = self.WA
        return _sandwich(None, X, WA if transpose or WA.dim() == 1 else WA.T)

    def _in(self, X: Tensor) -> Tensor:
        """``W_G^T X W_A`` per column (a vector W: a diagonal scaling)."""
        WG, WA = self.WG, self.WA
        Y = WG[:, None, None] * X if WG.dim() == 1 else _sandwich(WG.T, X, None)
        return _sandwich(None, Y, WA)

    def _out(self, X: Tensor) -> Tensor:
        """``W_G X W_A^T`` per column."""
        WG, WA = self.WG, self.WA
        Y = WG[:, None, None] * X if WG.dim() == 1 else _sandwich(WG, X, None)
        return _sandwich(None, Y, WA.T if WA.dim() == 2 else WA)


def nearest_kronecker(G1: Tensor, A1: Tensor, G2: Tensor, A2: Tensor, what: str = "block") -> tuple[Tensor, Tensor]:
    """``(G, A)`` with ``G (x) A`` the Kronecker product nearest in Frobenius norm to ``G1 (x) A1 + G2 (x) A2``
    (Van Loan & Pitsianis 1993: the best rank-one approximation of the rearrangement
    ``R = vec(G1) vec(A1)^T + vec(G2) vec(A2)^T``, a rank-two matrix).

    R's top singular pair lies in span(vec G1, vec G2) x span(vec A1, vec A2): with the 2 x 2 Gram matrices
    ``K_G = [<G_i, G_j>]``, ``K_A = [<A_i, A_j>]`` (Frobenius inner products; a vector is a diagonal factor) and
    the top singular triplet ``(u, sigma, v)`` of ``K_G^{1/2} K_A^{1/2}``,

        G = sigma sum_i x_i G_i,  x = K_G^{+1/2} u;    A = sum_j y_j A_j,  y = K_A^{+1/2} v

    (pseudo-inverse square roots: a use with zero factors, or proportional factors, leaves a rank-one Gram).
    For positive semi-definite factors the Gram matrices are entrywise non-negative, so u, v, x and y are too
    (Perron-Frobenius; their common sign is fixed here) and G, A are positive semi-definite. When the sum is
    itself a Kronecker product (one term zero, or ``G2 = c G1``, or ``A2 = c A1``) it is returned exactly.
    Shapes: G (out, out) dense unless both G's are vectors; likewise A. Low-rank factors are refused."""
    if any(isinstance(M, LowRankFactor) for M in (G1, A1, G2, A2)):
        raise ValueError(f"nearest_kronecker({what}): a low-rank output factor (a vocabulary-sized head) plus a "
                         "second term has no thin eigenbasis; freeze the tied weight (requires_grad_(False)), or form "
                         "the factor densely with config=CurvatureConfig(output_factor='dense') (a V^2 matrix)")

    def inner(M: Tensor, N: Tensor) -> Tensor:
        return (M * N).sum() if M.dim() == N.dim() else (_diag(M) * _diag(N)).sum()

    def roots(M1: Tensor, M2: Tensor) -> tuple[Tensor, Tensor]:  # K^{1/2} and K^{+1/2} of the 2 x 2 Gram matrix
        K = torch.stack([torch.stack([inner(a, b) for b in (M1, M2)]) for a in (M1, M2)])
        lam, Q = torch.linalg.eigh(K)
        lam = lam.clamp_min(0)
        keep = lam > 1e-12 * float(lam.max())
        return (Q * lam.sqrt()) @ Q.T, (Q[:, keep] * lam[keep].rsqrt()) @ Q[:, keep].T

    def combine(c: Tensor, M1: Tensor, M2: Tensor) -> Tensor:
        if M1.dim() == 1 and M2.dim() == 1:
            return c[0] * M1 + c[1] * M2
        return _symmetrise(c[0] * (torch.diag(M1) if M1.dim() == 1 else M1) +
                           c[1] * (torch.diag(M2) if M2.dim() == 1 else M2))

    rG, pG = roots(G1, G2)
    rA, pA = roots(A1, A2)
    U, S, Vh = torch.linalg.svd(rG @ rA)
    u, v = U[:, 0], Vh[0]
    if float(u.sum()) < 0:  # the common sign (u v^T is unchanged)
        u, v = -u, -v
    return combine((pG @ u).clamp_min(0) * S[0], G1, G2), combine((pA @ v).clamp_min(0), A1, A2)


def _generalised_eigh(M1: Tensor, M2: Tensor, what: str) -> tuple[Tensor, Tensor, Tensor]:
    """(W, w, log det M2) with ``W^T M2 W = I`` and ``W^T M1 W = diag(w)`` for symmetric M1 and positive
    definite M2 (vectors: diagonal factors, W then the vector ``M2^{-1/2}`` when M1 is diagonal too)."""
    if M2.dim() == 1:
        if not bool((M2 > 0).all()):
            raise NotPositiveDefiniteError(f"the damped {what} is not positive definite; increase the damping")
        s = M2.rsqrt()
        if M1.dim() == 1:
            return s, M1 * s * s, torch.log(M2).sum()
        w, Q = stable_eigh(s[:, None] * M1 * s[None, :], what)
        return s[:, None] * Q, w, torch.log(M2).sum()
    L, info = torch.linalg.cholesky_ex(M2)
    if int(info) != 0:
        raise NotPositiveDefiniteError(f"the damped {what} is not positive definite; increase the damping")
    M1d = torch.diag(M1) if M1.dim() == 1 else M1
    Li = torch.linalg.solve_triangular(L, torch.eye(L.shape[0], dtype=L.dtype, device=L.device), upper=False)
    w, Q = stable_eigh(_symmetrise(Li @ M1d @ Li.T), what)
    return Li.T @ Q, w, 2 * torch.log(L.diagonal()).sum()


def _sandwich(L: Tensor | LowRankFactor | None, X: Tensor, R: Tensor | None) -> Tensor:
    """``L X[:, :, j] R`` for every column j of X (m, n, k), with two plain 2-D matrix products.

    ``R`` may be a vector (``diag(R)``) or None (the identity); ``L`` may be None (the identity) or a
    :class:`LowRankFactor`. (Avoids broadcast batched matmuls, which are slow for small factors.)
    """
    m, n, k = X.shape
    if k == 1:  # one column: 2-D products read a transposed (strided) X directly, no reshaping copies
        Z1 = X[:, :, 0] if L is None else L @ X[:, :, 0]
        return (Z1 if R is None else Z1 * R if R.dim() == 1 else Z1 @ R)[:, :, None]
    Z = X if L is None else (L @ X.reshape(m, n * k)).reshape(L.shape[0], n, k)
    if R is None:
        return Z
    if R.dim() == 1:
        return Z * R[None, :, None]
    Y = R.T @ Z.transpose(0, 1).reshape(n, -1)  # (n', m' k)
    return Y.reshape(R.shape[1], Z.shape[0], k).transpose(0, 1)


def _transpose(Q: Tensor | None) -> Tensor | None:
    return None if Q is None else Q.T
