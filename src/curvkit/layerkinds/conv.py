"""Convolutions (``nn.Conv1d``, ``nn.Conv2d``, ``nn.Conv3d``; any padding mode, stride, dilation; grouped and depthwise).

The T output locations share the weight. Input rows are the unfolded patches (B, T, C*k) in the order of
``weight.reshape(out, -1)`` (:func:`conv_patches`), output rows the gradient at the
output (B, out, *spatial) as (B, T, out).

Groups. A convolution with ``groups = g`` is g independent convolutions: group j maps input channels
``[j C/g, (j+1) C/g)`` to output channels ``[j O/g, (j+1) O/g)`` with the rows ``[j O/g, (j+1) O/g)`` of
the weight (out, C/g, *k) (and of the bias). Each group gets its own block ``G_j (x) A_j`` (G_j: (O/g, O/g),
A_j: (C/g k + 1, C/g k + 1)) from its own patch columns and output channels; a depthwise convolution
(g = C) has one block per channel. (curvlinops instead averages the patches over the groups and keeps one
(out, out) G: a different approximation, not per-group blocks.)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import torch
import torch.nn.functional as F
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

__all__ = ["ConvHandler", "conv_forward", "conv_patch_means", "conv_patches"]

_BUDGET = 2**24  # scalars per chunk of per-sample gradients (squared_gradients)


class ConvHandler(LayerHandler):
    """``nn.Conv1d`` / ``nn.Conv2d`` / ``nn.Conv3d`` with any ``groups`` (module docstring)."""

    kind = "conv"
    takes_shards = True

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
                emit(UnfoldedSite(0, y, rows, lambda lo, hi: conv_patches(mod, x[lo:hi]), B, size,
                                  lambda: conv_patch_means(mod, x)))
                return
            patches = conv_patches(mod, x)  # (B, T, C*k)
            k, o = patches.shape[-1] // g, out // g
            for j in range(g):
                emit(Site(j, patches[..., j * k:(j + 1) * k], y, _columns(rows, j * o, (j + 1) * o)))

        return [module.register_forward_hook(hook)]

    # ------------------------------------------------------------------ capabilities
    def bilinear(self, module: nn.Module) -> bool:
        return True

    def tangent(self, module: nn.Module, x: Tensor, t: Tensor | None, values: Mapping[str, Tensor],
                tangents: Mapping[str, Tensor]) -> Tensor | None:
        """``conv(t, W) + conv(x, dW) + db`` (:func:`conv_forward`: any padding mode, stride,
        dilation, groups); with groups 1 the k weight tangents are stacked along the output channels: ONE
        convolution for all directions."""
        W, dW, db = values["weight"], tangents.get("weight"), tangents.get("bias")
        out: Tensor | None = None
        if t is not None:
            out = conv_forward(module, t.flatten(0, 1), W, None)
            out = out.view(t.shape[0], -1, *out.shape[1:])
        if dW is not None or db is not None:
            k, o = (dW if dW is not None else db).shape[0], W.shape[0]  # type: ignore[union-attr]
            if dW is None:
                dW = torch.zeros(k, *W.shape, dtype=W.dtype, device=W.device)
            if int(module.groups) == 1:  # type: ignore[arg-type]
                term = conv_forward(module, x, dW.reshape(k * o, *W.shape[1:]),
                                    None if db is None else db.reshape(k * o))
                term = term.view(x.shape[0], k, o, *term.shape[2:]).transpose(0, 1)
            else:
                term = torch.stack([conv_forward(module, x, dW[j], None if db is None else db[j]) for j in range(k)])
            out = term if out is None else out + term
        return out

    def paired_rows(self, module: nn.Module) -> Literal["samples", "positions"] | None:
        """Groups 1 (1-, 2- and 3-D): one block, its rows the unfolded patches of every output location; a grouped
        convolution has one block per group."""
        return "positions" if int(module.groups) == 1 else None  # type: ignore[arg-type]

    def squares(self, module: nn.Module, x: Tensor | None = None) -> bool:
        """Groups 1 (1-, 2- and 3-D): the per-sample gradient is a sum over the unfolded patches of one block."""
        return int(module.groups) == 1  # type: ignore[arg-type]

    def squared_gradients(self, module: nn.Module, x: Tensor, deltas: Tensor) -> dict[str, Tensor]:
        """g_{r,n} = sum_p deltas[r, n, :, p] patches_{n,p}^T over the output locations p: the per-sample
        gradients (r, B, out, C*k) are formed a chunk of r at a time (at most 2^24 scalars) and squared."""
        cols = conv_patches(module, x).transpose(1, 2)  # (B, K, P), any padding mode
        d = deltas.reshape(deltas.shape[0], deltas.shape[1], deltas.shape[2], -1)  # (R, B, O, P)
        acc = torch.zeros(d.shape[2], cols.shape[1], dtype=d.dtype, device=d.device)
        step = max(1, _BUDGET // (d.shape[1] * d.shape[2] * cols.shape[1]))
        for r in range(0, d.shape[0], step):
            acc += (torch.einsum("rbop,bkp->rbok", d[r:r + step], cols) ** 2).sum((0, 1))
        weight: Any = module.weight
        out = {"weight": acc.reshape(weight.shape)}
        if getattr(module, "bias", None) is not None:
            out["bias"] = (d.sum(-1) ** 2).sum((0, 1))
        return out


def _columns(rows: Callable[[Tensor], Tensor], start: int, stop: int) -> Callable[[Tensor], Tensor]:
    """``rows`` followed by the output columns [start, stop) of one group."""
    return lambda grad: rows(grad)[..., start:stop]


# ---------------------------------------------------------------------------------------------- convolutions
def _conv_pad(conv: nn.Module, x: Tensor) -> tuple[Tensor, Any]:
    """Apply a convolution's padding to x: (padded input, padding left for F.conv / F.unfold)."""
    if conv.padding_mode != "zeros":  # type: ignore[attr-defined]
        return F.pad(x, conv._reversed_padding_repeated_twice, mode=conv.padding_mode), 0  # type: ignore[arg-type]
    if isinstance(conv.padding, str):  # 'same' / 'valid': explicit (possibly asymmetric) zero padding
        return F.pad(x, conv._reversed_padding_repeated_twice), 0  # type: ignore[arg-type]
    return x, conv.padding


def conv_forward(conv: nn.Module, x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
    """``conv``'s operation (stride, padding of any mode, dilation, groups) with the given weight and bias;
    linear in (x, weight, bias) separately, so it also maps tangents."""
    x, pad = _conv_pad(conv, x)
    fn: Any = F.conv3d if isinstance(conv, nn.Conv3d) else F.conv2d if isinstance(conv, nn.Conv2d) else F.conv1d
    return fn(x, weight, bias, conv.stride, pad, conv.dilation, conv.groups)  # type: ignore[no-any-return]


def _patches_3d(conv: nn.Module, x: Tensor) -> Tensor:
    """Conv3d input (B, C, D, H, W) -> patches (B, T, C*kd*kh*kw) (``F.unfold`` is 2-D only: a strided
    window view per spatial dimension, dilation by slicing the window)."""
    c: Any = conv
    if x.dim() != 5:
        raise ValueError(f"Conv3d expects a (B, C, D, H, W) input, got shape {tuple(x.shape)}")
    x, pad = _conv_pad(conv, x)
    if pad != 0:
        x = F.pad(x, [p for q in reversed(pad) for p in (q, q)])
    for i in range(3):
        k, d, st = c.kernel_size[i], c.dilation[i], c.stride[i]
        x = x.unfold(2 + i, d * (k - 1) + 1, st)[..., ::d]  # (..., out_i, ..., k_i) appended last
    B, C = x.shape[:2]
    return x.permute(0, 2, 3, 4, 1, 5, 6, 7).reshape(B, -1, C * math.prod(c.kernel_size))


def conv_patch_means(conv: nn.Module, x: Tensor) -> Tensor:
    """(B, C*k) the mean over the T output locations of :func:`conv_patches` (KFAC-reduce's input rows, any
    padding mode, stride and dilation, 1-, 2- and 3-D), without unfolding: entry (c, j) of the mean patch is
    the mean of the padded input of channel c over the strided grid of output locations shifted by kernel
    offset j,

        mean_t patch_t[c, j] = (1/T) sum_{o_1..o_D} x_pad[c, o_1 s_1 + j_1 d_1, ..., o_D s_D + j_D d_D],

    one strided view summed per kernel offset (j in row-major order, channel-major columns as ``F.unfold``):
    memory of the padded input and (B, C) per offset, against T times (B, C*k) for the patches."""
    c: Any = conv
    D = 1 if isinstance(conv, nn.Conv1d) else 3 if isinstance(conv, nn.Conv3d) else 2
    if x.dim() != 2 + D:
        raise ValueError(f"{type(conv).__name__} expects a {2 + D}-D input (B, C, *spatial), got shape "
                         f"{tuple(x.shape)}")
    x, pad = _conv_pad(conv, x)
    if pad != 0 and any(pad):
        x = F.pad(x, [p for q in reversed(pad) for p in (q, q)])
    k, s, d = tuple(c.kernel_size), tuple(c.stride), tuple(c.dilation)
    out = [(x.shape[2 + i] - d[i] * (k[i] - 1) - 1) // s[i] + 1 for i in range(D)]
    sums = []
    for j in itertools.product(*(range(n) for n in k)):
        index: tuple[Any, ...] = (..., *(slice(j[i] * d[i], j[i] * d[i] + s[i] * (out[i] - 1) + 1, s[i])
                                         for i in range(D)))
        view = x[index]
        sums.append(view.sum(tuple(range(2, 2 + D))))
    return torch.stack(sums, dim=-1).flatten(1).div_(math.prod(out))  # (B, C, k) -> (B, C*k)


def conv_patches(conv: nn.Module, x: Tensor) -> Tensor:
    """Conv2d input (B, C, H, W) or Conv1d input (B, C, L) -> patches (B, T, C*k) in the order of
    ``weight.reshape(out, -1)`` (all groups' channels; any padding mode); T is the number of output
    locations and k the kernel's size."""
    one_d = isinstance(conv, nn.Conv1d)
    c: Any = conv
    if isinstance(conv, nn.Conv3d):
        return _patches_3d(conv, x)
    if x.dim() != (3 if one_d else 4):
        layout = "(B, C, L)" if one_d else "(B, C, H, W)"
        raise ValueError(f"{type(conv).__name__} expects a {layout} input, got shape {tuple(x.shape)}")
    x, pad = _conv_pad(conv, x)
    if one_d:  # a 1 x k convolution of a 1 x L image
        pad = pad if pad == 0 else (0, pad[0])
        cols = F.unfold(x[:, :, None, :], (1, c.kernel_size[0]), dilation=(1, c.dilation[0]), padding=pad,
                        stride=(1, c.stride[0]))
    else:
        cols = F.unfold(x, c.kernel_size, dilation=c.dilation, padding=pad, stride=c.stride)
    return cols.transpose(1, 2)
