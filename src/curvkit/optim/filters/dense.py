"""The reference dense Gaussian (Kalman) filter for tiny models (Aitchison 2018, Sec. 2.1, Eqs. 1-7).

Latent z in R^D (all parameters, flattened in :class:`~curvkit.linalg.layout.ParamLayout` order).

    prior dynamics (1):  z(t+1) ~ N((I - A) z(t), Q)
    predict (3):         mu_prior = (I - A) mu_post,  Sigma_prior = (I - A) Sigma_post (I - A)^T + Q
    update (7):          Sigma_post = Sigma_prior - (Sigma_prior e)(Sigma_prior e)^T / (1 + e^T Sigma_prior e)
                         (applied once per rank-1 Fisher sample e; Lambda_like = sum_k e_k e_k^T)
    mean (6):            mu_post = mu_prior + Sigma_post g

g is the ascent gradient of the summed log-likelihood at mu_prior (the current parameters). This is the
exact Kalman filter whenever the log-likelihood is quadratic with Hessian -sum_k e_k e_k^T, and the test
oracle for every other filter here. Memory O(D^2): tiny models only.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor

from curvkit.optim.base import check_finite, check_step_extras
from curvkit.optim.filters._base import FilterOptimizer, Reduction, ascent_grad
from curvkit.validation import finite_tensor


def kalman_predict(mu: Tensor, S: Tensor, F: Tensor, Q: Tensor) -> tuple[Tensor, Tensor]:
    """Eq. 3: (F mu, F S F^T + Q) with F = I - A."""
    return F @ mu, F @ S @ F.T + Q


def kalman_rank1_update(S: Tensor, e: Tensor) -> Tensor:
    """Eq. 7 (Sherman-Morrison) for one Fisher sample e (D,): (S^{-1} + e e^T)^{-1}."""
    Se = S @ e
    return S - torch.outer(Se, Se) / (1.0 + e @ Se)


class DenseKalmanFilter(FilterOptimizer):
    """Dense Gaussian filter over all parameters (Sec. 2.1, Eqs. 1-7).

    Args:
        params: parameters (or named parameters); one param group.
        transition: F = I - A, (D, D). ``None``: identity (static optimum, no drift).
        process_noise: Q, (D, D). ``None``: zero.
        prior_cov: Sigma_post(0), (D, D); step 1 predicts from it (the paper gives no initialisation; the
            stationary prior Psi = F Psi F^T + Q, which the prediction leaves unchanged, is the natural
            choice). The initial parameters are mu_prior(1).
        reduction, batch_size: loss scaling (see :mod:`._base`).

    ``step(closure=None, *, fisher=None)``: ``fisher`` is a (K, D) tensor of rank-1 Fisher samples in summed
    log-likelihood units; ``None`` uses the empirical e = g (one sample).
    """

    def __init__(self, params: Any, prior_cov: Tensor, transition: Tensor | None = None,
                 process_noise: Tensor | None = None, reduction: Reduction = "sum",
                 batch_size: int | None = None):
        super().__init__(params, {}, reduction, batch_size)
        if len(self.param_groups) != 1:
            raise ValueError("DenseKalmanFilter supports a single parameter group")
        ps = self.param_groups[0]["params"]
        D = sum(p.numel() for p in ps)
        dtype, device = ps[0].dtype, ps[0].device
        eye = torch.eye(D, dtype=dtype, device=device)
        for name, M in (("prior_cov", prior_cov), ("transition", transition), ("process_noise", process_noise)):
            if M is None:
                continue
            if not isinstance(M, Tensor) or tuple(M.shape) != (D, D):
                shape = tuple(M.shape) if isinstance(M, Tensor) else type(M).__name__
                raise ValueError(f"{name} must be a ({D}, {D}) tensor for {D} parameters, got {shape}")
            finite_tensor(name, M)
        if not torch.allclose(prior_cov, prior_cov.T) or bool(torch.linalg.eigvalsh(prior_cov).min() <= 0):
            raise ValueError("prior_cov must be symmetric positive definite")
        if process_noise is not None and (not torch.allclose(process_noise, process_noise.T)
                                          or bool(torch.linalg.eigvalsh(process_noise.double()).min() < -1e-12)):
            raise ValueError("process_noise must be symmetric positive semi-definite (a covariance)")
        self.F = eye if transition is None else transition.to(dtype)
        self.Q = torch.zeros_like(eye) if process_noise is None else process_noise.to(dtype)
        self.state[ps[0]] = {"S": prior_cov.clone().to(dtype), "mu_post": None, "step": 0}

    @property
    def _st(self) -> dict[str, Any]:
        return self.state[self.param_groups[0]["params"][0]]

    def _flat(self) -> Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.param_groups[0]["params"]])

    def _write(self, flat: Tensor) -> None:
        off = 0
        with torch.no_grad():
            for p in self.param_groups[0]["params"]:
                p.copy_(flat[off:off + p.numel()].view_as(p))
                off += p.numel()

    @property
    def covariance(self) -> Tensor:
        """Sigma_post (D, D)."""
        return self._st["S"]

    @property
    def mean(self) -> Tensor:
        """mu_post (D,); before the first step the current parameters."""
        mu = self._st["mu_post"]
        return self._flat() if mu is None else mu

    @torch.no_grad()
    def step(self, closure: Any = None, *, fisher: Tensor | None = None, batch_size: int | None = None,
             **extras: Any) -> Any:
        """One Kalman step. ``fisher``: (K, D) rank-1 Fisher samples (summed log-likelihood units) or None
        (the empirical e = g). Nothing is written unless the new mean and covariance are finite."""
        check_step_extras(type(self).__name__, extras, ("fisher", "batch_size"))
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        st = self._st
        scale = self.loss_scale.factor(batch_size)
        g = torch.cat([ascent_grad(p, scale, f"#{i}").reshape(-1)
                       for i, p in enumerate(self.param_groups[0]["params"])])
        mu_prior = self._flat()
        S = self.F @ st["S"] @ self.F.T + self.Q
        if fisher is not None:
            if not isinstance(fisher, Tensor) or fisher.dim() not in (1, 2) or fisher.shape[-1] != g.numel():
                shape = tuple(fisher.shape) if isinstance(fisher, Tensor) else type(fisher).__name__
                raise ValueError(f"fisher must be a (K, {g.numel()}) tensor of Fisher samples (one row per sample, "
                                 f"{g.numel()} parameters), got {shape}")
            finite_tensor("fisher", fisher)
        E = g[None] if fisher is None else fisher.reshape(-1, g.numel()).to(g.dtype)
        for e in E:
            S = kalman_rank1_update(S, e)
        S = 0.5 * (S + S.T)
        mu_post = mu_prior + S @ g
        check_finite(st["step"] + 1, [("the posterior covariance", S), ("the posterior mean", mu_post)],
                     "DenseKalmanFilter")
        st.update(S=S, mu_post=mu_post, step=st["step"] + 1)
        self._write(self.F @ mu_post)
        return loss

    @contextmanager
    def posterior_mean(self) -> Iterator[None]:
        mu = self._st["mu_post"]
        if mu is None:
            yield
            return
        saved = self._flat().clone()
        self._write(mu)
        try:
            yield
        finally:
            self._write(saved)

    def curvature(self) -> Any:
        """The posterior precision Sigma_post^{-1} as a DenseOperator."""
        from curvkit.linalg.operator import DenseOperator

        return DenseOperator(self._layout(), torch.linalg.inv(self.covariance))

    def effective_lr(self) -> dict[str, Tensor]:
        scale = float(self.loss_scale.default_batch()) if self.loss_scale.reduction == "mean" else 1.0
        diag = self.covariance.diagonal() * scale
        out, off = {}, 0
        for name, p, _ in self._named_params():
            out[name] = diag[off:off + p.numel()].view_as(p)
            off += p.numel()
        return out
