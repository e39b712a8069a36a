"""Kaldi's online natural gradient (Povey, Zhang & Khudanpur 2015, arXiv:1410.7455), as the NGD paper's
authors actually ran it: the paper (Saghir et al. 2024, arXiv:2409.04913) writes NGD as
w <- w - eta F_s^{-1} grad L with F_s = F + kappa I (its eqs. 5-7), but its code uses ``ngd.py`` of the
NGD-SGD repository, a PyTorch port of Kaldi's method. Written from the algorithm's description; no code
copied.

For every parameter tensor and every tensor axis a of size D > 1 there is one Fisher-like estimate

    F_t = R_tᵀ diag(d_t) R_t + ρ_t I        (R_t: R x D with orthonormal rows, rank R = min((D+1)//2, 80)),

of E[x xᵀ] over the rows x of the gradient matrix X (N x D): the gradient tensor with axis a moved last
and the other axes flattened ("the other dimensions act as the minibatch"). F_t is smoothed to

    F̂_t = F_t + α (tr F_t / D) I = R_tᵀ diag(d_t) R_t + β_t I,   β_t = ρ_t (1 + α) + α Σd_t / D,

(the paper's κ = (α/d) max(tr F, ε) of eq. 7, but as the authors' code does it: d = the axis size D, not
the total parameter count, and ε a floor on the eigenvalues, not on the trace), and the
gradient is replaced by X̂ = β_t X F̂_t⁻¹ = X - X Wᵀ W with W = diag(e)^{1/2} R, e = d/(d + β). The
estimate used is the one from *before* the current batch; afterwards F is moved towards
S = XᵀX/N, F_{t+1} ≈ η S + (1 - η) F_t, by one step of subspace iteration plus an R x R eigen-
decomposition. Eigenvalues are floored at max(ε, δ · largest). The estimate is updated on the first
10 calls and then every ``update_period`` calls. With ``preserve_norm`` (the reproduction default)
X̂ is rescaled to ||X̂||_F = ||X||_F after every axis, so only the *direction* of each tensor's
gradient changes. After all axes, weight decay, momentum and Nesterov are applied as in torch SGD.

Shapes: a Linear weight (out, in) gets an out x out and an in x in factor; a bias (out,) an out x out
factor with N = 1; axes of size 1 are left alone.

Choices where the sources are silent (documented): if a state update produces NaN/inf it is discarded
(the previous estimate is kept); if preconditioning produces NaN/inf the raw gradient is used for that
axis (as the original); weight decay is added after preconditioning; the R x R eigendecomposition is
done in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

import torch
from torch import Tensor

from curvkit.optim.base import CurvatureOptimizer, GroupChecks, check_finite, check_step_extras
from curvkit.validation import integer, nonnegative, positive, unit_interval

AxisState = dict[str, Any]


def default_rank(D: int) -> int:
    return min((D + 1) // 2, 80)


def init_axis_state(X: Tensor, alpha: float, eta: float, epsilon: float, delta: float,
                    rank: int | None = None) -> AxisState:
    """State for an axis of size D = X.shape[1], initialised from the first gradient matrix X (N, D)."""
    D = X.shape[1]
    R = default_rank(D) if rank is None else int(rank)
    if not 0 < R < D:
        raise ValueError(f"rank must satisfy 0 < rank < D = {D}, got {R}")
    O = torch.zeros(R, D, dtype=X.dtype, device=X.device)
    cols = torch.arange(D, device=X.device)
    O[cols % R, cols] = 1.0
    O[torch.arange(R), torch.arange(R)] = 1.1
    O = O / O.norm(dim=1, keepdim=True)
    state: AxisState = {
        "t": 1,
        "W": O * math.sqrt(1.0 / (2.0 + (D + R) * alpha / D)),
        "d": torch.full((R,), epsilon, dtype=X.dtype, device=X.device),
        "rho": torch.tensor(epsilon, dtype=X.dtype, device=X.device),
    }
    for _ in range(3):
        _core(state, X, (X * X).sum(), alpha, eta, epsilon, delta, update_period=1)
    state["t"] = 0
    return state


def beta_of(state: AxisState, alpha: float) -> Tensor:
    D = state["W"].shape[1]
    return state["rho"] * (1 + alpha) + alpha * state["d"].sum() / D


def smoothed_fisher(state: AxisState, alpha: float) -> Tensor:
    """The dense D x D F̂ = Rᵀ diag(d) R + β I of the current state (for tests and inspection)."""
    W, d = state["W"], state["d"]
    e = d / (d + beta_of(state, alpha))
    R = W / e.sqrt()[:, None]
    return R.T @ (d[:, None] * R) + beta_of(state, alpha) * torch.eye(W.shape[1], dtype=W.dtype, device=W.device)


def _core(state: AxisState, X: Tensor, trXX: Tensor, alpha: float, eta: float, epsilon: float, delta: float,
          update_period: int) -> Tensor:
    """Precondition X with the current estimate, then (on schedule) update the estimate with X."""
    t = state["t"]
    updating = t < 10 or t % update_period == 0
    state["t"] = t + 1
    W, d, rho = state["W"], state["d"], state["rho"]
    H = X @ W.T
    Xh = X - H @ W
    if not updating:
        return Xh
    N, D = X.shape
    R = W.shape[0]
    f64 = torch.float64
    W64, d64, rho64, X64, H64 = W.to(f64), d.to(f64), rho.to(f64), X.to(f64), H.to(f64)
    J = H64.T @ X64
    L = J @ W64.T if N > D else H64.T @ H64
    K = J @ J.T
    beta = rho64 * (1 + alpha) + alpha * d64.sum() / D
    e = 1.0 / (beta / d64 + 1.0)
    ise = e.rsqrt()
    dr = d64 + rho64
    eN = eta / N
    cross = L * torch.outer(ise, ise * dr)
    Z = eN**2 * K * torch.outer(ise, ise) + eN * (1 - eta) * (cross + cross.T) + (1 - eta) ** 2 * torch.diag(dr**2)
    z = torch.clamp(torch.trace(Z), min=1.0)
    c, U = torch.linalg.eigh((Z + Z.T) / (2 * z))
    c, U = c.flip(0), U.flip(1)
    c = torch.clamp(c, min=float(((1 - eta) * rho64) ** 2 / z))
    sc = (c * z).sqrt()
    rho_new = (eN * trXX.to(f64) + (1 - eta) * (D * rho64 + d64.sum()) - sc.sum()) / (D - R)
    floor = torch.clamp(delta * sc.max(), min=epsilon)
    d_new = torch.maximum(sc - rho_new, floor)
    rho_new = torch.maximum(rho_new, floor)
    beta_new = rho_new * (1 + alpha) + alpha * d_new.sum() / D
    e_new = 1.0 / (beta_new / d_new + 1.0)
    B = J + ((1 - eta) / eN) * dr[:, None] * W64
    A = eN * (e_new.sqrt() / sc)[:, None] * (U.T * ise[None, :])
    W_new = _reorthonormalize(A @ B, e_new)
    if bool(torch.isfinite(W_new).all()) and bool(torch.isfinite(d_new).all()) and bool(torch.isfinite(rho_new)):
        state["W"], state["d"], state["rho"] = W_new.to(W.dtype), d_new.to(d.dtype), rho_new.to(rho.dtype)
    return Xh


def _reorthonormalize(W: Tensor, e: Tensor, tol: float = 1e-3) -> Tensor:
    """Restore orthonormal rows of R = diag(e)^{-1/2} W when rounding has broken them (max |R Rᵀ - I| > tol).

    This happens for rank-deficient gradient matrices (a bias has N = 1): the eigenvalues of Z for
    directions outside the data are below the eigensolver's relative precision. Like Kaldi's
    re-orthogonalisation, rows are Gram-Schmidt orthonormalised in order (largest eigenvalue first),
    so well-determined leading rows are kept.
    """
    R = W / e.sqrt()[:, None]
    G = R @ R.T
    if float((G - torch.eye(G.shape[0], dtype=G.dtype, device=G.device)).abs().max()) <= tol:
        return W
    Q, T = torch.linalg.qr(R.T)
    sign = torch.where(T.diagonal() < 0, -1.0, 1.0).to(Q.dtype)
    return e.sqrt()[:, None] * (Q * sign[None, :]).T


def precondition_axis(state: AxisState | None, X: Tensor, alpha: float, eta: float, epsilon: float,
                      delta: float, rank: int | None, update_period: int,
                      preserve_norm: bool = True) -> tuple[Tensor, AxisState]:
    """X (N, D) -> (X̂, state). Creates the state on first use."""
    if state is None:
        state = init_axis_state(X, alpha, eta, epsilon, delta, rank)
    s0 = (X * X).sum()
    Xh = _core(state, X, s0, alpha, eta, epsilon, delta, update_period)
    s1 = (Xh * Xh).sum()
    if not bool(torch.isfinite(s1)):
        return X, state
    if preserve_norm:
        Xh = Xh * torch.sqrt(s0 / (s1 + 1e-30))
    return Xh, state


class KaldiNGD(CurvatureOptimizer):
    """Online natural-gradient SGD (Kaldi NG-SGD) with torch-SGD momentum/Nesterov.

    Defaults are the settings of the paper's code (its figure captions give only alpha, lr and epsilon):
    alpha=0.1, eta=0.9 (EMA weight of the *new* batch), epsilon=1e-10, delta=5e-4, rank=auto
    (min((D+1)//2, 80)), update_period=4, momentum=0.9, nesterov=True, preserve_norm=True. ``alpha=0`` is
    allowed.
    """

    group_checks: ClassVar[GroupChecks] = {"lr": positive, "momentum": nonnegative, "dampening": nonnegative, "weight_decay": nonnegative,
                    "alpha": nonnegative, "eta": unit_interval, "epsilon": nonnegative,
                    "delta": lambda n, v: unit_interval(n, v, closed_left=True), "update_period": integer,
                    "rank": integer}

    def __init__(self, params: Iterable[Any], lr: float = 1e-2, momentum: float = 0.9, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = True, alpha: float = 0.1, eta: float = 0.9,
                 epsilon: float = 1e-10, delta: float = 5e-4, rank: int | None = None, update_period: int = 4,
                 preserve_norm: bool = True):
        positive("lr", lr)
        nonnegative("momentum", momentum)
        nonnegative("dampening", dampening)
        nonnegative("weight_decay", weight_decay)
        nonnegative("alpha", alpha)
        unit_interval("eta", eta)
        nonnegative("epsilon", epsilon)
        unit_interval("delta", delta, closed_left=True)
        integer("update_period", update_period)
        if rank is not None:
            integer("rank", rank)  # None means automatic, min((D + 1) // 2, 80); never a negative number
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("Nesterov momentum requires momentum > 0 and dampening = 0")
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay, nesterov=nesterov,
                        alpha=alpha, eta=eta, epsilon=epsilon, delta=delta, rank=rank, update_period=update_period,
                        preserve_norm=preserve_norm)
        super().__init__(params, defaults)
        self._steps = 0

    def precondition(self, p: Tensor, g: Tensor, group: dict[str, Any]) -> Tensor:
        """Apply the per-axis online NG to gradient ``g`` of parameter ``p`` (updates p's NG state)."""
        state = self.state[p]
        axes = state.setdefault("ng_axes", [None] * g.dim())
        for a in range(g.dim()):
            D = g.shape[a]
            if D == 1:
                continue
            moved = g.movedim(a, -1)
            X = moved.reshape(-1, D)
            Xh, axes[a] = precondition_axis(axes[a], X, group["alpha"], group["eta"], group["epsilon"],
                                            group["delta"], group["rank"], group["update_period"],
                                            group["preserve_norm"])
            g = Xh.reshape(moved.shape).movedim(-1, a)
        return g

    @torch.no_grad()
    def step(self, closure: Callable[[], Tensor] | None = None, **extras: Any) -> Tensor | None:  # type: ignore[override]
        """One step; raises FloatingPointError, changing nothing, if a gradient is NaN or inf."""
        check_step_extras(type(self).__name__, extras, ())
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        check_finite(self._steps + 1, [(f"the gradient of parameter #{i}", p.grad) for i, p in
                                       enumerate(p for g in self.param_groups for p in g["params"])
                                       if p.grad is not None], "KaldiNGD")
        for group in self.param_groups:
            mu = group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = self.precondition(p, p.grad.detach(), group)
                if group["weight_decay"] != 0:
                    g = g.add(p, alpha=group["weight_decay"])
                if mu != 0:
                    st = self.state[p]
                    if "momentum_buffer" not in st:
                        st["momentum_buffer"] = g.clone()
                    else:
                        st["momentum_buffer"].mul_(mu).add_(g, alpha=1 - group["dampening"])
                    buf = st["momentum_buffer"]
                    g = g.add(buf, alpha=mu) if group["nesterov"] else buf
                p.add_(g, alpha=-group["lr"])
        self._steps += 1
        return loss
