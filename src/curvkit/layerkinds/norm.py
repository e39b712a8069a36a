"""Normalisation layers' affine parameters: ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm`` and
``nn.BatchNorm1d/2d/3d`` with running statistics (eval mode).

Each layer computes ``y = x_hat * w + b`` with a normalised input ``x_hat`` that does not depend on w, b,
so the per-sample gradient of its parameters for an output-space vector with back-propagated output
gradient ``dy`` is exact and cheap:

    dL/dw_n = sum_positions x_hat (.) dy,      dL/db_n = sum_positions dy,

summed over every position of sample n (tokens, pixels) BEFORE squaring. The block is formed from these
per-sample gradients (``form='grad'``): the exact per-layer block ``sum_n u_n u_n^T`` of the vectors the
estimator back-propagates (dense, P = 2 D entries: they are small) or its diagonal, as the estimator's
``norm_structure`` asks. ``x_hat`` is recomputed from the layer INPUT with the layer's own eps and
statistics (never from the output as ``(y - b) / w``, which fails for w = 0 or without a bias), when the
gradient arrives (no copy of it is kept). BatchNorm
in training mode (batch statistics couple the samples) is refused by the model reader before this runs,
unless the estimator was built with ``batch_statistics='couple'``: then ``x_hat`` is normalised with the
statistics of the batch the layer ran on, ``(x - mean) / sqrt(var + eps)`` with the mean and the BIASED
variance over the samples and positions of each channel (as BatchNorm normalises in training mode), and
``dy`` is the gradient of the coupled backward pass (it includes the terms through the batch statistics).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from curvkit.layerkinds._base import BlockSpec, Emit, LayerHandler, Site, batched_input, recording, row_index

__all__ = ["NormHandler"]

_BUDGET = 2**20  # scalars of x_hat formed at once (a few samples' worth of the layer input)


def _normalised(mod: nn.Module, x: Tensor) -> Tensor:
    """x_hat of the layer, same shape as x (no affine parameters applied)."""
    if isinstance(mod, nn.LayerNorm):
        return F.layer_norm(x, mod.normalized_shape, None, None, mod.eps)
    if isinstance(mod, nn.RMSNorm):
        return F.rms_norm(x, list(mod.normalized_shape), None, mod.eps)
    if isinstance(mod, nn.GroupNorm):
        return F.group_norm(x, mod.num_groups, None, None, mod.eps)
    assert isinstance(mod, nn.modules.batchnorm._BatchNorm)
    if mod.training or mod.running_mean is None:  # batch statistics (biased variance), nothing updated
        return F.batch_norm(x, None, None, None, None, True, 0.0, mod.eps)
    return F.batch_norm(x, mod.running_mean, mod.running_var, None, None, False, 0.0, mod.eps)


class NormHandler(LayerHandler):
    """LayerNorm / RMSNorm / GroupNorm / BatchNorm (running statistics) (module docstring)."""

    kind = "norm"
    takes_shards = True

    def blocks(self, module: nn.Module, label: str, names: Mapping[str, str | None], what: str) -> list[BlockSpec]:
        w, b = names.get("weight"), names.get("bias")
        first = w if w is not None else b
        assert first is not None
        P = sum(int(getattr(module, a).numel()) for a in ("weight", "bias") if names.get(a) is not None)
        roles = tuple(a for a in ("weight", "bias") if names.get(a) is not None)
        return [BlockSpec(label, first, b if w is not None else None, 1, P, form="grad", index=row_index(P),
                          roles=roles)]

    def attach(self, module: nn.Module, label: str, blocks: Sequence[BlockSpec], emit: Emit, what: str) -> list[Any]:
        with_w, with_b = "weight" in blocks[0].roles, "bias" in blocks[0].roles
        channels_last = isinstance(module, (nn.LayerNorm, nn.RMSNorm))
        m: Any = module
        width = int(math.prod(m.normalized_shape) if channels_last else
                    getattr(m, "num_features", getattr(m, "num_channels", 0)))

        def position_sums(t: Tensor) -> Tensor:
            """(b, ...) -> (b, width): the sum over the positions of each sample and parameter entry (no copy
            of t: channels first are summed over the trailing dimensions where they are)."""
            if channels_last:
                return t.reshape(t.shape[0], -1, width).sum(1)
            return t.sum(tuple(range(2, t.dim()))) if t.dim() > 2 else t

        def gradient(mod: nn.Module, x: Tensor) -> Callable[[Tensor], Tensor]:
            # x_hat is recomputed here (the layer input is alive anyway), a few samples at a time: with
            # statistics of the batch (BatchNorm in training mode) from the whole batch at once
            per_sample = not isinstance(mod, nn.modules.batchnorm._BatchNorm) or (
                not mod.training and mod.running_mean is not None)
            step = max(1, _BUDGET // max(1, x[0].numel())) if per_sample and x.shape[0] else max(1, x.shape[0])

            starts = range(0, x.shape[0], step) or range(1)  # an empty batch (a data-parallel rank's): one chunk

            def read(g: Tensor) -> Tensor:
                parts = []
                if with_w:
                    parts.append(torch.cat([position_sums(_normalised(mod, x[lo:lo + step]).mul_(g[lo:lo + step]))
                                            for lo in starts]))
                if with_b:
                    parts.append(position_sums(g))
                return torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]
            return read

        least = len(m.normalized_shape) if channels_last else 1

        def hook(mod: nn.Module, inputs: tuple[Any, ...], out: Tensor) -> None:
            if not recording(out):
                return
            x = batched_input(mod, label, inputs[0], least + 1, what, "an input with a batch dimension").detach()
            emit(Site(0, x, out, gradient(mod, x)))

        return [module.register_forward_hook(hook)]

