"""``nn.Linear``, with or without weight sharing: an input (B, *S, in) gives R = prod(S) positions.

One block, the standard ``W_hat = [W | b]`` (out, in+1). Input rows are the layer input reshaped to
(B, R, in); output rows the gradient at the layer output reshaped to (B, R, out). Tokens of a sequence,
patches of a ViT and time steps all share the weight, so the estimator's ``weight_sharing`` keyword
(expand or reduce) applies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

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
