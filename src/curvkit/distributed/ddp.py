"""DistributedDataParallel with the exact gradient of the loss over the union of unequal shards.

Plain DDP averages the per-rank gradients, (1/P) sum_r g_r. That is the union's gradient only for a
``reduction='mean'`` loss on EQUAL shards. :func:`ddp` wraps a module in
``torch.nn.parallel.DistributedDataParallel`` with a communication hook that makes the bucket all-reduce
(still one ``all_reduce`` per bucket, overlapped with the backward pass as DDP does) return

* ``reduction='mean'``: sum_r B_r g_r / sum_r B_r (the batch size B_r of the rank's last forward pass
  travels as one extra number in each bucket), the gradient of the mean loss over the union;
* ``reduction='sum'``: sum_r g_r, the gradient of the summed loss over the union.

The reducer passed in is switched to ``grads='synced'`` so the curvkit optimisers sharing it read
``p.grad`` as it is. The bucket all-reduce goes through the reducer's entry point (device check, byte
count); DDP itself waits for it (with the process group's timeout, not the reducer's). Give the curvkit optimisers the UNWRAPPED module as ``model=``.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn

from curvkit.distributed.reducer import Reducer

__all__ = ["ddp"]


class _HookState:
    def __init__(self, reducer: Reducer, reduction: str):
        self.reducer = reducer
        self.reduction = reduction
        self.batch = 0


def _hook(state, bucket):  # type: ignore[no-untyped-def]  # DDP checks the annotations: none given
    t = bucket.buffer()
    red = state.reducer
    if state.reduction == "sum":
        fut = red._collective("all_reduce", "DDP gradient bucket", [t],
                              lambda: dist.all_reduce(t, group=red.group, async_op=True),
                              t.numel() * t.element_size(), wait=False).get_future()
        return fut.then(lambda f: f.value()[0])
    buf = torch.cat([t * float(state.batch), t.new_tensor([float(state.batch)])])
    fut = red._collective("all_reduce", "DDP gradient bucket", [buf],
                          lambda: dist.all_reduce(buf, group=red.group, async_op=True),
                          buf.numel() * buf.element_size(), wait=False).get_future()

    def done(f: Any) -> Any:
        out = f.value()[0]
        if not float(out[-1]) > 0:
            raise RuntimeError("curvkit.distributed.ddp: the batch sizes of the ranks sum to 0")
        return t.copy_(out[:-1] / out[-1])

    return fut.then(done)


def ddp(module: nn.Module, distributed: Reducer, reduction: Literal["mean", "sum"] = "mean",
        **ddp_kwargs: Any) -> nn.parallel.DistributedDataParallel:
    """``DistributedDataParallel(module, **ddp_kwargs)`` whose gradient is the union's (module docstring).

    ``reduction`` must match the loss the ranks back-propagate. The batch size of a rank is the leading
    size of the first input of its last forward pass with autograd enabled.
    """
    if reduction not in ("mean", "sum"):
        raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
    if not isinstance(distributed, Reducer):
        raise TypeError(f"distributed must be a curvkit.distributed.Reducer, got {type(distributed).__name__}")
    state = _HookState(distributed, reduction)

    def record(_m: nn.Module, args: tuple[Any, ...]) -> None:
        if torch.is_grad_enabled() and args and hasattr(args[0], "shape"):
            state.batch = int(args[0].shape[0])

    module.register_forward_pre_hook(record)
    kwargs = dict(ddp_kwargs)
    if distributed.group is not None:
        kwargs.setdefault("process_group", distributed.group)
    wrapped = nn.parallel.DistributedDataParallel(module, **kwargs)
    wrapped.register_comm_hook(state, _hook)
    distributed.grads = "synced"
    return wrapped
