"""Exact block-diagonal Hessian and GGN of an MLP by backward recursions (thesis Lemmas 3.16 and 3.22).

For a feed-forward chain (thesis Eq. 3.10) ``a_hat_0 = [x; 1]``, ``h_l = W_hat_l a_hat_{l-1}``,
``a_l = phi(h_l)`` for l < L, output ``f = h_L`` (no output activation), and a per-sample loss
``L^n = -log p(y^n | h_L^n)``, the pre-activation Hessians ``H_l = d^2 L / dh_l^2`` obey (Eq. 3.23)

    H_L = d^2 L / dh_L^2,
    H_l = B_l W_{l+1}^T H_{l+1} W_{l+1} B_l + D_l,
    B_l = diag(phi'(h_l)),  D_l = diag((W_{l+1}^T dL/dh_{l+1}) o phi''(h_l)),

with ``W_{l+1}`` WITHOUT its bias column; the pre-activation GGNs (Eq. 3.30) obey the same recursion
without ``D_l``: ``G_L = H_L``, ``G_l = B_l W_{l+1}^T G_{l+1} W_{l+1} B_l``. The exact per-sample diagonal
parameter block is, in PyTorch's row-major ``W_hat = [W | b]`` layout (digest 002 section 0),

    d^2 L^n / dW_hat_l^2 = H_l^n (x) a_hat_{l-1}^n a_hat_{l-1}^{nT}     (thesis Eq. 3.17 re-ordered),

and the data block is the reduction of these over the N samples (``sum``, or the mean over all N for
``reduction='mean'``), which is NOT Kronecker-factored. All per-layer, per-sample matrices come from one
vectorised backward pass over the batch.

Supported models: ``nn.Sequential`` (optionally starting with ``nn.Flatten``) of ``nn.Linear`` layers
separated by elementwise activations (ReLU, LeakyReLU, Tanh, Sigmoid, Identity; several in a row are
composed), ending with a ``nn.Linear``. Anything else raises an error naming the offending module.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from curvkit.likelihoods import Likelihood
from curvkit.linalg.kron import BlockDiagonalOperator, DenseBlock
from curvkit.linalg.layout import ParamLayout

__all__ = [
    "BlockDiagonalCurvature",
    "MLPChain",
    "blockdiag_ggn",
    "blockdiag_hessian",
    "mlp_chain",
]

_ELEMENTWISE = (nn.ReLU, nn.LeakyReLU, nn.Tanh, nn.Sigmoid, nn.Identity)


# ---------------------------------------------------------------------------------------------- chain
@dataclass
class MLPChain:
    """A parsed feed-forward chain: linear layers and the elementwise activations that follow each.

    ``activations[l]`` are applied to ``h_l`` (the output of ``linears[l]``); the last list is empty.
    """

    names: list[str]
    linears: list[nn.Linear]
    activations: list[list[nn.Module]]
    flatten: nn.Module | None


def mlp_chain(model: nn.Module, method: str = "this method") -> MLPChain:
    """Parse ``model`` as an MLP chain, or raise a ValueError naming the unsupported module."""
    if not isinstance(model, nn.Sequential):
        raise ValueError(f"{method} needs an nn.Sequential of nn.Linear layers and elementwise activations "
                         f"(ReLU, LeakyReLU, Tanh, Sigmoid, Identity); got {type(model).__name__}")
    names: list[str] = []
    linears: list[nn.Linear] = []
    acts: list[list[nn.Module]] = []
    flatten: nn.Module | None = None
    for i, (name, m) in enumerate(model.named_children()):
        if isinstance(m, nn.Flatten) and i == 0:
            flatten = m
        elif isinstance(m, nn.Linear):
            names.append(name)
            linears.append(m)
            acts.append([])
        elif isinstance(m, _ELEMENTWISE):
            if not linears:
                raise ValueError(f"{method}: module {name!r} ({type(m).__name__}) comes before the first "
                                 "nn.Linear; the chain must start with nn.Linear (optionally after nn.Flatten)")
            acts[-1].append(m)
        else:
            raise ValueError(
                f"{method}: module {name!r} ({type(m).__name__}) is not supported; the model must be an "
                "nn.Sequential of nn.Linear layers and elementwise activations (ReLU, LeakyReLU, Tanh, "
                "Sigmoid, Identity)"
            )
    if not linears:
        raise ValueError(f"{method}: the model has no nn.Linear layer")
    if acts[-1]:
        raise ValueError(
            f"{method}: the model ends with an activation ({type(acts[-1][-1]).__name__}) after its last "
            "nn.Linear; the output must be the likelihood's natural parameter (logits/mean): remove the "
            "output activation and let the likelihood apply it"
        )
    for name, lin in zip(names, linears):
        if not lin.weight.requires_grad or (lin.bias is not None and not lin.bias.requires_grad):
            raise ValueError(f"{method}: layer {name!r} has frozen parameters; the recursions need every "
                             "parameter of the chain to be trainable")
    return MLPChain(names, linears, acts, flatten)


def activation_derivatives(modules: list[nn.Module], h: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Apply the elementwise activations ``modules`` to ``h``; return ``(phi(h), phi'(h), phi''(h))``.

    Compositions use the chain rule: ``(p o q)' = p'(q) q'``, ``(p o q)'' = p''(q) q'^2 + p'(q) q''``.
    ReLU's derivative at 0 is taken as 0 (as autograd does).
    """
    a, d1, d2 = h, torch.ones_like(h), torch.zeros_like(h)
    for m in modules:
        if isinstance(m, nn.ReLU):
            p1, p2, v = (a > 0).to(a.dtype), torch.zeros_like(a), torch.relu(a)
        elif isinstance(m, nn.LeakyReLU):
            p1 = torch.where(a > 0, torch.ones_like(a), torch.full_like(a, m.negative_slope))
            p2, v = torch.zeros_like(a), torch.nn.functional.leaky_relu(a, m.negative_slope)
        elif isinstance(m, nn.Tanh):
            v = torch.tanh(a)
            p1 = 1 - v**2
            p2 = -2 * v * p1
        elif isinstance(m, nn.Sigmoid):
            v = torch.sigmoid(a)
            p1 = v * (1 - v)
            p2 = p1 * (1 - 2 * v)
        elif isinstance(m, nn.Identity):
            continue
        else:  # pragma: no cover - mlp_chain rejects these
            raise ValueError(f"unsupported activation {type(m).__name__}")
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
    """Normalise ``data`` (an ``(X, y)`` pair, an iterable of pairs, or ``X`` with ``y`` given) to a list."""
    if y is not None:
        if not isinstance(data, Tensor):
            raise TypeError("when y is given, the third argument must be the input tensor X")
        return [(data, y)]
    if isinstance(data, tuple) and len(data) == 2 and isinstance(data[0], Tensor):
        return [data]  # type: ignore[list-item]
    if isinstance(data, Tensor):
        raise TypeError("data must be an (X, y) pair or an iterable of (X, y) pairs, got a single tensor; "
                        "pass the targets too")
    batches = list(data)  # type: ignore[arg-type]
    for i, b in enumerate(batches):
        if not (isinstance(b, (tuple, list)) and len(b) == 2 and isinstance(b[0], Tensor)):
            raise TypeError(f"batch {i} of data is not an (X, y) pair of tensors")
    if not batches:
        raise ValueError("data is empty: need at least one (X, y) batch")
    return [(b[0], b[1]) for b in batches]


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
    prefix = {id(p): n for n, p in model.named_parameters()}
    wnames = [prefix[id(lin.weight)] for lin in chain.linears]
    bnames: list[str | None] = [prefix[id(lin.bias)] if lin.bias is not None else None for lin in chain.linears]
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
