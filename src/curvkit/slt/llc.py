"""Local learning coefficient λ̂(w*) and WBIC from SGLD draws (paper section 2.2, eq. 18-21).

Estimator (paper eq. 19, devinterp convention, digest section 2.5):

    λ̂(w*) = nβ ( E^β_{w|w*}[ L(w) ] - L(w*) ),

where the expectation is the mean over the kept SGLD draws of the minibatch loss (evaluated before
each step's update) and L(w*) is the *reference (initial) loss*, chosen by ``config.init_loss`` unless
given explicitly:

* ``"minibatch"`` (default): the mean loss at w* over the first minibatch of every chain's stream
  (``num_chains`` batches; with ``shared_batches`` the first shared batch). devinterp 2.0.1 instead
  averages its first ``num_init_loss_batches`` = 32 batches (of its shared stream).
* ``"full"``: the full-data loss L_n(w*), no estimation error.
* ``estimate_llc(..., init_loss=value)``: a number computed elsewhere, e.g. the same L(w*) for
  several runs or implementations that are to be compared (the benchmark gives every arm L_n(w*)).

L(w*) is subtracted from every chain's mean, so its estimation error is shared by all chains: it
shifts λ̂ by nβ·(error) and is *not* in the spread over chains. For the MLP of
``benchmarks/llc.py`` (nβ = 128/ln 128 = 26.4, per-example loss std 0.61 at w*) four minibatches of
128 carry an error of 0.71 in λ̂ (devinterp's 32 batches: 0.25), as large as the standard error over
four chains, which is why ``"full"`` or an explicit value is preferable when estimates are compared.

Per chain c: λ̂_c = nβ (mean_t ℓ_{c,t} - L(w*)); the estimate is the mean over chains, reported with
the standard deviation over chains (ddof = 1; devinterp's ``llc_std`` uses ddof = 0) and its standard
error std/sqrt(C).

Where devinterp 2.0.1 (``devinterp.slt.llc.llc``/``sample``) differs, beyond L(w*) above: its update,
noise and nβ are the same as here, and so is the recorded loss (the minibatch mean before each update);
but its chains share one minibatch sequence by default (``SGLDConfig(shared_batches=True)`` here),
replay the first shuffled epoch instead of reshuffling (``epoch_mode="cycle"``; same expectation),
its ``compute_llc`` averages the losses of *every* step including burn-in (here burn-in steps are
dropped; identical at ``num_burnin=0``), and its ``llc_std`` is the ddof = 0 spread.

WBIC (paper eq. 18, devinterp ``OnlineWBICEstimator``) = n · mean over all draws of the sampled loss,
n = data-set size. It is Watanabe's WBIC only when sampled at nβ = n/ln n (``nbeta="n/log n"``,
γ -> 0); the paper's numbers used nβ = m/ln m. The value of nβ is recorded in every result.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from curvkit.slt.sampler import (
    MinibatchStream,
    SGLDConfig,
    model_params,
    module_loss_fn,
    run_sgld,
    stacked_mlp_grad_fn,
)


@dataclass
class LLCResult:
    """λ̂ with its per-chain values and per-draw traces (all (C, T) tensors are float64, on CPU)."""

    llc_mean: float
    llc_std: float
    llc_per_chain: Tensor  # (C,)
    loss_trace: Tensor  # (C, T) sampled losses
    init_loss: float
    nbeta: float
    n: int
    batch_size: int
    config: SGLDConfig
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_chains(self) -> int:
        return int(self.loss_trace.shape[0])

    @property
    def llc_stderr(self) -> float:
        return self.llc_std / math.sqrt(self.num_chains) if self.num_chains > 1 else math.nan

    @property
    def llc_trace(self) -> Tensor:
        """(C, T) per-draw values nβ (ℓ_t - L(w*))."""
        return self.nbeta * (self.loss_trace - self.init_loss)

    @property
    def moving_average(self) -> Tensor:
        """(C, T) running estimate nβ (mean_{s<=t} ℓ_s - L(w*)); its last column is λ̂_c."""
        T = self.loss_trace.shape[1]
        cum = self.loss_trace.cumsum(dim=1) / torch.arange(1, T + 1, dtype=torch.float64)
        return self.nbeta * (cum - self.init_loss)

    @property
    def wbic(self) -> float:
        """n · mean sampled loss (devinterp's online WBIC), at this result's nβ."""
        return float(self.n * self.loss_trace.mean())

    @property
    def rhat(self) -> float:
        """Gelman-Rubin potential scale reduction of the loss traces (needs >= 2 chains)."""
        return gelman_rubin(self.loss_trace)

    def to_dict(self, traces: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "llc_mean": self.llc_mean, "llc_std": self.llc_std, "llc_stderr": self.llc_stderr,
            "llc_per_chain": self.llc_per_chain.tolist(), "init_loss": self.init_loss,
            "nbeta": self.nbeta, "n": self.n, "batch_size": self.batch_size, "wbic": self.wbic,
            "rhat": self.rhat, "seconds": self.seconds, "config": self.config.to_dict(), **self.extra,
        }
        if traces:
            out["loss_trace"] = self.loss_trace.tolist()
        return out


def gelman_rubin(traces: Tensor) -> float:
    """R-hat of (C, T) traces: sqrt(((T-1)/T W + B/T) / W); NaN for one chain or constant traces."""
    C, T = traces.shape
    if C < 2 or T < 2:
        return math.nan
    x = traces.to(torch.float64)
    W = x.var(dim=1, unbiased=True).mean()
    B = T * x.mean(dim=1).var(unbiased=True)
    if W <= 0:
        return math.nan
    return float(torch.sqrt(((T - 1) / T * W + B / T) / W))


def _summarise(losses: Tensor, init_loss: float, nbeta: float, n: int, m: int, cfg: SGLDConfig,
               seconds: float, extra: dict[str, Any] | None = None) -> LLCResult:
    per_chain = nbeta * (losses.mean(dim=1) - init_loss)
    std = float(per_chain.std(unbiased=True)) if per_chain.numel() > 1 else 0.0
    return LLCResult(float(per_chain.mean()), std, per_chain, losses, float(init_loss), nbeta, n, m, cfg,
                     seconds, extra or {})


Criterion = Callable[[Tensor, Tensor], Tensor]


def _criterion(loss: str | Criterion | Any) -> Criterion:
    if callable(loss) and not hasattr(loss, "nll_per_sample"):
        return loss
    if hasattr(loss, "nll_per_sample"):  # a curvkit Likelihood: use the per-sample mean
        return lambda f, y: loss.nll_per_sample(f, y).mean()
    if loss == "cross_entropy":
        return torch.nn.functional.cross_entropy
    if loss == "mse_half":
        return lambda f, y: 0.5 * ((f - y) ** 2).sum(dim=-1).mean() if f.dim() > 1 else 0.5 * ((f - y) ** 2).mean()
    raise ValueError(f"unknown loss {loss!r}; pass 'cross_entropy', 'mse_half', a Likelihood or a callable")


def estimate_llc(
    model: nn.Module,
    data: tuple[Tensor, Tensor],
    loss: str | Criterion | Any = "cross_entropy",
    batch_size: int | None = 128,
    config: SGLDConfig | None = None,
    seed: int = 0,
    generator: torch.Generator | None = None,
    init_loss: float | None = None,
    vectorise: str = "auto",
) -> LLCResult:
    """λ̂(w*) of ``model`` at its current parameters w* on ``data`` = (X (n, ...), y (n, ...)).

    ``loss`` is the *mean* per-sample loss: ``"cross_entropy"`` (default, the paper's), ``"mse_half"``
    (½||f - y||², Gaussian NLL up to a constant), a curvkit Likelihood, or a callable (f, y) -> scalar.
    ``batch_size=None`` uses full-batch gradients. The model is not modified.

    ``init_loss``: the reference loss L(w*) as a number (it overrides ``config.init_loss``; the
    sampling itself is unchanged). Use it to give several estimates the same L(w*), e.g. the
    full-data loss computed once, or devinterp's value when comparing with it.
    ``vectorise``: ``"auto"`` uses :func:`curvkit.slt.sampler.stacked_mlp_grad_fn` for plain MLPs on
    2-D inputs and ``vmap`` otherwise; ``"vmap"`` always uses ``vmap`` (same numbers up to rounding).
    """
    cfg = config or SGLDConfig()
    X, y = data
    if X.shape[0] != y.shape[0]:
        raise ValueError(f"data has {X.shape[0]} inputs but {y.shape[0]} targets")
    if vectorise not in ("auto", "vmap"):
        raise ValueError(f"vectorise must be 'auto' or 'vmap', got {vectorise!r}")
    if init_loss is not None and not math.isfinite(float(init_loss)):
        raise ValueError(f"init_loss must be a finite number (the reference loss L(w*)), got {init_loss}")
    gen = generator if generator is not None else torch.Generator().manual_seed(seed)
    crit = _criterion(loss)
    w_star = model_params(model)
    for k, v in w_star.items():
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"parameter {k!r} of the model at w* contains NaN/inf")
    stream = MinibatchStream(X, y, batch_size, cfg.num_chains, gen, shared=cfg.shared_batches)
    n, m = stream.n, stream.m
    nbeta = cfg.resolve_nbeta(m, n)
    loss_fn = module_loss_fn(model, crit)
    # L(w*): given, the full-data loss, or the mean over the first batch of every chain's stream (the
    # same batches those chains then start from; one batch when the chains share their batches).
    with torch.no_grad():
        if init_loss is not None:
            init = float(init_loss)
            first = None
        elif cfg.init_loss == "full" or stream.full:
            init = float(loss_fn(w_star, (X, y)))
            first = None
        else:
            xb, yb = next(stream)
            if stream.chain_axis is None:
                init = float(loss_fn(w_star, (xb, yb)))
            else:
                init = float(torch.stack([loss_fn(w_star, (xb[c], yb[c])) for c in range(cfg.num_chains)]).mean())
            first = (xb, yb)
    if not math.isfinite(init):
        raise ValueError(f"the loss at w* is {init}; check the model and the data")

    def batches() -> Any:
        nonlocal first
        if first is not None:
            b, first = first, None
            return b
        return next(stream)

    grad_fn = stacked_mlp_grad_fn(model, crit, stream.chain_axis) if vectorise == "auto" and X.dim() == 2 else None
    run = run_sgld(loss_fn, w_star, batches, stream.chain_axis, cfg, nbeta, gen, grad_fn=grad_fn)
    return _summarise(run.losses, init, nbeta, n, m, cfg, run.seconds)


def estimate_llc_potential(
    potential: Callable[[Tensor], Tensor],
    w_star: Tensor,
    config: SGLDConfig,
    seed: int = 0,
    n: int = 1,
) -> LLCResult:
    """λ̂ for an explicit deterministic loss L(w) of a flat parameter vector (toy singular models).

    ``config.nbeta`` must be a number here (there is no batch or data size). ``n`` only scales WBIC.
    """
    if isinstance(config.nbeta, str):
        raise ValueError("estimate_llc_potential needs a numeric nbeta (there is no data set to size it)")
    gen = torch.Generator().manual_seed(seed)
    nbeta = float(config.nbeta)

    def loss_fn(params: dict[str, Tensor], batch: Any) -> Tensor:
        return potential(params["w"])

    init = float(potential(w_star.detach()))
    run = run_sgld(loss_fn, {"w": w_star.detach()}, lambda: None, None, config, nbeta, gen)
    return _summarise(run.losses, init, nbeta, n, 0, config, run.seconds)


def quadratic_llc(eigenvalues: Tensor, nbeta: float, gamma: float, epsilon: float = 0.0) -> float:
    """λ̂ predicted for a quadratic loss ½ Σ h_i u_i² sampled exactly by SGLD (digest C1/C8):

        λ̂ = ½ Σ_i nβ h_i / (a_i (1 - ε a_i / 4)),   a_i = nβ h_i + γ,

    (ε = 0 gives the continuous-time value ½ Σ nβh_i/(nβh_i + γ) = ½ N_eff(H, γ/nβ)). Eigenvalues
    h_i <= 0 are dropped (the quadratic picture does not hold in those directions).
    """
    h = eigenvalues.to(torch.float64)
    h = h[h > 0]
    a = nbeta * h + gamma
    if epsilon > 0 and bool((epsilon * a >= 4).any()):
        raise ValueError(f"epsilon={epsilon} is beyond the SGLD stability limit 4/(nbeta*h_max + gamma)")
    return float(0.5 * (nbeta * h / (a * (1 - epsilon * a / 4))).sum())
