"""Laplace posteriors with ``distributed=`` (issue 33): data-parallel (every rank the whole model, its own shard of
the data) and FSDP2-sharded (``fully_shard``: the whole-parameter replica route). The posterior of the union of the
ranks' data, whole on every rank, equals the single-process posterior on all the data (float64, 1e-12; 2 and 3
processes, unequal shards, several batches per rank, padded targets): the precision, the log marginal likelihood
and its prior-precision optimisation, the GLM predictive and functional variance, samples and the MC predictive
with a shared generator. Gloo, CPU."""

from __future__ import annotations

import pytest
import torch
from tests.test_sharded import (
    Tagger,
    _data,
    _scaled_sharded_and_reference,
    _sharded_and_reference,
    _sharded_mlp,
)
from torch import nn

from curvkit.distributed import spawn

D64 = torch.float64
TOL = dict(atol=1e-12, rtol=0)


def _rank_batches(X, y, bounds, rank):
    """This rank's rows of (X, y) as two batches (of unequal sizes where the shard allows)."""
    a, b = bounds[rank], bounds[rank + 1]
    mid = a + max(1, (b - a) // 2)
    return [(X[a:mid], y[a:mid]), (X[mid:b], y[mid:b])]


def _same_posterior(got, want, X, *, mc: bool = True):
    """Every posterior quantity of ``got`` (fitted on this rank's shard) equals ``want`` (all the data)."""
    assert got.num_data == want.num_data and got.num_seen == want.num_seen
    assert list(got.names) == list(want.names)
    torch.testing.assert_close(got.mean, want.mean, atol=0, rtol=0)
    torch.testing.assert_close(got.precision().to_dense(), want.precision().to_dense(), **TOL)
    torch.testing.assert_close(got.log_marginal_likelihood(), want.log_marginal_likelihood(), **TOL)
    lam = torch.linspace(0.5, 2.0, len(got.layer_names), dtype=D64)
    torch.testing.assert_close(got.log_marginal_likelihood(prior_precision=lam),
                               want.log_marginal_likelihood(prior_precision=lam), **TOL)
    torch.testing.assert_close(got.predict(X, "glm"), want.predict(X, "glm"), **TOL)
    for a, b in zip(got.functional_variance(X), want.functional_variance(X)):
        torch.testing.assert_close(a, b, **TOL)
    if mc:
        gens = [torch.Generator().manual_seed(9) for _ in range(2)]
        torch.testing.assert_close(got.sample(3, gens[0]), want.sample(3, gens[1]), **TOL)
        gens = [torch.Generator().manual_seed(9) for _ in range(2)]
        torch.testing.assert_close(got.predict(X, "mc", num_samples=4, generator=gens[0]),
                                   want.predict(X, "mc", num_samples=4, generator=gens[1]), **TOL)


def laplace_worker(rank, world):
    from torch.distributed.fsdp import fully_shard

    from curvkit.curvature import estimators
    from curvkit.curvature.estimators import LOW_RANK_OUTPUTS
    from curvkit.distributed import Reducer, ReplicaMismatch
    from curvkit.laplace import Laplace, grid_search, optimize_prior_precision
    from curvkit.likelihoods import CrossEntropy

    X, y, bounds = _data(world)
    mine = _rank_batches(X, y, bounds, rank)
    lik = CrossEntropy(ignore_index=-100)
    cases = [("kron", "kflr", {}), ("kron", "empirical", dict(weight_sharing="reduce")),
             ("kron", "kflr", dict(prior_form="exact", norm_structure="diag")),
             ("diag", "ggn", {}), ("diag", "empirical", {}), ("full", "ggn", {})]
    for structure, curvature, options in cases:
        what = f"{structure}/{curvature}/{options}"
        net, ref = _sharded_and_reference()
        want = Laplace(ref, lik, structure, curvature, prior_precision=0.7, **options).fit([(X, y)])
        dp = Laplace(ref, lik, structure, curvature, prior_precision=0.7, distributed=Reducer(), **options).fit(mine)
        got = Laplace(net, lik, structure, curvature, prior_precision=0.7, distributed=Reducer(), **options).fit(mine)
        assert got.replica is not None and dp.replica is None, what
        _same_posterior(dp, want, X)  # data-parallel: every rank the whole model
        _same_posterior(got, want, X)  # FSDP2 shards: the replica route
        # the prior precision by marginal likelihood: the same optimum on every rank as on one process
        lam_got = optimize_prior_precision(got, per_layer=True, steps=20)
        lam_want = optimize_prior_precision(want, per_layer=True, steps=20)
        torch.testing.assert_close(lam_got, lam_want, atol=1e-12, rtol=0)
        for p, q in zip(net.parameters(), ref.parameters()):  # the user's model: still sharded, unchanged
            assert type(p).__name__ == "DTensor"
            torch.testing.assert_close(p.full_tensor(), q, atol=0, rtol=0)
            q.untyped_storage().resize_(q.untyped_storage().nbytes())  # still resizable (FSDP2 frees storage so)
    # the thesis's grid search on the union of the ranks' validation shards: the same table, the same choice
    rows = slice(bounds[rank], bounds[rank + 1])
    for method in ("glm", "mc"):
        kw = dict(num_data_grid=[9.0, 90.0], prior_grid=[0.1, 1.0, 10.0], method=method, num_samples=3)
        mine_g, want_g = grid_search(got, (X[rows], y[rows]), **kw), grid_search(want, (X, y), **kw)
        assert mine_g["best"] == want_g["best"]
        torch.testing.assert_close(torch.tensor(mine_g["table"]), torch.tensor(want_g["table"]), **TOL)
    # a raw parameter with empty shards on the other ranks (a kind the estimator cannot take on shards), a
    # subset, and the last layer found on the replica's forward pass
    net, ref = _scaled_sharded_and_reference()
    for subset in ("all", ["head", "gamma"]):
        want = Laplace(ref, lik, "kron", subset=subset).fit((X, y))
        got = Laplace(net, lik, "kron", subset=subset, distributed=Reducer()).fit(mine)
        _same_posterior(got, want, X)
    net, ref = _sharded_and_reference()
    want = Laplace(ref, lik, "full", "ggn", subset="last_layer").fit((X, y))
    got = Laplace(net, lik, "full", "ggn", subset="last_layer", distributed=Reducer()).fit(mine)
    assert got.names == ["head.weight", "head.bias"]
    _same_posterior(got, want, X)
    # KFRA (batch means of the union, batch by batch) on a sharded MLP chain
    mlp, ref, Xm, ym = _sharded_mlp()
    parts = _rank_batches(Xm, ym, bounds, rank)
    union = [(torch.cat([b[0] for b in bs]), torch.cat([b[1] for b in bs]))
             for bs in zip(*[_rank_batches(Xm, ym, bounds, r) for r in range(world)])]  # batch i of every rank
    want = Laplace(ref, CrossEntropy(), "kron", "kfra").fit(union)
    got = Laplace(mlp, CrossEntropy(), "kron", "kfra", distributed=Reducer()).fit(parts)
    _same_posterior(got, want, Xm)
    # KFAC and the MC Fisher sample labels with each rank's generator: equal to the data-parallel posterior
    net, _ = _sharded_and_reference()
    _, rep = _sharded_and_reference()
    for structure, curvature in (("kron", "kfac"), ("diag", "mc_fisher")):
        got = Laplace(net, lik, structure, curvature, distributed=Reducer()).fit(mine)
        dp = Laplace(rep, lik, structure, curvature, distributed=Reducer()).fit(mine)
        _same_posterior(got, dp, X, mc=False)
    # the ranks must pass equally many batches: every rank raises, none pairs its statistics with another message
    with pytest.raises(ValueError, match="every rank must pass the same number of batches"):
        Laplace(net, lik, "kron", distributed=Reducer()).fit(mine[:1] if rank == 0 else mine)
    # one theta*: replicas that differ are refused on every rank (an unsharded parameter of a sharded model too)
    torch.manual_seed(0)
    plain, partly = Tagger().to(D64), Tagger().to(D64)
    fully_shard(partly.lin)  # the other parameters stay ordinary tensors, each rank's own
    for model in (plain, partly):
        with torch.no_grad():
            model.head.bias.add_(rank)
        with pytest.raises(ReplicaMismatch, match=r"Laplace\.fit with distributed=: .*differ between the ranks"):
            Laplace(model, lik, "kron", distributed=Reducer()).fit(mine)
    with pytest.raises(ValueError, match=r"FSDP2 .*pass distributed=Reducer"):
        Laplace(net, lik, "kron")
    # a vocabulary-sized output (the threshold lowered below its 7 outputs): its low-rank factor's rows gathered
    estimators.LOW_RANK_OUTPUTS = 4
    try:
        torch.manual_seed(6)
        wide = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 7)).to(D64)
        g = torch.Generator().manual_seed(7)
        Xw, yw = torch.randn(5, 3, generator=g, dtype=D64), torch.randint(0, 7, (5,), generator=g)
        cut = [0, 1, 3, 5] if world == 3 else [0, 2, 5]  # unequal shards of the 5 rows
        a, b = cut[rank], cut[rank + 1]
        want = Laplace(wide, CrossEntropy(), "kron", "empirical").fit([(Xw, yw)])
        got = Laplace(wide, CrossEntropy(), "kron", "empirical", distributed=Reducer()).fit([(Xw[a:b], yw[a:b])])
        assert any(f.low_rank_output for blk in got.blocks for f in getattr(blk, "factors", []))
        _same_posterior(got, want, Xw)
    finally:
        estimators.LOW_RANK_OUTPUTS = LOW_RANK_OUTPUTS
    with pytest.raises(TypeError, match=r"distributed must be a curvkit\.distributed\.Reducer"):
        Laplace(ref, lik, "kron", distributed=object())


@pytest.mark.parametrize("world", [2, 3])
def test_laplace_with_distributed_is_the_union(world):
    spawn(laplace_worker, world, timeout=600, collective_timeout=60)
