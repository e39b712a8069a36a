"""Data-parallel curvkit on torch.distributed (gloo, 2 and 3 CPU processes): every quantity equals the
single-process result on the union of the ranks' shards (float64; shards of unequal size), Monte Carlo
quantities with the same seeds; a failing rank stops every rank (no hang); checkpoints resume on another
number of processes.

Each test spawns its processes once (``curvkit.distributed.spawn``: fresh processes, a file rendezvous, a
wall-clock limit and collective timeouts) and runs many checks inside; the workers compute the
single-process reference themselves (every rank holds the union data) and assert.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import time
import warnings

import pytest
import torch
from torch.multiprocessing import ProcessRaisedException

from curvkit.distributed import (
    DistributedCheckpointError,
    DistributedOperator,
    Reducer,
    assign_owners,
    derive_seed,
    shard_range,
    spawn,
)

RTOL, ATOL = 1e-9, 1e-11  # float64 rounding of sums taken in another order (products of ~10 terms)
BOUNDS = {2: [0, 8, 13], 3: [0, 2, 7, 13]}  # unequal shards of N = 13 rows


def _close(a, b, what, rtol=RTOL, atol=ATOL):
    a, b = torch.as_tensor(a), torch.as_tensor(b)
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    a, b = a.detach(), b.detach()
    err = float((a - b).abs().max()) if a.numel() else 0.0
    assert torch.allclose(a, b, rtol=rtol, atol=atol), f"{what}: max abs difference {err:.3g}"


def _data(seed, n=13, d=5, c=3):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64), torch.randint(0, c, (n,), generator=g)


def _net(act="tanh", seed=0):
    from curvkit.models import mlp

    return mlp([5, 4, 3], act, dtype=torch.float64, seed=seed)


def _shard(t, rank, world):
    b = BOUNDS[world]
    return t[b[rank]:b[rank + 1]]


class _MappingNet(torch.nn.Module):
    """A network called on a mapping batch {"x": (B, 5), "gate": (B,)}: net(x * gate)."""

    def __init__(self, net):
        super().__init__()
        self.net = net

    def forward(self, batch):
        return self.net(batch["x"] * batch["gate"].unsqueeze(-1))


# ---------------------------------------------------------------------------------------------- workers
def _curvature_checks(rank, world, red):
    from curvkit.curvature import DiagonalEstimator, GGNOperator, HessianOperator, KroneckerEstimator
    from curvkit.likelihoods import CrossEntropy

    X, y = _data(1)
    Xr, yr = _shard(X, rank, world), _shard(y, rank, world)
    net = _net()
    for method in ("kflr", "kfra", "empirical"):
        for red_name in ("mean", "sum"):
            lik = CrossEntropy(red_name)
            ref = KroneckerEstimator(net, lik, method).update((X, y))
            dst = KroneckerEstimator(net, lik, method, distributed=red).update((Xr, yr))
            assert dst.num_data == 13
            for (n1, G1, A1), (_, G2, A2) in zip(ref.factors(), dst.factors()):
                _close(G2, G1, f"{method}/{red_name} G of {n1}")
                _close(A2, A1, f"{method}/{red_name} A of {n1}")
    # moving average over two updates (batch means weighted by the shard sizes)
    X2, y2 = _data(2)
    ref = KroneckerEstimator(net, CrossEntropy("mean"), "kflr", ema=0.5).update((X, y)).update((X2, y2))
    dst = KroneckerEstimator(net, CrossEntropy("mean"), "kflr", ema=0.5, distributed=red)
    dst.update((Xr, yr)).update((_shard(X2, rank, world), _shard(y2, rank, world)))
    for a, b in zip(dst._stats, ref._stats):
        _close(a, b, "kflr ema statistics")
    # Monte Carlo labels: each rank its own seed derive_seed(seed, rank): the sum of per-shard estimators
    for method in ("kfac", "projection"):
        dst = KroneckerEstimator(net, CrossEntropy("sum"), method, mc_samples=2, seed=7, distributed=red)
        dst.update((Xr, yr))
        parts = [KroneckerEstimator(net, CrossEntropy("sum"), method, mc_samples=2, seed=derive_seed(7, r))
                 .update((_shard(X, r, world), _shard(y, r, world)))._stats for r in range(world)]
        for i, t in enumerate(dst._stats):
            _close(t, sum(p[i] for p in parts), f"{method} statistic {i}")
    # diagonal estimators
    ref = DiagonalEstimator(net, CrossEntropy("mean"), "ggn").update((X, y)).operator()
    dst = DiagonalEstimator(net, CrossEntropy("mean"), "ggn", distributed=red).update((Xr, yr)).operator()
    _close(dst.flat, ref.flat, "GGN diagonal estimator")
    dmc = DiagonalEstimator(net, CrossEntropy("sum"), "mc_fisher", seed=3, distributed=red).update((Xr, yr))
    parts = [DiagonalEstimator(net, CrossEntropy("sum"), "mc_fisher", seed=derive_seed(3, r))
             .update((_shard(X, r, world), _shard(y, r, world)))._stats[0] for r in range(world)]
    _close(dmc._stats[0], sum(parts), "MC Fisher diagonal")
    # an overflow on one rank (finite outputs, inf input factor): every rank raises the same error after the
    # reduction (an error a rank raises BEFORE a collective makes the others time out instead, see below)
    bad = Xr.clone()
    if rank == world - 1:
        bad[0, 0] = 1e200
    with pytest.raises(ValueError, match="NaN or inf"):
        KroneckerEstimator(net, CrossEntropy("mean"), "kflr", distributed=red).update((bad, yr))

    # exact operators over sharded data
    for lik in (CrossEntropy("mean"), CrossEntropy("sum")):
        ref = GGNOperator(net, lik, (X, y))
        dop = DistributedOperator(GGNOperator(net, lik, (Xr, yr)), red)
        d = ref.layout.dim
        M = torch.randn(d, 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
        _close(dop @ M, ref @ M, f"GGN product ({lik.reduction})")
        _close(dop.quadratic_form(M), ref.quadratic_form(M), "GGN quadratic form")
        _close(dop.diagonal().flat, ref.diagonal().flat, "GGN exact diagonal")
        _close(dop.to_dense(), ref.to_dense(), "GGN to_dense")
        _close(dop.trace(), ref.trace(), "GGN exact trace")
        for method in ("hutchinson", "hutch++"):
            t1 = dop.trace(method, num_probes=9, generator=torch.Generator().manual_seed(5))
            t2 = ref.trace(method, num_probes=9, generator=torch.Generator().manual_seed(5))
            _close(t1, t2, f"GGN {method} trace")
        _close(dop.diagonal("hutchinson", num_probes=6, generator=torch.Generator().manual_seed(6)).flat,
               ref.diagonal("hutchinson", num_probes=6, generator=torch.Generator().manual_seed(6)).flat,
               "Hutchinson diagonal")
        ev1 = dop.eigenvalues(2, generator=torch.Generator().manual_seed(8))
        ev2 = ref.eigenvalues(2, generator=torch.Generator().manual_seed(8))
        _close(ev1, ev2, "Lanczos eigenvalues", rtol=1e-8)
        b = M[:, 0]
        _close(dop.solve(b, damping=0.1), ref.solve(b, damping=0.1), "CG solve", rtol=1e-8, atol=1e-9)
        _close(dop.logdet(0.1, method="slq", num_probes=4, num_iter=10, generator=torch.Generator().manual_seed(9)),
               ref.logdet(0.1, method="slq", num_probes=4, num_iter=10, generator=torch.Generator().manual_seed(9)),
               "SLQ logdet", rtol=1e-8)
    # no generator: the probes are still shared, so every rank returns the same number
    t = float(dop.trace("hutchinson", num_probes=4))
    assert len(set(red.all_gather_object(t))) == 1
    relu = _net("relu", seed=1)
    hop = DistributedOperator(HessianOperator(relu, CrossEntropy("mean"), (Xr, yr)), red)
    _close(hop.trace(), HessianOperator(relu, CrossEntropy("mean"), (X, y)).trace(), "Hessian trace")
    tanh_h = DistributedOperator(HessianOperator(net, CrossEntropy("sum"), (Xr, yr)), red)
    _close(tanh_h.diagonal().flat, HessianOperator(net, CrossEntropy("sum"), (X, y)).diagonal().flat,
           "Hessian diagonal")


def _meanfield_checks(rank, world, red):
    from curvkit.likelihoods import CrossEntropy
    from curvkit.optim import BGD, MESU

    batches = [_data(10 + t) for t in range(3)]
    for loss in ("sum", "mean"):
        ref_net, dst_net = _net(), _net()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = MESU(ref_net.parameters(), model=ref_net, loss_fn=CrossEntropy(loss), mc_samples=3, seed=5,
                       sigma_prior=0.05)
            dst = MESU(dst_net.parameters(), model=dst_net, loss_fn=CrossEntropy(loss), mc_samples=3, seed=5,
                       sigma_prior=0.05, distributed=red)
        for X, y in batches:
            l1 = ref.step(batch=(X, y))
            l2 = dst.step(batch=(_shard(X, rank, world), _shard(y, rank, world)))
            _close(l2, l1, f"MESU ({loss}) loss")
        for (n, p1), p2 in zip(ref_net.named_parameters(), dst_net.parameters()):
            _close(p2, p1, f"MESU ({loss}) mu of {n}")
        for (n, s1), s2 in zip(ref.sigma_dict().items(), dst.sigma_dict().values()):
            _close(s2, s1, f"MESU ({loss}) sigma of {n}")
    # BatchNorm in training mode: each rank normalises its shard and the running statistics are averaged
    # over the ranks (weighted by shard size), so the replicas keep identical buffers
    torch.manual_seed(0)
    bn_net = torch.nn.Sequential(torch.nn.Linear(5, 4), torch.nn.BatchNorm1d(4), torch.nn.Tanh(),
                                 torch.nn.Linear(4, 3)).double()
    bn_opt = MESU(bn_net.parameters(), model=bn_net, mc_samples=2, seed=5, distributed=red)
    for X, y in batches:
        bn_opt.step(batch=(_shard(X, rank, world), _shard(y, rank, world)))
    assert int(bn_net[1].num_batches_tracked) == len(batches)
    red.check_same([b.tolist() for b in bn_net.buffers()], "BatchNorm running statistics")
    # BGD through closures (a summed loss per shard)
    ref_net, dst_net = _net(), _net()
    ref = BGD(ref_net.parameters(), model=ref_net, mc_samples=2, seed=1)
    dst = BGD(dst_net.parameters(), model=dst_net, mc_samples=2, seed=1, distributed=red)
    lik = CrossEntropy("sum")
    for X, y in batches:
        Xr, yr = _shard(X, rank, world), _shard(y, rank, world)

        def c1(X=X, y=y):
            out = lik(ref_net(X), y)
            out.backward()
            return out

        def c2(Xr=Xr, yr=yr):
            out = lik(dst_net(Xr), yr)
            out.backward()
            return out

        ref.step(c1)
        dst.step(c2)
    for p1, p2 in zip(ref_net.parameters(), dst_net.parameters()):
        _close(p2, p1, "BGD (closure) mu")


def _filter_checks(rank, world, red):
    from curvkit.likelihoods import CrossEntropy
    from curvkit.optim.filters import KFBayes, KFNatGrad, KFWhiten

    batches = [_data(20 + t) for t in range(3)]
    lik = CrossEntropy("mean")
    for name, make in (
        ("KFWhiten", lambda n, **kw: KFWhiten(n.parameters(), model=n, lr=0.05, inv_every=2, **kw)),
        ("KFBayes", lambda n, **kw: KFBayes(n.parameters(), model=n, lr=1e-3, fisher_samples=4, **kw)),
    ):
        ref_net, dst_net = _net(), _net()
        ref, dst = make(ref_net), make(dst_net, distributed=red)
        for X, y in batches:
            ref.zero_grad()
            lik(ref_net(X), y).backward()
            ref.step()
            dst.zero_grad()
            lik(dst_net(_shard(X, rank, world)), _shard(y, rank, world)).backward()
            dst.step()
        for p1, p2 in zip(ref_net.parameters(), dst_net.parameters()):
            _close(p2, p1, f"{name} parameters", rtol=1e-8, atol=1e-10)
        ref.close()
        dst.close()
    # layers with T > 1 rows per example (a Linear layer shared over positions, a convolution, a tied head and
    # embedding): the union's first examples' rows, grouped per example; KFWhiten's statistics of the stacked rows
    # (full-rank factors: a rank-deficient one's kept eigenbasis is arbitrary, see KFWhiten's docstring)
    g = torch.Generator().manual_seed(7)
    Xp, Xc = torch.randn(13, 4, 5, generator=g, dtype=torch.float64), torch.randn(13, 2, 6, generator=g,
                                                                                 dtype=torch.float64)
    ids, yp = torch.randint(0, 5, (13, 3), generator=g), torch.randint(0, 3, (13,), generator=g)

    def positions_net():
        return _net()

    def conv_net():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Conv1d(2, 3, 2), torch.nn.Tanh(), torch.nn.AdaptiveAvgPool1d(1),
                                   torch.nn.Flatten(), torch.nn.Linear(3, 3)).double()

    def tied_net():
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Embedding(5, 3), torch.nn.Tanh(), torch.nn.Linear(3, 5)).double()
        net[2].weight = net[0].weight
        return net

    models = (("positions", positions_net, Xp, lambda out: out.mean(1), yp),
              ("conv", conv_net, Xc, lambda out: out, yp),
              ("tied", tied_net, ids, lambda out: out.mean(1), yp.remainder(5)))
    for (what, net_of, X, head, y), (name, make) in [(m, c) for m in models for c in (
            ("KFBayes", lambda n, **kw: KFBayes(n.parameters(), model=n, lr=1e-3, fisher_samples=4, **kw)),
            ("KFNatGrad batched", lambda n, **kw: KFNatGrad(n.parameters(), model=n, fisher_samples=None,
                                                            sample_update="batched", **kw)),
            ("KFWhiten", lambda n, **kw: KFWhiten(n.parameters(), model=n, lr=0.05, inv_every=2, **kw)))]:
        ref_net, dst_net = net_of(), net_of()
        ref, dst = make(ref_net), make(dst_net, distributed=red)
        assert not ref.diagonal or what == "tied"
        for t in range(2):
            Xt, yt = (X, y) if t == 0 else (X.flip(0), y.flip(0))
            ref.zero_grad()
            lik(head(ref_net(Xt)), yt).backward()
            ref.step()
            dst.zero_grad()
            lik(head(dst_net(_shard(Xt, rank, world))), _shard(yt, rank, world)).backward()
            dst.step()
        for p1, p2 in zip(ref_net.parameters(), dst_net.parameters()):
            _close(p2, p1, f"{name} on the {what} model", rtol=0, atol=1e-12)
        ref.close()
        dst.close()


def _gauss_newton_checks(rank, world, red):
    from curvkit.distributed import ddp
    from curvkit.likelihoods import CrossEntropy
    from curvkit.optim import GaussNewton

    batches = [_data(30 + t) for t in range(4)]
    lik = CrossEntropy("mean")
    configs = [dict(curvature="kflr", inversion="factored"), dict(curvature="kfra", inversion="eigen"),
               dict(curvature="kflr", inversion="factored", momentum=True, ema=0.5)]
    for placement in ("comm-opt", "mem-opt"):
        r = Reducer(placement=placement, timeout=red.timeout)
        for cfg in configs:
            ref_net, dst_net = _net(), _net()
            kw = dict(likelihood=lik, tau_every=1, zeta_every=2, weight_decay=1e-4, **cfg)
            ref = GaussNewton(ref_net.parameters(), model=ref_net, **kw)
            dst = GaussNewton(dst_net.parameters(), model=dst_net, distributed=r, **kw)
            for X, y in batches:
                e1 = ref.step(batch=(X, y))
                e2 = dst.step(batch=(_shard(X, rank, world), _shard(y, rank, world)))
                _close(e2, e1, f"GaussNewton {cfg} {placement} objective")
            for k in ("alpha", "tau", "zeta", "rho"):
                _close(torch.tensor([h[k] or 0.0 for h in dst.history]), torch.tensor([h[k] or 0.0 for h in ref.history]),
                       f"GaussNewton {cfg} {placement} {k}", rtol=1e-7)
            for p1, p2 in zip(ref_net.parameters(), dst_net.parameters()):
                _close(p2, p1, f"GaussNewton {cfg} {placement} parameters", rtol=1e-7, atol=1e-9)
    # the non-standard blocks of a ViT (q/k/v slices, LayerNorm rows, the raw class token and position table): the
    # union's step with each parameter unit placed on its owner
    from curvkit.architectures import vit

    g = torch.Generator().manual_seed(60)
    Xv, yv = torch.randn(13, 1, 4, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (13,), generator=g)
    for placement, cfg in (("comm-opt", dict(curvature="kflr", inversion="factored")),
                           ("mem-opt", dict(curvature="kflr", inversion="eigen", weight_sharing="reduce"))):
        r = Reducer(placement=placement, timeout=red.timeout)
        nets = [vit(image_size=4, patch_size=2, dim=4, depth=1, heads=2, mlp_dim=4, num_classes=3, seed=1,
                    dtype=torch.float64) for _ in range(2)]
        kw = dict(likelihood=lik, tau_every=1, zeta_every=2, weight_decay=1e-4, **cfg)
        ref = GaussNewton(nets[0].parameters(), model=nets[0], **kw)
        dst = GaussNewton(nets[1].parameters(), model=nets[1], distributed=r, **kw)
        for t in range(2):
            Xt = Xv * (1 + t)
            _close(dst.step(batch=(_shard(Xt, rank, world), _shard(yv, rank, world))), ref.step(batch=(Xt, yv)),
                   f"GaussNewton ViT {cfg} {placement} objective")
        for p1, p2 in zip(nets[0].parameters(), nets[1].parameters()):
            _close(p2, p1, f"GaussNewton ViT {cfg} {placement} parameters", rtol=1e-7, atol=1e-9)
    # mapping batches (a model called on {"x": ..., "gate": ...}): each rank steps on its rows of every tensor
    nets = [_MappingNet(_net()) for _ in range(2)]
    kw = dict(likelihood=lik, curvature="kflr", tau_every=1, weight_decay=1e-4)
    ref = GaussNewton(nets[0].parameters(), model=nets[0], **kw)
    dst = GaussNewton(nets[1].parameters(), model=nets[1], distributed=red, **kw)
    for t, (X, y) in enumerate(batches[:2]):
        gate = torch.linspace(0.5, 1.5, 13, dtype=torch.float64) * (1 + t)
        Xm = {"x": X, "gate": gate}
        Xr = {k: _shard(v, rank, world) for k, v in Xm.items()}
        _close(dst.step(batch=(Xr, _shard(y, rank, world))), ref.step(batch=(Xm, y)), "GaussNewton mapping objective")
    for p1, p2 in zip(nets[0].parameters(), nets[1].parameters()):
        _close(p2, p1, "GaussNewton mapping parameters", rtol=1e-7, atol=1e-9)
    # closures under DistributedDataParallel with the union-gradient hook (unequal shards, mean loss)
    ref_net, dst_net = _net(), _net()
    r = Reducer(timeout=red.timeout)
    wrapped = ddp(dst_net, r, "mean")
    ref = GaussNewton(ref_net.parameters(), model=ref_net, likelihood=lik, curvature="kflr", tau_every=1)
    dst = GaussNewton(dst_net.parameters(), model=dst_net, likelihood=lik, curvature="kflr", tau_every=1,
                      distributed=r)
    for X, y in batches[:3]:
        Xr, yr = _shard(X, rank, world), _shard(y, rank, world)

        def c1(X=X, y=y):
            ref.zero_grad()
            out = lik(ref_net(X), y)
            out.backward()
            return out

        def c2(Xr=Xr, yr=yr):
            dst.zero_grad()
            out = lik(wrapped(Xr), yr)
            out.backward()
            return out

        _close(dst.step(c2), ref.step(c1), "GaussNewton closure (DDP) objective")
    for p1, p2 in zip(ref_net.parameters(), dst_net.parameters()):
        _close(p2, p1, "GaussNewton closure (DDP) parameters", rtol=1e-7, atol=1e-9)


def _llc_checks(rank, world, red):
    from curvkit.slt import SGLDConfig, estimate_llc
    from curvkit.slt.llc import _summarise

    X, y = _data(40, n=40)
    net = _net()
    cfg = SGLDConfig(num_chains=world + 1, num_draws=15, epsilon=1e-3, gamma=10.0)
    res = estimate_llc(net, (X, y), batch_size=8, config=cfg, seed=3, distributed=red)
    counts = [shard_range(cfg.num_chains, r, world) for r in range(world)]
    runs = [estimate_llc(net, (X, y), batch_size=8, config=dataclasses.replace(cfg, num_chains=b - a),
                         seed=derive_seed(3, r)) for r, (a, b) in enumerate(counts)]
    init = sum(run.num_chains * run.init_loss for run in runs) / cfg.num_chains
    ref = _summarise(torch.cat([run.loss_trace for run in runs]), init, runs[0].nbeta, 40, 8, cfg, 0.0)
    _close(res.llc_per_chain, ref.llc_per_chain, "LLC per chain (chains over ranks)")
    _close(torch.tensor(res.llc_mean), torch.tensor(ref.llc_mean), "LLC mean")
    one = estimate_llc(net, (X, y), batch_size=8, config=cfg, seed=3)
    split = estimate_llc(net, (X, y), batch_size=8, config=cfg, seed=3, distributed=red, distributed_split="batch")
    _close(split.loss_trace, one.loss_trace, "LLC traces (data-parallel gradients)", rtol=1e-8, atol=1e-10)
    assert len({float(v) for v in red.all_gather_object(split.llc_mean)}) == 1


def union_worker(rank, world):
    torch.manual_seed(100 + rank)  # a different global RNG per rank: nothing may depend on it
    red = Reducer(timeout=30)
    _curvature_checks(rank, world, red)
    _meanfield_checks(rank, world, red)
    _filter_checks(rank, world, red)
    _gauss_newton_checks(rank, world, red)
    _llc_checks(rank, world, red)


def _gn(net, curvature, red=None):
    from curvkit.likelihoods import CrossEntropy
    from curvkit.optim import GaussNewton

    return GaussNewton(net.parameters(), model=net, likelihood=CrossEntropy("mean"), curvature=curvature,
                       tau_every=1, zeta_every=2, distributed=red)


def checkpoint_writer(rank, world, path):
    from curvkit.distributed import save_checkpoint

    red = Reducer(timeout=30)
    for curvature in ("kflr", "kfac"):
        net = _net()
        opt = _gn(net, curvature, red)
        for t in range(2):
            X, y = _data(50 + t)
            opt.step(batch=(_shard(X, rank, world), _shard(y, rank, world)))
        rank_state = opt.state_dict()["gauss_newton"]["generator"] if curvature == "kfac" else None
        save_checkpoint(os.path.join(path, f"{curvature}.pt"), {"model": net.state_dict(), "opt": opt.state_dict()},
                        red, rank_state=rank_state)


def checkpoint_reader(rank, world, path):
    from curvkit.distributed import load_checkpoint

    red = Reducer(timeout=30)
    state, own = load_checkpoint(os.path.join(path, "kflr.pt"), red)
    assert own is None
    net = _net()
    net.load_state_dict(state["model"])
    opt = _gn(net, "kflr", red)
    opt.load_state_dict(state["opt"])
    ref_net = _net()
    ref = _gn(ref_net, "kflr")
    for t in range(4):
        X, y = _data(50 + t)
        ref.step(batch=(X, y))
        if t >= 2:
            opt.step(batch=(_shard(X, rank, world), _shard(y, rank, world)))
    for p1, p2 in zip(ref_net.parameters(), net.parameters()):
        _close(p2, p1, "resumed on another number of processes", rtol=1e-7, atol=1e-9)
    with pytest.raises(DistributedCheckpointError, match="written by 3 processes"):
        load_checkpoint(os.path.join(path, "kfac.pt"), red, rank_state_required=True)


def failing_worker(rank, world, mode):
    red = Reducer(timeout=4)
    t = torch.ones(3)
    if rank == 1:
        if mode == "raise":
            raise RuntimeError("boom on rank 1")
        time.sleep(60)  # alive but never arrives: the others' collective times out
    red.all_reduce_([t])


# ---------------------------------------------------------------------------------------------- tests
@pytest.mark.parametrize("world", [2, 3])
def test_every_quantity_equals_the_union_single_process(world):
    spawn(union_worker, world, timeout=240, collective_timeout=60)


def test_checkpoint_resumes_on_another_number_of_processes(tmp_path):
    spawn(checkpoint_writer, 3, (str(tmp_path),), timeout=120)
    spawn(checkpoint_reader, 2, (str(tmp_path),), timeout=120)


@pytest.mark.parametrize("mode", ["raise", "stall"])
def test_a_failing_rank_stops_every_rank(mode):
    t0 = time.monotonic()
    # "raise": rank 1's error, or rank 0's CollectiveTimeout naming the dropped connection, whichever is seen
    # first; "stall": rank 0's CollectiveTimeout after 4 s
    expected = "boom on rank 1|Connection reset|CollectiveTimeout" if mode == "raise" else "CollectiveTimeout"
    with pytest.raises(ProcessRaisedException, match=expected):
        spawn(failing_worker, 2, (mode,), timeout=90, collective_timeout=60)
    assert time.monotonic() - t0 < 60  # stopped by the error or the 4 s collective timeout, not the limit


def test_placement_balances_cost():
    costs = [100.0, 1.0, 50.0, 49.0, 2.0]
    a = assign_owners(costs, 2, "comm-opt")
    assert a.owner == (0, 0, 1, 1, 1) and a.load == (101.0, 101.0)
    assert all(w == (0, 1) for w in a.grad_workers)
    m = assign_owners(costs, 3, "mem-opt")
    assert all(w == (o,) for w, o in zip(m.grad_workers, m.owner))
    h = assign_owners(costs, 4, "hybrid", grad_worker_fraction=0.5)
    assert {w for w in h.grad_workers} <= {(0, 2), (1, 3)}
    assert all(o in w for o, w in zip(h.owner, h.grad_workers))
    with pytest.raises(ValueError, match="grad_worker_fraction"):
        assign_owners(costs, 2, "hybrid")


def test_seeds_and_shards():
    assert derive_seed(5, 0) == 5 and derive_seed(5, 1) != derive_seed(5, 2) != 5
    assert derive_seed(5, 1) == derive_seed(5, 1) and 0 <= derive_seed(5, 1) < 2**63
    ranges = [shard_range(13, r, 3) for r in range(3)]
    assert ranges == [(0, 5), (5, 9), (9, 13)]


def test_reducer_needs_a_process_group():
    with pytest.raises(RuntimeError, match="process group"):
        Reducer()


def test_distributed_operator_refuses_non_operators():
    with pytest.raises(TypeError):
        DistributedOperator(copy.copy(1), None)  # type: ignore[arg-type]
