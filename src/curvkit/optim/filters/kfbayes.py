"""KFBayes and KFNatGrad: the Kronecker-factored Bayesian filter with weight drift and its static-weight case
(Aitchison 2018, Eqs. 22-28); the math, the Fisher samples and the models are in
:mod:`curvkit.optim.filters.kronecker`, which holds the bookkeeping shared with :mod:`.kfwhiten`."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn

from curvkit.optim.filters._base import Reduction, check_positive
from curvkit.optim.filters.kron_capture import DiagonalParam, LayerRecord
from curvkit.optim.filters.kron_math import (
    apply_root,
    first_order_coefficients,
    gradient_residual,
    kl_project,
    kron_sandwich,
    mean_inverse_diagonal,
    project_first_order_rows,
    rebalance,
    rows_after_update,
    rows_kron_vec,
    sandwich_costs,
    symmetrise,
)
from curvkit.optim.filters.kronecker import _KroneckerBase


class KFBayes(_KroneckerBase):
    """Kronecker-factored filter with weight drift (Eqs. 25-28). ``lr`` = eta; eta = 0 gives
    :class:`KFNatGrad`.

    Args:
        params: the parameters to optimise (default: all of ``model``'s trainable ones): the weights and
            biases of its ``nn.Linear`` and groups=1 convolution layers (and a tied head and embedding) get the
            Kronecker posterior, every other one the diagonal form (module docstring). Frozen parameters
            (``requires_grad=False``) are left out: a frozen layer gets no block and never changes.
        model: the network (required: the filter reads its layer structure and captures each layer's
            input and output gradient with hooks, removed by ``close()``).
        lr: eta, the per-step diffusion sd of the optimum.
        sigma2: stationary prior variance (inf: no weight decay).
        s0: initial posterior variance per weight; Sigma^x = Sigma^delta = sqrt(s0) I (the paper gives no
            initialisation; this is the choice made here);
            default ``lr_sgd / batch_size``.
        fisher_samples: examples per step used for the covariance update (None: all); see module doc.
        sample_update: 'sequential' (Eq. 24 per sample, paper) or 'batched' (summed first-order increments).
        projection: 'first_order' (Eqs. 24, 28) or 'exact' (dense + KL flip-flop; tiny layers).
        inv_every: refresh period of Lambda_x, Lambda_delta in Eq. 28.
    """

    def __init__(self, params: Any = None, *, model: nn.Module | None = None, lr: float = 1e-3,
                 sigma2: float = math.inf, s0: float | None = None, lr_sgd: float = 0.1,
                 fisher_samples: int | None = 8, sample_update: str = "sequential", projection: str = "first_order",
                 inv_every: int = 10, reduction: Reduction = "mean", batch_size: int | None = None,
                 distributed: Any = None):
        check_positive("lr", lr, allow_zero=True)
        check_positive("sigma2", sigma2, allow_inf=True)
        check_positive("lr_sgd", lr_sgd)
        if s0 is not None:
            check_positive("s0", s0)
        if fisher_samples is not None and (int(fisher_samples) != fisher_samples or fisher_samples < 1):
            raise ValueError(f"fisher_samples must be a positive integer or None, got {fisher_samples!r}")
        if sample_update not in ("sequential", "batched"):
            raise ValueError(f"sample_update must be 'sequential' or 'batched', got {sample_update!r}")
        if projection not in ("first_order", "exact"):
            raise ValueError(f"projection must be 'first_order' or 'exact', got {projection!r}")
        if int(inv_every) != inv_every or inv_every < 1:
            raise ValueError(f"inv_every must be a positive integer, got {inv_every!r}")
        s_init = s0 if s0 is not None else lr_sgd / (batch_size or 1)
        defaults = {"lr": float(lr), "sigma2": float(sigma2), "s0": float(s_init), "fisher_samples": fisher_samples,
                    "sample_update": sample_update, "projection": projection, "inv_every": int(inv_every)}
        super().__init__(params, model, defaults, reduction, batch_size, distributed)
        if projection == "exact":
            for rec in self.layers:
                if rec.in_dim * rec.out_dim > 4096:
                    raise ValueError(f"projection='exact' forms dense covariances; layer {rec.name!r} has "
                                     f"{rec.in_dim * rec.out_dim} weights (limit 4096)")

    def _decay(self) -> float:
        g = self._group()
        return 1.0 if math.isinf(g["sigma2"]) else 1.0 - g["lr"] ** 2 / (2.0 * g["sigma2"])

    def _init(self, rec: LayerRecord) -> dict[str, Any]:
        st = self.state[rec.weight]
        if not st:
            r = math.sqrt(self._group()["s0"])
            dt, dev = rec.weight.dtype, rec.weight.device
            st["Sx"] = torch.eye(rec.in_dim, dtype=dt, device=dev) * r
            st["Sd"] = torch.eye(rec.out_dim, dtype=dt, device=dev) * r
            st["step"] = 0
        return st

    def _drift(self, st: dict[str, Any]) -> tuple[float, Tensor | float, Tensor | float]:
        """Coefficients (c, ex, ed) of the prior step (Eq. 28, :func:`~.kron_math.drift_project`):
        Sx_prior = c Sx + ex I, Sd_prior = c Sd + ed I, with c = decay - eta^2 Lx Ld / 2, ex = eta^2 Ld,
        ed = eta^2 Lx; Lambda_x = tr(Sx^{-1})/N, Lambda_delta = tr(Sd^{-1})/M refreshed every ``inv_every``
        steps (the paper finds inverting the factors "not desirable" and leaves the approximation open; the
        periodic refresh is the choice made here). (1, 0, 0) without drift (KFNatGrad)."""
        grp = self._group()
        eta = grp["lr"]
        if eta == 0 and math.isinf(grp["sigma2"]):
            return 1.0, 0.0, 0.0
        if st["step"] % grp["inv_every"] == 0 or "lam_x" not in st:
            st["lam_x"] = mean_inverse_diagonal(st["Sx"])
            st["lam_d"] = mean_inverse_diagonal(st["Sd"])
        e2 = eta * eta
        cf = self._decay() - 0.5 * e2 * float(st["lam_x"]) * float(st["lam_d"])
        return cf, e2 * st["lam_d"], e2 * st["lam_x"]

    def _exact_step(self, st: dict[str, Any], E: Tensor) -> None:
        """The dense Kalman step with the Fisher samples e_k (rows of E (K, N M), column-stacking), sample after
        sample, then the exact KL projection onto Kronecker form."""
        grp = self._group()
        Sx, Sd = st["Sx"], st["Sd"]
        N, M = Sx.shape[0], Sd.shape[0]
        S = torch.kron(Sx, Sd)
        if grp["lr"] > 0 or math.isfinite(grp["sigma2"]):
            S = self._decay() ** 2 * S + grp["lr"] ** 2 * torch.eye(N * M, dtype=S.dtype, device=S.device)
        for e in E:
            Se = S @ e
            S = S - torch.outer(Se, Se) / (1.0 + e @ Se)
        st["Sx"], st["Sd"] = kl_project(0.5 * (S + S.T), N, M, init=(Sx, Sd))

    def _first_order_step(self, rec: LayerRecord, st: dict[str, Any], X: Tensor, D: Tensor, scale: float,
                          own: bool) -> Tensor:
        """Prior step (Eq. 28), data step (corrected Eq. 24 for the K Fisher samples, sequential or batched),
        rebalance (the common scale of the two factors is arbitrary and the paper leaves its split open; it
        is moved so that tr(Sigma^x)/N = tr(Sigma^delta)/M), and the mean increment Sigma^delta G Sigma^x
        with the updated factors.
        Updates ``st`` and returns the increment (M, N).

        Work-saving forms, all equal (up to rounding) to drift_project, the per-sample loop of
        :func:`~.kron_math.project_first_order` (or :func:`~.kron_math.project_first_order_batched`),
        rebalance and Sd' G Sx' (G = the ascent gradient of the summed log-likelihood):

        * the prior factors S0 = c S + e I are never formed: U0 = X S0 = c X S + e X;
        * the K updates act in the span of the samples (:func:`~.kron_math.first_order_coefficients`):
          Sx' = alpha S0x - W^T W with W = R U0 (K, N); with the rebalancing scale r (computed from traces,
          tr(W^T W) = ||W||_F^2) the new factor is a single product r alpha c Sx - r W^T W (+ diagonal), one pass
          over the N x N matrix instead of K (sequential) or several;
        * the mean increment goes through the gradient's per-example factors G = Dg^T Xg (B rows) when that is
          cheaper (:func:`~.kron_math.sandwich_costs`): Xg Sx' = alpha Xg S0x - (Xg W^T) W reuses Y = Xg S0x,
          whose first K rows are U0 when the Fisher samples are the minibatch's own (X = Xg[:K],
          D = -sqrt(B/K) Dg[:K]); r cancels in Sd' G Sx'. A part of G the factors do not explain (an L2 term)
          is added by the direct route. The large temporaries (Y, Z, the increment) live in reused buffers, so
          the returned increment is only valid until the next step.
        """
        grp = self._group()
        Sx, Sd = st["Sx"], st["Sd"]
        N, M = Sx.shape[0], Sd.shape[0]
        K = X.shape[0]
        cf, ex, ed = self._drift(st)
        low = None
        if self.distributed is None and rec.a is not None and rec.delta is not None and not rec.uses:
            B = rec.a.shape[0]
            shared = own and K <= B
            c_low, c_dense = sandwich_costs(B, K, M, N, shared)
            if c_low < c_dense:   # the per-example factors (B rows) are needed only on this route
                factors = self._grad_factors(rec, scale, X.dtype)
                assert factors is not None
                Dg, Xg = factors
                Y = torch.mm(Xg, Sx, out=self._buffer(rec, "Y", (B, N), Xg))
                Z = torch.mm(Dg, Sd, out=self._buffer(rec, "Z", (B, M), Dg))
                low = (Dg, Xg, self._prior_rows(Y, Xg, cf, ex), self._prior_rows(Z, Dg, cf, ed))
        if low is not None and shared:
            U0, V0 = low[2][:K], low[3][:K] * (-math.sqrt(B / K) if K < B else -1.0)
        else:
            U0, V0 = self._prior_rows(X @ Sx, X, cf, ex), self._prior_rows(D @ Sd, D, cf, ed)
        if grp["sample_update"] == "sequential":
            up = first_order_coefficients(U0 @ X.T, V0 @ D.T, N, M, True)
        else:   # only the Gram diagonals x_j^T Sx x_j are needed
            up = first_order_coefficients((U0 * X).sum(1), (V0 * D).sum(1), N, M, False)
        Wx, Wd = apply_root(up.Rx, U0), apply_root(up.Rd, V0)
        # mean diagonals of Sx' = alpha S0x - W^T diag(s) W (before rebalancing) -> rebalancing scale r
        mx = up.alpha * (cf * torch.diagonal(Sx).mean() + ex) - (Wx.square().sum(1) * up.sx).sum() / N
        md = up.alpha * (cf * torch.diagonal(Sd).mean() + ed) - (Wd.square().sum(1) * up.sd).sum() / M
        r = float(torch.sqrt(md / mx))
        refresh = st["step"] % grp["inv_every"] == 0   # remove any rounding asymmetry now and then
        st["Sx"] = self._new_factor(Sx, Wx, up.sx, up.alpha, cf, ex, r, refresh)
        st["Sd"] = self._new_factor(Sd, Wd, up.sd, up.alpha, cf, ed, 1.0 / r, refresh)
        if low is None and self.distributed is not None:   # the union's ascent gradient
            return st["Sd"] @ self._union[rec.name][2] @ st["Sx"]
        if low is None:   # dense route: -scale Sd' [dW | db] Sx', the gradient gathered into a reused buffer
            G = rec.weight_matrix_grad(out=self._buffer(rec, "G", (M, N), Sx))
            return torch.mm(st["Sd"] @ G, st["Sx"], out=self._buffer(rec, "inc", (M, N), G)).mul_(-scale)
        Dg, Xg, Y, Z = low
        Zn, Yn = rows_after_update(Z, Dg, Wd, up.alpha, up.sd), rows_after_update(Y, Xg, Wx, up.alpha, up.sx)
        inc = torch.mm(Zn.T, Yn, out=self._buffer(rec, "inc", (M, N), Yn))
        assert rec.delta is not None
        res = gradient_residual(rec.grad_parts(), rec.delta.to(X.dtype), Xg)   # unscaled: G = -scale dW_hat
        return inc if res is None else inc.add_(st["Sd"] @ res.mul_(-scale) @ st["Sx"])

    def _rows_step(self, st: dict[str, Any], L: Tensor, R: Tensor) -> None:
        """Prior step (Eq. 28), the data step for per-example gradients of any rank E_n = L_n^T R_n
        (:func:`~.kron_math.project_first_order_rows`: the corrected Eq. 24 generalised, sequential or batched)
        and the rebalancing, as :meth:`_first_order_step` does for rank-one samples; the factors are updated in
        place."""
        cf, ex, ed = self._drift(st)
        Sx0, Sd0 = st["Sx"] * cf, st["Sd"] * cf
        Sx0.diagonal().add_(float(ex))
        Sd0.diagonal().add_(float(ed))
        Sx, Sd = rebalance(*project_first_order_rows(Sx0, Sd0, L, R, self._group()["sample_update"] == "sequential"))
        st["Sx"].copy_(Sx)
        st["Sd"].copy_(Sd)

    @staticmethod
    def _prior_rows(RS: Tensor, R: Tensor, cf: float, e: Tensor | float) -> Tensor:
        """R S0 = cf (R S) + e R for the prior factor S0 = cf S + e I, given RS = R S (updated in place)."""
        if cf != 1.0:
            RS = RS.mul_(cf)
        return RS.add_(R, alpha=float(e)) if float(e) != 0.0 else RS

    @staticmethod
    def _new_factor(S: Tensor, W: Tensor, sign: Tensor, alpha: float, cf: float, e: Tensor | float, r: float,
                    symmetrise_now: bool) -> Tensor:
        """r (alpha (cf S + e I) - W^T diag(sign) W) in one product (plus a diagonal update), in place in S
        (like the moment buffers of torch.optim.Adam; ``factors()`` returns the live tensors)."""
        Wl = W if bool((sign > 0).all()) else W * sign[:, None]
        out = S.addmm_(Wl.T, W, beta=r * alpha * cf, alpha=-r)
        if float(e) != 0.0:
            out.diagonal().add_(r * alpha * float(e))
        if symmetrise_now or Wl is not W:
            out = symmetrise(out)
        return out

    @torch.no_grad()
    def step(self, closure: Any = None, *, fisher_samples: dict[str, Any] | None = None,
             batch_size: int | None = None, **extras: Any) -> Any:
        loss, scale = self._begin_step(closure, fisher_samples, batch_size, extras)
        grp = self._group()
        decay = self._decay()
        if self.distributed is not None:
            from curvkit.optim.filters._distributed import bayes_inputs

            self._union = bayes_inputs(self, scale, fisher_samples, grp["fisher_samples"])
        for rec in self.layers:
            st = self._init(rec)
            dtype = rec.weight.dtype
            if rec.positions > 1 and (fisher_samples is None or rec.name not in fisher_samples):
                inc = self._positions_step(rec, st, scale, dtype)
                self._finish(rec, st, inc, decay)
                continue
            if self.distributed is None:
                X, D = self._samples(rec, scale, fisher_samples, grp["fisher_samples"])
            else:
                X, D = self._union[rec.name][:2]
            X, D = X.to(dtype), D.to(dtype)
            if grp["projection"] == "exact":
                self._exact_step(st, rows_kron_vec(D[:, None], X[:, None]))
                if self.distributed is None:
                    G = rec.weight_matrix_grad().mul(-scale)
                    inc = kron_sandwich(st["Sd"], G, st["Sx"], self._grad_factors(rec, scale, dtype))
                else:
                    inc = kron_sandwich(st["Sd"], self._union[rec.name][2], st["Sx"], None)
            else:
                own = fisher_samples is None or rec.name not in fisher_samples
                inc = self._first_order_step(rec, st, X, D, scale, own)
            self._finish(rec, st, inc, decay)
        self._diagonal_step(scale)
        self._clear()
        return loss

    def _positions_step(self, rec: LayerRecord, st: dict[str, Any], scale: float, dtype: torch.dtype) -> Tensor:
        """A layer with T > 1 rows per example (a Linear layer shared over positions, a convolution's output
        locations, a tied weight's stacked uses): its per-example gradient E_n = L_n^T R_n has rank up to T, the data step is
        :meth:`_rows_step` (or, ``projection='exact'``, the dense Kalman step with e_n = vec(E_n)); returns the
        mean increment Sigma^delta G Sigma^x with the updated factors."""
        grp = self._group()
        if self.distributed is None:
            L, R = self._example_rows(rec, scale, grp["fisher_samples"])
        else:   # the union's first examples' rows (curvkit.optim.filters._distributed.bayes_inputs)
            X, D, G = self._union[rec.name]
            L, R = D.reshape(-1, rec.positions, D.shape[1]), X.reshape(-1, rec.positions, X.shape[1])
        L, R = L.to(dtype), R.to(dtype)
        if grp["projection"] == "exact":
            self._exact_step(st, rows_kron_vec(L, R))
        else:
            self._rows_step(st, L, R)
        if self.distributed is not None:
            return st["Sd"] @ G @ st["Sx"]
        G = rec.weight_matrix_grad().mul(-scale)
        return kron_sandwich(st["Sd"], G, st["Sx"], self._grad_factors(rec, scale, dtype))

    def _finish(self, rec: LayerRecord, st: dict[str, Any], inc: Tensor, decay: float) -> None:
        """Count the step and write the posterior mean W + inc (its decayed copy as the next prior mean)."""
        st["step"] += 1
        if decay == 1.0:   # the posterior mean is the next prior mean: update the parameters in place
            st.pop("mu_post", None)
            rec.add_to_matrix(inc)
        else:
            W_post = rec.weight_matrix().add_(inc)
            st["mu_post"] = W_post
            rec.write_matrix(W_post * decay)

    def _diag_update(self, d: DiagonalParam, st: dict[str, Any], g: Tensor) -> tuple[Tensor, Tensor]:
        """The factorised filter of the same equations (paper Eqs. 8-12; :class:`~.factorised.BFRMSProp`
        with ``drift='paper'``, :class:`~.factorised.BFNatGrad` when eta = 0): s_prior = decay^2 s + eta^2,
        s <- 1 / (1/s_prior + g^2), W_post = W + s g, next prior mean decay W_post, with s_0 = ``s0`` (the
        Kronecker layers' initial per-weight variance) and the Fisher sample e = g, the minibatch's ascent
        gradient in summed units (the factorised filters' ``curvature='empirical'``)."""
        grp = self._group()
        if not st:
            st["s"] = torch.full_like(g, grp["s0"])
            st["step"] = 0
        decay = self._decay()
        s = st["s"]
        if grp["lr"] > 0 or decay != 1.0:
            s.mul_(decay * decay).add_(grp["lr"] ** 2)
        s.reciprocal_().add_(g * g).reciprocal_()
        st["step"] += 1
        W_post = d.param.detach() + s * g
        return W_post, (W_post if decay == 1.0 else W_post * decay)

    def _diag_variance(self, st: dict[str, Any]) -> Tensor:
        return st["s"]  # type: ignore[no-any-return]

    def _diag_regime(self, st: dict[str, Any], s: Tensor) -> tuple[float, float]:
        return self._regime(None, s)  # type: ignore[arg-type]

    def factors(self) -> dict[str, tuple[Tensor, Tensor]]:
        """Posterior covariance factors per layer: {name: (Sigma^x (N, N), Sigma^delta (M, M))} (the live state
        tensors, updated in place by later steps: clone them to keep a snapshot)."""
        return {rec.name: (self.state[rec.weight]["Sx"], self.state[rec.weight]["Sd"])
                for rec in self.layers if self.state.get(rec.weight)}

    def _precision_blocks(self) -> list[tuple[LayerRecord, Tensor, Tensor]]:
        out = []
        for rec in self.layers:
            st = self.state.get(rec.weight)
            if not st:
                raise RuntimeError("the optimiser has no posterior yet: call step() first")
            out.append((rec, torch.linalg.inv(st["Sd"]), torch.linalg.inv(st["Sx"])))
        return out

    def _cov_diagonals(self, rec: LayerRecord) -> tuple[Tensor, Tensor]:
        st = self.state.get(rec.weight)
        if not st:
            raise RuntimeError("the optimiser has no posterior yet: call step() first")
        return torch.diagonal(st["Sd"]), torch.diagonal(st["Sx"])

    def _regime(self, rec: LayerRecord, s: Tensor) -> tuple[float, float]:
        """As the factorised filters without a running v: ``sgd_like`` = s/cap (cap = sigma^2, or s0 when
        sigma^2 = inf), clipped to 1, and ``adam_like`` = sqrt(1 - sgd_like) from the steady-state identity
        v s^2 = eta^2 (1 - s/sigma^2); 0 when eta = 0 (KFNatGrad has no steady state, its s decays like
        1/t)."""
        grp = self._group()
        cap = grp["sigma2"] if math.isfinite(grp["sigma2"]) else grp["s0"]
        sgd = (s / cap).clamp(max=1.0)
        adam = (1 - sgd).sqrt() if grp["lr"] > 0 else torch.zeros_like(sgd)
        return float(sgd.median()), float(adam.median())


class KFNatGrad(KFBayes):
    """Kronecker-factored natural gradient with static weights (Eqs. 22-24): :class:`KFBayes` with eta = 0."""

    def __init__(self, params: Any = None, *, model: nn.Module | None = None, s0: float | None = None,
                 lr_sgd: float = 0.1, fisher_samples: int | None = 8, sample_update: str = "sequential",
                 projection: str = "first_order", reduction: Reduction = "mean", batch_size: int | None = None,
                 distributed: Any = None):
        super().__init__(params, model=model, lr=0.0, sigma2=math.inf, s0=s0, lr_sgd=lr_sgd, fisher_samples=fisher_samples,
                         sample_update=sample_update, projection=projection, reduction=reduction,
                         batch_size=batch_size, distributed=distributed)
