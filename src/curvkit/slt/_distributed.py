"""LLC chains spread over ranks (:func:`estimate_llc_chains`, reached through
``curvkit.slt.estimate_llc(..., distributed=reducer)``) and data-parallel gradients within a chain
(:func:`sharded_grad_fn`, ``distributed_split='batch'``).

Chains (``distributed_split='chains'``, the default). Every rank holds the whole data set D_n. The
``num_chains`` chains are split as evenly as possible (the first ``num_chains % P`` ranks run one more);
rank r runs its chains with the seed ``derive_seed(seed, r)`` (rank 0 keeps ``seed``, so one process
reproduces the non-distributed estimate). The per-chain loss traces are gathered on every rank in rank
order and summarised once: with ``init_loss='minibatch'`` L(w*) is the mean over ALL chains of the
first-batch losses (sum_r C_r L_r / C, the non-distributed definition), with ``'full'`` or a given value
it is the same on every rank. Every rank returns the identical :class:`~curvkit.slt.llc.LLCResult`; it
equals the single-process computation that runs each rank's chains with that rank's seed. The chains of
one rank share one generator (as in the single-process estimator), so the estimate depends on the pair
(number of processes, seed); it is the same estimator in distribution.

Batch (``distributed_split='batch'``). All ranks run the SAME chains (same seed, same noise, same
minibatch indices); each SGLD gradient is computed on this rank's contiguous share of the minibatch rows,
weighted by share/m, and all-reduced with the losses: the numbers of the single-process run to rounding.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from curvkit.distributed.reducer import Reducer, shard_range
from curvkit.validation import map_inputs

__all__ = ["estimate_llc_chains", "sharded_grad_fn"]


def sharded_grad_fn(step_fn: Any, batch_axis: int | None, distributed: Reducer) -> Any:
    """``step_fn`` on this rank's share of every batch's rows; gradients and losses weighted by
    (share / m) and summed over the ranks: the whole batch's mean-loss gradient on every rank."""

    def fn(params: dict[str, Tensor], batch: Any) -> tuple[dict[str, Tensor], Tensor]:
        X, y = batch
        dim = 0 if batch_axis is None else batch_axis + 1
        m = int(y.shape[dim])
        a, b = shard_range(m, distributed.rank, distributed.world_size)
        if b <= a:
            raise ValueError(f"estimate_llc(distributed_split='batch'): a minibatch of {m} rows cannot give every "
                             f"one of {distributed.world_size} ranks a row; use a batch_size >= the number of "
                             "processes or distributed_split='chains'")
        g, v = step_fn(params, (map_inputs(lambda t: t.narrow(dim, a, b - a), X), y.narrow(dim, a, b - a)))
        w = (b - a) / m
        names = list(g)
        parts = [g[k] * w for k in names] + [v * w]
        distributed.all_reduce_(parts, "all_reduce of SGLD gradients")
        return dict(zip(names, parts[:-1])), parts[-1]

    return fn


def estimate_llc_chains(distributed: Reducer, model: Any, data: Any, *, config: Any, seed: int,
                        init_loss: float | None, **kwargs: Any) -> Any:
    """The chain-parallel estimate (module docstring); ``kwargs`` go to ``estimate_llc``."""
    from curvkit.slt.llc import _summarise, estimate_llc
    from curvkit.slt.sampler import SGLDConfig

    if kwargs.get("generator") is not None:
        raise ValueError("estimate_llc(distributed=..., distributed_split='chains') derives each rank's generator "
                         "from seed=; pass seed instead of generator")
    cfg = config or SGLDConfig()
    C = int(cfg.num_chains)
    P = distributed.world_size
    if C < P:
        raise ValueError(f"estimate_llc: {C} chains cannot be spread over {P} processes (each needs at least "
                         f"one); use num_chains >= {P} or distributed_split='batch'")
    distributed.check_same((C, seed, init_loss), "estimate_llc's (num_chains, seed, init_loss)")
    a, b = shard_range(C, distributed.rank, P)
    local_cfg = dataclasses.replace(cfg, num_chains=b - a)
    res = estimate_llc(model, data, config=local_cfg, seed=distributed.seed(seed), init_loss=init_loss, **kwargs)
    gathered = distributed.all_gather_object((b - a, res.init_loss, res.loss_trace, res.seconds))
    counts = [g[0] for g in gathered]
    traces = torch.cat([g[2] for g in gathered])
    if init_loss is not None or cfg.init_loss == "full" or res.batch_size >= res.n:
        init = float(res.init_loss)
    else:
        init = float(sum(c * g[1] for c, g in zip(counts, gathered)) / C)
    seconds = max(float(g[3]) for g in gathered)
    out = _summarise(traces, init, res.nbeta, res.n, res.batch_size, cfg, seconds,
                     {"world_size": P, "chains_per_rank": counts})
    return out
