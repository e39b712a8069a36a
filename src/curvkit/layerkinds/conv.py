"""Convolutions (``nn.Conv1d``, ``nn.Conv2d``, ``nn.Conv3d``; any padding mode, stride, dilation; grouped and depthwise).

The T output locations share the weight. Input rows are the unfolded patches (B, T, C*k) in the order of
``weight.reshape(out, -1)`` (:func:`curvkit.structure.conv_patches`), output rows the gradient at the
output (B, out, *spatial) as (B, T, out).

Groups. A convolution with ``groups = g`` is g independent convolutions: group j maps input channels
``[j C/g, (j+1) C/g)`` to output channels ``[j O/g, (j+1) O/g)`` with the rows ``[j O/g, (j+1) O/g)`` of
the weight (out, C/g, *k) (and of the bias). Each group gets its own block ``G_j (x) A_j`` (G_j: (O/g, O/g),
A_j: (C/g k + 1, C/g k + 1)) from its own patch columns and output channels; a depthwise convolution
(g = C) has one block per channel. (curvlinops instead averages the patches over the groups and keeps one
(out, out) G: a different approximation, not per-group blocks.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from torch import Tensor, nn

from curvkit.layerkinds._base import (
    BlockSpec,
    Emit,
    LayerHandler,
    Site,
    UnfoldedSite,
    batched_input,
    recording,
    weight_and_bias,
)
from curvkit.linalg.kron import standard_index
from curvkit.structure import conv_patches

__all__ = ["ConvHandler"]


class ConvHandler(LayerHandler):
    """``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d`` with any ``groups`` (module docstring)."""

    kind = "conv"

    def blocks(self, module: nn.Module, label: str, names: Mapping[str, str | None], what: str) -> list[BlockSpec]:
        w, b = weight_and_bias(module, label, names, what)
        assert w is not None
        weight: Any = module.weight
        g = int(module.groups)  # type: ignore[arg-type]
        out, k = int(weight.shape[0]), int(math.prod(weight.shape[1:]))
        if g == 1:
            return [BlockSpec(label, w, b, out, k)]
        index = standard_index(weight.shape, b is not None)
        rows = out // g
        return [BlockSpec(f"{label}.group{j}", w, b, rows, k, index=index[j * rows:(j + 1) * rows])
                for j in range(g)]

    def attach(self, module: nn.Module, label: str, blocks: Sequence[BlockSpec], emit: Emit, what: str) -> list[Any]:
        mod: Any = module
        g, out = int(mod.groups), int(mod.out_channels)
        spatial = 1 if isinstance(module, nn.Conv1d) else 3 if isinstance(module, nn.Conv3d) else 2
        expect = {1: "an input (batch, channels, length)", 2: "an input (batch, channels, height, width)",
                  3: "an input (batch, channels, depth, height, width)"}[spatial]
        ck = int(math.prod(mod.weight.shape[1:]))  # C/g * k: one patch's entries per group

        def hook(mod: nn.Module, inputs: tuple[Any, ...], y: Tensor) -> None:
            if not recording(y):
                return
            x = batched_input(mod, label, inputs[0], 2 + spatial, what, expect).detach()
            B = x.shape[0]

            def rows(grad: Tensor) -> Tensor:
                return grad.reshape(B, out, -1).transpose(1, 2)  # (B, T, out)

            if g == 1:  # patches unfolded on demand, a few samples at a time if the consumer wants
                size = y[0, 0].numel() * ck  # T * C*k
                emit(UnfoldedSite(0, y, rows, lambda lo, hi: conv_patches(mod, x[lo:hi]), B, size))
                return
            patches = conv_patches(mod, x)  # (B, T, C*k)
            k, o = patches.shape[-1] // g, out // g
            for j in range(g):
                emit(Site(j, patches[..., j * k:(j + 1) * k], y, _columns(rows, j * o, (j + 1) * o)))

        return [module.register_forward_hook(hook)]


def _columns(rows: Callable[[Tensor], Tensor], start: int, stop: int) -> Callable[[Tensor], Tensor]:
    """``rows`` followed by the output columns [start, stop) of one group."""
    return lambda grad: rows(grad)[..., start:stop]
