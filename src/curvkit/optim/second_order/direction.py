"""The damped Kronecker direction d = (G~ + delta I)^{-1} g of thesis Eqs. 4.16 and 4.23, per layer.

With factored Tikhonov damping (Eq. 4.25; delta = lambda + zeta, k = sqrt(delta), omega per layer from
:meth:`curvkit.linalg.kron.KroneckerOperator.damping_split`, Eq. 4.27) a layer's block
``(G + k/omega I) (x) (A + omega k I)`` is inverted by two Cholesky factorisations, and applied to the layer's
gradient in the ``W_hat = [W | b]`` layout (out, in+1) as

    D = (G + k/omega I)^{-1} grad_W_hat (A + omega k I)^{-1}

with triangular solves on both sides (no explicit inverse and no flat-vector permutation: this is the
per-step hot path of the optimiser). It is the same matrix as
``op.inverse(delta, method='factored')`` (tested), which forms the two inverses explicitly.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from curvkit.linalg.kron import KroneckerOperator
from curvkit.linalg.krylov import NotPositiveDefiniteError

__all__ = ["FactoredInverse"]


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
