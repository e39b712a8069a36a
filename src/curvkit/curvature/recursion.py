"""Exact block-diagonal Hessian and GGN of an MLP by backward recursions (thesis Lemmas 3.16 and 3.22).

For a feed-forward chain (thesis Eq. 3.10) ``a_hat_0 = [x; 1]``, ``h_l = W_hat_l a_hat_{l-1}``,
``a_l = phi(h_l)`` for l < L, output ``f = h_L`` (no output activation), and a per-sample loss
``L^n = -log p(y^n | h_L^n)``, the pre-activation Hessians ``H_l = d^2 L / dh_l^2`` obey (Eq. 3.23)

    H_L = d^2 L / dh_L^2,
    H_l = B_l W_{l+1}^T H_{l+1} W_{l+1} B_l + D_l,
    B_l = diag(phi'(h_l)),  D_l = diag((W_{l+1}^T dL/dh_{l+1}) o phi''(h_l)),

with ``W_{l+1}`` WITHOUT its bias column; the pre-activation GGNs (Eq. 3.30) obey the same recursion
without ``D_l``: ``G_L = H_L``, ``G_l = B_l W_{l+1}^T G_{l+1} W_{l+1} B_l``. The exact per-sample diagonal
parameter block is, in PyTorch's row-major ``W_hat = [W | b]`` layout (see :mod:`curvkit.linalg.kron`),

    d^2 L^n / dW_hat_l^2 = H_l^n (x) a_hat_{l-1}^n a_hat_{l-1}^{nT}     (thesis Eq. 3.17 re-ordered),

and the data block is the reduction of these over the N samples (``sum``, or the mean over all N for
``reduction='mean'``), which is NOT Kronecker-factored. All per-layer, per-sample matrices come from one
vectorised backward pass over the batch.

Supported models: ``nn.Sequential`` (optionally starting with ``nn.Flatten``) of ``nn.Linear`` layers
separated by elementwise activations (any of :data:`curvkit.structure.ELEMENTWISE`; several in a row are
composed), ending with a ``nn.Linear`` (:meth:`curvkit.structure.ModelStructure.mlp_chain`). Anything
else raises an error naming the offending module.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.func import jvp

from curvkit.curvature._functional import as_tensor_batches
from curvkit.likelihoods import Likelihood
from curvkit.linalg.kron import BlockDiagonalOperator, DenseBlock
from curvkit.linalg.layout import ParamLayout
from curvkit.structure import MLPChain, UnsupportedModelError, read_model

__all__ = [
    "BlockDiagonalCurvature",
    "MLPChain",
    "blockdiag_ggn",
    "blockdiag_hessian",
    "mlp_chain",
]


# ---------------------------------------------------------------------------------------------- chain
def mlp_chain(model: nn.Module, method: str = "this method") -> MLPChain:
    """Parse ``model`` as an MLP chain, or raise naming the unsupported module
    (:meth:`curvkit.structure.ModelStructure.mlp_chain`)."""
    return read_model(model).mlp_chain(method)


def _closed_form(m: nn.Module, a: Tensor) -> tuple[Tensor, Tensor, Tensor] | None:
    """(phi(a), phi'(a), phi''(a)) for the activations with simple closed forms, else None."""
    if type(m) is nn.ReLU:
        return torch.relu(a), (a > 0).to(a.dtype), torch.zeros_like(a)
    if type(m) is nn.LeakyReLU:
        p1 = torch.where(a > 0, torch.ones_like(a), torch.full_like(a, m.negative_slope))
        return torch.nn.functional.leaky_relu(a, m.negative_slope), p1, torch.zeros_like(a)
    if type(m) is nn.Tanh:
        v = torch.tanh(a)
        p1 = 1 - v**2
        return v, p1, -2 * v * p1
    if type(m) is nn.Sigmoid:
        v = torch.sigmoid(a)
        p1 = v * (1 - v)
        return v, p1, p1 * (1 - 2 * v)
    if type(m) is nn.Identity:
        return a, torch.ones_like(a), torch.zeros_like(a)
    return None


def _by_autodiff(m: nn.Module, a: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(phi(a), phi'(a), phi''(a)) of any elementwise activation by forward-mode differentiation: the
    derivative of an elementwise map in the all-ones direction is its derivative at each entry."""
    ones = torch.ones_like(a)

    def d1(x: Tensor) -> Tensor:
        return jvp(m, (x,), (ones,))[1]  # type: ignore[no-any-return]

    out: Any = jvp(m, (a,), (ones,))
    p2 = jvp(d1, (a,), (ones,))[1]
    return out[0], out[1], p2


def activation_derivatives(modules: list[nn.Module], h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Apply the elementwise activations ``modules`` to ``h``; return ``(phi(h), phi'(h), phi''(h))``.

    Any activation of :data:`curvkit.structure.ELEMENTWISE` is accepted (closed forms for ReLU, LeakyReLU,
    Tanh, Sigmoid, Identity; forward-mode autodiff for the others). Compositions use the chain rule:
    ``(p o q)' = p'(q) q'``, ``(p o q)'' = p''(q) q'^2 + p'(q) q''``. ReLU's derivative at 0 is 0 (as
    autograd's).
    """
    a, d1, d2 = h, torch.ones_like(h), torch.zeros_like(h)
    for m in modules:
        closed = _closed_form(m, a)
        v, p1, p2 = closed if closed is not None else _by_autodiff(m, a)
        d2 = p2 * d1**2 + p1 * d2
        d1 = p1 * d1
        a = v
    return a, d1, d2

def _with_ones(a: Tensor, bias: bool) -> Tensor:
    return torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1) if bias else a


@dataclass
class ChainForward:
    """Cached forward pass: per layer the augmented input ``a_hat_{l-1}`` (B, in_aug), ``h_l`` (B, out),
    ``phi'(h_l)`` and ``phi''(h_l)`` (B, out) (ones/zeros for the last layer), and the output f = h_L."""

    inputs: list[Tensor]
    pre: list[Tensor]
    d1: list[Tensor]
    d2: list[Tensor]
    output: Tensor


@torch.no_grad()
def chain_forward(chain: MLPChain, X: Tensor) -> ChainForward:
    a = chain.flatten(X) if chain.flatten is not None else X
    if a.dim() != 2:
        raise ValueError(f"MLP input must have shape (batch, {chain.linears[0].in_features}), got "
                         f"{tuple(a.shape)} (add nn.Flatten as the first module for image inputs)")
    inputs, pre, d1s, d2s = [], [], [], []
    for lin, acts in zip(chain.linears, chain.activations):
        inputs.append(_with_ones(a, lin.bias is not None))
        h = torch.nn.functional.linear(a, lin.weight, lin.bias)
        a, d1, d2 = activation_derivatives(acts, h)
        pre.append(h)
        d1s.append(d1)
        d2s.append(d2)
    return ChainForward(inputs, pre, d1s, d2s, pre[-1])


def iterate_data(data: tuple[Tensor, Tensor] | Iterable[tuple[Tensor, Tensor]],
                 y: Tensor | None = None) -> list[tuple[Tensor, Tensor]]:
    """Normalise ``data`` (an ``(X, y)`` pair, an iterable of pairs, or ``X`` with ``y`` given) to a list of
    validated pairs (:func:`curvkit.curvature._functional.as_tensor_batches`)."""
    if y is not None:
        if not isinstance(data, Tensor):
            raise TypeError("when y is given, the third argument must be the input tensor X")
        return as_tensor_batches((data, y))
    if isinstance(data, Tensor):
        raise TypeError("data must be an (X, y) pair or an iterable of (X, y) pairs, got a single tensor; "
                        "pass the targets too")
    return as_tensor_batches(data)


# ---------------------------------------------------------------------------------------------- result
@dataclass
class BlockDiagonalCurvature:
    """Per-layer exact curvature of an MLP from the recursions.

    Attributes:
        kind: ``'hessian'`` or ``'ggn'``.
        layout: the model's :class:`ParamLayout`.
        weight_names, bias_names: per layer (bias None when absent).
        pre_activation: per layer, (N, out, out) per-sample pre-activation Hessians ``H_l^n`` (or GGNs
            ``G_l^n``); unreduced (no 1/N).
        inputs: per layer, (N, in_aug) per-sample augmented inputs ``a_hat_{l-1}^n`` (bias entry 1 last).
        scale: the reduction factor (1 for ``sum``, 1/N for ``mean``).
    """

    kind: str
    layout: ParamLayout
    weight_names: list[str]
    bias_names: list[str | None]
    pre_activation: list[Tensor]
    inputs: list[Tensor]
    scale: float

    def block(self, layer: int) -> Tensor:
        """Dense (P, P) data block of layer ``layer`` in ``W_hat`` row-major order, P = out * in_aug:
        ``scale * sum_n H_l^n (x) a_hat^n a_hat^{nT}``. Memory O(P^2)."""
        H, a = self.pre_activation[layer], self.inputs[layer]
        out, ina = H.shape[1], a.shape[1]
        B = torch.einsum("nij,na,nb->iajb", H, a, a) * self.scale
        return B.reshape(out * ina, out * ina)

    def blocks(self) -> list[Tensor]:
        return [self.block(i) for i in range(len(self.pre_activation))]

    def to_operator(self) -> BlockDiagonalOperator:
        """The block-diagonal curvature as an operator (``to_dense()`` in the flat parameter order)."""
        return BlockDiagonalOperator(self.layout, [
            DenseBlock(self.block(i), w, b) for i, (w, b) in enumerate(zip(self.weight_names, self.bias_names))
        ])


def _recursion(kind: Literal["hessian", "ggn"], model: nn.Module, likelihood: Likelihood,
               data: tuple[Tensor, Tensor] | Iterable[tuple[Tensor, Tensor]] | Tensor,
               y: Tensor | None) -> BlockDiagonalCurvature:
    method = "blockdiag_hessian" if kind == "hessian" else "blockdiag_ggn"
    chain = mlp_chain(model, method)
    layout = ParamLayout.from_module(model)
    wnames, bnames = chain.weights, chain.biases
    L = len(chain.linears)
    pre: list[list[Tensor]] = [[] for _ in range(L)]
    ins: list[list[Tensor]] = [[] for _ in range(L)]
    N = 0
    for X, yb in iterate_data(data, y):  # type: ignore[arg-type]
        fw = chain_forward(chain, X)
        likelihood.check(fw.output, yb)
        N += X.shape[0]
        H = likelihood.output_hessian(fw.output)  # (B, C, C)
        delta = likelihood.output_grad(fw.output, yb) if kind == "hessian" else None  # dL/dh_l, (B, d_l)
        per = [H]
        for l in range(L - 2, -1, -1):
            W = chain.linears[l + 1].weight.detach()  # (d_{l+1}, d_l), no bias column
            d1 = fw.d1[l]
            H = d1[:, :, None] * (W.T @ H @ W) * d1[:, None, :]  # B_l W^T H W B_l
            if delta is not None:
                dL_da = delta @ W  # (B, d_l)
                H = H + torch.diag_embed(dL_da * fw.d2[l])  # + D_l  (Lemma 3.16 only)
                delta = dL_da * d1
            per.append(H)
        per.reverse()
        for l in range(L):
            pre[l].append(per[l])
            ins[l].append(fw.inputs[l])
    scale = 1.0 if likelihood.reduction == "sum" else 1.0 / N
    return BlockDiagonalCurvature(kind, layout, wnames, bnames, [torch.cat(p) for p in pre],
                                  [torch.cat(a) for a in ins], scale)


def blockdiag_hessian(model: nn.Module, likelihood: Likelihood,
                      data: tuple[Tensor, Tensor] | Iterable[tuple[Tensor, Tensor]] | Tensor,
                      y: Tensor | None = None) -> BlockDiagonalCurvature:
    """Exact per-layer Hessian blocks of an MLP by the recursion of thesis Lemma 3.16 (Eq. 3.23).

    Args:
        model: ``nn.Sequential`` MLP (see module docstring).
        likelihood: gives ``H_L`` (``output_hessian``), ``dL/dh_L`` (``output_grad``) and the reduction.
        data: an ``(X, y)`` pair or an iterable of pairs; or ``X`` with the targets passed as ``y``.
    Returns:
        :class:`BlockDiagonalCurvature`; ``.to_operator().to_dense()`` equals the block-diagonal part of
        the Hessian of ``likelihood.nll`` (summed, or averaged over all N points).
    """
    return _recursion("hessian", model, likelihood, data, y)


def blockdiag_ggn(model: nn.Module, likelihood: Likelihood,
                  data: tuple[Tensor, Tensor] | Iterable[tuple[Tensor, Tensor]] | Tensor,
                  y: Tensor | None = None) -> BlockDiagonalCurvature:
    """Exact per-layer GGN blocks of an MLP by the recursion of thesis Lemma 3.22 (Eq. 3.30), with
    ``G_L = H_L``. Arguments and result as :func:`blockdiag_hessian` (targets are only validated)."""
    return _recursion("ggn", model, likelihood, data, y)


def kfra_chain(structure: Any) -> Any:
    """The MLP chain KFRA's recursion runs on (thesis Eq. 4.7), or the chain reader's error (naming the first
    module that breaks the chain) pointing to the methods that take any model."""
    try:
        return structure.mlp_chain("kfra", frozen=True)
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{exc}. KFRA's recursion is defined on MLP chains only; curvature='kflr' "
                                    "(exact output factors) or 'kfac' (Monte Carlo) take every layer kind") from exc
