"""Hessian trace and effective dimension at a solution (NGD paper App. B; Sec. 1.1 motivates the effective
dimension).

* :func:`hessian_trace_estimate` - Tr(H) of the mean loss on a fixed data set by Hutchinson's estimator
  (paper eq. 34): Tr(H) = E[vᵀ H v], E[v vᵀ] = I, with Rademacher (default, as PyHessian and the
  authors' code) or Gaussian (the paper's text) probes. Stopping: ``tol`` = relative standard error
  (curvkit's rule), or ``protocol="pyhessian"`` - PyHessian's rule (runs of up to 50 probes that stop
  when |mean - previous mean| / (|previous mean| + 1e-6) < 1e-5, repeated 5 times, all probe values
  averaged, as in the authors' code). ``method="exact"`` gives the exact trace (small models).
* :func:`effective_dimension` - Maddox et al.'s N_eff(H, z) = Σ_i h_i / (h_i + z); with z = γ/(nβ) it
  equals 2 λ̂ for a quadratic loss sampled exactly (derived, not in the paper; see
  :func:`curvkit.slt.quadratic_llc`).
* :func:`thresholded_rank` - #{i : h_i > τ} (τ absolute, or relative to the largest eigenvalue).
* :func:`hessian_spectrum` - all eigenvalues (dense, small models) or the top k by Lanczos.

The Hessian comes from the curvature engine (:class:`curvkit.curvature.HessianOperator`).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import Tensor, nn

from curvkit.linalg.operator import CurvatureOperator
from curvkit.validation import finite_tensor, nonnegative, positive


@dataclass
class TraceEstimate:
    """A trace estimate: value, standard error of the mean over probes (NaN if exact) and #probes."""

    value: float
    stderr: float
    num_probes: int

    def to_dict(self) -> dict[str, Any]:
        return {"value": self.value, "stderr": self.stderr, "num_probes": self.num_probes}


def hessian_operator(model: nn.Module, likelihood: Any, data: Any) -> CurvatureOperator:
    from curvkit.curvature import HessianOperator

    return HessianOperator(model, likelihood, data)


def operator_trace(op: CurvatureOperator, method: Literal["hutchinson", "exact"] = "hutchinson",
                   num_probes: int = 250, tol: float | None = None,
                   distribution: Literal["rademacher", "gaussian"] = "rademacher",
                   protocol: Literal["curvkit", "pyhessian"] = "curvkit",
                   generator: torch.Generator | None = None) -> TraceEstimate:
    """Trace of any curvature operator (see module docstring for the options)."""
    if distribution not in ("rademacher", "gaussian"):
        raise ValueError(f"distribution must be 'rademacher' or 'gaussian', got {distribution!r}")
    if method == "exact":
        return TraceEstimate(float(op.trace("exact")), math.nan, 0)
    if method != "hutchinson":
        raise ValueError(f"method must be 'hutchinson' or 'exact', got {method!r}")
    from curvkit.linalg.trace import hutchinson_values, probes
    from curvkit.slt.sampler import count

    num_probes = count("num_probes", num_probes)
    if tol is not None:
        tol = positive("tol", tol)
    d = op.layout.dim
    if protocol == "curvkit":
        # per-probe values v_i^T H v_i: with ``tol`` the engine may stop early, and their count is the
        # number of probes actually used
        vals = hutchinson_values(op._matmat, d, num_probes, op.dtype, op.device, generator=generator,
                                 distribution=distribution, tol=tol).to(torch.float64)
        m = int(vals.numel())
        sem = float(vals.std(unbiased=True)) / math.sqrt(m) if m > 1 else math.nan
        return TraceEstimate(float(vals.mean()), sem, m)
    if protocol != "pyhessian":
        raise ValueError(f"protocol must be 'curvkit' or 'pyhessian', got {protocol!r}")
    values: list[float] = []
    for _ in range(5):
        run: list[float] = []
        prev = 0.0
        for _ in range(50):
            v = probes(d, 1, op.dtype, op.device, generator=generator, distribution=distribution)
            run.append(float((v * op._matmat(v)).sum()))
            mean_run = sum(run) / len(run)
            if abs(mean_run - prev) / (abs(prev) + 1e-6) < 1e-5:
                break
            prev = mean_run
        values += run
    t = torch.tensor(values, dtype=torch.float64)
    sem = float(t.std(unbiased=True)) / math.sqrt(len(values)) if len(values) > 1 else math.nan
    return TraceEstimate(float(t.mean()), sem, len(values))


def hessian_trace_estimate(model: nn.Module, likelihood: Any, data: Any, **kwargs: Any) -> TraceEstimate:
    """Tr of the Hessian of the (mean-reduced) loss of ``model`` on ``data`` with its standard error, as a
    :class:`TraceEstimate`; kwargs: see operator_trace. (:func:`curvkit.curvature.hessian_trace` returns the
    trace alone, a Tensor.)"""
    return operator_trace(hessian_operator(model, likelihood, data), **kwargs)


def hessian_trace(model: nn.Module, likelihood: Any, data: Any, **kwargs: Any) -> TraceEstimate:
    """Deprecated name of :func:`hessian_trace_estimate` (one release): ``curvkit.curvature.hessian_trace`` of
    the same name returns a Tensor, this one a :class:`TraceEstimate`."""
    warnings.warn("curvkit.slt.hessian_trace is renamed hessian_trace_estimate (it returns a TraceEstimate; "
                  "curvkit.curvature.hessian_trace returns the trace as a Tensor); the old name goes in the next "
                  "release", DeprecationWarning, stacklevel=2)
    return hessian_trace_estimate(model, likelihood, data, **kwargs)


def hessian_spectrum(op: CurvatureOperator, k: int | None = None, max_dense_dim: int = 4000) -> Tensor:
    """Eigenvalues in descending order: all of them (dense eigh) if ``k`` is None, else the top k (Lanczos)."""
    if k is not None:
        from curvkit.slt.sampler import count

        k = count("k", k)
    if k is None:
        if op.layout.dim > max_dense_dim:
            raise ValueError(f"the dense spectrum needs a {op.layout.dim}^2 matrix (> max_dense_dim="
                             f"{max_dense_dim}); pass k for the top-k Lanczos eigenvalues")
        M = op.to_dense()
        return torch.linalg.eigvalsh(0.5 * (M + M.T)).flip(0)
    return op.eigenvalues(k)


def effective_dimension(eigenvalues: Tensor, z: float) -> float:
    """N_eff(H, z) = Σ_i h_i / (h_i + z) over eigenvalues h_i > 0 (Maddox et al. 2020); z > 0 finite.
    NaN/inf eigenvalues are refused (they would otherwise be dropped or count as 1 silently)."""
    z = positive("z", z)
    h = finite_tensor("eigenvalues", eigenvalues).to(torch.float64)
    h = h[h > 0]
    return float((h / (h + z)).sum())


def thresholded_rank(eigenvalues: Tensor, threshold: float, relative: bool = True) -> int:
    """#{h_i > τ}; τ = threshold · max_i h_i when ``relative`` (default) else τ = threshold (finite, >= 0)."""
    threshold = nonnegative("threshold", threshold)
    h = finite_tensor("eigenvalues", eigenvalues).to(torch.float64)
    if h.numel() == 0:
        raise ValueError("eigenvalues is empty: pass at least one eigenvalue")
    tau = threshold * float(h.max()) if relative else threshold
    return int((h > tau).sum())
