"""The damped Kronecker direction d = (G~ + delta I)^{-1} g of thesis Eqs. 4.16 and 4.23, per layer.

With factored Tikhonov damping (Eq. 4.25; delta = lambda + zeta, k = sqrt(delta), omega per layer from
:meth:`curvkit.linalg.kron.KroneckerOperator.damping_split`, Eq. 4.27) a layer's block
``(G + k/omega I) (x) (A + omega k I)`` is inverted by two Cholesky factorisations, and applied to the layer's
gradient in the ``W_hat = [W | b]`` layout (out, in+1) as

    D = (G + k/omega I)^{-1} grad_W_hat (A + omega k I)^{-1}

with triangular solves on both sides (no explicit inverse and no flat-vector permutation: this is the
per-step hot path of the optimiser). It is the same matrix as
``op.inverse(delta, method='factored')`` (tested), which forms the two inverses explicitly.

A block whose curvature is exactly zero (a factor with zero trace: e.g. a saturated softmax, whose output
Hessian diag(p) - p p^T vanishes in floating point, zeroes every G_l) has no optimal split: omega* of
Eq. 4.27 is infinite. The damped block ``(G + k/omega I) (x) (A + omega k I)`` then tends to
``k^2 I = delta I`` as omega -> infinity (the cross terms ``omega k G (x) I`` and ``(k/omega) I (x) A`` vanish
because G = 0 or A = 0), so the direction of that block is ``g / delta``. :func:`split_with_zero_blocks`
represents such a block by zero factors with omega = 1, which gives exactly this limit through the same
code path (``(0 + k I) (x) (0 + k I) = delta I``), and the exact damped inverse likewise.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor

from curvkit.linalg.kron import KroneckerBlock, KroneckerOperator
from curvkit.linalg.krylov import NotPositiveDefiniteError

__all__ = ["FactoredInverse", "split_with_zero_blocks"]


def split_with_zero_blocks(op: KroneckerOperator, norm: Literal["trace", "frobenius"]
                           ) -> tuple[KroneckerOperator, list[float], list[str]]:
    """(operator, omega per block, weight names of the zero blocks) for the factored damping (module docstring).

    Blocks with a factor of zero trace (the factors are positive semi-definite, so the factor is zero and so
    is the block ``G (x) A``) are replaced by zero factors with omega = 1 (the omega -> infinity limit of
    Eq. 4.25, ``delta I``); the others keep their factors and the split of Eq. 4.27 in ``norm``.
    """
    zero = [i for i, b in enumerate(op.blocks) if not (float(b.G.trace()) > 0 and float(b.A.trace()) > 0)]
    if not zero:
        return op, op.damping_split(norm), []
    kept = [b for i, b in enumerate(op.blocks) if i not in zero]
    split = iter(op.block([n for b in kept for n in b.names]).damping_split(norm)) if kept else iter(())  # type: ignore[attr-defined]
    blocks, omegas = [], []
    for i, b in enumerate(op.blocks):
        if i in zero:
            blocks.append(KroneckerBlock.from_gram(torch.zeros_like(b.G), torch.zeros_like(b.A), b.weight_name,
                                                   b.bias_name))
            omegas.append(1.0)
        else:
            blocks.append(b)
            omegas.append(next(split))
    return KroneckerOperator(op.layout, blocks, op.damping), omegas, [op.blocks[i].weight_name for i in zero]


def _cholesky(M: Tensor, what: str) -> Tensor:
    L, info = torch.linalg.cholesky_ex(M)
    if int(info) != 0:
        raise NotPositiveDefiniteError(f"factor {what} is not positive definite after damping; increase the damping")
    return L


class FactoredInverse:
    """Per layer the Cholesky factors of the damped factors ``G + k/omega I`` and ``A + omega k I``.

    Args:
        op: the undamped Kronecker curvature (its blocks name their weight and bias).
        damping: delta = lambda + zeta > 0.
        omegas: omega per block (``op.damping_split(norm)``).
    """

    def __init__(self, op: KroneckerOperator, damping: float, omegas: list[float]):
        if not (math.isfinite(damping) and damping > 0):
            raise ValueError(f"factored damping needs a positive finite total damping, got {damping}")
        k = math.sqrt(damping)
        self.blocks = []
        for b, om in zip(op.blocks, omegas):
            Gd = b.G.clone()
            Gd.diagonal().add_(k / om)
            Ad = b.A.clone()
            Ad.diagonal().add_(om * k)
            self.blocks.append((b.weight_name, b.bias_name, _cholesky(Gd, f"{b.weight_name!r} G"),
                                _cholesky(Ad, f"{b.weight_name!r} A")))

    def apply(self, grads: dict[str, Tensor]) -> dict[str, Tensor]:
        """The direction for every parameter named in the blocks, from the gradients by name."""
        out: dict[str, Tensor] = {}
        for w, bias, LG, LA in self.blocks:
            gw = grads[w]
            X = gw.reshape(gw.shape[0], -1)
            if bias is not None:
                X = torch.cat([X, grads[bias][:, None]], dim=1)
            Y = torch.cholesky_solve(X, LG)  # G_d^{-1} X
            Y = torch.cholesky_solve(Y.T, LA).T  # ... A_d^{-1} (A_d symmetric)
            n = X.shape[1] - (bias is not None)
            out[w] = Y[:, :n].reshape(gw.shape)
            if bias is not None:
                out[bias] = Y[:, n]
        return out
