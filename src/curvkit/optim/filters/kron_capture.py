"""Per-layer capture of layer inputs x and backpropagated output gradients delta for the
Kronecker-factored filters (forward hooks plus a tensor hook on each layer output).

Supported: ``nn.Linear`` (x: (B, in[+1]), delta: (B, out)) and, where the caller allows it,
``nn.Conv2d`` (x: unfolded patches (B*L, C*kh*kw[+1]), delta: (B*L, out), L spatial positions).
The hook stores the input rows without the bias column (``a``); ``x_rows(k)`` appends the column of ones on
demand, so a caller that needs only k of the B rows does not copy all of them.
A module that owns trainable parameters and is not supported raises a ``ValueError`` naming it.
Captured tensors are detached; capture happens only in forward passes with autograd enabled.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn import functional as F


@dataclass
class LayerRecord:
    name: str
    module: nn.Module
    weight: nn.Parameter
    bias: nn.Parameter | None
    weight_name: str
    bias_name: str | None
    a: Tensor | None = None   # layer input rows (B, in), without the bias column
    delta: Tensor | None = None
    positions: int = 1
    handles: list[Any] = field(default_factory=list)

    def x_rows(self, k: int | None = None) -> Tensor:
        """The first ``k`` (all when None) captured input rows, with the bias column of ones appended."""
        if self.a is None:
            raise ValueError(f"no activations captured for layer {self.name!r}")
        a = self.a if k is None else self.a[:k]
        return a if self.bias is None else torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)

    @property
    def in_dim(self) -> int:
        w = self.weight
        n = int(w[0].numel())
        return n + (1 if self.bias is not None else 0)

    @property
    def out_dim(self) -> int:
        return int(self.weight.shape[0])

    def grad_parts(self) -> tuple[Tensor, Tensor | None]:
        """(dW as an (out, in) matrix (Conv2d weights flattened to (out, C*kh*kw)), db or None): the
        gradient without concatenating it."""
        if self.weight.grad is None:
            raise ValueError(f"layer {self.name!r} has no gradient; call loss.backward() before step()")
        gb = None
        if self.bias is not None:
            if self.bias.grad is None:
                raise ValueError(f"bias of layer {self.name!r} has no gradient")
            gb = self.bias.grad
        return self.weight.grad.reshape(self.out_dim, -1), gb

    def weight_matrix_grad(self, out: Tensor | None = None) -> Tensor:
        """[dW | db] as an (out, in[+1]) matrix (written into ``out`` when given)."""
        gW, gb = self.grad_parts()
        if gb is None:
            return gW if out is None else out.copy_(gW)
        return torch.cat([gW, gb[:, None]], dim=1, out=out)

    def weight_matrix(self) -> Tensor:
        """A copy of W_hat = [W | b], (out, in[+1])."""
        W = self.weight.detach().reshape(self.out_dim, -1).clone()
        if self.bias is not None:
            W = torch.cat([W, self.bias.detach()[:, None]], dim=1)
        return W

    def _split(self, M: Tensor) -> tuple[Tensor, Tensor | None]:
        """An (out, in[+1]) matrix as (weight-shaped part, bias column or None)."""
        k = self.weight[0].numel()
        return M[:, :k].reshape(self.weight.shape), (M[:, k] if self.bias is not None else None)

    def add_to_matrix(self, inc: Tensor) -> None:
        """W_hat += inc in place (inc (out, in[+1])), without forming W_hat."""
        w, b = self._split(inc)
        with torch.no_grad():
            self.weight.add_(w)
            if self.bias is not None and b is not None:
                self.bias.add_(b)

    def write_matrix(self, W: Tensor) -> None:
        """W_hat <- W (out, in[+1])."""
        w, b = self._split(W)
        with torch.no_grad():
            self.weight.copy_(w)
            if self.bias is not None and b is not None:
                self.bias.copy_(b)


def collect_layers(model: nn.Module, supported: Sequence[type[nn.Module]], optimiser: str) -> list[LayerRecord]:
    """Find the parameter-bearing layers; raise naming any unsupported one."""
    names = {id(p): n for n, p in model.named_parameters()}
    layers: list[LayerRecord] = []
    for mname, module in model.named_modules():
        mod: Any = module
        own = [p for p in mod.parameters(recurse=False) if p.requires_grad]
        if not own:
            continue
        if not isinstance(mod, tuple(supported)):
            allowed = ", ".join(t.__name__ for t in supported)
            raise ValueError(
                f"{optimiser} cannot handle module {mname or '<root>'!r} ({type(mod).__name__}): it has trainable "
                f"parameters but only {allowed} layers have Kronecker factors here; freeze it "
                "(requires_grad_(False)) or use a factorised filter such as BFRMSProp"
            )
        if isinstance(mod, nn.Conv2d) and (mod.groups != 1 or mod.padding_mode != "zeros"
                                           or isinstance(mod.padding, str)):
            raise ValueError(f"{optimiser}: Conv2d {mname!r} must have groups=1 and numeric zero padding")
        w: nn.Parameter = getattr(module, "weight")  # noqa: B009
        bias: Any = getattr(mod, "bias", None)
        b = bias if (bias is not None and bias.requires_grad) else None
        if not w.requires_grad:
            raise ValueError(f"{optimiser}: layer {mname!r} has a frozen weight but a trainable bias; unsupported")
        layers.append(LayerRecord(mname, module, w, b, names[id(w)], None if b is None else names[id(b)]))
    if not layers:
        raise ValueError(f"{optimiser}: the model has no trainable layers")
    return layers


class Capture:
    """Registers the hooks; ``records`` hold the last training forward/backward of each layer."""

    def __init__(self, layers: list[LayerRecord]):
        self.records = layers
        for rec in layers:
            rec.handles.append(rec.module.register_forward_hook(self._hook(rec)))

    @staticmethod
    def _hook(rec: LayerRecord) -> Any:
        def fwd(mod: nn.Module, inputs: tuple[Tensor, ...], out: Tensor) -> None:
            if not torch.is_grad_enabled() or not out.requires_grad:
                return
            a = inputs[0].detach()
            if isinstance(mod, nn.Conv2d):
                cols = F.unfold(a, mod.kernel_size, dilation=mod.dilation, padding=mod.padding,  # type: ignore[arg-type]
                                stride=mod.stride)
                rec.positions = int(cols.shape[-1])
                a = cols.transpose(1, 2).reshape(-1, cols.shape[1])
            else:
                rec.positions = 1
                a = a.reshape(-1, a.shape[-1])
            rec.a = a

            def bwd(grad: Tensor) -> None:
                if isinstance(mod, nn.Conv2d):
                    rec.delta = grad.detach().flatten(2).transpose(1, 2).reshape(-1, grad.shape[1])
                else:
                    rec.delta = grad.detach().reshape(-1, grad.shape[-1])

            out.register_hook(bwd)

        return fwd

    def remove(self) -> None:
        for rec in self.records:
            for h in rec.handles:
                h.remove()
            rec.handles.clear()
