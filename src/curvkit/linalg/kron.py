"""Kronecker-factored, block-diagonal curvature operators (thesis Ch. 4: Sec. 4.2, Eqs. 4.2-4.3, and Sec. 4.4.2).

This module holds the operators; the factor algebra is in :mod:`.factors`, the map from a block to its
parameters in :mod:`.block_index`, the blocks' data in :mod:`.blocks` (their public names are re-exported here).

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
from collections.abc import Sequence
from typing import Any, Literal

import torch
from torch import Tensor

from curvkit.linalg.block_index import (
    BlockIndex,
    BlockView,
    Index,
    StridedIndex,
    _build_index,
    block_matrix,
    block_positions,
    index_from_state,
    index_state,
    standard_index,
    transposed_index,
    write_block_matrix,
)
from curvkit.linalg.blocks import DenseBlock, KroneckerBlock
from curvkit.linalg.factors import (  # noqa: F401  (re-exported)
    KroneckerEigh,
    KroneckerPairEigh,
    LowRankFactor,
    _complement_apply,
    _dense,
    _diag,
    _fro,
    _read,
    _sandwich,
    _shift,
    _spd_inverse,
    _spectrum_sum,
    _spectrum_values,
    _symmetrise,
    _trace,
    _transpose,
    factor_from_state,
    factor_state,
    kron_matvec,
    psd_eigh,
    stable_eigh,
    vec_row,
)
from curvkit.linalg.krylov import NotPositiveDefiniteError
from curvkit.linalg.layout import ParamLayout
from curvkit.linalg.operator import CurvatureOperator, DiagonalOperator, TraceMethod, _finite, sub_layout
from curvkit.validation import check_damping

__all__ = [
    "BlockDiagonalOperator",
    "BlockIndex",
    "BlockView",
    "DenseBlock",
    "FactoredPairInverse",
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
    "dense_sum",
    "factor_from_state",
    "factor_state",
    "index_from_state",
    "index_state",
    "kron_matvec",
    "pair_eigh",
    "pair_in_view",
    "psd_eigh",
    "stable_eigh",
    "standard_index",
    "transposed_index",
    "vec_row",
    "write_block_matrix",
]


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
        self._singles: tuple[KroneckerOperator, Tensor] | None = None  # the one-term blocks (_solve_by_blocks)
        self._traces: list[tuple[float, float] | None] | None = None  # factor_traces(), read once

    @property
    def has_pairs(self) -> bool:
        """Some block is a sum of two Kronecker terms (:attr:`KroneckerBlock.second`)."""
        return any(b.pair for b in self.blocks)

    # ------------------------------------------------------------------ products and closed forms
    def _matmat(self, M: Tensor) -> Tensor:
        M = M.to(self.dtype)
        out = torch.empty_like(M)
        for b, ix in zip(self.blocks, self._index):
            X = ix.gather(M)
            Y = _sandwich(b.G, X, b.A)
            if b.second is not None:
                Y = Y + _term(*b.second, X)
            ix.scatter(Y, out)
        return out + self.damping * M if self.damping != 0 else out

    def to_dense(self) -> Tensor:
        """The (d, d) matrix in the flat PARAMETER order (bias entries after the weight entries)."""
        d = self.layout.dim
        D = torch.zeros(d, d, dtype=self.dtype, device=self.device)
        for b, ix in zip(self.blocks, self._index):
            A = torch.diag(b.A) if b.diagonal_input else b.A
            K = torch.kron(_dense(b.G).contiguous(), A.contiguous())
            if b.second is not None:
                G2, A2 = (torch.diag(M) if M.dim() == 1 else M for M in b.second)
                K = K + torch.kron(G2.contiguous(), A2.contiguous())
            D[ix.perm[:, None], ix.perm[None, :]] = K
        if self.damping != 0:
            D.diagonal().add_(self.damping)
        return D

    def _exact_diagonal(self) -> DiagonalOperator:
        """Exact: the diagonal of ``G (x) A`` is ``vec_row(outer(diag G, diag A))``."""
        flat = torch.empty(self.layout.dim, dtype=self.dtype, device=self.device)
        for b, ix in zip(self.blocks, self._index):
            d = torch.outer(b.G.diagonal(), _diag(b.A))
            if b.second is not None:
                d = d + torch.outer(_diag(b.second[0]), _diag(b.second[1]))
            ix.scatter(d, flat[:, None])
        return DiagonalOperator.from_flat(self.layout, flat + self.damping)

    def trace(self, method: TraceMethod = "exact", num_probes: int = 100,
              generator: torch.Generator | None = None,
              distribution: Literal["rademacher", "gaussian"] = "rademacher") -> Tensor:
        """``sum_l tr(G_l) tr(A_l) + damping * d`` for ``method='exact'``; estimators otherwise."""
        if method != "exact":
            return super().trace(method, num_probes, generator, distribution)
        t = sum((b.G.trace() * _trace(b.A) + (_trace(b.second[0]) * _trace(b.second[1]) if b.second is not None else 0)
                 for b in self.blocks), torch.zeros((), dtype=self.dtype, device=self.device))
        return t + self.damping * self.layout.dim

    def eigh(self) -> list[KroneckerEigh]:
        """Per-block eigendecompositions of the factors (cached; the damping is NOT included). Refused for a
        block that is a sum of two Kronecker terms (it has no Kronecker eigenbasis)."""
        if self._eigh is None:
            self._eigh = [_block_eigh(b.single("the factors' eigendecomposition")) for b in self.blocks]
        return self._eigh

    def eigenvalues(self, k: int = 1, which: Literal["largest", "smallest"] = "largest",
                    num_iter: int | None = None, generator: torch.Generator | None = None) -> Tensor:
        """Exact top-k (or bottom-k) eigenvalues from the factors' spectra, in descending order (Lanczos, the
        general route, when a block is a sum of two terms)."""
        if self.has_pairs:
            return super().eigenvalues(k, which, num_iter, generator)
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
        return [_damped_spectrum(b, e, delta, what) for b, e in zip(self.blocks, self.eigh())]

    def _logdet(self, damping: float) -> Tensor:
        """``log det(C + damping I) = sum_l sum_ij log(lG_i lA_j + delta)`` (raises if not PD). A sum of two
        Kronecker terms plus ``delta I`` has no closed form: with such a block the general (dense) route."""
        if self.has_pairs:
            return super()._logdet(damping)
        spectra = self._damped_spectra(damping, "logdet")
        return sum((_spectrum_sum(e, torch.log(s)) for e, s in zip(self.eigh(), spectra)),
                   torch.zeros((), dtype=self.dtype, device=self.device))

    # ------------------------------------------------------------------ algebra that stays structured
    def add_identity(self, damping: float) -> KroneckerOperator:
        """``C + damping I`` as a KroneckerOperator (the damping is carried exactly; shares the factors and
        their cached eigendecompositions)."""
        out = KroneckerOperator(self.layout, self.blocks, self.damping + _check_damping(damping))
        out._eigh, out._traces = self._eigh, self._traces
        return out

    def __mul__(self, scale: float) -> KroneckerOperator:
        """``scale * C``: each ``G_l`` and the damping are multiplied by ``scale``."""
        s = float(scale)
        if not math.isfinite(s):
            raise ValueError(f"scale must be finite, got {s}")
        return KroneckerOperator(self.layout, [b.scaled(s) for b in self.blocks], s * self.damping)

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
        traces = self.factor_traces() if norm == "trace" else [None] * len(self.blocks)
        for b, tr in zip(self.blocks, traces):
            if not b.factored:  # damped exactly (factored_damping): no split
                out.append(1.0)
                continue
            G, A = b.second if b.second is not None else (b.G, b.A)  # a pair: the term that carries the damping
            if tr is not None:
                nG, nA = tr[0] / b.out_dim, tr[1] / b.in_dim
            else:
                nG = _fro(G) / math.sqrt(b.out_dim)
                nA = _fro(A) / math.sqrt(b.in_dim)
            if not (nG > 0 and nA > 0 and math.isfinite(nG) and math.isfinite(nA)):
                raise ValueError(
                    f"block {b.name!r}: the {norm}-norm split needs positive finite factor norms, got "
                    f"||G||/dim = {nG:.3g}, ||A||/dim = {nA:.3g}; pass an explicit pi"
                )
            out.append(math.sqrt(nA / nG))
        return out

    def factor_traces(self) -> list[tuple[float, float] | None]:
        """Per block ``(tr G, tr A)`` of the term that carries factored damping (the second of a pair), None for
        a block damped exactly (``factored=False``); all read from the device at once, on the first call."""
        if self._traces is None:
            terms = [(b.second if b.second is not None else (b.G, b.A)) if b.factored else None for b in self.blocks]
            values = iter(_read([_trace(M) for GA in terms if GA is not None for M in GA]))
            self._traces = [None if GA is None else (next(values), next(values)) for GA in terms]
        return self._traces

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
        scales = iter(_read([b.G[0, 0] for b in self.blocks if not b.factored]))
        for b, p in zip(self.blocks, pis):
            second = None
            # symmetric and finite by construction (validated factors plus a multiple of I): the fast path
            if not b.factored:  # [[g]] (x) A + delta I = [[g]] (x) (A + delta / g I): exact
                g = next(scales)
                if not g > 0:
                    raise ValueError(f"block {b.name!r}: its scale {g:g} must be positive to carry damping")
                G, A = b.G, _shift(b.A, delta / g)
            elif b.second is not None:  # a sum of two terms: the damping rides on the second (KroneckerPairEigh)
                G, A = b.G, b.A
                second = (_shift(b.second[0], k / p), _shift(b.second[1], p * k))
            else:
                G, A = _shift(b.G, k / p), _shift(b.A, p * k)
            blocks.append(KroneckerBlock.from_gram(G, A, b.weight_name, b.bias_name, index=b.index, label=b.label,
                                                   factored=b.factored, second=second, symmetric_G=True,
                                                   symmetric_A=True))
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
            return super().inverse(damping) if self.has_pairs else KroneckerInverseOperator(self, damping)
        if method == "factored":
            damped = self.factored_damping(damping, pi, norm)
            if damped.has_pairs:
                return FactoredPairInverse(damped)
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
        are unused: no iteration). With a block that is a sum of two terms, ``method='eigen'`` has no closed
        form and runs conjugate gradients (``tol``, ``max_iter`` as in :meth:`CurvatureOperator.solve`)."""
        damping = check_damping(damping)
        if method == "eigen" and self.has_pairs:  # no closed form (:meth:`_solve`): tol / max_iter apply
            return super().solve(b, damping, tol=tol, max_iter=max_iter)
        inv = self.inverse(damping, method)
        return self._apply_to(b, lambda B: inv._matmat(_finite(B, "solve")), "solve")

    def _solve(self, B: Tensor, damping: float, tol: float | None, max_iter: int | None) -> Tensor:
        if self.has_pairs:  # a sum of two terms plus delta I has no closed form: conjugate gradients on it alone
            return self._solve_by_blocks(B, damping, tol, max_iter)
        return KroneckerInverseOperator(self, damping)._matmat(B)

    def _solve_by_blocks(self, B: Tensor, damping: float, tol: float | None, max_iter: int | None) -> Tensor:
        """``(C + damping I)^{-1} B`` block by block (C block-diagonal): the one-term blocks in closed form
        (:class:`KroneckerInverseOperator` of their restriction, eigendecompositions cached), each pair block
        ``G (x) A + G2 (x) A2 + delta I`` by conjugate gradients on its own (out, in_aug) matrices (``tol``,
        ``max_iter`` as in :meth:`CurvatureOperator.solve`; a product costs one pass over the block's two
        terms). The same numbers whether the block is solved inside the whole operator or in
        ``op.block(names)`` (a data-parallel owner's restriction)."""
        from curvkit.linalg.krylov import _default_tol, conjugate_gradient

        B = B.to(self.dtype)
        out = torch.empty_like(B)
        singles = [b for b in self.blocks if not b.pair]
        if singles:
            if self._singles is None:
                names = [n for b in singles for n in b.names]
                sub = KroneckerOperator(sub_layout(self.layout, names), singles, self.damping)
                slices = self.layout.slices()
                rows = torch.cat([torch.arange(slices[n].start, slices[n].stop, device=self.device)
                                  for n in sub.layout.names])
                self._singles = (sub, rows)
            sub, rows = self._singles
            out[rows] = KroneckerInverseOperator(sub, damping)._matmat(B[rows])
        delta = self.damping + damping
        for b, ix in zip(self.blocks, self._index):
            if b.second is None:
                continue
            X = ix.gather(B)
            m, n = X.shape[0], X.shape[1]

            def product(V: Tensor, b: KroneckerBlock = b, G2: Tensor = b.second[0], A2: Tensor = b.second[1],
                        m: int = m, n: int = n) -> Tensor:
                Xv = V.reshape(m, n, -1)
                Y = _sandwich(b.G, Xv, b.A) + _term(G2, A2, Xv)
                return (Y + delta * Xv if delta != 0 else Y).reshape(V.shape)

            Y = conjugate_gradient(product, X.reshape(m * n, -1), tol=_default_tol(self.dtype) if tol is None else tol,
                                   max_iter=max_iter)
            ix.scatter(Y.reshape(m, n, -1), out)
        return out

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
        if self.has_pairs and self.damping != 0:
            raise ValueError("sample: a block is a sum of two Kronecker terms, whose Gaussian has a closed form only "
                             "without the operator's exact damping; put the damping into the factors "
                             "(factored_damping) and sample from that operator")
        noise = torch.empty(self.layout.dim, S, dtype=self.dtype, device=self.device)
        eighs = self.eigh() if not self.has_pairs else [None if b.pair else _block_eigh(b) for b in self.blocks]
        for b, e, ix in zip(self.blocks, eighs, self._index):
            Z = torch.randn(ix.out, ix.in_aug, S, dtype=self.dtype, device=self.device, generator=generator)
            if e is None:  # a sum of two terms: W_G [Z / sqrt(g a^T + 1)] W_A^T (KroneckerPairEigh.sample)
                ix.scatter(pair_eigh(b).sample(Z), noise)
                continue
            lam = _damped_spectrum(b, e, self.damping, "sample")
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
        ``spectra[l]`` of shape (rows_l, in_aug_l) (e.g. the eigenbasis-corrected scalings of EKFAC): rows_l =
        out_l, or r + 1 for a low-rank output factor of rank r (:attr:`KroneckerEigh.G_values`: the last row
        is the value of every direction of the complement of its span, ``G_rest`` rows)."""
        spectra = list(spectra)
        eigh = op.eigh()
        if len(spectra) != len(eigh):
            raise ValueError(f"need one spectrum per block ({len(eigh)}), got {len(spectra)}")
        for b, e, lam in zip(op.blocks, eigh, spectra):
            shape = (e.G_values.numel(), e.A_eigvals.numel())
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


# ---------------------------------------------------------------------------------------------- per block
def _block_eigh(b: KroneckerBlock) -> KroneckerEigh:
    """The eigendecompositions of one block's factors (a low-rank G is already one; a diagonal A is its own)."""
    rest: tuple[int, float] = (0, 0.0)
    if isinstance(b.G, LowRankFactor):  # already a thin eigendecomposition
        lG, QG, rest = b.G.s, b.G.U, (b.G.complement, b.G.c)
    else:
        lG, QG = stable_eigh(b.G, f"factor G of {b.name!r}")
    if b.diagonal_input:
        return KroneckerEigh(lG, QG, b.A.clone(), None, *rest)
    lA, QA = stable_eigh(b.A, f"factor A of {b.name!r}")
    return KroneckerEigh(lG, QG, lA, QA, *rest)


def _damped_spectrum(b: KroneckerBlock, e: KroneckerEigh, delta: float, what: str) -> Tensor:
    """One block's eigenvalues ``outer(lG, lA) + delta``, checked positive (:meth:`KroneckerOperator.
    _damped_spectra`)."""
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
    return lam


def _term(G: Tensor, A: Tensor, X: Tensor) -> Tensor:
    """``G X[:, :, j] A`` per column of X (out, in_aug, k), either factor possibly a vector (diagonal)."""
    if G.dim() == 1:
        return _sandwich(None, G[:, None, None] * X, A)
    return _sandwich(G, X, A)


def pair_eigh(b: KroneckerBlock, damping: float = 0.0, pi: float = 1.0) -> KroneckerPairEigh:
    """The generalised eigendecomposition of a pair block ``G (x) A + G2 (x) A2`` with factored damping on the
    second term (:class:`KroneckerPairEigh`: ``G2 + (k/pi) I``, ``A2 + pi k I``, ``k = sqrt(damping)``)."""
    assert b.second is not None
    return KroneckerPairEigh.of(b.G, b.A, *b.second, damping=damping, pi=pi, what=repr(b.name))


class FactoredPairInverse(CurvatureOperator):
    """The inverse of a factored-damped Kronecker operator (:meth:`KroneckerOperator.factored_damping`) some of
    whose blocks are sums of two terms: per block ``G^{-1} (x) A^{-1}`` (one term) or
    :meth:`KroneckerPairEigh.solve` (two terms, the damping already on the second), through the blocks' index."""

    def __init__(self, damped: KroneckerOperator):
        super().__init__(damped.layout, damped.dtype, damped.device)
        self._index = damped._index
        self._solvers = [pair_eigh(b) if b.pair else (_spd_inverse(b.G, f"{b.name!r} G"),
                                                      _spd_inverse(b.A, f"{b.name!r} A")) for b in damped.blocks]

    def _matmat(self, M: Tensor) -> Tensor:
        M = M.to(self.dtype)
        out = torch.empty_like(M)
        for solver, ix in zip(self._solvers, self._index):
            X = ix.gather(M)
            ix.scatter(solver.solve(X) if isinstance(solver, KroneckerPairEigh) else _sandwich(solver[0], X, solver[1]),
                       out)
        return out


# ---------------------------------------------------------------------------------------------- sums of blocks
def dense_sum(layout: ParamLayout, terms: Sequence[KroneckerBlock], label: str | None = None) -> KroneckerBlock:
    """The exact sum of blocks that read the same parameters (the uses of a shared parameter, each in its own
    matrix view: an embedding's ``G_e (x) diag(counts)`` of ``W^T`` and a tied head's ``G_h (x) A_h`` of
    ``[W | b]``) as ONE plain-matrix block ``[[1]] (x) M`` (``factored=False``): M (P, P) over the entries of
    their parameters (at most two: a weight and a bias) in ``layout`` order, ``M = sum_t P_t^T (G_t (x) A_t)
    P_t`` with P_t the placement of term t's ``W_hat`` entries. Every consumer of a plain-matrix block (exact
    damping, eigendecomposition, log-determinant, sampling, GLM terms) then takes the sum exactly; P x P
    floats are formed, so callers keep P small (:data:`curvkit.curvature.estimators.SHARED_DENSE_LIMIT`)."""
    names = sorted({n for b in terms for n in b.names}, key=list(layout.names).index)
    if len(names) > 2:
        raise ValueError(f"dense_sum: the terms read {len(names)} parameters ({', '.join(names)}); a block holds a "
                         "weight and a bias at most")
    sub = sub_layout(layout, names)
    first = terms[0]
    M = first.A.new_zeros(sub.dim, sub.dim)
    for b in terms:
        pos = block_positions(sub, b.weight_name, b.bias_name, b.index, M.device).reshape(-1)
        A = torch.diag(b.A) if b.A.dim() == 1 else b.A
        M[pos[:, None], pos[None, :]] += torch.kron(_dense(b.G), A)
    index = torch.arange(sub.dim, device=M.device)[None, :]
    return KroneckerBlock.from_gram(M.new_ones(1, 1), M, names[0], names[1] if len(names) > 1 else None,
                                    index=index, label=label, factored=False)


def pair_in_view(first: KroneckerBlock, second: KroneckerBlock) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Two uses' Kronecker terms of one weight as ``(G1, A1, G2, A2)`` in the view of ``first``, for
    :class:`KroneckerPairEigh` (``G1 (x) A1 + G2 (x) A2`` on ``first``'s ``W_hat``, exactly the sum of the two
    blocks on their entries).

    ``first`` is a whole weight in its standard view ``[W.reshape(out, -1) | b]`` (index None: a tied head, with
    or without its bias); ``second`` is the same weight in the standard view (G2, A2 as they are) or in the
    TRANSPOSED view (an embedding's ``G_e (x) diag(counts)`` of ``W^T``: ``W^T``'s ``G (x) A`` is ``A (x) G`` on
    ``W``, so ``G2`` = its A, the counts, a vector, and ``A2`` = its G), with no bias of its own: a bias column of
    ``first`` reads as a zero row and column of ``A2`` (the second use does not read the bias). Anything else is
    a ValueError (callers sum such terms densely, :func:`dense_sum`)."""
    what = f"pair_in_view({first.name!r}, {second.name!r})"
    if first.index is not None or second.weight_name != first.weight_name or second.bias_name is not None:
        raise ValueError(f"{what}: needs the first term in the standard view of a whole weight and the second on "
                         "the same weight without a bias of its own")
    s_index = second.index
    if s_index is None:
        G2, A2 = second.G, second.A
    elif isinstance(s_index, StridedIndex) and s_index.transposed and s_index.shape == (first.in_dim - int(
            first.bias_name is not None), first.out_dim) and not s_index.bias:
        G2, A2 = second.A, _dense(second.G)
    else:
        raise ValueError(f"{what}: the second term's view ({s_index}) is neither the standard nor the whole "
                         "transposed view of the first's weight")
    if first.bias_name is not None:  # the second use does not read the bias: a zero row and column
        A2 = torch.nn.functional.pad(torch.diag(A2) if A2.dim() == 1 else A2, (0, 1, 0, 1))
    return first.G, first.A, G2, A2
