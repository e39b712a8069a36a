"""Data-parallel curvkit on padded per-token batches (issue 34): every component that takes ``distributed=``
(and ``DistributedOperator``, ``ddp``) equals the single-process result on the union of the shards when the
ranks hold unequal numbers of COUNTED tokens, with ``reduction='mean'`` and ``'sum'`` (float64, gloo, 2 and
3 processes; with 3 processes one rank's every target is padding).

A mean over counted tokens weights the ranks by their counted terms (``likelihood.num_terms``), not by their
sequences: with the shards below, sequences 3 : 4 against tokens 3 : 15, so a reduction weighted by
sequences is off by a large factor (issue 34 measured 7.4e-2 in a GaussNewton update). One spawn per number
of processes runs every check; the workers compute the single-process reference on the union themselves.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch

from curvkit.distributed import Reducer, spawn

D64 = torch.float64
PAD = -100
B, T = 7, 4
BOUNDS = {2: [0, 3, 7], 3: [0, 2, 3, 7]}  # rows of each rank
TOL = 1e-12


def _close(a, b, what, tol=TOL):
    """|a - b| <= tol * max(1, |b|) entrywise scale: relative to the largest entry of b."""
    a, b = torch.as_tensor(a).detach(), torch.as_tensor(b).detach()
    assert a.shape == b.shape, f"{what}: shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    scale = max(1.0, float(b.abs().max())) if b.numel() else 1.0
    err = float((a - b).abs().max()) if a.numel() else 0.0
    assert err <= tol * scale, f"{what}: max abs difference {err:.3g} (scale {scale:.3g})"


def _pad(y):
    """Padding that gives the ranks unequal counted tokens: 3 : 15 on 2 ranks, 3 : 0 : 15 on 3 ranks."""
    y = y.clone()
    y[0, 1:] = PAD
    y[1, 2:] = PAD
    y[2, :] = PAD
    y[5, 3] = PAD
    return y


def _features(seed, n=B, classes=3):
    """Per-token inputs (n, T, 5) and padded targets (n, T)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, T, 5, generator=g, dtype=D64), _pad(torch.randint(0, classes, (n, T), generator=g))


def _tokens(seed, vocab=6):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (B, T), generator=g), _pad(torch.randint(0, vocab, (B, T), generator=g))


def _shard(t, rank, world):
    b = BOUNDS[world]
    return t[b[rank]:b[rank + 1]]


def _per_token_mlp(seed=0):
    """Linear - tanh - Linear on (B, T, 5) inputs: (B, T, 3) outputs, one loss term per token."""
    from curvkit.models import mlp

    return mlp([5, 4, 3], "tanh", dtype=D64, seed=seed)


def _lm():
    from curvkit.architectures import causal_lm

    return causal_lm(vocab_size=6, max_len=T, dim=4, depth=1, heads=2, mlp_dim=4, seed=1, dtype=D64)


def _lik(reduction):
    from curvkit.likelihoods import CrossEntropy

    return CrossEntropy(reduction, ignore_index=PAD)


# ---------------------------------------------------------------------------------------------- checks
def _gauss_newton(rank, world, red):
    """GaussNewton (the issue's case: a tiny transformer, kflr): loss, gradient, alpha*, rho, tau, zeta and
    the parameters after three steps, batch form; both inversions, mean and sum."""
    from curvkit.optim import GaussNewton

    batches = [_tokens(30 + t) for t in range(3)]
    for reduction, cfg in (("mean", dict(inversion="factored")), ("sum", dict(inversion="eigen", momentum=True))):
        nets = [_lm(), _lm()]
        kw = dict(likelihood=_lik(reduction), curvature="kflr", tau_every=1, zeta_every=1, weight_decay=1e-3, **cfg)
        ref = GaussNewton(nets[0].parameters(), model=nets[0], **kw)
        dst = GaussNewton(nets[1].parameters(), model=nets[1], distributed=red, **kw)
        for X, y in batches:
            _close(dst.step(batch=(_shard(X, rank, world), _shard(y, rank, world))), ref.step(batch=(X, y)),
                   f"GaussNewton ({reduction}) objective")
        for k in ("alpha", "beta", "rho", "tau", "zeta", "predicted_change", "dCd", "direction_dot_grad"):
            _close(torch.tensor([h[k] or 0.0 for h in dst.history]), torch.tensor([h[k] or 0.0 for h in ref.history]),
                   f"GaussNewton ({reduction}) {k}")
        for (n, p1), p2 in zip(nets[0].named_parameters(), nets[1].parameters()):
            _close(p2, p1, f"GaussNewton ({reduction}) parameter {n}")


def _meanfield(rank, world, red):
    """MESU (mean and sum), BGD and BBBSGD on per-token outputs: the losses, mu and sigma after three steps."""
    from curvkit.optim import BBBSGD, BGD, MESU

    batches = [_features(10 + t) for t in range(3)]
    makers = {
        "MESU mean": lambda n, **kw: MESU(n.parameters(), model=n, loss_fn=_lik("mean"), mc_samples=3, seed=5,
                                          sigma_prior=0.05, **kw),
        "MESU sum": lambda n, **kw: MESU(n.parameters(), model=n, loss_fn=_lik("sum"), mc_samples=3, seed=5,
                                         sigma_prior=0.05, **kw),
        "BGD mean": lambda n, **kw: BGD(n.parameters(), model=n, loss_fn=_lik("mean"), mc_samples=2, seed=1, **kw),
        "BBBSGD sum": lambda n, **kw: BBBSGD(n.parameters(), model=n, loss_fn=_lik("sum"), mc_samples=2, seed=2,
                                             lr=1e-2, **kw),
    }
    for name, make in makers.items():
        nets = [_per_token_mlp(), _per_token_mlp()]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # MeanReductionWarning
            ref, dst = make(nets[0]), make(nets[1], distributed=red)
        for X, y in batches:
            _close(dst.step(batch=(_shard(X, rank, world), _shard(y, rank, world))), ref.step(batch=(X, y)),
                   f"{name} loss")
        for (n, p1), p2 in zip(nets[0].named_parameters(), nets[1].parameters()):
            _close(p2, p1, f"{name} mu of {n}")
        for (n, s1), s2 in zip(ref.sigma_dict().items(), dst.sigma_dict().values()):
            _close(s2, s1, f"{name} sigma of {n}")
    # a torch loss with reduction='mean' divides by a count curvkit cannot read: refused data-parallel
    net = _per_token_mlp()
    with pytest.raises(ValueError, match="number of terms"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        MESU(net.parameters(), model=net, loss_fn=torch.nn.CrossEntropyLoss(), distributed=red)


def _curvature(rank, world, red):
    """Estimators (Kronecker, diagonal) and DistributedOperator on per-token targets with padding."""
    from curvkit.curvature import DiagonalEstimator, GGNOperator, KroneckerEstimator
    from curvkit.distributed import DistributedOperator

    X, y = _features(1)
    Xr, yr = _shard(X, rank, world), _shard(y, rank, world)
    net = _per_token_mlp()
    for reduction in ("mean", "sum"):
        lik = _lik(reduction)
        for sharing in ("expand", "reduce"):
            ref = KroneckerEstimator(net, lik, "kflr", weight_sharing=sharing).update((X, y)).operator().to_dense()
            dst = KroneckerEstimator(net, lik, "kflr", weight_sharing=sharing, distributed=red).update((Xr, yr))
            _close(dst.operator().to_dense(), ref, f"kflr ({reduction}, {sharing})")
        ref = DiagonalEstimator(net, lik, "ggn").update((X, y)).operator().flat
        _close(DiagonalEstimator(net, lik, "ggn", distributed=red).update((Xr, yr)).operator().flat, ref,
               f"GGN diagonal estimator ({reduction})")
        dense = GGNOperator(net, lik, (X, y)).to_dense()
        if reduction == "sum" or all(_shard(y, r, world).ne(PAD).any() for r in range(world)):
            local, weight = GGNOperator(net, lik, (Xr, yr)), None  # ranks weighted by their counted tokens
        else:  # a shard without a counted token has no mean of its own: summed operators, weighted by 1 / M
            local = GGNOperator(net, lik.with_reduction("sum"), (Xr, yr))
            weight = 1.0 / float(y.ne(PAD).sum())
        dop = DistributedOperator(local, red, weight=weight)
        _close(dop.to_dense(), dense, f"DistributedOperator to_dense ({reduction})")
        v = torch.randn(dop.layout.dim, generator=torch.Generator().manual_seed(2), dtype=D64)
        _close(dop @ v, dense @ v, f"DistributedOperator product ({reduction})")


def _filters(rank, world, red):
    """Kronecker filters with a summed padded loss (their ``'mean'`` is the mean over examples, which a
    padded loss is not: see the module docstring of curvkit.optim.filters.kronecker): KFWhiten on per-token
    outputs (weight-shared Linear layers), KFBayes/KFNatGrad on (B, C) outputs with padded samples."""
    from curvkit.models import mlp
    from curvkit.optim.filters import KFBayes, KFNatGrad, KFWhiten

    lik = _lik("sum")
    token_batches = [_features(20 + t) for t in range(3)]
    g = torch.Generator().manual_seed(21)
    sample_batches = []
    for _ in range(3):
        Xs, ys = torch.randn(B, 5, generator=g, dtype=D64), torch.randint(0, 3, (B,), generator=g)
        ys[[0, 2, 4]] = PAD
        sample_batches.append((Xs, ys))
    cases = (
        ("KFWhiten", lambda n, **kw: KFWhiten(n.parameters(), model=n, lr=0.05, inv_every=2, reduction="sum", **kw),
         _per_token_mlp, token_batches),
        ("KFBayes", lambda n, **kw: KFBayes(n.parameters(), model=n, lr=1e-3, fisher_samples=4, reduction="sum", **kw),
         lambda: mlp([5, 4, 3], "tanh", dtype=D64, seed=0), sample_batches),
        ("KFNatGrad", lambda n, **kw: KFNatGrad(n.parameters(), model=n, lr_sgd=1e-2, fisher_samples=None, reduction="sum", **kw),
         lambda: mlp([5, 4, 3], "tanh", dtype=D64, seed=0), sample_batches),
    )
    for name, make, net, batches in cases:
        nets = [net(), net()]
        ref, dst = make(nets[0]), make(nets[1], distributed=red)
        for X, y in batches:
            ref.zero_grad()
            lik(nets[0](X), y).backward()
            ref.step()
            dst.zero_grad()
            lik(nets[1](_shard(X, rank, world)), _shard(y, rank, world)).backward()
            dst.step()
        for (n, p1), p2 in zip(nets[0].named_parameters(), nets[1].parameters()):
            _close(p2, p1, f"{name} parameter {n}")
        ref.close()
        dst.close()


def _llc(rank, world, red):
    """The LLC's data-parallel gradients (``distributed_split='batch'``) with a padded per-token likelihood:
    its loss is the per-SAMPLE mean (each sample's counted tokens summed), so the shards are weighted by
    their rows, whatever the likelihood's reduction."""
    from curvkit.slt import SGLDConfig, estimate_llc

    X, y = _features(40, n=24)
    net = _per_token_mlp()
    cfg = SGLDConfig(num_chains=2, num_draws=6, epsilon=1e-3, gamma=10.0)
    for reduction in ("mean", "sum"):
        one = estimate_llc(net, (X, y), loss=_lik(reduction), batch_size=7, config=cfg, seed=3)
        split = estimate_llc(net, (X, y), loss=_lik(reduction), batch_size=7, config=cfg, seed=3, distributed=red,
                             distributed_split="batch")
        _close(split.loss_trace, one.loss_trace, f"LLC traces ({reduction})")


def _ddp(rank, world, red):
    """ddp's union gradient: a padded per-token mean (torch's cross-entropy) with the counted tokens declared
    (set_loss_terms; a shard without one has a NaN mean, not read), the default count (the output's
    positions) for sequences of unequal length per rank, and a summed loss."""
    from curvkit.distributed import ddp, set_loss_terms

    X, y = _features(50)
    ref_net = _per_token_mlp()

    def grads(net):
        return [p.grad.detach().clone() for p in net.parameters()]

    for reduction in ("mean", "sum"):
        lik = _lik(reduction)
        ref_net.zero_grad()
        lik(ref_net(X), y).backward()
        net = _per_token_mlp()
        model = ddp(net, Reducer(timeout=red.timeout), reduction)
        f = model(_shard(X, rank, world))
        yr = _shard(y, rank, world)
        set_loss_terms(model, lik.num_terms(f, yr))
        # torch's loss: its mean over a shard without a counted token is NaN, which the hook does not read
        torch.nn.functional.cross_entropy(f.reshape(-1, 3), yr.reshape(-1), ignore_index=PAD,
                                          reduction=reduction).backward()
        for (n, g1), g2 in zip(zip([n for n, _ in ref_net.named_parameters()], grads(ref_net)), grads(net)):
            _close(g2, g1, f"ddp ({reduction}) gradient of {n}")
    # no padding, sequences of unequal length per rank (rank r holds T - r positions): the default count
    lik = _lik("mean")
    lens = [T - r for r in range(world)]
    ref_net.zero_grad()
    total = sum(B * t for t in lens)
    sum(lik.with_reduction("sum")(ref_net(X[:, :t]), y[:, :t].clamp(min=0)) for t in lens).div(total).backward()
    net = _per_token_mlp()
    model = ddp(net, Reducer(timeout=red.timeout), "mean")
    t = lens[rank]
    lik(model(X[:, :t]), y[:, :t].clamp(min=0)).backward()
    for g1, g2 in zip(grads(ref_net), grads(net)):
        _close(g2, g1, "ddp (mean, unequal lengths) gradient")
    with pytest.raises(TypeError, match=r"module returned by curvkit\.distributed\.ddp"):
        set_loss_terms(net, 3)


def _no_counted_term(rank, world, red):
    """The union's mean over no counted term is refused on every rank (as one process refuses it), and a rank
    that holds none contributes nothing to a mean over the others'."""
    with pytest.raises(ValueError, match="every rank's count of terms is 0"):
        red.mean_of_sums([torch.ones(2, dtype=D64)], 0)
    out, total = red.mean_of_sums([torch.full((2,), 3.0 if rank == 0 else 0.0, dtype=D64)], 2 if rank == 0 else 0)
    assert total == 2 and out[0].tolist() == [1.5, 1.5]
    out, total = red.weighted_mean([torch.full((2,), float("nan") if rank else 1.0, dtype=D64)], 0 if rank else 2)
    assert total == 2 and out[0].tolist() == [1.0, 1.0]


def padded_worker(rank, world):
    torch.manual_seed(100 + rank)  # a different global RNG per rank: nothing may depend on it
    red = Reducer(timeout=60)
    _no_counted_term(rank, world, red)
    for check in (_gauss_newton, _meanfield, _curvature, _filters, _llc, _ddp):
        check(rank, world, red)


@pytest.mark.parametrize("world", [2, 3])
def test_padded_token_batches_equal_the_union_single_process(world):
    spawn(padded_worker, world, timeout=300, collective_timeout=120)


def test_sequences_and_tokens_differ_in_the_shards():
    """The test data weigh the ranks differently by sequences and by counted tokens (otherwise a reduction
    weighted by sequences would pass), and the 3-process split has a rank without a counted token."""
    _, y = _features(1)
    for bounds in BOUNDS.values():
        rows = [b - a for a, b in itertools.pairwise(bounds)]
        tokens = [int(y[a:b].ne(PAD).sum()) for a, b in itertools.pairwise(bounds)]
        gap = max(abs(r / sum(rows) - t / sum(tokens)) for r, t in zip(rows, tokens))
        assert gap > 0.2, f"rows {rows} and counted tokens {tokens} weigh the ranks alike"
    assert 0 in [int(y[a:b].ne(PAD).sum()) for a, b in itertools.pairwise(BOUNDS[3])]
