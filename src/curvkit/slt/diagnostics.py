"""Convergence diagnostics for SGLD chains: a per-chain trace plot (loss and running λ̂) and a summary."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from curvkit.slt.llc import LLCResult


def plot_chains(result: LLCResult, path: str | Path, title: str = "") -> Path:
    """Save a two-panel figure: per-draw sampled loss of every chain (left) and each chain's running
    estimate nβ(mean_{s<=t} ℓ_s - L(w*)) with the final mean ± std over chains (right)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(10, 3.6))
    T = result.loss_trace.shape[1]
    for c in range(result.num_chains):
        ax0.plot(range(T), result.loss_trace[c].numpy(), lw=0.7, label=f"chain {c}")
        ax1.plot(range(T), result.moving_average[c].numpy(), lw=1.0)
    ax0.axhline(result.init_loss, color="k", ls="--", lw=0.8, label="L(w*)")
    ax0.set_xlabel("draw")
    ax0.set_ylabel("sampled loss")
    ax0.legend(fontsize=7)
    ax1.axhline(result.llc_mean, color="k", ls="--", lw=0.8)
    if math.isfinite(result.llc_std):  # undefined (NaN) for one chain: no band
        ax1.axhspan(result.llc_mean - result.llc_std, result.llc_mean + result.llc_std, color="0.85")
    ax1.set_xlabel("draw")
    ax1.set_ylabel("running λ̂")
    cfg = result.config
    spread = f" ± {result.llc_std:.2f}" if math.isfinite(result.llc_std) else " (1 chain: no spread)"
    rhat = f"{result.rhat:.3f}" if math.isfinite(result.rhat) else "undefined"
    fig.suptitle(title or f"λ̂ = {result.llc_mean:.2f}{spread} (ε={cfg.epsilon:g}, γ={cfg.gamma:g}, "
                 f"nβ={result.nbeta:.3g}, R-hat={rhat})", fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def summary(result: LLCResult) -> dict[str, Any]:
    """Short convergence summary: R-hat of the loss traces and the drift of the running λ̂ over the last half.

    Undefined values are NaN, never 0: R-hat and ``llc_std`` for one chain, the drift for one draw.
    """
    ma = result.moving_average
    T = ma.shape[1]
    drift = float((ma[:, -1] - ma[:, T // 2]).abs().mean()) if T > 1 else math.nan
    return {"rhat": result.rhat, "llc_mean": result.llc_mean, "llc_std": result.llc_std,
            "late_drift": drift}
