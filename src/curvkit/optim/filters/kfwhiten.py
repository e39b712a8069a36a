"""KFWhiten: the steady state of the Kronecker-factored filter, a whitening "Kronecker RMSProp/Adam"
(Aitchison 2018, end of Sec. 2.1.3); the math shared with KFBayes is in :mod:`curvkit.optim.filters.kronecker`."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from curvkit.optim.filters._base import Reduction, check_positive, check_unit_interval
from curvkit.optim.filters.kron_capture import DiagonalParam, LayerRecord
from curvkit.optim.filters.kron_math import (
    robust_eigh,
    whitened_gradient,
    whitening_low_rank_is_cheaper,
)
from curvkit.optim.filters.kronecker import _KroneckerBase, _store_posterior


def _damped_gains(d: Tensor, bc: float, damping: float) -> tuple[Tensor, float]:
    """Per-direction gains (d/bc + lam)^{-1/2} of one factor and lam = damping * mean(d/bc).

    ``d`` holds the second moments of the factor along its (possibly stale) eigenbasis, so mean(d/bc) is
    tr(C_hat)/dim, the mean eigenvalue of the bias-corrected covariance C_hat = C/bc. The damping is
    therefore relative to the factor's own scale, which keeps the whitened step invariant to the loss scale;
    it is floored at 1e-30 so that an all-zero factor (e.g. a layer whose ReLUs are all inactive) gives
    finite gains (its gradient is zero then)."""
    dh = d / bc
    lam = max(damping * float(dh.mean()), 1e-30)
    return (dh + lam).rsqrt(), lam


class KFWhiten(_KroneckerBase):
    """Steady-state Kronecker filter, the whitening "Kronecker RMSProp/Adam" (paper, end of Sec. 2.1.3).

    Math: the steady state of the full updates (Eqs. 23 and 25), 0 ~ eta^2 I (x) I - Sigma^x E[x x^T] Sigma^x
    (x) Sigma^delta E[delta delta^T] Sigma^delta (the paper's unnumbered equation, which drops the x and the
    expectation), gives Sigma^x = sqrt(eta) C_x^{-1/2}, Sigma^delta = sqrt(eta) C_delta^{-1/2}, so the mean
    update (6) is W_post = W_prior + eta C_delta^{-1/2} G C_x^{-1/2}, with

        C_x = EMA_beta(mean_n x_n x_n^T)  (N, N),   C_delta = EMA_beta(sum_n delta_n delta_n^T)  (M, M),

    bias-corrected (divided by 1 - beta^t), delta_n in summed-log-likelihood units and G (M, N) the ascent
    gradient of the summed log-likelihood (``-batch_size * p.grad`` for a mean loss).

    Amortised inversion (``inv_every = k``). Every k steps (and at step 1) each factor is eigendecomposed,
    C = V diag(d) V^T. In between, the basis V is kept but the second moments along it,
    d = diag(V^T C V), are updated at every step from the new samples (cost K*dim^2, like the EMA itself),
    and the update uses C ~ V diag(d) V^T. At a refresh step this is exactly C^{-1/2}. Keeping the
    *normaliser* current is what the filter requires (Sec. 2.2.5: the posterior includes the current
    sample before the step): a whitening step whose inverse roots are frozen for k steps is not scale
    invariant, since it grows linearly with any growth of the gradient since the last refresh. In a deep
    network that growth feeds back (larger steps in the top layers enlarge the backpropagated delta of the
    lower ones), which made an earlier version with frozen inverse roots diverge within a few steps at
    eta = 1e-3 on a repeated minibatch. With current d the step obeys, for every entry in the rotated basis,
        |(V_d^T (W_post - W_prior) V_x)_ij| <= eta sqrt(K) (1 - beta^t) / (1 - beta)
    for empirical Fisher samples (K = rows of the minibatch), whatever the gradient scale (Cauchy-Schwarz;
    the current samples enter C with weight (1 - beta)/(1 - beta^t)). The bound holds for any orthonormal
    basis; note that inside a degenerate eigenspace of C at a refresh (typically the null space of a
    rank-deficient C early on) the kept basis is arbitrary, so the gains there depend on it, and a
    rounding-level change of C can change later steps by more than rounding.

    The eigendecompositions go through :func:`curvkit.linalg.kron.psd_eigh`: LAPACK's float32 ``eigh`` can fail to
    converge on the many repeated zero eigenvalues of a rank-deficient factor (it did after ~240 steps on a
    repeated batch of the 784-512-512-10 MLP); the fallbacks are float64, a tiny jitter, the kept basis.

    Damping (not in the paper; the choice made here): each factor gets lam = ``damping`` * tr(C_hat)/dim added
    to its eigenvalues, i.e. relative to its own mean eigenvalue, so the update stays invariant to the loss
    scale. Directions the statistics have not seen (a rank-deficient single-batch C at step 1) get the gain
    of lam, which is at most sqrt(1/damping) times the typical gain.

    Args:
        params: the parameters to optimise (default: all of ``model``'s trainable ones; frozen ones are
            left out).
        model: the network (required); its ``nn.Linear`` and groups=1 ``nn.Conv1d/2d/3d`` layers (convolutions: the
            KFC-style patch statistics, x = unfolded patches, delta per position) get the Kronecker form, every
            other trainable parameter the diagonal form (:mod:`curvkit.optim.filters.kronecker`).
        lr: eta (the Adam/RMSProp learning rate of the steady state).
        beta: EMA factor of the covariances (bias-corrected).
        damping: relative Tikhonov damping (see above).
        inv_every: eigendecomposition period k.
        eta_p: momentum (0 = none): M_p <- (1 - eta_p) M_p + eta_p U, W <- W + eta M_p. An extrapolation by
            analogy with :class:`~.momentum.BFAdamSS` (Eqs. 18-21); the paper does not derive it.
        sigma2: prior variance; the parameters decay by 1 - eta^2/(2 sigma^2) per step (inf: none).
    """

    def __init__(self, params: Any = None, *, model: nn.Module | None = None, lr: float = 1e-3, beta: float = 0.99,
                 damping: float = 1e-3, inv_every: int = 20, eta_p: float = 0.0, sigma2: float = math.inf,
                 reduction: Reduction = "mean", batch_size: int | None = None, distributed: Any = None):
        check_positive("lr", lr)
        check_unit_interval("beta", beta)
        check_positive("damping", damping)
        check_positive("sigma2", sigma2, allow_inf=True)
        check_unit_interval("eta_p", eta_p, closed_left=True)
        if int(inv_every) != inv_every or inv_every < 1:
            raise ValueError(f"inv_every must be a positive integer, got {inv_every!r}")
        defaults = {"lr": float(lr), "beta": beta, "damping": damping, "inv_every": int(inv_every),
                    "eta_p": eta_p, "sigma2": float(sigma2)}
        super().__init__(params, model, defaults, reduction, batch_size, distributed)

    def _decay(self) -> float:
        g = self._group()
        return 1.0 if math.isinf(g["sigma2"]) else 1.0 - g["lr"] ** 2 / (2.0 * g["sigma2"])

    def _update_statistics(self, st: dict[str, Any], X: Tensor, D: Tensor) -> tuple[Tensor, Tensor] | None:
        """EMA of the factors, then either a fresh eigendecomposition (returns None) or the per-step update
        of d along the kept basis (returns the rotated samples (D V_d, X V_x) for reuse)."""
        grp = self._group()
        beta, K = grp["beta"], X.shape[0]
        st["Cx"].mul_(beta).addmm_(X.T, X, alpha=(1 - beta) / K)
        st["Cd"].mul_(beta).addmm_(D.T, D, alpha=1 - beta)
        if (st["step"] - 1) % grp["inv_every"] == 0:
            for C, d, V in (("Cx", "dx", "Vx"), ("Cd", "dd", "Vd")):
                st[d], st[V] = robust_eigh(st[C], st.get(V))
            return None
        XV, DV = X @ st["Vx"], D @ st["Vd"]
        st["dx"].mul_(beta).add_(XV.square().sum(0), alpha=(1 - beta) / K)
        st["dd"].mul_(beta).add_(DV.square().sum(0), alpha=1 - beta)
        return DV, XV

    def _gains(self, st: dict[str, Any]) -> tuple[Tensor, float, Tensor, float]:
        grp = self._group()
        bc = 1.0 - grp["beta"] ** st["step"]
        sx, lx = _damped_gains(st["dx"], bc, grp["damping"])
        sd, ld = _damped_gains(st["dd"], bc, grp["damping"])
        return sx, lx, sd, ld

    @torch.no_grad()
    def step(self, closure: Any = None, *, fisher_samples: dict[str, Any] | None = None,
             batch_size: int | None = None, **extras: Any) -> Any:
        loss, scale = self._begin_step(closure, fisher_samples, batch_size, extras)
        grp = self._group()
        check_positive("lr", grp["lr"])
        union = None
        if self.distributed is not None:
            from curvkit.optim.filters._distributed import whiten_inputs, whiten_statistics

            union = whiten_inputs(self, scale, fisher_samples)
        for rec in self.layers:
            st = self.state[rec.weight]
            G = rec.weight_matrix_grad().mul(-scale) if union is None else union[rec.name]["G"]
            X, D = self._samples(rec, scale, fisher_samples, None)
            X, D = X.to(G.dtype), D.to(G.dtype)
            if not st:
                st["Cx"] = torch.zeros(rec.in_dim, rec.in_dim, dtype=G.dtype, device=G.device)
                st["Cd"] = torch.zeros(rec.out_dim, rec.out_dim, dtype=G.dtype, device=G.device)
                st["step"] = 0
                if grp["eta_p"] > 0:
                    st["mu_p"] = torch.zeros_like(G)
            st["step"] += 1
            rotated = None
            if union is None:
                rotated = self._update_statistics(st, X, D)
            else:
                whiten_statistics(self, rec, st, union[rec.name])
            sx, _, sd, _ = self._gains(st)
            factors = self._grad_factors(rec, scale, G.dtype) if union is None else None
            own = fisher_samples is None or rec.name not in fisher_samples   # then D = -D_ascent
            reuse = (-rotated[0], rotated[1]) if rotated is not None and own else None
            if factors is not None and whitening_low_rank_is_cheaper(factors[0].shape[0], rec.out_dim, rec.in_dim,
                                                                     reuse is not None):
                U = whitened_gradient(G, st["Vd"], sd, st["Vx"], sx, factors, reuse)
            else:
                U = whitened_gradient(G, st["Vd"], sd, st["Vx"], sx)
            W = rec.weight_matrix()
            if grp["eta_p"] > 0:
                st["mu_p"].mul_(1 - grp["eta_p"]).add_(U, alpha=grp["eta_p"])
                W_post = W
                W_next = W_post * self._decay() + grp["lr"] * st["mu_p"]
            else:
                W_post = W.add_(U, alpha=grp["lr"])
                W_next = W_post if self._decay() == 1.0 else W_post * self._decay()
            _store_posterior(st, W_post, W_next)
            rec.write_matrix(W_next)
        self._diagonal_step(scale)
        self._clear()
        return loss

    def _diag_gains(self, st: dict[str, Any]) -> tuple[Tensor, Tensor, float]:
        """(v_hat, the gains (v_hat + lam)^{-1/2}, lam) of a diagonal parameter, lam = ``damping`` mean(v_hat)
        as for a factor."""
        grp = self._group()
        bc = 1.0 - grp["beta"] ** st["step"]
        gains, lam = _damped_gains(st["v"], bc, grp["damping"])
        return st["v"] / bc, gains, lam

    def _diag_update(self, d: DiagonalParam, st: dict[str, Any], g: Tensor) -> tuple[Tensor, Tensor]:
        """The diagonal steady state of the same filter (:class:`~.factorised.BFRMSPropSS`'s fixed point with
        the factors' relative damping): v = EMA_beta(g^2) (bias-corrected v_hat, the Fisher sample e = g, the
        minibatch's ascent gradient in summed units), U = g / sqrt(v_hat + lam), then the update, momentum and
        decay of the Kronecker layers with U."""
        grp = self._group()
        if not st:
            st["v"] = torch.zeros_like(g)
            st["step"] = 0
            if grp["eta_p"] > 0:
                st["mu_p"] = torch.zeros_like(g)
        st["step"] += 1
        st["v"].mul_(grp["beta"]).addcmul_(g, g, value=1 - grp["beta"])
        U = g * self._diag_gains(st)[1]
        W = d.param.detach().clone()
        if grp["eta_p"] > 0:
            st["mu_p"].mul_(1 - grp["eta_p"]).add_(U, alpha=grp["eta_p"])
            return W, W * self._decay() + grp["lr"] * st["mu_p"]
        W_post = W.add_(U, alpha=grp["lr"])
        return W_post, (W_post if self._decay() == 1.0 else W_post * self._decay())

    def _diag_variance(self, st: dict[str, Any]) -> Tensor:
        """eta (v_hat + lam)^{-1/2}, as eta C^{-1/2} of the Kronecker layers."""
        return self._diag_gains(st)[1] * self._group()["lr"]

    def _diag_regime(self, st: dict[str, Any], s: Tensor) -> tuple[float, float]:
        """As :meth:`_regime` for one factor: sqrt(lam) gain and sqrt(v_hat) gain, medians."""
        v_hat, gains, lam = self._diag_gains(st)
        return float((gains * math.sqrt(lam)).median()), float((gains * v_hat.sqrt()).median())

    def _state(self, rec: LayerRecord) -> dict[str, Any]:
        st = self.state.get(rec.weight)
        if not st:
            raise RuntimeError("the optimiser has no posterior yet: call step() first")
        return st

    def _precision_blocks(self) -> list[tuple[LayerRecord, Tensor, Tensor]]:
        """Precision (Sigma^x (x) Sigma^delta)^{-1} = eta^{-1} C_x^{1/2} (x) C_delta^{1/2}, split evenly."""
        out = []
        r = 1.0 / math.sqrt(self._group()["lr"])
        for rec in self.layers:
            st = self._state(rec)
            sx, _, sd, _ = self._gains(st)
            Rx = (st["Vx"] / sx) @ st["Vx"].T
            Rd = (st["Vd"] / sd) @ st["Vd"].T
            out.append((rec, 0.5 * (Rd + Rd.T) * r, 0.5 * (Rx + Rx.T) * r))
        return out

    def _cov_diagonals(self, rec: LayerRecord) -> tuple[Tensor, Tensor]:
        st = self._state(rec)
        sx, _, sd, _ = self._gains(st)
        r = math.sqrt(self._group()["lr"])
        return st["Vd"].square() @ sd * r, st["Vx"].square() @ sx * r

    def _regime(self, rec: LayerRecord, s: Tensor) -> tuple[float, float]:
        """Per eigen-direction pair (i, j) the gain is eta ((d_i + lam_d)(d_j + lam_x))^{-1/2}: SGD-like
        (a constant gain eta/sqrt(lam_d lam_x), the damping acting as the prior) when the damping dominates,
        Adam-like (eta/sqrt(d_i d_j), whitening) when the curvature does. ``sgd_like`` = gain/(SGD gain),
        ``adam_like`` = gain * sqrt(d_i d_j)/eta, both medians over all M N pairs."""
        st = self._state(rec)
        bc = 1.0 - self._group()["beta"] ** st["step"]
        sx, lx, sd, ld = self._gains(st)
        sgd = torch.outer(sd * math.sqrt(ld), sx * math.sqrt(lx))
        adam = torch.outer(sd * (st["dd"] / bc).sqrt(), sx * (st["dx"] / bc).sqrt())
        return float(sgd.median()), float(adam.median())
