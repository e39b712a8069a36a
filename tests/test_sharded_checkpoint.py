"""Checkpoints of FSDP2-sharded runs (issue 33; :mod:`curvkit.distributed.sharded_checkpoint`): a GaussNewton run
stopped after two steps, saved (the model's shards through DCP, the optimiser's whole state in curvkit's format)
and resumed on the same number of processes equals the uninterrupted run bitwise, and on another number (save
with 2, load with 3 and vice versa) equals the single-process run on the union to 1e-12 (kflr; kfac's per-rank
label streams resume on the same number only, and another is refused by name); a fitted posterior of a sharded
model saved and loaded on either number gives the single-process posterior's numbers. Gloo, CPU, float64."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from tests.test_laplace_sharded import _rank_batches, _same_posterior
from tests.test_sharded import _batches, _data, _sharded_and_reference

from curvkit.distributed import spawn

COMMON = dict(tau_every=1, zeta_every=2, weight_decay=1e-3, momentum=True)


def _optimiser(net, curvature, distributed=None):
    from curvkit.likelihoods import CrossEntropy
    from curvkit.optim import GaussNewton

    return GaussNewton(net.parameters(), model=net, likelihood=CrossEntropy(ignore_index=-100), curvature=curvature,
                       distributed=distributed, **COMMON)


def _whole(net):
    return [p.full_tensor().detach().clone() for p in net.parameters()]


def save_worker(rank, world, path):
    from curvkit.distributed import Reducer, save_sharded_checkpoint
    from curvkit.laplace import Laplace
    from curvkit.likelihoods import CrossEntropy

    red = Reducer()
    batches, bounds = _batches(world, steps=4)
    mine = slice(bounds[rank], bounds[rank + 1])
    for curvature in ("kflr", "kfac"):
        net, _ = _sharded_and_reference()
        opt = _optimiser(net, curvature, red)
        for X, y in batches[:2]:
            opt.step(batch=(X[mine], y[mine]))
        save_sharded_checkpoint(os.path.join(path, f"gn-{curvature}"), red, model=net,
                                state={"opt": opt.state_dict()}, rank_state=opt.rank_state())
        for X, y in batches[2:]:  # the uninterrupted run
            opt.step(batch=(X[mine], y[mine]))
        final = _whole(net)
        if red.is_primary:
            torch.save(final, os.path.join(path, f"final-{curvature}.pt"))
    # a fitted posterior of the sharded model (saved twice: the second save replaces the first in place)
    X, y, data_bounds = _data(world)
    net, _ = _sharded_and_reference()
    post = Laplace(net, CrossEntropy(ignore_index=-100), "kron", prior_precision=0.5, distributed=red)
    for prior in (2.0, 0.5):
        post.prior_precision = prior
        post.fit(_rank_batches(X, y, data_bounds, rank))
        save_sharded_checkpoint(os.path.join(path, "posterior"), red, model=net, state={"posterior": post.state_dict()})
    red.barrier()


def load_worker(rank, world, path, saved_world):
    from curvkit.distributed import DistributedCheckpointError, Reducer, load_sharded_checkpoint
    from curvkit.laplace import Laplace
    from curvkit.likelihoods import CrossEntropy

    red = Reducer()
    batches, bounds = _batches(world, steps=4)
    mine = slice(bounds[rank], bounds[rank + 1])
    same = world == saved_world
    for curvature in ("kflr", "kfac"):
        net, ref = _sharded_and_reference()
        with torch.no_grad():  # nothing of the fresh model may survive the load
            for p in net.parameters():
                p.to_local().normal_()
        opt = _optimiser(net, curvature, red)
        where = os.path.join(path, f"gn-{curvature}")
        if curvature == "kfac" and not same:  # each rank's stream of sampled labels cannot be re-split
            with pytest.raises(DistributedCheckpointError, match=f"written by {saved_world} processes"):
                load_sharded_checkpoint(where, red, model=net, rank_state_required=opt.rank_state() is not None)
            continue
        state, own = load_sharded_checkpoint(where, red, model=net, rank_state_required=opt.rank_state() is not None)
        opt.load_state_dict(state["opt"])
        opt.load_rank_state(own)
        for X, y in batches[2:]:
            opt.step(batch=(X[mine], y[mine]))
        got = _whole(net)
        if same:  # bitwise the uninterrupted run
            for a, b in zip(got, torch.load(os.path.join(path, f"final-{curvature}.pt"))):
                torch.testing.assert_close(a, b, atol=0, rtol=0)
        if curvature == "kflr":  # the single-process run on the union, uninterrupted
            want = _optimiser(ref, curvature)
            for X, y in batches:
                want.step(batch=(X, y))
            for a, b in zip(got, ref.parameters()):
                torch.testing.assert_close(a, b, atol=1e-12, rtol=0)
        for p in net.parameters():  # still sharded over this run's ranks
            assert p.to_local().shape[0] <= -(-p.shape[0] // world)
    # the posterior, loaded on a fresh sharded model (the model's shards restored too)
    X, y, _ = _data(world)
    lik = CrossEntropy(ignore_index=-100)
    net, ref = _sharded_and_reference()
    with torch.no_grad():
        for p in net.parameters():
            p.to_local().zero_()
    post = Laplace(net, lik, "kron", distributed=red)
    state, _ = load_sharded_checkpoint(os.path.join(path, "posterior"), red, model=net)
    post.load_state_dict(state["posterior"])
    want = Laplace(ref, lik, "kron", prior_precision=0.5).fit((X, y))
    _same_posterior(post, want, X)
    for p, q in zip(net.parameters(), ref.parameters()):
        torch.testing.assert_close(p.full_tensor(), q, atol=0, rtol=0)
    assert not os.path.exists(os.path.join(path, "posterior.old"))
    assert not os.path.exists(os.path.join(path, "posterior.partial"))


@pytest.mark.parametrize(("saved", "other"), [(2, 3), (3, 2)])
def test_sharded_runs_resume_on_the_same_and_another_number_of_processes(tmp_path, saved, other):
    spawn(save_worker, saved, (str(tmp_path),), timeout=300, collective_timeout=60)
    spawn(load_worker, saved, (str(tmp_path), saved), timeout=300, collective_timeout=60)
    spawn(load_worker, other, (str(tmp_path), saved), timeout=300, collective_timeout=60)


class _Boom:
    """A pickle that creates a directory when it is loaded by an ordinary unpickler."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.mkdir, (self.marker,))


def crafted_worker(rank, world, path):
    from curvkit.checkpoint import CheckpointError
    from curvkit.distributed import DistributedCheckpointError, Reducer, load_sharded_checkpoint

    red = Reducer()
    net, _ = _sharded_and_reference()
    with pytest.raises(DistributedCheckpointError, match="no complete sharded checkpoint"):
        load_sharded_checkpoint(os.path.join(path, "nothing"), red, model=net)
    with pytest.raises(CheckpointError, match="not DCP metadata that curvkit reads safely"):
        load_sharded_checkpoint(os.path.join(path, "gn-kflr"), red, model=net)
    # a save stopped between its two renames: the previous checkpoint, complete, is read from PATH.old
    state, own = load_sharded_checkpoint(os.path.join(path, "gn-kfac"), red, model=net, rank_state_required=True)
    assert state["opt"]["gauss_newton"]["num_steps"] == 2 and own is not None


def test_a_crafted_metadata_file_is_refused_unrun_and_an_interrupted_save_reads_the_previous(tmp_path):
    spawn(save_worker, 2, (str(tmp_path),), timeout=300, collective_timeout=60)
    with open(tmp_path / "gn-kflr" / "model" / ".metadata", "wb") as f:
        pickle.dump(_Boom(str(tmp_path / "ran")), f)
    os.replace(tmp_path / "gn-kfac", tmp_path / "gn-kfac.old")
    spawn(crafted_worker, 2, (str(tmp_path),), timeout=120, collective_timeout=60)
    assert not (tmp_path / "ran").exists()
