"""``nn.Linear``, with or without weight sharing: an input (B, *S, in) gives R = prod(S) positions.

One block, the standard ``W_hat = [W | b]`` (out, in+1). Input rows are the layer input reshaped to
(B, R, in); output rows the gradient at the layer output reshaped to (B, R, out). Tokens of a sequence,
patches of a ViT and time steps all share the weight, so the estimator's ``weight_sharing`` keyword
(expand or reduce) applies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from torch import Tensor, nn

from curvkit.layerkinds._base import (
    BlockSpec,
    Emit,
    LayerHandler,
    Site,
    batched_input,
    recording,
    weight_and_bias,
)

__all__ = ["LinearHandler"]


class LinearHandler(LayerHandler):
    """``nn.Linear`` on inputs (B, in) or (B, *S, in) (module docstring)."""

    kind = "linear"
    takes_shards = True

    def sizes(self, module: nn.Module) -> tuple[int, int]:
        """(in, out) features of the layer."""
        mod: Any = module
        return int(mod.in_features), int(mod.out_features)

    def blocks(self, module: nn.Module, label: str, names: Mapping[str, str | None], what: str) -> list[BlockSpec]:
        w, b = weight_and_bias(module, label, names, what)
        assert w is not None
        n_in, n_out = self.sizes(module)
        return [BlockSpec(label, w, b, n_out, n_in)]

    def attach(self, module: nn.Module, label: str, blocks: Sequence[BlockSpec], emit: Emit, what: str) -> list[Any]:
        n_in, n_out = self.sizes(module)

        def hook(mod: nn.Module, inputs: tuple[Any, ...], out: Tensor) -> None:
            if not recording(out):
                return
            x = batched_input(mod, label, inputs[0], 2, what, "an input (batch, ..., features)")
            B = x.shape[0]
            emit(Site(0, x.detach().reshape(B, -1, n_in), out, lambda g: g.reshape(B, -1, n_out)))

        return [module.register_forward_hook(hook)]

    # ------------------------------------------------------------------ capabilities
    def bilinear(self, module: nn.Module) -> bool:
        return True

    def tangent(self, module: nn.Module, x: Tensor, t: Tensor | None, values: Mapping[str, Tensor],
                tangents: Mapping[str, Tensor]) -> Tensor | None:
        """``t W^T + x dW^T + db`` for x (B, ..., in), t (k, B, ..., in): the x dW_j^T of every direction j is ONE
        batched matrix product, (k, B, ..., out)."""
        W, dW, db = values["weight"], tangents.get("weight"), tangents.get("bias")
        out: Tensor | None = None
        if t is not None:
            out = t @ W.T
        if dW is not None:
            term = torch.matmul(x, dW.mT) if x.dim() == 2 else torch.einsum("b...i,koi->kb...o", x, dW)
            out = term if out is None else out.add_(term)
        if db is not None:
            k = db.shape[0]
            bias = db.view(k, *([1] * (x.dim() - 1)), -1)
            out = bias.expand(k, *x.shape[:-1], db.shape[-1]) if out is None else out + bias
        return out

    def paired_rows(self, module: nn.Module) -> Literal["samples", "positions"] | None:
        return "samples"

    def squares(self, module: nn.Module, x: Tensor | None = None) -> bool:
        """On (B, in) inputs only (with positions a sample's gradient is a sum over them)."""
        return x is None or x.dim() == 2

    def squared_gradients(self, module: nn.Module, x: Tensor, deltas: Tensor) -> dict[str, Tensor]:
        """g_{r,n} = deltas[r, n] x_n^T, so sum_{r,n} g^2 = (sum_r deltas^2)^T x^2: sum over r first, (B, out),
        then one (out, B) x (B, in) product; the bias's is sum_{r,n} deltas^2."""
        q = deltas.square().sum(0)  # not in place: autograd may hand the same gradient tensor to two layers
        out = {"weight": q.T @ x**2}
        if getattr(module, "bias", None) is not None:
            out["bias"] = q.sum(0)
        return out
