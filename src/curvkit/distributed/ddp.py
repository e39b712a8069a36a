"""DistributedDataParallel with the exact gradient of the loss over the union of unequal shards.

Plain DDP averages the per-rank gradients, (1/P) sum_r g_r. That is the union's gradient only for a
``reduction='mean'`` loss on EQUAL shards. :func:`ddp` wraps a module in
``torch.nn.parallel.DistributedDataParallel`` with a communication hook that makes the bucket all-reduce
(still one ``all_reduce`` per bucket, overlapped with the backward pass as DDP does) return

* ``reduction='mean'``: sum_r M_r g_r / sum_r M_r, the gradient of the mean loss over the union, with M_r
  the number of terms the rank's mean loss divides by (its counted terms, :mod:`curvkit.distributed.reducer`),
  which travels as one extra number in each bucket (a rank with M_r = 0, every target padding, sends
  zeros). By default M_r is the number of positions of the rank's last forward output, all but its last
  dimension (curvkit's convention: outputs (B, *P, C), classes last; = B for (B, C) outputs, and the
  leading size of the first input for an output that is not a tensor): the count of a mean over every
  position. A mean that leaves positions out (padding, ``ignore_index``) must say how many it counted, on
  every rank, after the forward pass and before ``backward()``: ``set_loss_terms(model,
  likelihood.num_terms(f, y))``;
* ``reduction='sum'``: sum_r g_r, the gradient of the summed loss over the union.

The reducer passed in is switched to ``grads='synced'`` so the curvkit optimisers sharing it read
``p.grad`` as it is. The bucket all-reduce goes through the reducer's entry point (device check, byte
count); DDP itself waits for it (with the process group's timeout, not the reducer's). Give the curvkit optimisers the UNWRAPPED module as ``model=``.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from curvkit.distributed.reducer import Reducer

__all__ = ["ddp", "set_loss_terms"]


class _HookState:
    def __init__(self, reducer: Reducer, reduction: str):
        self.reducer = reducer
        self.reduction = reduction
        self.terms = 0  # the counted terms of the rank's mean loss (module docstring)


def _positions(output: Any, args: tuple[Any, ...]) -> int:
    """The number of positions of a forward output (module docstring)."""
    if isinstance(output, torch.Tensor) and output.dim() >= 1:
        return math.prod(output.shape[:-1]) if output.dim() >= 2 else int(output.shape[0])
    return int(args[0].shape[0]) if args and hasattr(args[0], "shape") else 0


def _hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations: none given
    t = bucket.buffer()
    red = state.reducer
    if state.reduction == "sum":
        fut = red._collective("all_reduce", "DDP gradient bucket", [t],
                              lambda: dist.all_reduce(t, group=red.group, async_op=True),
                              t.numel() * t.element_size(), wait=False).get_future()
        return fut.then(lambda f: f.value()[0])
    m = float(state.terms)
    buf = torch.cat([t * m if m else torch.zeros_like(t), t.new_tensor([m])])
    fut = red._collective("all_reduce", "DDP gradient bucket", [buf],
                          lambda: dist.all_reduce(buf, group=red.group, async_op=True),
                          buf.numel() * buf.element_size(), wait=False).get_future()

    def done(f: Any) -> Any:
        out = f.value()[0]
        if not float(out[-1]) > 0:
            raise RuntimeError("curvkit.distributed.ddp: the counted loss terms of the ranks sum to 0 (every "
                               "target is padding); the mean over the union is undefined")
        return t.copy_(out[:-1] / out[-1])

    return fut.then(done)


def ddp(module: nn.Module, distributed: Reducer, reduction: Literal["mean", "sum"] = "mean",
        **ddp_kwargs: Any) -> nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel(module, **ddp_kwargs)`` whose gradient is the union's (module docstring).

    ``reduction`` must match the loss the ranks back-propagate. With ``'mean'`` a rank's weight is the
    number of positions of its last forward output with autograd enabled, or the count given to
    :func:`set_loss_terms` after that forward pass (padding).
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if not isinstance(distributed, Reducer):
        raise TypeError(f"distributed must be a curvkit.distributed.Reducer, got {type(distributed).__name__}")
    state = _HookState(distributed, reduction)

    def record(_m: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if torch.is_grad_enabled():
            state.terms = _positions(output, args)

    module.register_forward_hook(record)
    kwargs = dict(ddp_kwargs)
    if distributed.group is not None:
        kwargs.setdefault("process_group", distributed.group)
    wrapped = nn.parallel.DistributedDataParallel(module, **kwargs)
    wrapped.register_comm_hook(state, _hook)
    setattr(wrapped, "_curvkit_ddp_state", state)  # noqa: B010  # read by set_loss_terms
    distributed.grads = "synced"
    return wrapped


def set_loss_terms(model: nn.parallel.DistributedDataParallel, terms: int) -> None:
    """Declare how many terms this rank's ``reduction='mean'`` loss counted in the last forward pass of
    ``model`` (a :func:`ddp` module), e.g. ``likelihood.num_terms(f, y)`` with padding; call it after the
    forward pass and before ``backward()``, on every rank (module docstring). 0 is allowed (every target
    of the shard is padding)."""
    state = getattr(model, "_curvkit_ddp_state", None)
    if not isinstance(state, _HookState):
        raise TypeError(f"set_loss_terms needs a module returned by curvkit.distributed.ddp, got "
                        f"{type(model).__name__}")
    if isinstance(terms, bool) or int(terms) != terms or terms < 0:
        raise ValueError(f"terms must be a non-negative integer (the counted loss terms of this rank's batch), got "
                         f"{terms!r}")
    state.terms = int(terms)
