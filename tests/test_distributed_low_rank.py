"""Data-parallel Kronecker curvature with a vocabulary-sized head (issue 30 section 3): the low-rank output
statistic R^T R travels as its rows (``Reducer.all_gather_rows``) and the union's factor is the ranks' rows
stacked, never an (n, n) matrix. With the threshold ``LOW_RANK_OUTPUTS`` lowered, on a float64 MLP and a
causal LM, 2 and 3 processes with unequal shards (gloo):

* the empirical-Fisher Kronecker operator equals the single-process operator on the union to 1e-12
  (products with and without damping);
* data-parallel GaussNewton (``curvature='kfac'``, each rank sampling its own labels) with the low-rank head
  equals the same data-parallel run with every factor dense to 1e-10 (parameters after three steps), factored
  inversion with comm-opt placement and eigen inversion with mem-opt;
* ``output_factor='auto'`` on a wide layer (``ROWS_OUTPUTS`` lowered to 8: the MLP's 12-output head): the ranks'
  rows are gathered while the union's are at most 12 and the union's factor becomes dense at the update where
  they would be more, on every rank alike; each update's operator equals the single-process one to 1e-12.
"""

from __future__ import annotations

import pytest
import torch

from curvkit.distributed import Reducer, spawn

D64 = torch.float64
BOUNDS = {2: [0, 2, 6], 3: [0, 1, 2, 6]}
DENSE = 10**9


def _close(a, b, what, tol):
    a, b = torch.as_tensor(a).detach(), torch.as_tensor(b).detach()
    err, scale = float((a - b).abs().max()), max(1.0, float(b.abs().max()))
    assert err <= tol * scale, f"{what}: max abs difference {err:.3g} (scale {scale:.3g})"


def _models():
    from curvkit.architectures import causal_lm
    from curvkit.models import mlp

    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(6, 3, generator=g, dtype=D64), torch.randint(0, 12, (6,), generator=g)
    ids = torch.randint(0, 40, (6, 6), generator=g)
    return {"mlp": (lambda: mlp([3, 4, 12], "tanh", dtype=D64, seed=1), X, y, 8),
            "lm": (lambda: causal_lm(vocab_size=40, max_len=5, dim=8, depth=1, heads=2, mlp_dim=16, seed=0, dtype=D64),
                   ids[:, :-1], ids[:, 1:], 32)}


def worker(rank, world):
    from curvkit.curvature import KroneckerEstimator, estimators
    from curvkit.likelihoods import CrossEntropy
    from curvkit.optim import GaussNewton

    red, mem_opt = Reducer(timeout=60), Reducer(timeout=60, placement="mem-opt")
    lo, hi = BOUNDS[world][rank], BOUNDS[world][rank + 1]
    for name, (make, X, y, threshold) in _models().items():
        estimators.LOW_RANK_OUTPUTS = threshold
        model = make()
        ref = KroneckerEstimator(model, CrossEntropy("mean"), "empirical").update((X, y)).operator()
        dst = KroneckerEstimator(model, CrossEntropy("mean"), "empirical", distributed=red)
        K = dst.update((X[lo:hi], y[lo:hi])).operator()
        assert any(b.low_rank_output for b in K.blocks), name
        v = torch.randn(K.shape[0], 2, generator=torch.Generator().manual_seed(5), dtype=D64)
        _close(K @ v, ref @ v, f"{name}: empirical operator", 1e-12)
        _close(K.inverse(damping=0.1) @ v, ref.inverse(damping=0.1) @ v, f"{name}: damped inverse", 1e-12)

        for inversion, reducer in (("factored", red), ("eigen", mem_opt)):
            params = {}
            for t in (threshold, DENSE):
                estimators.LOW_RANK_OUTPUTS = t
                net = make()
                opt = GaussNewton(net.parameters(), model=net, likelihood=CrossEntropy("mean"), curvature="kfac",
                                  inversion=inversion, distributed=reducer, zeta=0.1, tau_every=1, zeta_every=2)
                for _ in range(3):
                    opt.step(batch=(X[lo:hi], y[lo:hi]))
                assert any(b.low_rank_output for b in opt.estimator.operator().blocks) == (t == threshold)
                params[t] = [p.detach().clone() for p in net.parameters()]
            for a, b in zip(params[threshold], params[DENSE]):
                _close(a, b, f"{name}: GaussNewton ({inversion}, {reducer.placement}) parameters", 1e-10)


def rows_worker(rank, world):
    from curvkit.curvature import KroneckerEstimator, estimators
    from curvkit.curvature.estimators import GramRows
    from curvkit.likelihoods import CrossEntropy

    estimators.ROWS_OUTPUTS = 8
    make, X, y, _ = _models()["mlp"]
    lo, hi = BOUNDS[world][rank], BOUNDS[world][rank + 1]
    model = make()
    ref = KroneckerEstimator(model, CrossEntropy("mean"), "empirical")
    dst = KroneckerEstimator(model, CrossEntropy("mean"), "empirical", distributed=Reducer(timeout=60))
    assert dst.low_rank == [False, True] and dst.dense_above == [False, True]
    for step in range(3):  # 6, 12, 18 union rows of the 12-output head
        ref.update((X, y))
        dst.update((X[lo:hi], y[lo:hi]))
        assert isinstance(dst._stats[-1], GramRows) == (step < 2)
        v = torch.randn(ref.operator().shape[0], 2, generator=torch.Generator().manual_seed(step), dtype=D64)
        _close(dst.operator() @ v, ref.operator() @ v, f"update {step}: operator", 1e-12)
        _close(dst.operator().inverse(damping=0.1) @ v, ref.operator().inverse(damping=0.1) @ v,
               f"update {step}: damped inverse", 1e-12)


@pytest.mark.parametrize("world", [2, 3])
def test_rows_of_a_wide_layer_data_parallel(world):
    spawn(rows_worker, world, timeout=180, collective_timeout=60)


@pytest.mark.parametrize("world", [2, 3])
def test_low_rank_head_data_parallel(world):
    spawn(worker, world, timeout=300, collective_timeout=120)
