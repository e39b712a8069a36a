"""Per-layer capture of inputs and output gradients of the Kronecker layers, the one hook machinery behind
the Kronecker estimators (:mod:`curvkit.curvature.estimators`) and the Kronecker-factored filters
(:mod:`curvkit.optim.filters`).

For each layer l of :meth:`curvkit.structure.ModelStructure.kronecker_layers` a forward hook records, per
forward pass with autograd enabled,

* the input rows ``a`` (B*T, in) without the bias column: the layer input itself for ``nn.Linear``
  ((B, in), T = 1) and the unfolded patches for ``nn.Conv2d`` (T output locations, any padding mode,
  :func:`curvkit.structure.conv_patches`), and
* the output h_l (B, out, ...) still on the autograd graph, so a caller can back-propagate any output-space
  vectors to it (``torch.autograd.grad(f, capture.outputs(), V)``), and, with ``output_grads=True``, the
  rows of the gradient that the user's own backward pass sends through h_l (B*T, out).

Every pass counts the calls: :meth:`LayerCapture.check` raises when a layer ran more than once (its input
and output gradient could not be paired) or its output was overwritten in place. Hooks are removed by
:meth:`LayerCapture.close` (also on ``with``-exit and garbage collection).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from curvkit.structure import LayerInfo, UnsupportedModelError, conv_patches

__all__ = ["CapturedLayer", "LayerCapture", "input_rows", "output_rows"]


def input_rows(layer: LayerInfo, x: Tensor) -> tuple[Tensor, int]:
    """A layer's input as rows (B*T, in) (no bias column) and the number T of output locations."""
    if isinstance(layer.module, nn.Conv2d):
        p = conv_patches(layer.module, x)  # (B, T, C*kh*kw)
        return p.reshape(-1, p.shape[-1]), int(p.shape[1])
    if x.dim() != 2:
        raise UnsupportedModelError(
            f"Kronecker factors: module {layer.label!r} (Linear) got an input of shape {tuple(x.shape)}; the "
            "factors need a (batch, features) input: flatten extra dimensions before the layer")
    return x, 1


def output_rows(layer: LayerInfo, g: Tensor) -> Tensor:
    """A tensor shaped like the layer output (B, out[, H, W]) as rows (B*T, out)."""
    if isinstance(layer.module, nn.Conv2d):
        return g.flatten(2).transpose(1, 2).reshape(-1, g.shape[1])
    return g.reshape(-1, g.shape[-1])


@dataclass
class CapturedLayer:
    """What the hooks recorded for one layer in the last forward pass (see the module docstring)."""

    info: LayerInfo
    a: Tensor | None = None  # (B*T, in) input rows, detached, without the bias column
    positions: int = 1  # T
    output: Tensor | None = None  # the layer output on the graph
    delta: Tensor | None = None  # (B*T, out) output-gradient rows from the user's backward pass
    calls: int = 0
    version: int = 0

    @property
    def module(self) -> nn.Module:
        return self.info.module

    @property
    def has_bias(self) -> bool:
        return self.info.bias is not None

    def x_rows(self, k: int | None = None) -> Tensor:
        """The first ``k`` (all when None) input rows with the bias column of ones appended."""
        if self.a is None:
            raise ValueError(f"no input captured for layer {self.info.label!r}: run a forward pass with "
                             "autograd enabled first")
        a = self.a if k is None else self.a[:k]
        return a if not self.has_bias else torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)


@dataclass
class LayerCapture:
    """Hooks on ``layers`` recording their inputs, outputs and (optionally) output gradients.

    Args:
        layers: from :meth:`curvkit.structure.ModelStructure.kronecker_layers`.
        what: the name used in error messages.
        output_grads: also record the gradient rows of the user's backward pass (a tensor hook per pass).
    """

    layers: Sequence[LayerInfo]
    what: str = "Kronecker capture"
    output_grads: bool = False
    records: list[CapturedLayer] = field(init=False)
    _handles: list[Any] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.records = [CapturedLayer(lay) for lay in self.layers]

    # ------------------------------------------------------------------ hooks
    def attach(self) -> LayerCapture:
        """Install the forward hooks (idempotent)."""
        if not self._handles:
            self._handles = [rec.module.register_forward_hook(self._hook(rec)) for rec in self.records]
        return self

    def close(self) -> None:
        """Remove every hook; the capture records nothing afterwards."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> LayerCapture:
        self.reset()
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def reset(self) -> None:
        """Forget the last pass (call counts, recorded tensors)."""
        for rec in self.records:
            rec.a, rec.output, rec.delta, rec.calls = None, None, None, 0

    def _hook(self, rec: CapturedLayer) -> Any:
        def fwd(mod: nn.Module, inputs: tuple[Any, ...], out: Tensor) -> None:
            if not torch.is_grad_enabled() or not isinstance(out, Tensor) or not out.requires_grad:
                return
            rec.calls += 1
            rec.a, rec.positions = input_rows(rec.info, inputs[0].detach())
            rec.output, rec.version = out, out._version
            if self.output_grads:
                def bwd(grad: Tensor) -> None:
                    rec.delta = output_rows(rec.info, grad.detach())

                out.register_hook(bwd)

        return fwd

    # ------------------------------------------------------------------ reading
    def check(self) -> None:
        """Raise unless every layer ran exactly once in the last pass and kept its output unchanged."""
        for rec in self.records:
            if rec.calls != 1:
                raise UnsupportedModelError(
                    f"{self.what}: module {rec.info.label!r} was called {rec.calls} times in one forward pass; "
                    "a Kronecker block pairs one input with one output gradient, so shared, repeated or unused "
                    "layers are not supported (use one module per call, or freeze it)")
            assert rec.output is not None
            if rec.output._version != rec.version:
                raise UnsupportedModelError(
                    f"{self.what}: the output of module {rec.info.label!r} was modified in place later in the "
                    "forward pass (e.g. nn.ReLU(inplace=True)); use inplace=False")

    def outputs(self) -> list[Tensor]:
        """The recorded layer outputs (on the graph), in layer order."""
        self.check()
        return [rec.output for rec in self.records]  # type: ignore[misc]
