"""Dense torch.func references for tests (tiny float64 models only; O(d^2) memory).

Every curvature quantity in curvkit is tested against these. They are written independently of the
library's own code paths: full Hessians by ``torch.func.hessian``, Jacobians by ``torch.func.jacrev``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev

from curvkit.likelihoods import CrossEntropy, Likelihood
from curvkit.linalg.layout import ParamLayout


def flat_params(model: nn.Module) -> tuple[list[str], list[torch.Size], Tensor]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    names = [n for n, _ in named]
    shapes = [p.shape for _, p in named]
    flat = torch.cat([p.detach().reshape(-1) for _, p in named])
    return names, shapes, flat


def _unflat(names: list[str], shapes: list[torch.Size], flat: Tensor) -> dict[str, Tensor]:
    out, o = {}, 0
    for n, s in zip(names, shapes):
        k = int(torch.Size(s).numel())
        out[n] = flat[o:o + k].reshape(s)
        o += k
    return out


def output_fn(model: nn.Module):
    """theta_flat -> model outputs as a function of the flat parameter vector."""
    names, shapes, flat = flat_params(model)

    def f(theta: Tensor, X: Tensor) -> Tensor:
        return functional_call(model, _unflat(names, shapes, theta), (X,))

    return f, flat


def loss_fn(model: nn.Module, lik: Likelihood):
    f, flat = output_fn(model)

    def L(theta: Tensor, X: Tensor, y: Tensor) -> Tensor:
        return lik.nll(f(theta, X), y)

    return L, flat


def _batches(data):
    if isinstance(data, tuple):
        return [data]
    return list(data)


def _total(data) -> int:
    return sum(int(X.shape[0]) for X, _ in _batches(data))


def dense_hessian(model: nn.Module, lik: Likelihood, data) -> Tensor:
    """Hessian of the reduced loss over all of ``data`` (a pair or a list of pairs).

    With ``reduction='mean'`` the loss is the mean over ALL N data points (batches weighted by size).
    """
    L, flat = loss_fn(model, lik)
    N = _total(data)
    H = torch.zeros(flat.numel(), flat.numel(), dtype=flat.dtype)
    for X, y in _batches(data):
        w = 1.0 if lik.reduction == "sum" else X.shape[0] / N
        H += w * hessian(L)(flat, X, y)
    return H


def per_sample_jacobians(model: nn.Module, X: Tensor) -> Tensor:
    """(B, C, d) Jacobian of each sample's output w.r.t. the flat parameters."""
    f, flat = output_fn(model)
    return jacrev(f)(flat, X)  # (B, C, d)


def dense_ggn(model: nn.Module, lik: Likelihood, data) -> Tensor:
    """GGN = sum_n J_n^T H_L^n J_n, times 1/N for mean reduction."""
    _, _, flat = flat_params(model)
    N = _total(data)
    G = torch.zeros(flat.numel(), flat.numel(), dtype=flat.dtype)
    f, _ = output_fn(model)
    for X, _y in _batches(data):
        J = per_sample_jacobians(model, X)
        HL = lik.output_hessian(f(flat, X).detach())
        G += torch.einsum("bci,bcd,bdj->ij", J, HL, J)
    return G / (N if lik.reduction == "mean" else 1)


def dense_fisher_categorical(model: nn.Module, data, reduction: str = "mean") -> Tensor:
    """Type-2 Fisher for softmax outputs by its definition: sum_n sum_c p_c g_nc g_nc^T."""
    lik = CrossEntropy(reduction="sum")
    L, flat = loss_fn(model, lik)
    f, _ = output_fn(model)
    N = _total(data)
    F = torch.zeros(flat.numel(), flat.numel(), dtype=flat.dtype)
    for X, _y in _batches(data):
        p = f(flat, X).detach().softmax(-1)
        for n in range(X.shape[0]):
            for c in range(p.shape[1]):
                g = torch.func.grad(L)(flat, X[n:n + 1], torch.tensor([c]))
                F += p[n, c] * torch.outer(g, g)
    return F / (N if reduction == "mean" else 1)


def dense_empirical_fisher(model: nn.Module, lik: Likelihood, data) -> Tensor:
    """sum_n g_n g_n^T with g_n the per-sample gradient at the DATA label (1/N for mean reduction)."""
    per = type(lik)(reduction="sum") if not hasattr(lik, "sigma") else type(lik)("sum", sigma=lik.sigma)
    L, flat = loss_fn(model, per)
    N = _total(data)
    F = torch.zeros(flat.numel(), flat.numel(), dtype=flat.dtype)
    for X, y in _batches(data):
        for n in range(X.shape[0]):
            g = torch.func.grad(L)(flat, X[n:n + 1], y[n:n + 1])
            F += torch.outer(g, g)
    return F / (N if lik.reduction == "mean" else 1)


def block_mask(model: nn.Module) -> torch.Tensor:
    """Boolean (d, d) mask of the per-module diagonal blocks (weight and bias of a layer together)."""
    lay = ParamLayout.from_module(model)
    groups: dict[str, list[int]] = {}
    for name, sl in lay.slices().items():
        groups.setdefault(name.rsplit(".", 1)[0], []).extend(range(sl.start, sl.stop))
    M = torch.zeros(lay.dim, lay.dim, dtype=torch.bool)
    for idx in groups.values():
        t = torch.tensor(idx)
        M[t[:, None], t[None, :]] = True
    return M


def make_data(lik_name: str, n: int, seed: int = 0, d_in: int = 4, c: int = 3):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d_in, generator=g)
    if lik_name == "ce":
        return X, torch.randint(0, c, (n,), generator=g)
    if lik_name == "bce":
        return X, torch.rand(n, c, generator=g)
    return X, torch.randn(n, c, generator=g)


class NotSequential(nn.Module):
    """Wraps a network in a module that is not a plain nn.Sequential, so the exact operators take their
    general torch.func paths (dual numbers, vjp + vmapped jvp) instead of the recorded-tangent fast path."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        return self.net(x)
