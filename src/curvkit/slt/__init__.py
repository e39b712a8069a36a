"""Singular learning theory diagnostics (as in Saghir et al. 2024, "NGD converges to less degenerate
solutions than SGD", arXiv:2409.04913): LLC by vectorised SGLD, WBIC, Hessian trace, effective dimension."""

from curvkit.slt.diagnostics import plot_chains, summary
from curvkit.slt.hessian import (
    TraceEstimate,
    effective_dimension,
    hessian_spectrum,
    hessian_trace,
    hessian_trace_estimate,
    operator_trace,
    thresholded_rank,
)
from curvkit.slt.llc import LLCResult, estimate_llc, estimate_llc_potential, gelman_rubin, quadratic_llc
from curvkit.slt.sampler import MinibatchStream, SGLDConfig, SGLDDivergenceError, run_sgld

__all__ = [
    "LLCResult",
    "MinibatchStream",
    "SGLDConfig",
    "SGLDDivergenceError",
    "TraceEstimate",
    "effective_dimension",
    "estimate_llc",
    "estimate_llc_potential",
    "gelman_rubin",
    "hessian_spectrum",
    "hessian_trace",
    "hessian_trace_estimate",
    "operator_trace",
    "plot_chains",
    "quadratic_llc",
    "run_sgld",
    "summary",
    "thresholded_rank",
]
