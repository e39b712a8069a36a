"""FSDP2-sharded models (``fully_shard``; issue 33). The Kronecker estimators take them with ``distributed=``:
each rank runs the model on its own shard of the data and the ranks' statistics are summed, so the factors are
those of the union on every rank, equal to the single-process factors of an unsharded copy on all the data
(float64, 1e-12; 2 and 3 processes, unequal shards, 'sum' and 'mean' losses, per-token targets). Every other
route still refuses a sharded model in curvkit's words (issue 33 found KroneckerEstimator returning each rank's
operator of its own data without a word, GGNOperator and GaussNewton failing inside torch). HSDP (2 x 2 mesh, 4
processes) equals one process on the union too; other layouts (Shard(1), tensor parallelism) are refused by name;
a rank killed mid-step or mid-update ends the others with CollectiveError. Laplace on sharded models:
tests/test_laplace_sharded.py. Gloo, CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from curvkit.distributed import spawn

D64 = torch.float64


class Tagger(nn.Module):
    """Token ids (B, T) -> (B, T, 5) through every layer kind that takes sharded weights."""

    def __init__(self):
        super().__init__()
        self.emb, self.ln, self.lin = nn.Embedding(11, 8), nn.LayerNorm(8), nn.Linear(8, 8)
        self.conv, self.rms, self.head = nn.Conv1d(8, 8, 3, padding=1), nn.RMSNorm(8), nn.Linear(8, 5)

    def forward(self, ids):
        h = torch.tanh(self.lin(self.ln(self.emb(ids))))
        return self.head(self.rms(self.conv(h.transpose(1, 2)).transpose(1, 2)))


class ScaledTagger(Tagger):
    """Tagger whose logits a raw (1, 1, 5) parameter scales: one row, so FSDP2 leaves the other ranks' shards
    of it empty."""

    def __init__(self):
        super().__init__()
        self.gamma = nn.Parameter(torch.linspace(0.5, 1.5, 5).reshape(1, 1, 5))

    def forward(self, ids):
        return super().forward(ids) * self.gamma


def _scaled_sharded_and_reference():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net, ref = ScaledTagger().to(D64), ScaledTagger().to(D64)
    ref.load_state_dict(net.state_dict())
    fully_shard(net.lin), fully_shard(net)
    return net, ref


def _sharded_and_reference(extra: bool = False):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    net, ref = Tagger().to(D64), Tagger().to(D64)
    if extra:  # a raw parameter: a kind that reads its weight
        for m in (net, ref):
            m.register_parameter("gamma", nn.Parameter(torch.ones(1, 1, 5, dtype=D64)))
    ref.load_state_dict(net.state_dict())
    for m in (net.emb, net.ln, net.lin, net.conv, net.rms, net.head):
        fully_shard(m)
    fully_shard(net)
    return net, ref


def _data(world):
    g = torch.Generator().manual_seed(1)
    X, y = torch.randint(0, 11, (9, 5), generator=g), torch.randint(0, 5, (9, 5), generator=g)
    y[0, 3:] = -100  # padding: the ranks count different numbers of tokens
    y[4, 1:] = -100
    bounds = [0, 2, 6, 9] if world == 3 else [0, 3, 9]  # unequal shards
    return X, y, bounds


def factors_worker(rank, world):
    from curvkit.curvature import KroneckerEstimator, kflr
    from curvkit.distributed import Reducer
    from curvkit.likelihoods import CrossEntropy

    net, ref = _sharded_and_reference()
    X, y, bounds = _data(world)
    mine = slice(bounds[rank], bounds[rank + 1])
    for reduction in ("sum", "mean"):
        lik = CrossEntropy(reduction, ignore_index=-100)
        for method in ("kflr", "empirical"):
            for sharing in ("expand", "reduce"):
                est = KroneckerEstimator(net, lik, method, weight_sharing=sharing, distributed=Reducer())
                got = est.update((X[mine], y[mine])).operator()
                want = KroneckerEstimator(ref, lik, method, weight_sharing=sharing).update((X, y)).operator()
                torch.testing.assert_close(got.to_dense(), want.to_dense(), atol=1e-12, rtol=0)
                v = torch.randn(got.shape[0], generator=torch.Generator().manual_seed(2), dtype=D64)
                torch.testing.assert_close(got @ v, want @ v, atol=1e-12, rtol=0)  # full flat vectors
        got = kflr(net, lik, (X[mine], y[mine]), distributed=Reducer()).to_dense()  # the function form
        torch.testing.assert_close(got, kflr(ref, lik, (X, y)).to_dense(), atol=1e-12, rtol=0)
    kfac = KroneckerEstimator(net, CrossEntropy(ignore_index=-100), "kfac", distributed=Reducer())
    K = kfac.update((X[mine], y[mine])).operator().to_dense()
    assert kfac.num_data == len(X) and torch.isfinite(K).all() and torch.allclose(K, K.T)


@pytest.mark.parametrize("world", [2, 3])
def test_kronecker_factors_of_a_sharded_model_are_the_union(world):
    spawn(factors_worker, world, timeout=240, collective_timeout=60)


def refusals_worker(rank, world):
    from curvkit.curvature import EKFACEstimator, GGNOperator, KroneckerEstimator
    from curvkit.distributed import Reducer
    from curvkit.laplace import Laplace
    from curvkit.likelihoods import CrossEntropy
    from curvkit.structure import UnsupportedModelError

    net, _ = _sharded_and_reference()
    X, y, _ = _data(world)
    lik = CrossEntropy()
    with pytest.raises(ValueError, match=r"FSDP2 .*pass distributed=Reducer"):
        KroneckerEstimator(net, lik, "kflr")
    with pytest.raises(UnsupportedModelError, match="kfra on an FSDP2-sharded model"):
        KroneckerEstimator(net, lik, "kfra", distributed=Reducer())
    for route in (lambda: GGNOperator(net, lik, (X, y)), lambda: EKFACEstimator(net, lik)):
        with pytest.raises(NotImplementedError, match=r"DTensor shard.*KroneckerEstimator.*GaussNewton, Laplace"):
            route()
    with pytest.raises(ValueError, match=r"Laplace: .*FSDP2 .*pass distributed=Reducer"):
        Laplace(net, lik, structure="kron")
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    from curvkit.curvature import sharded_operator
    from curvkit.optim import GaussNewton

    cols = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(D64)
    fully_shard(cols, shard_placement_fn=lambda p: Shard(1) if p.dim() == 2 else Shard(0))
    # tensor parallelism: Shard(0) on a 1-D mesh as FSDP2's, but its ranks see the same data (counted P times)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    tp = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).to(D64)
    parallelize_module(tp, init_device_mesh("cpu", (world,)), {"0": ColwiseParallel()})
    for model, match in ((cols, r"Shard\(dim=1\).*FSDP2's layouts only.*HSDP"),
                         (tp, r"'0.weight' is a DTensor .*FSDP2 \(fully_shard\) does not manage: tensor parallelism")):
        for route in (lambda m: GaussNewton(m.parameters(), model=m, likelihood=lik, distributed=Reducer()),
                      lambda m: sharded_operator(GGNOperator, m, lik, (torch.randn(2, 4, dtype=D64), y[:2, 0]),
                                                 distributed=Reducer()),
                      lambda m: KroneckerEstimator(m, lik, "kflr", distributed=Reducer())):
            with pytest.raises(NotImplementedError, match=match):
                route(model)
    raw, _ = _sharded_and_reference(extra=True)
    with pytest.raises(UnsupportedModelError, match=r"module 'gamma'.*layer kind 'parameter'.*FSDP2"):
        KroneckerEstimator(raw, lik, "kflr", distributed=Reducer())


def test_other_routes_refuse_a_sharded_model_clearly():
    spawn(refusals_worker, 2, timeout=180, collective_timeout=60)


def _batches(world, steps=3):
    """``steps`` minibatches of token ids with padding, and each rank's unequal share of their rows."""
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(steps):
        X, y = torch.randint(0, 11, (9, 5), generator=g), torch.randint(0, 5, (9, 5), generator=g)
        y[1, 2:] = -100
        out.append((X, y))
    return out, (_data(world)[2])


def _sharded_mlp():
    """A 6-7-3 tanh MLP chain (KFRA's) with every layer and the root sharded, its unsharded copy, and 9 samples
    (X (9, 6), 3-class labels)."""
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(4)
    mlp, ref = (nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 3)).to(D64) for _ in range(2))
    ref.load_state_dict(mlp.state_dict())
    fully_shard(mlp[0]), fully_shard(mlp[2]), fully_shard(mlp)
    g = torch.Generator().manual_seed(5)
    return mlp, ref, torch.randn(9, 6, generator=g, dtype=D64), torch.randint(0, 3, (9,), generator=g)


def _full(p):
    return p.full_tensor() if hasattr(p, "full_tensor") else p


def gauss_newton_worker(rank, world):

    from curvkit.distributed import Reducer
    from curvkit.likelihoods import CrossEntropy
    from curvkit.optim import GaussNewton

    batches, bounds = _batches(world)
    mine = slice(bounds[rank], bounds[rank + 1])
    common = dict(tau_every=1, zeta_every=2, weight_decay=1e-3)
    # deterministic curvature: the single-process optimiser on the union of the ranks' data
    for reduction, extra in (("mean", dict(momentum=True)), ("sum", dict(inversion="eigen", tau=10.0))):
        lik = CrossEntropy(reduction, ignore_index=-100)
        net, ref = _sharded_and_reference()
        if reduction == "sum":  # a frozen sharded layer: gathered for the forward pass, never updated
            net.ln.requires_grad_(False), ref.ln.requires_grad_(False)
        kw = dict(likelihood=lik, curvature="kflr", **common, **extra)
        got = GaussNewton(net.parameters(), model=net, distributed=Reducer(), **kw)
        want = GaussNewton(ref.parameters(), model=ref, **kw)
        for X, y in batches:
            e_got, e_want = got.step(batch=(X[mine], y[mine])), want.step(batch=(X, y))
            torch.testing.assert_close(e_got, e_want, atol=1e-12, rtol=0)
        for (n, p), q in zip(net.named_parameters(), ref.parameters()):
            assert p.to_local().shape[0] < q.shape[0] or world == 1  # still sharded
            torch.testing.assert_close(_full(p), q, atol=1e-12, rtol=0, msg=lambda m, n=n, r=reduction: f"{r} {n}: {m}")
        for key in ("alpha", "rho", "tau", "zeta"):
            assert [h[key] for h in got.history] == pytest.approx([h[key] for h in want.history], abs=1e-12, rel=0)
    # a raw parameter (a kind the estimator cannot take on shards, whole on the replica) with empty shards
    net, ref = _scaled_sharded_and_reference()
    assert net.gamma.to_local().shape[0] == (1 if rank == 0 else 0)
    kw = dict(likelihood=CrossEntropy(ignore_index=-100), curvature="kflr", **common)
    got = GaussNewton(net.parameters(), model=net, distributed=Reducer(), **kw)
    want = GaussNewton(ref.parameters(), model=ref, **kw)
    for X, y in batches[:2]:
        got.step(batch=(X[mine], y[mine])), want.step(batch=(X, y))
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p), q, atol=1e-12, rtol=0)
    # KFRA (the thesis's source, chosen by 'auto' for an MLP chain) on a sharded MLP
    mlp, ref, X, y = _sharded_mlp()
    kw = dict(likelihood=CrossEntropy(), **common)
    got = GaussNewton(mlp.parameters(), model=mlp, distributed=Reducer(), **kw)
    want = GaussNewton(ref.parameters(), model=ref, **kw)
    for _ in range(2):
        got.step(batch=(X[mine], y[mine])), want.step(batch=(X, y))
    assert got.source == want.source == "kfra"
    for p, q in zip(mlp.parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p), q, atol=1e-12, rtol=0)
    # KFAC samples labels with each rank's generator: the data-parallel optimiser on unsharded replicas
    lik = CrossEntropy(ignore_index=-100)
    net, _ = _sharded_and_reference()
    _, rep = _sharded_and_reference()
    got = GaussNewton(net.parameters(), model=net, distributed=Reducer(), likelihood=lik, curvature="kfac", **common)
    want = GaussNewton(rep.parameters(), model=rep, distributed=Reducer(), likelihood=lik, curvature="kfac", **common)
    for X, y in batches:
        got.step(batch=(X[mine], y[mine])), want.step(batch=(X[mine], y[mine]))
    for p, q in zip(net.parameters(), rep.parameters()):
        torch.testing.assert_close(_full(p), q, atol=1e-12, rtol=0)
    # a stopped and resumed run equals an uninterrupted one (state_dict on the shards)
    kw = dict(likelihood=lik, curvature="kfac", momentum=True, **common)
    (a, _), (b, _) = _sharded_and_reference(), _sharded_and_reference()
    run = GaussNewton(a.parameters(), model=a, distributed=Reducer(), **kw)
    first = GaussNewton(b.parameters(), model=b, distributed=Reducer(), **kw)
    for X, y in batches[:2]:
        run.step(batch=(X[mine], y[mine])), first.step(batch=(X[mine], y[mine]))
    resumed = GaussNewton(b.parameters(), model=b, distributed=Reducer(), **kw)
    resumed.load_state_dict(first.state_dict())
    X, y = batches[2]
    run.step(batch=(X[mine], y[mine])), resumed.step(batch=(X[mine], y[mine]))
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p.to_local(), q.to_local(), atol=0, rtol=0)
    # refused by name
    with pytest.raises(ValueError, match=r"FSDP2 .*pass distributed=Reducer"):
        GaussNewton(net.parameters(), model=net, likelihood=lik)
    with pytest.raises(TypeError, match=r"step\(closure\) on an FSDP2-sharded model"):
        got.step(lambda: None)


@pytest.mark.parametrize("world", [2, 3])
def test_gauss_newton_steps_of_a_sharded_model_are_the_union(world):
    spawn(gauss_newton_worker, world, timeout=300, collective_timeout=60)


def operators_worker(rank, world):
    from curvkit.curvature import (
        EmpiricalFisherOperator,
        FisherOperator,
        GGNOperator,
        HessianOperator,
        KroneckerEstimator,
        sharded_operator,
    )
    from curvkit.distributed import DistributedOperator, Reducer
    from curvkit.likelihoods import CrossEntropy

    net, ref = _sharded_and_reference()
    X, y, bounds = _data(world)
    mine = slice(bounds[rank], bounds[rank + 1])
    g = torch.Generator().manual_seed(6)
    for reduction in ("mean", "sum"):
        lik = CrossEntropy(reduction, ignore_index=-100)
        for cls, options in ((GGNOperator, {}), (HessianOperator, {}), (FisherOperator, dict(snapshot=False)),
                             (EmpiricalFisherOperator, dict(chunk_size=7))):
            op = sharded_operator(cls, net, lik, (X[mine], y[mine]), distributed=Reducer(), **options)
            want = cls(ref, lik, (X, y))
            assert isinstance(op, DistributedOperator) and op.shape == want.shape
            V = torch.randn(op.shape[0], 3, generator=g, dtype=D64)
            torch.testing.assert_close(op @ V, want @ V, atol=1e-12, rtol=0)  # full flat vectors in, full out
            torch.testing.assert_close(op @ V[:, 0], want @ V[:, 0], atol=1e-12, rtol=0)
            torch.testing.assert_close(op.to_dense(), want.to_dense(), atol=1e-12, rtol=0)
            torch.testing.assert_close(op.diagonal().flat, want.diagonal().flat, atol=1e-12, rtol=0)
    # empty shards (a one-row parameter)
    scaled, ref_scaled = _scaled_sharded_and_reference()
    lik = CrossEntropy(ignore_index=-100)
    op = sharded_operator(GGNOperator, scaled, lik, (X[mine], y[mine]), distributed=Reducer())
    torch.testing.assert_close(op.to_dense(), GGNOperator(ref_scaled, lik, (X, y)).to_dense(), atol=1e-12, rtol=0)
    # a module's own hooks run on the replica (a pruning mask's pre-hook), FSDP2's do not
    from torch.distributed.fsdp import fully_shard
    from torch.nn.utils import prune

    torch.manual_seed(7)
    pruned, ref_pruned = (nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).to(D64) for _ in range(2))
    ref_pruned.load_state_dict(pruned.state_dict())
    for m in (pruned[0], ref_pruned[0]):
        prune.l1_unstructured(m, "weight", amount=0.4)
    fully_shard(pruned[0]), fully_shard(pruned)
    Xp, yp = torch.randn(9, 4, generator=g, dtype=D64), torch.randint(0, 3, (9,), generator=g)
    op = sharded_operator(GGNOperator, pruned, CrossEntropy(), (Xp[mine], yp[mine]), distributed=Reducer())
    want = GGNOperator(ref_pruned, CrossEntropy(), (Xp, yp)).to_dense()
    torch.testing.assert_close(op.to_dense(), want, atol=1e-12, rtol=0)
    # the same layout as the Kronecker operator of the sharded model: comparable entry by entry
    lik = CrossEntropy(ignore_index=-100)
    K = KroneckerEstimator(net, lik, "kflr", distributed=Reducer()).update((X[mine], y[mine])).operator()
    G = sharded_operator(GGNOperator, net, lik, (X[mine], y[mine]), distributed=Reducer())
    assert list(K.layout.names) == list(G.layout.names) and list(K.layout.shapes) == list(G.layout.shapes)
    Kref = KroneckerEstimator(ref, lik, "kflr").update((X, y)).operator()
    v = torch.randn(G.shape[0], generator=g, dtype=D64)
    torch.testing.assert_close(v @ (G @ v) - v @ (K @ v), v @ (GGNOperator(ref, lik, (X, y)) @ v) - v @ (Kref @ v),
                               atol=1e-12, rtol=0)
    # the user's model is unchanged: still sharded, the same values
    for p, q in zip(net.parameters(), ref.parameters()):
        assert type(p).__name__ == "DTensor"
        torch.testing.assert_close(p.full_tensor(), q, atol=0, rtol=0)
    with pytest.raises(TypeError, match="exact curvature operator class"):
        sharded_operator(KroneckerEstimator, net, lik, (X, y), distributed=Reducer())


@pytest.mark.parametrize("world", [2, 3])
def test_exact_operators_of_a_sharded_model_are_the_union(world):
    spawn(operators_worker, world, timeout=300, collective_timeout=60)


def _hsdp_and_reference():
    """The Tagger under HSDP: FSDP2 within each shard group of a 2 x 2 (replicate, shard) mesh of 4 ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    net, ref = Tagger().to(D64), Tagger().to(D64)
    ref.load_state_dict(net.state_dict())
    for m in (net.emb, net.lin, net.conv, net.head):
        fully_shard(m, mesh=mesh)
    fully_shard(net, mesh=mesh)
    return net, ref


def hsdp_worker(rank, world):
    from torch.distributed.tensor import Replicate, Shard

    from curvkit.curvature import GGNOperator, KroneckerEstimator, sharded_operator
    from curvkit.distributed import Reducer
    from curvkit.likelihoods import CrossEntropy
    from curvkit.optim import GaussNewton

    batches, _ = _batches(world)
    bounds = [0, 1, 3, 6, 9]  # unequal data shards: every rank its own, also within a shard group
    mine = slice(bounds[rank], bounds[rank + 1])
    lik = CrossEntropy("mean", ignore_index=-100)
    net, ref = _hsdp_and_reference()
    assert net.lin.weight.placements == (Replicate(), Shard(0)) and net.lin.weight.to_local().shape[0] == 4
    red = Reducer()
    # the Kronecker factors and the exact GGN of the union of the 4 ranks' data
    X, y = batches[0]
    K = KroneckerEstimator(net, lik, "kflr", distributed=red).update((X[mine], y[mine])).operator()
    want = KroneckerEstimator(ref, lik, "kflr").update((X, y)).operator()
    torch.testing.assert_close(K.to_dense(), want.to_dense(), atol=1e-12, rtol=0)
    G = sharded_operator(GGNOperator, net, lik, (X[mine], y[mine]), distributed=red)
    torch.testing.assert_close(G.to_dense(), GGNOperator(ref, lik, (X, y)).to_dense(), atol=1e-12, rtol=0)
    before = red.stats.snapshot()["bytes"].get("all_gather", 0)
    sharded_operator(GGNOperator, net, lik, (X[mine], y[mine]), distributed=red)
    gathered = red.stats.snapshot()["bytes"]["all_gather"] - before  # within the shard group of 2: half of
    numel = sum(p.numel() for p in ref.parameters())                  # the sharded parameters, padded
    assert 8 * numel / 2 <= gathered < 8 * numel, (gathered, numel)
    # GaussNewton: the single-process optimiser on the union; the two replicas of each shard stay identical
    kw = dict(likelihood=lik, curvature="kflr", tau_every=1, zeta_every=2, weight_decay=1e-3, momentum=True)
    got = GaussNewton(net.parameters(), model=net, distributed=red, **kw)
    want_opt = GaussNewton(ref.parameters(), model=ref, **kw)
    for X, y in batches:
        torch.testing.assert_close(got.step(batch=(X[mine], y[mine])), want_opt.step(batch=(X, y)), atol=1e-12, rtol=0)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p), q, atol=1e-12, rtol=0)
    red.check_identical([p.full_tensor() for p in net.parameters()], "the HSDP model's parameters")
    # the inverses placed by owner over the 4 ranks as data-parallel (mem-opt: directions broadcast by owners)
    net, ref = _hsdp_and_reference()
    got = GaussNewton(net.parameters(), model=net, distributed=Reducer(placement="mem-opt"), **kw)
    want_opt = GaussNewton(ref.parameters(), model=ref, **kw)
    for X, y in batches[:2]:
        got.step(batch=(X[mine], y[mine])), want_opt.step(batch=(X, y))
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(_full(p), q, atol=1e-12, rtol=0)


def test_hsdp_curvature_and_gauss_newton_steps_are_the_union_of_all_ranks():
    spawn(hsdp_worker, 4, timeout=400, collective_timeout=120)


def killed_rank_worker(rank, world, where, result):
    """Rank 1 dies (os._exit) in the middle of a GaussNewton step on the replica, or of an estimator update
    in FSDP2's forward pass or just before one of FSDP2's own all-gathers in the backward pass (outside the
    Reducer); rank 0 must end with curvkit's CollectiveError, well within the reducer's timeout."""
    import json
    import os
    import time
    from pathlib import Path

    from curvkit.curvature import KroneckerEstimator
    from curvkit.distributed import CollectiveError, Reducer
    from curvkit.likelihoods import CrossEntropy
    from curvkit.optim import GaussNewton

    net, _ = _sharded_and_reference()
    batches, bounds = _batches(world)
    X, y = batches[0]
    mine = slice(bounds[rank], bounds[rank + 1])
    lik, red = CrossEntropy(ignore_index=-100), Reducer(timeout=20)
    if where == "step":
        run = GaussNewton(net.parameters(), model=net, likelihood=lik, curvature="kflr", distributed=red)
        if rank == 1:  # a hook added after the optimiser: the replica runs it too (its forward, in the step)
            net.head.register_forward_hook(lambda *_: os._exit(3))
    else:
        run = KroneckerEstimator(net, lik, "kflr", distributed=red)
        if rank == 1 and where == "forward":
            net.head.register_forward_hook(lambda *_: os._exit(3))
        elif rank == 1:  # the third of FSDP2's all-gathers in the backward passes never starts
            from torch.distributed.fsdp._fully_shard import _fsdp_param_group as pg

            unshard, calls = pg.FSDPParamGroup.unshard, []

            def dying(group, *args, **kwargs):
                calls.append("BACKWARD" in str(group._training_state))
                if sum(calls) == 3:
                    os._exit(3)
                return unshard(group, *args, **kwargs)

            pg.FSDPParamGroup.unshard = dying
    t0 = time.monotonic()
    try:
        run.step(batch=(X[mine], y[mine])) if where == "step" else run.update((X[mine], y[mine]))
        got = ["completed", 0.0]
    except CollectiveError as err:
        got = [f"{type(err).__name__}: {err}", time.monotonic() - t0]
    Path(result).write_text(json.dumps(got))
    os._exit(0)


@pytest.mark.parametrize("where", ["step", "forward", "backward"])
def test_a_killed_rank_ends_the_others_with_a_curvkit_error(tmp_path, where):
    from torch.multiprocessing import ProcessExitedException

    result = tmp_path / "got.json"
    with pytest.raises(ProcessExitedException, match="process 1 terminated with exit code 3"):
        spawn(killed_rank_worker, 2, (where, str(result)), timeout=180, collective_timeout=120)
    msg, elapsed = __import__("json").loads(result.read_text())
    assert msg.startswith("CollectiveError: rank 0: ") and "another rank has probably" in msg, msg
    assert elapsed < 20, (msg, elapsed)  # the reducer's timeout; the process group's is 120 s
    if where == "backward":
        assert "a collective of FSDP2" in msg, msg
