"""Dense torch.func references for tests (tiny float64 models only; O(d^2) memory).

Every curvature quantity in curvkit is tested against these. They are written independently of the
library's own code paths: full Hessians by ``torch.func.hessian``, Jacobians by ``torch.func.jacrev``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.func import functional_call, hessian, jacrev
from torch.nn.attention import SDPBackend, sdpa_kernel

from curvkit.likelihoods import CrossEntropy, Gaussian, Likelihood
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


# ------------------------------------------------------------------------------ references for modern models
# Outputs (B, C) or (B, *P, C), padding, models with attention, BatchNorm in training mode. Written with plain
# torch (torch.nn.functional losses on the outputs flattened to (B * T, C), as nn.CrossEntropyLoss sees them),
# with PyTorch's unfused attention, and with Hessians by reverse-over-reverse differentiation (torch.func.hessian,
# forward-over-reverse, was seen to give wrong Hessians for BatchNorm in training mode in torch 2.13).


@contextlib.contextmanager
def unfused_attention():
    """PyTorch's math attention backend only and the multi-head-attention fast path off (previous settings
    restored); written independently of curvkit.structure.curvature_kernels."""
    previous = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(False)
    try:
        with sdpa_kernel(SDPBackend.MATH):
            yield
    finally:
        torch.backends.mha.set_fastpath_enabled(previous)


def flat_model(model: nn.Module):
    """(f(theta, X), theta0): the model as a function of its flat trainable parameters, evaluated with unfused
    attention and with fresh copies of its buffers (BatchNorm's running statistics are never changed)."""
    names, shapes, flat = flat_params(model)
    frozen = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    buffers = {n: b.detach() for n, b in model.named_buffers()}

    def f(theta: Tensor, X: Tensor) -> Tensor:
        state = {**frozen, **{n: b.clone() for n, b in buffers.items()}, **_unflat(names, shapes, theta)}
        with unfused_attention():
            return functional_call(model, state, (X,))

    return f, flat


def flat_terms(lik: Likelihood, f: Tensor, y: Tensor) -> tuple[Tensor, int]:
    """(per-position losses of the outputs flattened to (M, C), M = B * prod(P); number of counted positions),
    from torch.nn.functional (padded positions contribute 0)."""
    C = f.shape[-1]
    if isinstance(lik, CrossEntropy):
        ignore = getattr(lik, "ignore_index", None)
        ignore = -100 if ignore is None else ignore
        yf = y.reshape(-1)
        terms = torch.nn.functional.cross_entropy(f.reshape(-1, C), yf, ignore_index=ignore, reduction="none")
        return terms, int((yf != ignore).sum())
    if isinstance(lik, Gaussian):
        ff, yf = f.reshape(-1, C), y.reshape(-1, C).to(f.dtype)
        keep = torch.ones(ff.shape[0], dtype=torch.bool, device=f.device) if lik.ignore_value is None else (yf != lik.ignore_value).any(-1)
        terms = 0.5 * ((ff - yf) ** 2).sum(-1) / lik.sigma**2 * keep
        return terms, int(keep.sum())
    raise NotImplementedError(type(lik).__name__)


def _weight(lik: Likelihood, f: Callable, theta: Tensor, data) -> float:
    with torch.no_grad():
        counted = sum(flat_terms(lik, f(theta, X), y)[1] for X, y in _batches(data))
    return 1.0 if lik.reduction == "sum" else 1.0 / counted


def dense_hessian_ror(model: nn.Module, lik: Likelihood, data) -> Tensor:
    """Hessian of the reduced loss over all of ``data`` by reverse-over-reverse (one double-backward pass per
    row); ``mean`` divides by the counted positions of all the data, as nn.CrossEntropyLoss on (B * T, C)."""
    f, theta0 = flat_model(model)
    w = _weight(lik, f, theta0, data)
    theta = theta0.clone().requires_grad_()
    loss = sum(flat_terms(lik, f(theta, X), y)[0].sum() for X, y in _batches(data)) * w
    g = torch.autograd.grad(loss, theta, create_graph=True)[0]
    return torch.stack([torch.autograd.grad(g[i], theta, retain_graph=True)[0] for i in range(theta.numel())])


def dense_ggn_flat(model: nn.Module, lik: Likelihood, data) -> Tensor:
    """GGN w sum_b J_b^T (d^2 loss_b / d f_b^2) J_b with the full output Jacobian J_b (B * prod(P) * C, d) and the
    Hessian of the batch's summed loss in its flattened outputs (a tiny (B * prod(P) * C)^2 matrix)."""
    f, theta = flat_model(model)
    w = _weight(lik, f, theta, data)
    G = torch.zeros(theta.numel(), theta.numel(), dtype=theta.dtype)
    for X, y in _batches(data):
        out = f(theta, X).detach()
        J = jacrev(f)(theta, X).reshape(-1, theta.numel())
        H = hessian(lambda o, y=y, s=out.shape: flat_terms(lik, o.reshape(s), y)[0].sum())(out.reshape(-1))
        G += J.T @ H @ J
    return G * w


def dense_ef_flat(model: nn.Module, lik: Likelihood, data, labels=None) -> Tensor:
    """w sum over samples AND positions of g g^T, g the gradient of one position's loss (at the data labels, or
    for ``labels`` - a list per batch of lists of sampled targets - the mean over them: the MC Fisher)."""
    f, theta = flat_model(model)
    w = _weight(lik, f, theta, data)
    out = torch.zeros(theta.numel(), theta.numel(), dtype=theta.dtype)
    for b, (X, y) in enumerate(_batches(data)):
        targets = [y] if labels is None else labels[b]
        for t in targets:
            R = jacrev(lambda th, t=t, X=X: flat_terms(lik, f(th, X), t)[0])(theta)  # (B * prod(P), d)
            out += R.T @ R / len(targets)
    return out * w


def int_tensors(obj: object, seen: set[int] | None = None) -> list[Tensor]:
    """Every integer tensor reachable from ``obj`` through attributes, containers and dataclass fields."""
    seen = set() if seen is None else seen
    if id(obj) in seen:
        return []
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        return [obj] if not obj.dtype.is_floating_point else []
    if isinstance(obj, dict):
        items: list[object] = list(obj.values())
    elif isinstance(obj, (list, tuple, set)):
        items = list(obj)
    elif hasattr(obj, "__dict__"):
        items = list(vars(obj).values())
    else:
        return []
    return [t for it in items for t in int_tensors(it, seen)]


def kron_filter_step(Sx: Tensor, Sd: Tensor, Es: Tensor, G: Tensor, eta: float, sigma2: float, sequential: bool,
                     exact: bool) -> tuple[Tensor, Tensor, Tensor]:
    """One step of the Kronecker filter (Aitchison 2018, Eqs. 22-28) on one layer written from its per-example
    gradient matrices Es (K, M, N) and ascent gradient G (M, N): drift (Eq. 28, or dense with ``exact``), the data
    step for E_n of any rank (Sx' = Sx + (s/(2NM) Sx - Sx E^T Sd E Sx / M) / (1 + s), s = tr(Sx E^T Sd E), and Sd';
    ``exact``: the dense Kalman steps with e_n = vec(E_n), then the exact KL projection), the rebalancing; returns
    (Sx', Sd', the mean increment Sd' G Sx')."""
    from curvkit.optim.filters.kron_math import drift_project, kl_project, rebalance

    N, M = Sx.shape[0], Sd.shape[0]
    decay = 1.0 - eta**2 / (2 * sigma2)
    if exact:  # the dense drift and Kalman steps with e_n = vec(E_n) (column-stacking), then the exact KL projection
        S = decay**2 * torch.kron(Sx, Sd) + eta**2 * torch.eye(N * M, dtype=Sx.dtype)
        for E in Es:
            e = E.T.reshape(-1)
            Se = S @ e
            S = S - torch.outer(Se, Se) / (1 + e @ Se)
        Sx, Sd = kl_project(0.5 * (S + S.T), N, M, init=(Sx, Sd))
    else:
        if eta > 0:
            Sx, Sd = drift_project(Sx, Sd, eta, decay)
        Sx, Sd = rebalance(*first_order_data_step(Sx, Sd, Es, sequential))
    return Sx, Sd, Sd @ G @ Sx


def first_order_data_step(Sx: Tensor, Sd: Tensor, Es, sequential: bool) -> tuple[Tensor, Tensor]:
    """The first-order data step for per-example gradient matrices E_n (M, N) of any rank, written directly:
    Sx' = Sx + (s/(2NM) Sx - Sx E^T Sd E Sx / M) / (1 + s), Sd' likewise, s = tr(Sx E^T Sd E); ``sequential``:
    example after example, else the sum of the increments at the given factors (no rebalancing)."""
    N, M = Sx.shape[0], Sd.shape[0]
    dSx, dSd = torch.zeros_like(Sx), torch.zeros_like(Sd)
    for E in Es:
        a, b = Sx, Sd  # batched: Sx, Sd stay the given factors
        s = float(torch.trace(a @ E.T @ b @ E))
        dx = (s / (2 * N * M) * a - a @ E.T @ b @ E @ a / M) / (1 + s)
        dd = (s / (2 * N * M) * b - b @ E @ a @ E.T @ b / N) / (1 + s)
        if sequential:
            Sx, Sd = Sx + dx, Sd + dd
        else:
            dSx, dSd = dSx + dx, dSd + dd
    return (Sx, Sd) if sequential else (Sx + dSx, Sd + dSd)
