"""Comparing a curvature estimate with a reference: the metrics the experiments report.

* :func:`correlations` - agreement of two positive vectors (e.g. a Hessian-diagonal estimate read off
  MESU's sigma and the exact diagonal) on a log scale and by rank;
* :func:`binned_ratio` - median estimate/reference in log bins of the reference;
* :func:`relative_error` and :func:`cosine` for vectors or matrices.

Inputs may be tensors, numpy arrays or :class:`~curvkit.linalg.operator.DiagonalOperator` (its flat
diagonal is compared).
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import numpy as np
import torch
from scipy import stats

from curvkit.linalg.operator import DiagonalOperator

__all__ = ["binned_ratio", "correlations", "cosine", "relative_error"]


def _array(x: Any) -> np.ndarray:
    if isinstance(x, DiagonalOperator):
        x = x.flat
    if isinstance(x, torch.Tensor):
        x = x.detach().cpu().double().numpy()
    return np.asarray(x, dtype=np.float64).reshape(-1)


def correlations(estimate: Any, reference: Any) -> dict[str, float]:
    """Pearson correlation of log10 values (entries where both are > 0 and finite), Spearman and linear
    Pearson correlations (finite entries), and the median ratio estimate/reference (positive entries);
    NaN where fewer than three entries qualify."""
    est, true = _array(estimate), _array(reference)
    if est.shape != true.shape:
        raise ValueError(f"estimate and reference must have the same size, got {est.size} and {true.size}")
    both = (est > 0) & (true > 0) & np.isfinite(est) & np.isfinite(true)
    fin = np.isfinite(est) & np.isfinite(true)
    out: dict[str, float] = {"n": int(est.size), "n_positive": int(both.sum())}
    out["pearson_log"] = (float(stats.pearsonr(np.log10(est[both]), np.log10(true[both]))[0])
                          if both.sum() > 2 else math.nan)
    out["spearman"] = float(stats.spearmanr(est[fin], true[fin])[0]) if fin.sum() > 2 else math.nan
    out["pearson"] = float(stats.pearsonr(est[fin], true[fin])[0]) if fin.sum() > 2 else math.nan
    out["median_ratio"] = float(np.median(est[both] / true[both])) if both.any() else math.nan
    return out


def binned_ratio(estimate: Any, reference: Any, edges: Any) -> list[dict[str, float]]:
    """Median estimate/reference and median estimate in the bins ``[edges[i], edges[i+1])`` of the reference
    value (bins with fewer than 5 entries are left out)."""
    est, true = _array(estimate), _array(reference)
    rows = []
    for lo, hi in itertools.pairwise(np.asarray(edges, dtype=np.float64)):
        sel = (true >= lo) & (true < hi) & np.isfinite(est)
        if sel.sum() >= 5:
            rows.append({"lo": float(lo), "hi": float(hi), "count": int(sel.sum()),
                         "median_ratio": float(np.median(est[sel] / true[sel])),
                         "median_estimate": float(np.median(est[sel]))})
    return rows


def relative_error(estimate: torch.Tensor, reference: torch.Tensor) -> float:
    """||estimate - reference|| / ||reference|| (Frobenius for matrices)."""
    return float((estimate - reference).norm() / reference.norm())


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """a . b / (||a|| ||b||) of two flat vectors."""
    return float(a @ b / (a.norm() * b.norm()))
