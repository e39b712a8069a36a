"""Kronecker-factored, block-diagonal curvature (thesis Ch. 4: Sec. 4.2, Eqs. 4.2-4.3, and Sec. 4.4.2).

Layout (read this first). PyTorch stores a ``nn.Linear`` weight as (out, in) and flattens row-major. With
the bias appended as the LAST column, ``W_hat = [W | b]`` has shape (out, in+1) (``(out, in)`` without a
bias; a ``nn.Conv2d`` weight (out, C, kh, kw) is viewed as (out, C*kh*kw)). In this layout one layer's
curvature block is

    G (x) A,   G: (out, out) output-side factor,  A: (in_aug, in_aug) input-side factor,

with the OUTPUT factor first (the thesis writes ``A (x) G``, Eq. 3.17, because its vec stacks columns,
Sec. 3.2.2), and for symmetric A

    (G (x) A) vec_row(X) = vec_row(G X A^T) = vec_row(G X A).

The flat parameter vector of :class:`~curvkit.linalg.layout.ParamLayout` stores ``W.reshape(-1)`` and then
the bias ``b`` (a separate tensor), i.e. NOT ``W_hat.reshape(-1)``: the bias column is moved to the end.
Every operator here maps between the two orders per block (:class:`BlockIndex`: views of the flat vector for
the standard and transposed views and row slices of them, :class:`StridedIndex`; an integer map for an
explicit index), and ``to_dense()`` returns the matrix in the flat PARAMETER order.

Types:

* :class:`KroneckerBlock` - one block's factors ``G``, ``A`` (A may be a vector: a diagonal input factor),
  the names of its weight and bias and, where the block is not the standard ``[W | b]`` view, the
  ``index`` of its matrix's entries in them (an embedding's transposed weight, one attention projection or
  convolution group, a normalisation layer's (1, P) row with ``factored=False``).
* :class:`KroneckerOperator` - ``blockdiag_l (G_l (x) A_l) + damping * I``, a
  :class:`~curvkit.linalg.operator.CurvatureOperator` with exact diagonal, trace, eigenvalues and logdet,
  damped inverses (exact eigen-based, or factored Tikhonov damping with the trace-norm split, thesis
  Eqs. 4.25-4.27) and matrix-normal sampling. The operator is read as a PRECISION when sampling.
* :class:`KroneckerInverseOperator` - the exact ``(G (x) A + delta I)^{-1}`` per block via the factors'
  eigendecompositions (never forms the Kronecker product).
* :class:`BlockDiagonalOperator` - dense per-layer blocks in the same ``W_hat`` layout (exact
  block-diagonal curvature from :mod:`curvkit.curvature.recursion`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import asdict, dataclass, fields, replace
from typing import Any, Literal, Protocol, cast

import torch
from torch import Tensor

from curvkit.linalg.krylov import NotPositiveDefiniteError
from curvkit.linalg.layout import ParamLayout
from curvkit.linalg.operator import CurvatureOperator, DiagonalOperator, TraceMethod, _finite, sub_layout
from curvkit.validation import check_damping

__all__ = [
    "BlockDiagonalOperator",
    "BlockIndex",
    "BlockView",
    "DenseBlock",
    "Index",
    "KroneckerBlock",
    "KroneckerEigh",
    "KroneckerInverseOperator",
    "KroneckerOperator",
    "KroneckerPairEigh",
    "KroneckerSpectralOperator",
    "LowRankFactor",
    "StridedIndex",
    "block_matrix",
    "block_positions",
    "factor_from_state",
    "factor_state",
    "index_from_state",
    "index_state",
    "kron_matvec",
    "psd_eigh",
    "stable_eigh",
    "standard_index",
    "transposed_index",
    "vec_row",
    "write_block_matrix",
]


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


_TILE = 512  # symmetrise by tiles from this size on: M + M^T reads M^T with stride n, a cache miss per element


def _symmetrise(M: Tensor, c: float = 0.5) -> Tensor:
    """``c * (M + M^T)`` for a square M, a new tensor, bitwise equal to the plain expression (each entry is the
    same two-term sum times c). Large matrices go tile by tile: the transposed read of a (512, 512) tile stays
    in cache, where ``M + M.T`` over a 5,632-wide factor took twice the time (and 35 % of a KFAC update on a
    Llama layer, most of it in this transpose)."""
    n = M.shape[0]
    if M.dim() != 2 or n < 2 * _TILE or M.shape[1] != n:
        return (M + M.T).mul_(c)
    out = torch.empty_like(M)
    for i in range(0, n, _TILE):
        for j in range(i, n, _TILE):
            tile = (M[i:i + _TILE, j:j + _TILE] + M[j:j + _TILE, i:i + _TILE].T).mul_(c)
            out[i:i + _TILE, j:j + _TILE] = tile
            if j != i:
                out[j:j + _TILE, i:i + _TILE] = tile.T
    return out


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


# ---------------------------------------------------------------------------------------------- blocks
@dataclass
class KroneckerBlock:
    """One curvature block ``G (x) A`` in the row-major layout of a matrix view ``W_hat`` (out, in_aug).

    Attributes:
        G: (out, out) symmetric output-side factor (pre-activation curvature, e.g. the GGN ``G_l``), or a
            :class:`LowRankFactor` (a thin eigendecomposition: the output factor of a layer with a huge output
            dimension, e.g. a language model's vocabulary, is never formed as a matrix).
        A: (in_aug, in_aug) symmetric input-side factor, or an (in_aug,) vector: a DIAGONAL input factor
            ``diag(A)`` (an ``nn.Embedding``'s token counts; never a V x V matrix). By default
            ``in_aug = in + 1`` when ``bias_name`` is given (bias column LAST), else ``in``; for a
            ``nn.Conv2d`` layer ``in = C * kh * kw``.
        weight_name: name of the (first) parameter in the operator's :class:`ParamLayout`.
        bias_name: name of the bias (second parameter), or None.
        index: which parameter entries ``W_hat`` holds, as positions in the concatenation
            ``[weight.flatten(), bias.flatten()]`` of this block's own parameters: None for the standard
            view ``[W.reshape(out, -1) | b]``; a :class:`StridedIndex` (a few integers) for a transposed
            view (GPT-2's ``Conv1D``, an embedding's (V, D) weight as (D, V)) or a slice of rows of either
            view (one query/key/value projection of a packed attention weight, one group of a grouped
            convolution); an integer (out, in_aug) tensor for anything else (a row vector (1, P) of a
            normalisation layer's parameters). Every layout entry must belong to exactly one block.
        label: a name for messages (the layer and, for a slice, which one), or None.
        factored: False for a plain matrix block written as ``[[g]] (x) A`` with a (1, 1) ``G`` (the exact
            or diagonal block of a normalisation layer or of raw parameters): damping is then added to
            the block exactly, never split between the factors.

    ``G`` and ``A`` are validated (square - or a vector for A -, finite, symmetric up to rounding) and
    stored symmetrised. Their agreement with the parameter shapes is checked by :class:`KroneckerOperator`.
    """

    G: Tensor  # or a LowRankFactor: it offers the factor operations used here (typed as Tensor for consumers)
    A: Tensor
    weight_name: str
    bias_name: str | None = None
    index: Index | None = None
    label: str | None = None
    factored: bool = True

    def __post_init__(self) -> None:
        what = f"KroneckerBlock({self.name!r})"
        low_rank = isinstance(self.G, LowRankFactor)  # validated (finite, thin eigendecomposition) on creation
        if not low_rank:
            _check_square_symmetric(self.G, f"{what}.G")
        if isinstance(self.A, Tensor) and self.A.dim() == 1:
            _check_diagonal_factor(self.A, f"{what}.A")
        else:
            _check_square_symmetric(self.A, f"{what}.A")
        if self.G.dtype != self.A.dtype or self.G.device != self.A.device:
            raise ValueError(f"{what}: G and A must share dtype and device, got "
                             f"{self.G.dtype}/{self.G.device} and {self.A.dtype}/{self.A.device}")
        if not self.factored and self.G.shape != (1, 1):
            raise ValueError(f"{what}: a block with factored=False is [[g]] (x) A and needs a (1, 1) G, got "
                             f"{tuple(self.G.shape)}")
        self.G = self.G if low_rank else _symmetrise(self.G)
        self.A = self.A.clone() if self.A.dim() == 1 else _symmetrise(self.A)

    @classmethod
    def from_gram(cls, G: Tensor, A: Tensor, weight_name: str, bias_name: str | None = None,
                  scale_G: float = 1.0, scale_A: float = 1.0, *, index: Index | None = None,
                  label: str | None = None, factored: bool = True) -> KroneckerBlock:
        """Internal fast path for factors that are symmetric by construction (sums of Gram matrices
        ``X^T X`` computed by curvkit itself): skips the validation of ``__post_init__`` (which costs
        several elementwise passes over each factor) and stores ``scale * (M + M^T) / 2``, so the
        result is exactly symmetric in floating point, as a validated block is (a diagonal A: ``scale * A``).
        """
        blk = cls.__new__(cls)
        blk.G = G * scale_G if isinstance(G, LowRankFactor) else _symmetrise(G, 0.5 * scale_G)
        blk.A = A * scale_A if A.dim() == 1 else _symmetrise(A, 0.5 * scale_A)
        blk.weight_name, blk.bias_name = weight_name, bias_name
        blk.index, blk.label, blk.factored = index, label, factored
        return blk

    @property
    def name(self) -> str:
        """The block's label, or its weight's name."""
        return self.label if self.label is not None else self.weight_name

    @property
    def out_dim(self) -> int:
        return int(self.G.shape[0])

    @property
    def in_dim(self) -> int:
        """Size of A (``in + 1`` with a bias)."""
        return int(self.A.shape[0])

    @property
    def low_rank_output(self) -> bool:
        """G is a :class:`LowRankFactor` (thin eigendecomposition)."""
        return isinstance(self.G, LowRankFactor)

    @property
    def diagonal_input(self) -> bool:
        """A is stored as the vector of a diagonal input factor."""
        return self.A.dim() == 1

    @property
    def names(self) -> tuple[str, ...]:
        return (self.weight_name,) if self.bias_name is None else (self.weight_name, self.bias_name)

    def with_factors(self, G: Tensor, A: Tensor) -> KroneckerBlock:
        """The same block (names, index, label, kind) with other factors (validated)."""
        return KroneckerBlock(G, A, self.weight_name, self.bias_name, self.index, self.label, self.factored)


@dataclass
class DenseBlock:
    """One layer's dense curvature block (P, P), P = out * in_aug, in the row-major ``W_hat`` order."""

    matrix: Tensor
    weight_name: str
    bias_name: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.weight_name,) if self.bias_name is None else (self.weight_name, self.bias_name)


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


def _trace(M: Tensor) -> Tensor:
    """Trace of a factor (a vector is a diagonal factor)."""
    return M.sum() if M.dim() == 1 else M.trace()


def _fro(M: Tensor | LowRankFactor) -> float:
    if isinstance(M, LowRankFactor):
        return M.frobenius()
    return float(torch.linalg.vector_norm(M)) if M.dim() == 1 else float(torch.linalg.matrix_norm(M))


def _diag(M: Tensor) -> Tensor:
    return M if M.dim() == 1 else M.diagonal()


def _eye_like(M: Tensor) -> Tensor:
    """The identity in the form of factor M (ones for a diagonal factor)."""
    if M.dim() == 1:
        return torch.ones_like(M)
    return torch.eye(M.shape[0], dtype=M.dtype, device=M.device)


def _shift(M: Tensor, d: float) -> Tensor:
    """``M + d I`` in M's form (a vector: a diagonal factor; a :class:`LowRankFactor` stays one)."""
    if isinstance(M, LowRankFactor):
        return cast(Tensor, M.shifted(d))
    return M + d * _eye_like(M)


@dataclass(frozen=True)
class StridedIndex:
    """The index of a block whose matrix ``W_hat`` is a row range of the STANDARD or the TRANSPOSED view of a
    weight, held as a few integers (never as an (out, in_aug) integer tensor: 8 bytes per parameter).

    With ``V`` the (rows, cols) view of the weight ``w`` (any shape with ``rows * cols`` entries),

        V = w.reshape(rows, cols)          (standard:   ``nn.Linear``, a convolution's (out, C*kh*kw)),
        V = w.reshape(cols, rows)^T        (transposed: GPT-2's ``Conv1D`` (in, out), an embedding's (V, D)),

    the block's matrix is ``W_hat = [V[start:stop] | b[start:stop]]`` (the bias column only with ``bias``;
    the bias has ``rows`` entries). Entry ``W_hat[o, i]`` (row ``r = start + o``) sits at position
    ``r * cols + i`` (standard) or ``i * rows + r`` (transposed) of ``w.flatten()``, its bias entry at
    ``rows * cols + r`` of ``[w.flatten(), b]`` (:meth:`materialize` writes these out). Slicing rows
    (``index[j * n:(j + 1) * n]``: one q/k/v projection of a packed weight, one convolution group) gives a
    StridedIndex again. :meth:`gather` and :meth:`scatter` read and write ``W_hat`` through views of the
    parameters (a reshape, a transpose, a row slice), so a product never builds an integer map.
    """

    rows: int
    cols: int
    transposed: bool = False
    start: int = 0
    stop: int = -1  # -1: rows
    bias: bool = False

    def __post_init__(self) -> None:
        if self.stop == -1:
            object.__setattr__(self, "stop", self.rows)
        for name in ("rows", "cols", "start", "stop"):
            if isinstance(getattr(self, name), bool) or not isinstance(getattr(self, name), int):
                raise TypeError(f"StridedIndex.{name} must be an int, got {getattr(self, name)!r}")
        if self.rows < 1 or self.cols < 1 or not 0 <= self.start < self.stop <= self.rows:
            raise ValueError(f"StridedIndex: need rows >= 1, cols >= 1 and 0 <= start < stop <= rows, got "
                             f"rows={self.rows}, cols={self.cols}, start={self.start}, stop={self.stop}")

    @property
    def shape(self) -> tuple[int, int]:
        """(out, in_aug) of ``W_hat``."""
        return self.stop - self.start, self.cols + int(self.bias)

    def __getitem__(self, rows: slice) -> StridedIndex:
        """The rows ``rows`` (a slice with step 1) of ``W_hat``, as a StridedIndex."""
        r = range(self.start, self.stop)[rows] if isinstance(rows, slice) else range(0)
        if r.step != 1 or len(r) == 0:
            raise ValueError(f"a StridedIndex takes a non-empty row slice with step 1, got {rows!r}")
        return replace(self, start=r.start, stop=r.stop)

    def materialize(self, device: torch.device | str = "cpu") -> Tensor:
        """The (out, in_aug) int64 positions in ``[w.flatten(), b]`` (for consumers that need positions;
        allocates 8 bytes per entry)."""
        r = torch.arange(self.start, self.stop, device=device)[:, None]
        c = torch.arange(self.cols, device=device)[None, :]
        idx = c * self.rows + r if self.transposed else r * self.cols + c
        return torch.cat([idx, self.rows * self.cols + r], dim=1) if self.bias else idx

    def _weight_view(self, w: Tensor) -> Tensor:
        """The (out, cols, *t) view of ``W_hat``'s weight columns in ``w`` (rows * cols, *t)."""
        t = w.shape[1:]
        V = w.view(self.cols, self.rows, *t).transpose(0, 1) if self.transposed else w.view(self.rows, self.cols, *t)
        return V[self.start:self.stop]

    def gather(self, w: Tensor, b: Tensor | None) -> Tensor:
        """``W_hat`` (out, in_aug, *t) from the flat weight ``w`` (rows * cols, *t) and bias ``b`` (rows, *t)
        (a view of ``w`` without a bias column; differentiable)."""
        W = self._weight_view(w)
        return W if b is None else torch.cat([W, b[self.start:self.stop].unsqueeze(1)], dim=1)

    def scatter(self, X: Tensor, w: Tensor, b: Tensor | None) -> None:
        """Write ``X`` (out, in_aug, *t) into the flat ``w`` (rows * cols, *t) and ``b`` (rows, *t) in place."""
        self._weight_view(w).copy_(X[:, :self.cols])
        if b is not None:
            b[self.start:self.stop].copy_(X[:, self.cols])

    def state(self) -> dict[str, int | bool]:
        """Plain numbers (``torch.load(weights_only=True)`` reads them); :func:`index_from_state` inverts it."""
        return asdict(self)


#: A block's ``index``: an explicit integer tensor (out, in_aug) or a :class:`StridedIndex`.
Index = Tensor | StridedIndex


def index_state(index: Index | None) -> Tensor | dict[str, int | bool] | None:
    """A block's index in a form a ``weights_only=True`` checkpoint holds (a tensor stays a tensor)."""
    return index.state() if isinstance(index, StridedIndex) else index


def index_from_state(state: Any, device: torch.device | str = "cpu") -> Index | None:
    """The inverse of :func:`index_state` (a tensor is moved to ``device``)."""
    if state is None or isinstance(state, StridedIndex):
        return state
    if isinstance(state, Tensor):
        return state.to(device)
    if isinstance(state, Mapping) and set(state) == {f.name for f in fields(StridedIndex)}:
        return StridedIndex(**state)
    raise ValueError(f"a saved block index must be a tensor, None or a StridedIndex's state "
                     f"({', '.join(f.name for f in fields(StridedIndex))}), got {state!r}")


def standard_index(weight_shape: Sequence[int], bias: bool) -> StridedIndex:
    """The index of ``W_hat = [W.reshape(out, -1) | b]`` (the standard view; :class:`StridedIndex`)."""
    out = int(weight_shape[0])
    return StridedIndex(out, int(math.prod(weight_shape[1:])), bias=bias)


def transposed_index(n_in: int, n_out: int, bias: bool) -> StridedIndex:
    """The index of ``W_hat = [W^T | b]`` (out, in_aug) for a weight ``W`` of shape (in, out) (GPT-2's
    ``Conv1D``, an embedding's (V, D) table; :class:`StridedIndex`)."""
    return StridedIndex(int(n_out), int(n_in), transposed=True, bias=bias)


class BlockView(Protocol):
    """What :func:`block_matrix` and :func:`write_block_matrix` read of a block: its parameters' names and its
    ``index`` (a :class:`KroneckerBlock`, or a consumer's record of one)."""

    @property
    def weight_name(self) -> str: ...

    @property
    def bias_name(self) -> str | None: ...

    @property
    def index(self) -> Index | None: ...


def _view_index(block: BlockView, w: Tensor, b: Tensor | None) -> Index:
    return block.index if block.index is not None else standard_index(w.shape, b is not None)


def block_matrix(block: BlockView, tensors: Mapping[str, Tensor]) -> Tensor:
    """The block's matrix ``W_hat`` (out, in_aug) read from parameter-shaped tensors by name (the parameters,
    their gradients, a direction): views of them for a :class:`StridedIndex` (the standard ``[W | b]`` view
    for None, a transposed weight, a q/k/v or group row slice), else the entries
    ``[w.flatten(), b.flatten()][index]`` (a (1, P) row). Differentiable: autograd reaches ``tensors``.
    Inverse of :func:`write_block_matrix`."""
    w = tensors[block.weight_name]
    b = None if block.bias_name is None else tensors[block.bias_name]
    index = _view_index(block, w, b)
    if isinstance(index, StridedIndex):
        return index.gather(w.reshape(-1), None if b is None else b.reshape(-1))
    flat = w.reshape(-1) if b is None else torch.cat([w.reshape(-1), b.reshape(-1)])
    return flat[index.to(flat.device)]


def write_block_matrix(block: BlockView, M: Tensor, out: MutableMapping[str, Tensor]) -> None:
    """Write ``M`` (out, in_aug), a matrix in the block's ``W_hat`` view, into the parameter-shaped, contiguous
    tensors ``out[weight_name]`` (and ``out[bias_name]``) in place: exactly the entries the block covers are
    set (:func:`block_matrix` reads them back), so the blocks of a parameter split into several (q/k/v,
    convolution groups) fill it together."""
    w = out[block.weight_name]
    b = None if block.bias_name is None else out[block.bias_name]
    index = _view_index(block, w, b)
    if isinstance(index, StridedIndex):
        index.scatter(M, w.view(-1), None if b is None else b.view(-1))
        return
    idx, vals = index.to(w.device).reshape(-1), M.reshape(-1)
    if b is None:
        w.view(-1)[idx] = vals
        return
    in_w = idx < w.numel()
    w.view(-1)[idx[in_w]] = vals[in_w]
    b.view(-1)[idx[~in_w] - w.numel()] = vals[~in_w]


class BlockIndex:
    """Reads and writes a block's ``W_hat`` (out, in_aug) in flat parameter vectors of a layout: through views
    for a :class:`StridedIndex` (None: the standard view), through the flat positions :attr:`perm` for an
    explicit integer index (validated: 2-D, in range)."""

    def __init__(self, layout: ParamLayout, weight_name: str, bias_name: str | None, device: torch.device,
                 index: Index | None = None, label: str | None = None, *,
                 slices: dict[str, slice] | None = None, shapes: dict[str, Any] | None = None):
        slices = layout.slices() if slices is None else slices
        shapes = dict(zip(layout.names, layout.shapes)) if shapes is None else shapes
        wshape = tuple(shapes[weight_name])
        bn = int(math.prod(shapes[bias_name])) if bias_name is not None else 0
        what = label if label is not None else weight_name
        self.weight_name, self.bias_name, self.has_bias = weight_name, bias_name, bias_name is not None
        self._w0, self._wn = slices[weight_name].start, int(math.prod(wshape))
        self._b0 = slices[bias_name].start if bias_name is not None else None
        self._bn, self._device = bn, device
        self.strided: StridedIndex | None = None
        self._local: Tensor | None = None
        if index is None:
            if len(wshape) < 2:
                raise ValueError(f"parameter {weight_name!r} of shape {wshape} is not a weight matrix "
                                 "(need at least 2 dimensions: (out, in) or (out, C, kh, kw)); pass the block "
                                 "an explicit index")
            if bias_name is not None and tuple(shapes[bias_name]) != (wshape[0],):
                raise ValueError(f"bias {bias_name!r} has shape {tuple(shapes[bias_name])}, expected ({wshape[0]},) "
                                 f"to match weight {weight_name!r} of shape {wshape}")
            index = standard_index(wshape, self.has_bias)
        if isinstance(index, StridedIndex):
            if index.rows * index.cols != self._wn or index.bias != self.has_bias or (self.has_bias and bn != index.rows):
                raise ValueError(f"block {what!r}: its {index} needs a weight of {index.rows} x {index.cols} entries"
                                 f"{f' and a bias of {index.rows}' if index.bias else ' and no bias'}, got weight "
                                 f"{weight_name!r} {wshape}" + (f" and bias {bias_name!r} ({bn},)" if self.has_bias
                                                              else " and no bias"))
            self.strided = index
            self.out, self.in_aug = index.shape
        else:
            total = self._wn + bn
            if not isinstance(index, Tensor) or index.dim() != 2 or index.dtype not in (torch.int64, torch.int32):
                raise ValueError(f"block {what!r}: index must be a 2-D integer tensor or a StridedIndex, got "
                                 f"{type(index).__name__ if not isinstance(index, Tensor) else (index.dtype, tuple(index.shape))}")
            if index.numel() and (int(index.min()) < 0 or int(index.max()) >= total):
                raise ValueError(f"block {what!r}: index entries must lie in [0, {total - 1}] (the entries of its "
                                 "parameters), got values outside")
            self.out, self.in_aug = int(index.shape[0]), int(index.shape[1])
            self._local = index.to(device=device, dtype=torch.int64)
        self.in_w = self.in_aug - int(self.has_bias)  # the weight columns
        self._perm: Tensor | None = None
        self.size = self.out * self.in_aug

    @property
    def perm(self) -> Tensor:
        """W_hat row-major position -> flat parameter index (size,). Kept for an explicit index (as large as
        it); built on each use for a :class:`StridedIndex`, whose products never need it (``to_dense`` and
        :func:`block_positions` do)."""
        if self._perm is not None:
            return self._perm
        local = self.strided.materialize(self._device) if self.strided is not None else self._local
        assert local is not None
        loc = local.reshape(-1)
        perm = loc + self._w0
        if self._b0 is not None:
            perm = torch.where(loc < self._wn, perm, loc - self._wn + self._b0)
        if self.strided is None:
            self._perm = perm
        return perm

    def _parts(self, M: Tensor) -> tuple[Tensor, Tensor | None]:
        """The rows of a flat (d, ...) tensor that hold the weight and the bias."""
        b = None if self._b0 is None else M[self._b0:self._b0 + self._bn]
        return M[self._w0:self._w0 + self._wn], b

    def gather(self, M: Tensor) -> Tensor:
        """(d, k) flat -> (out, in_aug, k): column j of M as the matrix W_hat[:, :, j] (a view of M where the
        block is a weight without a bias column)."""
        if self.strided is not None:
            return self.strided.gather(*self._parts(M))
        return M.index_select(0, self.perm).reshape(self.out, self.in_aug, -1)

    def scatter(self, Y: Tensor, out: Tensor) -> None:
        """Write (out, in_aug, k) into the rows of the flat (d, k) ``out`` (any strides)."""
        if self.strided is not None:
            self.strided.scatter(Y.reshape(self.out, self.in_aug, -1), *self._parts(out))
            return
        out.index_copy_(0, self.perm, Y.reshape(self.size, -1))

    @property
    def names(self) -> tuple[str, ...]:
        return (self.weight_name,) if self.bias_name is None else (self.weight_name, self.bias_name)

    def row_view(self, name: str) -> tuple[Any, ...] | None:
        """For a :class:`StridedIndex`, the view whose rows ``[start, stop)`` this block takes of parameter
        ``name``: ``('weight', rows, cols, transposed)`` or ``('bias', rows)``; None for an explicit index."""
        s = self.strided
        if s is None:
            return None
        return ("weight", s.rows, s.cols, s.transposed) if name == self.weight_name else ("bias", s.rows)


def block_positions(layout: ParamLayout, weight_name: str, bias_name: str | None = None, index: Index | None = None,
                    device: torch.device | str = "cpu") -> Tensor:
    """(out, in_aug) flat positions in ``layout`` of the entries of a block's matrix ``W_hat`` (its ``index``
    into ``[weight.flatten(), bias.flatten()]``, or the standard ``[W | b]`` view for None, as
    :class:`KroneckerBlock`): ``flat[block_positions(...)]`` is ``W_hat``. Allocates 8 bytes per entry: to read
    or write a block's part of flat vectors use :class:`BlockIndex`'s ``gather``/``scatter``."""
    ix = BlockIndex(layout, weight_name, bias_name, torch.device(device), index)
    return ix.perm.reshape(ix.out, ix.in_aug)


def _sandwich(L: Tensor | LowRankFactor | None, X: Tensor, R: Tensor | None) -> Tensor:
    """``L X[:, :, j] R`` for every column j of X (m, n, k), with two plain 2-D matrix products.

    ``R`` may be a vector (``diag(R)``) or None (the identity); ``L`` may be None (the identity) or a
    :class:`LowRankFactor`. (Avoids broadcast batched matmuls, which are slow for small factors.)
    """
    m, n, k = X.shape
    Z = X if L is None else (L @ X.reshape(m, n * k)).reshape(L.shape[0], n, k)
    if R is None:
        return Z
    if R.dim() == 1:
        return Z * R[None, :, None]
    Y = R.T @ Z.transpose(0, 1).reshape(n, -1)  # (n', m' k)
    return Y.reshape(R.shape[1], Z.shape[0], k).transpose(0, 1)


def _transpose(Q: Tensor | None) -> Tensor | None:
    return None if Q is None else Q.T


def _build_index(layout: ParamLayout, named: Sequence[tuple[Any, ...]], device: torch.device,
                 kind: str) -> list[BlockIndex]:
    """Check that the blocks cover every layout entry exactly once; build their index maps.

    ``named``: per block (weight name, bias name) or (weight name, bias name, index, label)."""
    known = set(layout.names)
    seen: dict[str, int] = {}
    partial = False
    for i, spec in enumerate(named):
        w, b = spec[0], spec[1]
        explicit = len(spec) > 2 and spec[2] is not None
        partial |= explicit
        for name in (w,) if b is None else (w, b):
            if name not in known:
                raise ValueError(f"{kind} block {i} refers to parameter {name!r}, which is not in the layout "
                                 f"(parameters: {', '.join(layout.names)})")
            if name in seen and not explicit:
                raise ValueError(f"parameter {name!r} is covered by two {kind} blocks ({seen[name]} and {i}); "
                                 "every parameter must belong to exactly one block")
            seen.setdefault(name, i)
    missing = [n for n in layout.names if n not in seen]
    if missing:
        raise ValueError(f"parameter(s) {', '.join(repr(m) for m in missing)} not covered by any {kind} "
                         "block; give every trainable parameter a block (or build the layout without it)")
    slices, shapes = layout.slices(), dict(zip(layout.names, layout.shapes))
    out = [BlockIndex(layout, s[0], s[1], device, *(s[2:4] if len(s) > 2 else ()), slices=slices, shapes=shapes)
           for s in named]
    if partial:  # blocks that hold parts of parameters: every entry exactly once
        _check_coverage(layout, out, kind)
    return out


def _check_coverage(layout: ParamLayout, blocks: Sequence[BlockIndex], kind: str) -> None:
    """Raise unless every entry of every parameter belongs to exactly one block. A parameter whose blocks all
    take row ranges of one strided view (a whole weight, its q/k/v or group slices, their bias) is checked by
    counting the view's rows (out numbers, not parameters); any other by counting its entries through the
    blocks' positions (an explicit index: a normalisation layer's (1, P) row, a user's map)."""
    touching: dict[str, list[BlockIndex]] = {}
    for ix in blocks:
        for name in ix.names:
            touching.setdefault(name, []).append(ix)
    slices = layout.slices()
    for name, on in touching.items():
        views = {ix.row_view(name) for ix in on}
        view = views.pop() if len(views) == 1 else None
        if view is not None:  # counts per row of the view; row r's first entry is entry r * cols or r
            counts = torch.zeros(view[1], dtype=torch.int32)
            for ix in on:
                assert ix.strided is not None
                counts[ix.strided.start:ix.strided.stop] += 1
            step = view[2] if view[0] == "weight" and not view[3] else 1
        else:
            sl, device = slices[name], on[0]._device
            counts = torch.zeros(sl.stop - sl.start, dtype=torch.int32, device=device)
            for ix in on:
                perm = ix.perm
                perm = perm[(perm >= sl.start) & (perm < sl.stop)] - sl.start
                counts.index_add_(0, perm, torch.ones(perm.shape, dtype=counts.dtype, device=device))
            step = 1
        bad = torch.nonzero(counts != 1)
        if bad.numel():
            pos = int(bad[0, 0])
            raise ValueError(f"entry {pos * step} of parameter {name!r} is covered by {int(counts[pos])} {kind} "
                             "blocks; every entry must belong to exactly one block")


_check_damping = check_damping


# ---------------------------------------------------------------------------------------------- operator
class KroneckerOperator(CurvatureOperator):
    """Block-diagonal Kronecker curvature ``C = blockdiag_l (G_l (x) A_l) + damping * I``.

    Args:
        layout: the parameters the operator acts on; every one must belong to exactly one block.
        blocks: one :class:`KroneckerBlock` per layer (any order).
        damping: a multiple of the identity carried exactly (``add_identity`` stays structured).

    Products use ``vec_row(G X A)`` per layer (``O(out^2 in + out in^2)``, no Kronecker product is
    formed). ``diagonal``, ``trace``, ``eigenvalues``, ``logdet`` are exact closed forms from the factors.
    Scaling ``c * C`` multiplies every ``G`` (and the damping) by ``c``.
    """

    def __init__(self, layout: ParamLayout, blocks: Sequence[KroneckerBlock], damping: float = 0.0):
        blocks = list(blocks)
        if not blocks:
            raise ValueError("KroneckerOperator needs at least one KroneckerBlock")
        for b in blocks:
            if not isinstance(b, KroneckerBlock):
                raise TypeError(f"blocks must be KroneckerBlock instances, got {type(b).__name__}")
        dtype, device = blocks[0].G.dtype, blocks[0].G.device
        for b in blocks:
            if b.G.dtype != dtype or b.G.device != device:
                raise ValueError(f"all blocks must share dtype and device; block {b.weight_name!r} has "
                                 f"{b.G.dtype}/{b.G.device}, expected {dtype}/{device}")
        super().__init__(layout, dtype, device)
        self.blocks = blocks
        self.damping = _check_damping(damping)
        self._index = _build_index(layout, [(b.weight_name, b.bias_name, b.index, b.label) for b in blocks],
                                   self.device, "Kronecker")
        for b, ix in zip(blocks, self._index):
            if (b.out_dim, b.in_dim) != (ix.out, ix.in_aug):
                view = ("its index" if b.index is not None else
                        f"the weight viewed as W_hat ({ix.in_w} inputs, "
                        f"{'+1 for the bias column' if ix.has_bias else 'no bias'})")
                raise ValueError(
                    f"block for {b.name!r}: G is {tuple(b.G.shape)} and A is {tuple(b.A.shape)}, but "
                    f"{view} has shape ({ix.out}, {ix.in_aug}); expected G ({ix.out}, {ix.out}) and A "
                    f"({ix.in_aug}, {ix.in_aug})"
                )
        self._eigh: list[KroneckerEigh] | None = None

    # ------------------------------------------------------------------ products and closed forms
    def _matmat(self, M: Tensor) -> Tensor:
        M = M.to(self.dtype)
        out = torch.empty_like(M)
        for b, ix in zip(self.blocks, self._index):
            ix.scatter(_sandwich(b.G, ix.gather(M), b.A), out)
        return out + self.damping * M if self.damping != 0 else out

    def to_dense(self) -> Tensor:
        """The (d, d) matrix in the flat PARAMETER order (bias entries after the weight entries)."""
        d = self.layout.dim
        D = torch.zeros(d, d, dtype=self.dtype, device=self.device)
        for b, ix in zip(self.blocks, self._index):
            A = torch.diag(b.A) if b.diagonal_input else b.A
            D[ix.perm[:, None], ix.perm[None, :]] = torch.kron(_dense(b.G).contiguous(), A.contiguous())
        if self.damping != 0:
            D.diagonal().add_(self.damping)
        return D

    def _exact_diagonal(self) -> DiagonalOperator:
        """Exact: the diagonal of ``G (x) A`` is ``vec_row(outer(diag G, diag A))``."""
        flat = torch.empty(self.layout.dim, dtype=self.dtype, device=self.device)
        for b, ix in zip(self.blocks, self._index):
            ix.scatter(torch.outer(b.G.diagonal(), _diag(b.A)), flat[:, None])
        return DiagonalOperator.from_flat(self.layout, flat + self.damping)

    def trace(self, method: TraceMethod = "exact", num_probes: int = 100,
              generator: torch.Generator | None = None,
              distribution: Literal["rademacher", "gaussian"] = "rademacher") -> Tensor:
        """``sum_l tr(G_l) tr(A_l) + damping * d`` for ``method='exact'``; estimators otherwise."""
        if method != "exact":
            return super().trace(method, num_probes, generator, distribution)
        t = sum((b.G.trace() * _trace(b.A) for b in self.blocks), torch.zeros((), dtype=self.dtype,
                                                                              device=self.device))
        return t + self.damping * self.layout.dim

    def eigh(self) -> list[KroneckerEigh]:
        """Per-block eigendecompositions of the factors (cached; the damping is NOT included)."""
        if self._eigh is None:
            out = []
            for b in self.blocks:
                rest: tuple[int, float] = (0, 0.0)
                if isinstance(b.G, LowRankFactor):  # already a thin eigendecomposition
                    lG, QG, rest = b.G.s, b.G.U, (b.G.complement, b.G.c)
                else:
                    lG, QG = stable_eigh(b.G, f"factor G of {b.name!r}")
                if b.diagonal_input:
                    out.append(KroneckerEigh(lG, QG, b.A.clone(), None, *rest))
                    continue
                lA, QA = stable_eigh(b.A, f"factor A of {b.name!r}")
                out.append(KroneckerEigh(lG, QG, lA, QA, *rest))
            self._eigh = out
        return self._eigh

    def eigenvalues(self, k: int = 1, which: Literal["largest", "smallest"] = "largest",
                    num_iter: int | None = None, generator: torch.Generator | None = None) -> Tensor:
        """Exact top-k (or bottom-k) eigenvalues from the factors' spectra, in descending order."""
        allv = torch.cat([_spectrum_values(e, e.eigenvalues(self.damping), k) for e in self.eigh()])
        vals = torch.sort(allv, descending=True).values
        return vals[:k] if which == "largest" else vals[-k:]

    def _damped_spectra(self, damping: float, what: str) -> list[Tensor]:
        """Per block the eigenvalues ``outer(lG, lA) + delta`` of ``G (x) A + delta I``, checked positive.

        The factor product carries rounding of order ``size * eps * max|lG lA|``; entries of the product
        within that of zero (negative or not) are rounding of a positive semi-definite product and are set
        to 0 before the exact damping ``delta`` is added. A block then counts as positive definite when
        ``delta > 0`` or its smallest product eigenvalue is above that rounding level; products more
        negative than the rounding (indefinite factors) are kept and checked as they are.
        """
        delta = self.damping + _check_damping(damping)
        spectra = []
        for b, e in zip(self.blocks, self.eigh()):
            prod = torch.outer(e.G_values, e.A_eigvals)
            noise = max(prod.shape) * torch.finfo(prod.dtype).eps * float(prod.abs().max())
            low = float(prod.min())
            if low >= -noise:
                prod = torch.where(prod.abs() <= noise, torch.zeros_like(prod), prod)
            lam = prod + delta
            ok = (delta > 0 or low > noise) if low >= -noise else bool((lam > 0).all())
            if not ok:
                raise NotPositiveDefiniteError(
                    f"{what}: block {b.name!r} is not positive definite after damping {delta:g} "
                    f"(smallest eigenvalue {low + delta:.3g}, rounding level {noise:.2g}); increase the damping"
                )
            spectra.append(lam)
        return spectra

    def _logdet(self, damping: float) -> Tensor:
        """``log det(C + damping I) = sum_l sum_ij log(lG_i lA_j + delta)`` (raises if not PD)."""
        spectra = self._damped_spectra(damping, "logdet")
        return sum((_spectrum_sum(e, torch.log(s)) for e, s in zip(self.eigh(), spectra)),
                   torch.zeros((), dtype=self.dtype, device=self.device))

    # ------------------------------------------------------------------ algebra that stays structured
    def add_identity(self, damping: float) -> KroneckerOperator:
        """``C + damping I`` as a KroneckerOperator (the damping is carried exactly; shares the factors and
        their cached eigendecompositions)."""
        out = KroneckerOperator(self.layout, self.blocks, self.damping + _check_damping(damping))
        out._eigh = self._eigh
        return out

    def __mul__(self, scale: float) -> KroneckerOperator:
        """``scale * C``: each ``G_l`` and the damping are multiplied by ``scale``."""
        s = float(scale)
        if not math.isfinite(s):
            raise ValueError(f"scale must be finite, got {s}")
        blocks = [b.with_factors(s * b.G, b.A) for b in self.blocks]
        return KroneckerOperator(self.layout, blocks, s * self.damping)

    __rmul__ = __mul__

    # ------------------------------------------------------------------ damped inverses
    def damping_split(self, norm: Literal["trace", "frobenius"] = "trace") -> list[float]:
        """Per block the split ``pi`` of factored Tikhonov damping that minimises the residual bound of
        thesis Eqs. 4.26-4.27, ``pi = sqrt(||A (x) I_G|| / ||I_A (x) G||)`` (the thesis's omega):

        * ``norm='trace'`` (the thesis's choice in all experiments, = KFAC's pi):
          ``pi = sqrt((tr(A) / dim A) / (tr(G) / dim G))``;
        * ``norm='frobenius'``: ``||A (x) I_G||_F = ||A||_F sqrt(dim G)``, so
          ``pi = sqrt((||A||_F / sqrt(dim A)) / (||G||_F / sqrt(dim G)))``.

        Raises if a factor's norm is not positive (pass an explicit ``pi`` to :meth:`factored_damping`).
        Blocks with ``factored=False`` are damped exactly and get 1.0.
        """
        if norm not in ("trace", "frobenius"):
            raise ValueError(f"norm must be 'trace' or 'frobenius', got {norm!r}")
        out = []
        for b in self.blocks:
            if not b.factored:  # damped exactly (factored_damping): no split
                out.append(1.0)
                continue
            if norm == "trace":
                nG, nA = float(b.G.trace()) / b.out_dim, float(_trace(b.A)) / b.in_dim
            else:
                nG = _fro(b.G) / math.sqrt(b.out_dim)
                nA = _fro(b.A) / math.sqrt(b.in_dim)
            if not (nG > 0 and nA > 0 and math.isfinite(nG) and math.isfinite(nA)):
                raise ValueError(
                    f"block {b.name!r}: the {norm}-norm split needs positive finite factor norms, got "
                    f"||G||/dim = {nG:.3g}, ||A||/dim = {nA:.3g}; pass an explicit pi"
                )
            out.append(math.sqrt(nA / nG))
        return out

    def factored_damping(self, damping: float, pi: float | Sequence[float] | None = None,
                         norm: Literal["trace", "frobenius"] = "trace") -> KroneckerOperator:
        """Factored Tikhonov damping (thesis Eq. 4.25; Martens & Grosse 2015 section 6.3).

        With ``delta = self.damping + damping`` and ``k = sqrt(delta)``, each block ``G (x) A + delta I`` is
        replaced by

            (G + (k / pi) I) (x) (A + pi k I),   pi = sqrt( (tr(A) / dim A) / (tr(G) / dim G) )

        (the trace-norm split of Eq. 4.27 as used in all the thesis's experiments; the INPUT factor A gets
        ``pi k``, the output factor G gets ``k / pi``). A block with ``factored=False`` (a plain matrix
        ``[[g]] (x) A``) gets its damping exactly: ``[[g]] (x) (A + delta / g I)``. ``pi``: None for the split of :meth:`damping_split`
        with ``norm``; one number for every block (``pi=1.0``: the unbalanced split of the Laplace factors,
        thesis Eq. 5.14); or one number per block. Returns an undamped KroneckerOperator.
        """
        delta = self.damping + _check_damping(damping)
        if delta < 0:
            raise ValueError(f"factored damping needs a non-negative total damping, got {delta:g}")
        if pi is None:
            pis = self.damping_split(norm)
        elif isinstance(pi, (int, float)):
            pis = [float(pi)] * len(self.blocks)
        else:
            pis = [float(p) for p in pi]
            if len(pis) != len(self.blocks):
                raise ValueError(f"pi has {len(pis)} entries for {len(self.blocks)} blocks; give one per block")
        for p in pis:
            if not (math.isfinite(p) and p > 0):
                raise ValueError(f"pi must be a positive finite number, got {p}")
        k = math.sqrt(delta)
        blocks = []
        for b, p in zip(self.blocks, pis):
            # symmetric and finite by construction (validated factors plus a multiple of I): the fast path
            if not b.factored:  # [[g]] (x) A + delta I = [[g]] (x) (A + delta / g I): exact
                g = float(b.G[0, 0])
                if not g > 0:
                    raise ValueError(f"block {b.name!r}: its scale {g:g} must be positive to carry damping")
                G, A = b.G, b.A + (delta / g) * _eye_like(b.A)
            else:
                G = _shift(b.G, k / p)
                A = b.A + (p * k) * _eye_like(b.A)
            blocks.append(KroneckerBlock.from_gram(G, A, b.weight_name, b.bias_name, index=b.index, label=b.label,
                                                   factored=b.factored))
        return KroneckerOperator(self.layout, blocks)

    def inverse(self, damping: float = 0.0, method: Literal["eigen", "factored"] = "eigen",
                pi: float | Sequence[float] | None = None,
                norm: Literal["trace", "frobenius"] = "trace") -> CurvatureOperator:
        """``(C + damping I)^{-1}``.

        * ``method='eigen'`` (exact; "KFAC*"/"KFRA*" in the thesis): a :class:`KroneckerInverseOperator`
          using ``(G (x) A + delta I)^{-1} vec_row(X) = vec_row(QG [(QG^T X QA) / (lG lA^T + delta)] QA^T)``.
        * ``method='factored'``: the inverse of :meth:`factored_damping` (``pi``, ``norm`` as there), a
          KroneckerOperator with factors ``(G + k/pi I)^{-1}`` and ``(A + pi k I)^{-1}`` (approximate).
        """
        damping = check_damping(damping)
        if method == "eigen":
            return KroneckerInverseOperator(self, damping)
        if method == "factored":
            damped = self.factored_damping(damping, pi, norm)
            blocks = []
            for b in damped.blocks:
                blocks.append(KroneckerBlock.from_gram(_spd_inverse(b.G, f"{b.name!r} G"),
                                                       _spd_inverse(b.A, f"{b.name!r} A"),
                                                       b.weight_name, b.bias_name, index=b.index, label=b.label,
                                                       factored=b.factored))
            return KroneckerOperator(self.layout, blocks)
        raise ValueError(f"unknown inverse method {method!r}; use 'eigen' or 'factored'")

    def solve(self, b: Any, damping: float = 0.0, *, method: Literal["eigen", "factored"] = "eigen",
              tol: float | None = None, max_iter: int | None = None) -> Any:
        """``(C + damping I)^{-1} b`` in closed form (``method`` as :meth:`inverse`; ``tol``/``max_iter``
        are unused: no iteration)."""
        damping = check_damping(damping)
        inv = self.inverse(damping, method)
        return self._apply_to(b, lambda B: inv._matmat(_finite(B, "solve")), "solve")

    def _solve(self, B: Tensor, damping: float, tol: float | None, max_iter: int | None) -> Tensor:
        return KroneckerInverseOperator(self, damping)._matmat(B)

    def block(self, names: Sequence[str]) -> CurvatureOperator:
        """The restriction to ``names``: a KroneckerOperator when the names are whole blocks (weight and
        bias of some layers), else the general restricted operator."""
        sub = sub_layout(self.layout, names)
        wanted = set(sub.names)
        keep = [b for b in self.blocks if wanted.intersection(b.names)]
        if any(not wanted.issuperset(b.names) for b in keep):
            return super().block(names)
        return KroneckerOperator(sub, keep, self.damping)

    # ------------------------------------------------------------------ sampling
    def sample(self, mean_params: Tensor | Sequence[Tensor], generator: torch.Generator | None = None,
               num_samples: int = 1, scale: float = 1.0) -> Any:
        """Draw ``theta ~ N(mean, scale^2 * C^{-1})``: the operator is read as a PRECISION.

        Per layer this is the matrix-normal ``W_hat ~ MN(M_hat, G^{-1}, A^{-1})`` when ``damping = 0``
        (thesis Eq. 5.14 with the factors already damped); with ``damping > 0`` it is the exact Gaussian
        with precision ``G (x) A + damping I``. Uses the factors' eigendecompositions:
        ``X = QG [Z / sqrt(lG lA^T + damping)] QA^T``, ``Z`` standard normal of shape (out, in_aug).

        Args:
            mean_params: flat (d,) mean, or a list of parameter-shaped tensors.
            generator: the only source of randomness (the global RNG is never used when given).
            num_samples: S >= 1.  scale: multiplies the standard deviation (covariance ``scale^2 C^{-1}``).
        Returns:
            (S, d) flat samples for a flat mean, else a list of (S, *shape) tensors.
        """
        if int(num_samples) < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if not (math.isfinite(scale) and scale >= 0):
            raise ValueError(f"scale must be a non-negative finite number, got {scale}")
        as_list = not isinstance(mean_params, Tensor)
        mean = self.layout.flatten(list(mean_params)) if as_list else mean_params
        if not isinstance(mean, Tensor) or mean.shape != (self.layout.dim,):
            raise ValueError(f"mean_params must be a flat vector of length {self.layout.dim} or a list of "
                             "parameter-shaped tensors")
        S = int(num_samples)
        spectra = self._damped_spectra(0.0, "sample")
        noise = torch.empty(self.layout.dim, S, dtype=self.dtype, device=self.device)
        for e, lam, ix in zip(self.eigh(), spectra, self._index):
            Z = torch.randn(ix.out, ix.in_aug, S, dtype=self.dtype, device=self.device, generator=generator)
            if not e.G_rest:
                ix.scatter(_sandwich(e.G_eigvecs, Z / lam.sqrt()[:, :, None], _transpose(e.A_eigvecs)), noise)
                continue
            # low-rank G: the span of U from Z's coordinates in it, the complement from Z projected onto it
            inside = _sandwich(e.G_eigvecs, _sandwich(e.G_eigvecs.T, Z, None) / lam[:-1].sqrt()[:, :, None],
                               _transpose(e.A_eigvecs))
            ix.scatter(inside + _complement_apply(e, Z, lam[-1].rsqrt()), noise)
        samples = mean.to(self.dtype)[None, :] + scale * noise.T
        if as_list:
            return [t.movedim(-1, 0) for t in self.layout.unflatten(samples.T)]
        return samples

    def __repr__(self) -> str:
        shapes = ", ".join(f"{b.name}: G{tuple(b.G.shape)} (x) A{tuple(b.A.shape)}" for b in self.blocks)
        return f"KroneckerOperator(d={self.layout.dim}, damping={self.damping:g}, [{shapes}])"


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


class KroneckerSpectralOperator(CurvatureOperator):
    """Block-diagonal ``blockdiag_l QG_l diag(s_l) QA_l^T``-type operator in a Kronecker eigenbasis.

    Per block, with the factors' eigenvectors ``QG`` (out, out), ``QA`` (in_aug, in_aug) and eigenvalues
    ``s`` (out, in_aug) of the block: ``X -> QG [(QG^T X QA) * s] QA^T``. Every function of the operator
    stays in this form, so inverse, damping, diagonal, trace, eigenvalues and logdet are closed forms.
    """

    def __init__(self, layout: ParamLayout, index: list[BlockIndex], eigh: list[KroneckerEigh],
                 spectra: list[Tensor], names: list[str]):
        dtype, device = spectra[0].dtype, spectra[0].device
        super().__init__(layout, dtype, device)
        self._index, self._eigh, self._spectra, self._names = index, eigh, spectra, names

    @classmethod
    def in_eigenbasis_of(cls, op: KroneckerOperator, spectra: Sequence[Tensor]) -> KroneckerSpectralOperator:
        """The operator with the eigenvectors of ``op``'s factors and the given per-block eigenvalues
        ``spectra[l]`` of shape (out_l, in_aug_l) (e.g. the eigenbasis-corrected scalings of EKFAC)."""
        spectra = list(spectra)
        eigh = op.eigh()
        if len(spectra) != len(eigh):
            raise ValueError(f"need one spectrum per block ({len(eigh)}), got {len(spectra)}")
        for b, e, lam in zip(op.blocks, eigh, spectra):
            if e.G_rest:
                raise ValueError(f"block {b.name!r} has a low-rank output factor (a thin eigendecomposition of "
                                 f"rank {e.G_eigvals.numel()} of {e.G_eigvecs.shape[0]}), which an eigenbasis "
                                 "correction cannot use: build the estimator with output_factor='dense'")
            shape = (e.G_eigvals.numel(), e.A_eigvals.numel())
            if tuple(lam.shape) != shape:
                raise ValueError(f"spectrum of block {b.name!r} has shape {tuple(lam.shape)}, expected {shape}")
            _finite(lam, f"spectrum of block {b.name!r}")
        return cls(op.layout, op._index, eigh, spectra, [b.name for b in op.blocks])

    def _matmat(self, M: Tensor) -> Tensor:
        M = M.to(self.dtype)
        out = torch.empty_like(M)
        for e, lam, ix in zip(self._eigh, self._spectra, self._index):
            QG, QA = e.G_eigvecs, e.A_eigvecs
            X = ix.gather(M)
            inner = lam[:-1] if e.G_rest else lam
            Y = _sandwich(QG, _sandwich(QG.T, X, QA) * inner[:, :, None], _transpose(QA))
            ix.scatter(Y + _complement_apply(e, X, lam[-1]) if e.G_rest else Y, out)
        return out

    def _exact_diagonal(self) -> DiagonalOperator:
        flat = torch.empty(self.layout.dim, dtype=self.dtype, device=self.device)
        for e, lam, ix in zip(self._eigh, self._spectra, self._index):
            U2 = e.G_eigvecs**2
            GL = U2 @ lam[:-1] if e.G_rest else U2 @ lam
            if e.G_rest:  # the complement: (1 - |U_i|^2) times the complement row
                GL = GL + (1 - U2.sum(1))[:, None] * lam[-1][None, :]
            ix.scatter(GL if e.A_eigvecs is None else GL @ (e.A_eigvecs**2).T, flat[:, None])
        return DiagonalOperator.from_flat(self.layout, flat)

    def trace(self, method: TraceMethod = "exact", num_probes: int = 100,
              generator: torch.Generator | None = None,
              distribution: Literal["rademacher", "gaussian"] = "rademacher") -> Tensor:
        if method != "exact":
            return super().trace(method, num_probes, generator, distribution)
        return sum((_spectrum_sum(e, lam) for e, lam in zip(self._eigh, self._spectra)),
                   torch.zeros((), dtype=self.dtype, device=self.device))

    def eigenvalues(self, k: int = 1, which: Literal["largest", "smallest"] = "largest",
                    num_iter: int | None = None, generator: torch.Generator | None = None) -> Tensor:
        vals = torch.sort(torch.cat([_spectrum_values(e, lam, k) for e, lam in zip(self._eigh, self._spectra)]),
                          descending=True).values
        return vals[:k] if which == "largest" else vals[-k:]

    def _shifted(self, damping: float, what: str) -> list[Tensor]:
        out = [lam + damping for lam in self._spectra]
        for name, lam in zip(self._names, out):
            if not bool((lam > 0).all()):
                raise NotPositiveDefiniteError(f"{what}: block {name!r} is not positive definite after damping {damping:g} "
                                 f"(smallest eigenvalue {float(lam.min()):.3g}); increase the damping")
        return out

    def _logdet(self, damping: float) -> Tensor:
        return sum((_spectrum_sum(e, lam.log()) for e, lam in zip(self._eigh, self._shifted(damping, "logdet"))),
                   torch.zeros((), dtype=self.dtype, device=self.device))

    def add_identity(self, damping: float) -> KroneckerSpectralOperator:
        return KroneckerSpectralOperator(self.layout, self._index, self._eigh,
                                         [lam + check_damping(damping) for lam in self._spectra], self._names)

    def inverse(self, damping: float = 0.0) -> CurvatureOperator:
        spectra = self._shifted(check_damping(damping), "inverse")
        return KroneckerSpectralOperator(self.layout, self._index, self._eigh, [1.0 / lam for lam in spectra],
                                         self._names)

    def _solve(self, B: Tensor, damping: float, tol: float | None, max_iter: int | None) -> Tensor:
        return self.inverse(damping)._matmat(B)


class KroneckerInverseOperator(KroneckerSpectralOperator):
    """Exact ``(C + damping I)^{-1}`` of a :class:`KroneckerOperator` via the factors' eigendecompositions.

    Per block, with ``Lam = outer(lG, lA) + delta`` (``delta`` = the operator's damping + ``damping``):
    ``X -> QG [(QG^T X QA) / Lam] QA^T``; diagonal ``(QG o QG) (1 / Lam) (QA o QA)^T`` (exact);
    ``logdet = -sum log Lam``. Raises if a damped block is not positive definite. ``inverse()`` gives back
    the damped :class:`KroneckerOperator` itself.
    """

    def __init__(self, op: KroneckerOperator, damping: float = 0.0):
        self.op = op
        self.added_damping = check_damping(damping)
        spectra = op._damped_spectra(self.added_damping, "inverse")
        super().__init__(op.layout, op._index, op.eigh(), [1.0 / lam for lam in spectra],
                         [b.name for b in op.blocks])

    def inverse(self, damping: float = 0.0) -> CurvatureOperator:
        """With ``damping = 0``: the damped operator ``C + damping I`` this is the inverse of."""
        if check_damping(damping) == 0:
            return self.op.add_identity(self.added_damping)
        return super().inverse(damping)


# ---------------------------------------------------------------------------------------------- dense blocks
class BlockDiagonalOperator(CurvatureOperator):
    """Block-diagonal operator with one dense (P, P) block per layer, P = out * in_aug, in ``W_hat`` order.

    Used for the exact per-layer blocks of :mod:`curvkit.curvature.recursion`; ``to_dense()`` is in the flat
    parameter order like every operator. ``damping`` adds a multiple of the identity.
    """

    def __init__(self, layout: ParamLayout, blocks: Sequence[DenseBlock], damping: float = 0.0):
        blocks = list(blocks)
        if not blocks:
            raise ValueError("BlockDiagonalOperator needs at least one DenseBlock")
        dtype, device = blocks[0].matrix.dtype, blocks[0].matrix.device
        super().__init__(layout, dtype, device)
        self.blocks = blocks
        self.damping = _check_damping(damping)
        self._index = _build_index(layout, [(b.weight_name, b.bias_name) for b in blocks], device, "dense")
        for b, ix in zip(blocks, self._index):
            if tuple(b.matrix.shape) != (ix.size, ix.size):
                raise ValueError(f"dense block for {b.weight_name!r} has shape {tuple(b.matrix.shape)}, expected "
                                 f"({ix.size}, {ix.size}) = (out*in_aug)^2 with W_hat ({ix.out}, {ix.in_aug})")

    def _matmat(self, M: Tensor) -> Tensor:
        M = M.to(self.dtype)
        out = torch.empty_like(M)
        for b, ix in zip(self.blocks, self._index):
            ix.scatter(b.matrix @ ix.gather(M).reshape(ix.size, -1), out)
        return out + self.damping * M if self.damping != 0 else out

    def to_dense(self) -> Tensor:
        d = self.layout.dim
        D = torch.zeros(d, d, dtype=self.dtype, device=self.device)
        for b, ix in zip(self.blocks, self._index):
            D[ix.perm[:, None], ix.perm[None, :]] = b.matrix
        if self.damping != 0:
            D.diagonal().add_(self.damping)
        return D

    def _exact_diagonal(self) -> DiagonalOperator:
        flat = torch.empty(self.layout.dim, dtype=self.dtype, device=self.device)
        for b, ix in zip(self.blocks, self._index):
            ix.scatter(b.matrix.diagonal(), flat[:, None])
        return DiagonalOperator.from_flat(self.layout, flat + self.damping)

    def add_identity(self, damping: float) -> BlockDiagonalOperator:
        return BlockDiagonalOperator(self.layout, self.blocks, self.damping + _check_damping(damping))

    def inverse(self, damping: float = 0.0) -> BlockDiagonalOperator:
        """Exact ``(C + damping I)^{-1}`` block by block (Cholesky; raises if a block is not PD)."""
        delta = self.damping + _check_damping(damping)
        inv = []
        for b in self.blocks:
            M = b.matrix + delta * torch.eye(b.matrix.shape[0], dtype=self.dtype, device=self.device)
            inv.append(DenseBlock(_spd_inverse(M, f"block {b.weight_name!r}"), b.weight_name, b.bias_name))
        return BlockDiagonalOperator(self.layout, inv)

    def _solve(self, B: Tensor, damping: float, tol: float | None, max_iter: int | None) -> Tensor:
        return self.inverse(damping)._matmat(B)

    def block(self, names: Sequence[str]) -> CurvatureOperator:
        """The restriction to ``names``: a BlockDiagonalOperator when they are whole blocks."""
        sub = sub_layout(self.layout, names)
        keep = [b for b in self.blocks if b.weight_name in sub.names]
        if sorted(n for b in keep for n in b.names) != sorted(sub.names):
            return super().block(names)
        return BlockDiagonalOperator(sub, keep, self.damping)

    def _logdet(self, damping: float) -> Tensor:
        delta = self.damping + _check_damping(damping)
        total = torch.zeros((), dtype=self.dtype, device=self.device)
        for b in self.blocks:
            M = b.matrix + delta * torch.eye(b.matrix.shape[0], dtype=self.dtype, device=self.device)
            sign, val = torch.linalg.slogdet(M)
            if float(sign) <= 0:
                raise NotPositiveDefiniteError(f"block {b.weight_name!r} is not positive definite; increase the damping")
            total = total + val
        return total


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
    (the damping identity is already a third term, which is why it rides on the second): they are handled as
    the sum of the first two plus the rest by the operator's generic routes (CG solves, SLQ log-determinants),
    never silently dropped.
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
        k = math.sqrt(_check_damping(damping))
        G2d = G2 + (k / pi) * _eye_like(G2)
        A2d = A2 + (pi * k) * _eye_like(A2)
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
