"""Issue 30 §2: data-parallel GaussNewton takes a tied weight's block that is the SUM of two Kronecker terms
(``KroneckerBlock.second``, the route above ``SHARED_DENSE_LIMIT``; lowered here so that a tiny float64 nanoGPT
takes it). Two processes (gloo, unequal shards of the batch) against one process on their union:

* the all-reduced operator, both terms of the pair included, equals the union's to 1e-12;
* the owner-placed damped inverse applied to one gradient (``'factored'``: the owner's generalised
  eigendecompositions shared with the unit's workers; ``'eigen'``: the owner's conjugate-gradient direction
  shared with every rank) equals the single-process direction to 1e-12, under comm-opt and mem-opt;
* three GaussNewton steps give the union's objectives and parameters, and the replicas stay bitwise identical.
"""

from __future__ import annotations

import pytest
import torch

from curvkit.distributed import Reducer, spawn

D64 = torch.float64
V, B, T = 40, 5, 4
BOUNDS = [0, 3, 5]  # unequal shards of B = 5 sequences


def _batch(t):
    g = torch.Generator().manual_seed(20 + t)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def _close(a, b, what, tol=1e-12):
    a, b = torch.as_tensor(a).detach(), torch.as_tensor(b).detach()
    err = float((a - b).abs().max())
    scale = max(1.0, float(b.abs().max()))
    assert err <= tol * scale, f"{what}: max abs difference {err:.3g} (scale {scale:.3g})"


def pair_worker(rank, world):
    from tests.test_shared_weights import NanoGPT

    from curvkit.curvature import estimators
    from curvkit.likelihoods import CrossEntropy
    from curvkit.optim import GaussNewton
    from curvkit.optim.second_order._distributed import DistributedKroneckerInverse
    from curvkit.optim.second_order.direction import FactoredInverse

    estimators.SHARED_DENSE_LIMIT = 10  # a fresh process: the pair route for the 40 x 5 tied table
    torch.manual_seed(100 + rank)  # a different global RNG per rank: nothing may depend on it
    lik = CrossEntropy("mean")
    rows = slice(BOUNDS[rank], BOUNDS[rank + 1])

    def net():
        torch.manual_seed(0)
        return NanoGPT(vocab=V, dim=5).to(D64)

    for placement in ("comm-opt", "mem-opt"):
        for inversion in ("factored", "eigen"):
            red = Reducer(placement=placement, timeout=60)
            what = f"{inversion} {placement}"
            kw = dict(likelihood=lik, curvature="kflr", inversion=inversion, tau_every=1, zeta_every=2,
                      weight_decay=1e-4)
            nets = [net(), net()]
            ref = GaussNewton(nets[0].parameters(), model=nets[0], **kw)
            dst = GaussNewton(nets[1].parameters(), model=nets[1], distributed=red, **kw)
            for t in range(3):
                X, y = _batch(t)
                e1 = ref.step(batch=(X, y))
                e2 = dst.step(batch=(X[rows], y[rows]))
                _close(e2, e1, f"{what} step {t} objective")
                red.check_identical(nets[1].parameters(), f"{what} replicas after step {t}")
            (b,) = [b for b in dst._op.blocks if b.pair]
            assert b.name == "wte + lm_head"
            _close(dst._op.to_dense(), ref._op.to_dense(), f"{what} reduced operator (both terms of the pair)")
            for p1, p2 in zip(nets[0].parameters(), nets[1].parameters()):
                _close(p2, p1, f"{what} parameters", tol=1e-10)
            # the owner-placed inverse against the single-process one on the same operator and gradient
            op = ref._op
            g = torch.randn(op.layout.dim, generator=torch.Generator().manual_seed(3), dtype=D64)
            grads = dict(zip(op.layout.names, op.layout.unflatten(g)))
            omegas = op.damping_split() if inversion == "factored" else None
            d = DistributedKroneckerInverse(op, 0.2, inversion, omegas, red).apply(grads)
            got = op.layout.flatten([d[n] for n in op.layout.names])
            if inversion == "factored":
                want_d = FactoredInverse(op, 0.2, omegas).apply(grads)
                want = op.layout.flatten([want_d[n] for n in op.layout.names])
                _close(want, torch.linalg.solve(op.factored_damping(0.2, pi=omegas).to_dense(), g),
                       "factored direction against the dense damped operator", tol=1e-10)
            else:
                want = op.inverse(0.2, method="eigen") @ g
                _close(want, torch.linalg.solve(op.to_dense() + 0.2 * torch.eye(op.layout.dim, dtype=D64), g),
                       "exact direction against the dense damped operator", tol=1e-8)
            _close(got, want, f"{what} owner-placed direction")
            red.check_identical([got], f"{what} direction")


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_data_parallel_gauss_newton_takes_a_pair_block_equal_to_one_process_on_the_union():
    pytest.importorskip("transformers")  # tests.test_shared_weights (NanoGPT's module) needs it
    spawn(pair_worker, 2, timeout=240, collective_timeout=60)


def low_rank_pair_worker(rank, world):
    """The tied head's G low rank (``LOW_RANK_OUTPUTS`` lowered below its 40 outputs): its rows gathered over
    the ranks, the pair's thin generalised eigendecompositions on the owner; each rank samples its own labels
    (``kfac``), so the reference is the same data-parallel run with every factor dense."""
    from tests.test_shared_weights import NanoGPT

    from curvkit.curvature import estimators
    from curvkit.likelihoods import CrossEntropy
    from curvkit.optim import GaussNewton

    estimators.SHARED_DENSE_LIMIT = 10
    rows = slice(BOUNDS[rank], BOUNDS[rank + 1])
    for inversion, placement in (("factored", "comm-opt"), ("eigen", "mem-opt")):
        red = Reducer(placement=placement, timeout=60)
        out = {}
        for threshold in (8, 10**9):
            estimators.LOW_RANK_OUTPUTS = threshold
            torch.manual_seed(0)
            net = NanoGPT(vocab=V, dim=5).to(D64)
            opt = GaussNewton(net.parameters(), model=net, likelihood=CrossEntropy("mean"), curvature="kfac",
                              inversion=inversion, tau_every=1, zeta_every=2, distributed=red)
            for t in range(3):
                X, y = _batch(t)
                opt.step(batch=(X[rows], y[rows]))
            (b,) = [b for b in opt._op.blocks if b.pair]
            assert b.low_rank_output == (threshold == 8), b
            out[threshold] = [p.detach().clone() for p in net.parameters()]
        for p1, p2 in zip(out[8], out[10**9]):
            _close(p1, p2, f"low-rank pair, {inversion} {placement}: parameters", tol=1e-10)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_data_parallel_gauss_newton_takes_a_pair_block_with_a_low_rank_head():
    pytest.importorskip("transformers")
    spawn(low_rank_pair_worker, 2, timeout=240, collective_timeout=60)
