"""The data of one block of a block-diagonal curvature: :class:`KroneckerBlock` (factors ``G``, ``A``, the
names of its weight and bias, its ``index``) and :class:`DenseBlock` (a dense matrix in the same layout)."""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from curvkit.linalg.block_index import Index
from curvkit.linalg.factors import (
    LowRankFactor,
    _check_diagonal_factor,
    _check_square_symmetric,
    _symmetrise,
    _symmetrise_,
)


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
        second: None, or a second Kronecker term ``(G2, A2)`` on the SAME matrix view, so that the block is
            ``G (x) A + G2 (x) A2`` (a weight used in two places, e.g. a tied embedding and output layer:
            :func:`curvkit.linalg.kron.pair_in_view`). ``G2`` is (out, out) or an (out,) vector (a diagonal
            output factor: an embedding's token counts), ``A2`` (in_aug, in_aug) or (in_aug,). Only for
            ``factored=True`` blocks; damped inverses and log-determinants go through
            :class:`~curvkit.linalg.factors.KroneckerPairEigh`.

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
    second: tuple[Tensor, Tensor] | None = None

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
        if self.second is not None:
            self.second = _check_second(self.second, self.out_dim, self.in_dim, self.factored, what)

    @classmethod
    def from_gram(cls, G: Tensor, A: Tensor, weight_name: str, bias_name: str | None = None,
                  scale_G: float = 1.0, scale_A: float = 1.0, *, index: Index | None = None,
                  label: str | None = None, factored: bool = True,
                  second: tuple[Tensor, Tensor] | None = None, symmetric_A: bool = False,
                  in_place: bool = False, symmetric_G: bool = False) -> KroneckerBlock:
        """Internal fast path for factors that are symmetric by construction (sums of Gram matrices
        ``X^T X`` computed by curvkit itself): skips the validation of ``__post_init__`` (which costs
        several elementwise passes over each factor) and stores ``scale * (M + M^T) / 2``, so the
        result is exactly symmetric in floating point, as a validated block is (a diagonal A: ``scale * A``).
        ``symmetric_A``: A is exactly symmetric already (symmetrised by the caller, possibly shared by several
        blocks fed by one input): held as it is, times ``scale_A`` only when that is not 1.
        ``in_place``: a dense G is the caller's to give away (statistics not used again): it is symmetrised and
        scaled in place (:func:`~curvkit.linalg.factors._symmetrise_`, the same entries) instead of copied.
        ``symmetric_G``: G is exactly symmetric already (a block's factor plus a multiple of the identity,
        :meth:`KroneckerOperator.factored_damping`): held as it is, times ``scale_G`` only when that is not 1.
        """
        blk = cls.__new__(cls)
        if isinstance(G, LowRankFactor):
            blk.G = G * scale_G
        elif symmetric_G:
            blk.G = G if scale_G == 1.0 else G * scale_G
        else:
            blk.G = _symmetrise_(G, 0.5 * scale_G) if in_place else _symmetrise(G, 0.5 * scale_G)
        if symmetric_A:
            blk.A = A if scale_A == 1.0 else A * scale_A
        else:
            blk.A = A * scale_A if A.dim() == 1 else _symmetrise(A, 0.5 * scale_A)
        blk.weight_name, blk.bias_name = weight_name, bias_name
        blk.index, blk.label, blk.factored = index, label, factored
        blk.second = None if second is None else (second[0] * scale_G, second[1] * scale_A)
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

    @property
    def pair(self) -> bool:
        """The block is a sum of two Kronecker terms (:attr:`second`)."""
        return self.second is not None

    def with_factors(self, G: Tensor, A: Tensor, second: tuple[Tensor, Tensor] | None = None) -> KroneckerBlock:
        """The same block (names, index, label, kind) with other factors (validated)."""
        return KroneckerBlock(G, A, self.weight_name, self.bias_name, self.index, self.label, self.factored, second)

    def scaled(self, s: float) -> KroneckerBlock:
        """``s`` times the block: every term's output factor times ``s``."""
        second = None if self.second is None else (s * self.second[0], self.second[1])
        return self.with_factors(s * self.G, self.A, second)

    def single(self, what: str) -> KroneckerBlock:
        """This block, checked to be ONE Kronecker term: a route that reads ``G`` and ``A`` alone calls it, so
        a sum of two terms is refused by name instead of losing its second term."""
        if self.second is not None:
            raise ValueError(f"{what}: block {self.name!r} is the sum of two Kronecker terms (a parameter used in "
                             "two places, e.g. a tied embedding and output layer), which this route does not take; "
                             "freeze or untie the shared parameter, or use GaussNewton, the Kronecker operator or "
                             "Kronecker Laplace (prior_form='factored'), which take it")
        return self


def _check_second(second: tuple[Tensor, Tensor], out: int, in_aug: int, factored: bool,
                  what: str) -> tuple[Tensor, Tensor]:
    """The second term of a pair block, validated: shapes (vectors: diagonal factors), finite, symmetric."""
    if not factored:
        raise ValueError(f"{what}: a second Kronecker term needs a factored block")
    G2, A2 = second
    for M, n, side in ((G2, out, "G2"), (A2, in_aug, "A2")):
        if M.shape not in ((n,), (n, n)):
            raise ValueError(f"{what}: the second term's {side} must be ({n},) or ({n}, {n}), got {tuple(M.shape)}")
        if M.dim() == 1:
            _check_diagonal_factor(M, f"{what}.{side}")
        else:
            _check_square_symmetric(M, f"{what}.{side}")
    return (G2.clone() if G2.dim() == 1 else _symmetrise(G2), A2.clone() if A2.dim() == 1 else _symmetrise(A2))


@dataclass
class DenseBlock:
    """One layer's dense curvature block (P, P), P = out * in_aug, in the row-major ``W_hat`` order."""

    matrix: Tensor
    weight_name: str
    bias_name: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return (self.weight_name,) if self.bias_name is None else (self.weight_name, self.bias_name)
