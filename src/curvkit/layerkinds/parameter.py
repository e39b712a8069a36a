"""Raw trainable parameters that no layer kind owns, used directly in a module's own ``forward``: a ViT's
class token and position table (``nn.Parameter`` of shape (1, 1, D) and (1, N, D), as ``curvkit.architectures
.vit``, torchvision, timm and Hugging Face write them).

Such a parameter p of shape (1, *S) broadcasts over the batch. Its block comes from per-sample gradients
(``form='grad'``, like a normalisation layer's): for the estimator's own forward pass every sample gets its
own copy, ``P = p.expand(B, *S)`` substituted for p (:meth:`curvkit.structure.ModelStructure.functional_call`;
the model is never changed), and the gradient of a back-propagated vector with respect to P is, row by row,
the per-sample gradient. The block is its diagonal (default) or, on request and when small, the dense
(P, P) block (the estimator's ``parameter_structure``); with (B, C) outputs and KFLR's vectors it is the
exact GGN block.

The substitution is only valid when sample n's output depends on copy n alone, through the same function
as on p. The estimator verifies it once, on two samples with independent random perturbations of their
copies, against two single-sample evaluations; a parameter used otherwise (indexed along its first
dimension, summed, multiplied with the batch) is refused with an error naming it. A parameter whose first
dimension is not 1 is refused too.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from curvkit.layerkinds._base import BlockSpec, Emit, LayerHandler, row_index

__all__ = ["ParameterHandler"]


class ParameterHandler(LayerHandler):
    """One raw parameter (module docstring); its sites are emitted by the estimator's substitution."""

    kind = "parameter"
    per_sample_copies = True

    def __init__(self, attr: str):
        self.attr = attr

    def owned(self, module: nn.Module) -> tuple[str, ...]:
        return (self.attr,)

    def blocks(self, module: nn.Module, label: str, names: Mapping[str, str | None], what: str) -> list[BlockSpec]:
        name = names[self.attr]
        assert name is not None
        P = int(getattr(module, self.attr).numel())
        return [BlockSpec(name, name, None, 1, P, form="grad", index=row_index(P), roles=("raw",))]

    def attach(self, module: nn.Module, label: str, blocks: Sequence[BlockSpec], emit: Emit, what: str) -> list[Any]:
        return []
