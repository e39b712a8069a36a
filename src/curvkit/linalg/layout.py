"""Parameter layouts: how a list of parameter tensors maps to one flat vector.

Convention (fixed once for the whole library): the flat vector is the concatenation, in
``model.named_parameters()`` order (trainable parameters only), of each tensor flattened row-major
(``tensor.reshape(-1)``). A ``nn.Linear`` weight of shape (out, in) therefore occupies ``out * in``
consecutive entries, row by row, followed (if present) by its bias of shape (out,).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn


@dataclass(frozen=True)
class ParamLayout:
    """Names and shapes of the parameters an operator acts on, in flat-vector order."""

    names: tuple[str, ...]
    shapes: tuple[torch.Size, ...]

    @classmethod
    def from_module(cls, module: nn.Module) -> ParamLayout:
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError(f"{type(module).__name__} has no trainable parameters")
        return cls(tuple(n for n, _ in named), tuple(p.shape for _, p in named))

    @classmethod
    def from_tensors(cls, tensors: Sequence[Tensor], names: Sequence[str] | None = None) -> ParamLayout:
        names = tuple(names) if names is not None else tuple(str(i) for i in range(len(tensors)))
        return cls(names, tuple(t.shape for t in tensors))

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(int(torch.Size(s).numel()) for s in self.shapes)

    @property
    def dim(self) -> int:
        """Total number of scalar parameters d."""
        return sum(self.numels)

    @property
    def offsets(self) -> tuple[int, ...]:
        out, acc = [], 0
        for n in self.numels:
            out.append(acc)
            acc += n
        return tuple(out)

    def flatten(self, tensors: Sequence[Tensor]) -> Tensor:
        """List of parameter-shaped tensors -> flat (d,) vector.

        Trailing batch dimensions are allowed: tensors of shape ``shape + (k,)`` give a (d, k) matrix.
        """
        tensors = list(tensors)
        if len(tensors) != len(self.shapes):
            raise ValueError(
                f"expected {len(self.shapes)} parameter-shaped tensors ({', '.join(self.names)}), "
                f"got {len(tensors)}"
            )
        parts = []
        extra: tuple[int, ...] | None = None
        for name, shape, t in zip(self.names, self.shapes, tensors):
            nd = len(shape)
            if tuple(t.shape[:nd]) != tuple(shape) or t.dim() > nd + 1:
                raise ValueError(
                    f"tensor for parameter {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}"
                    " (optionally with one trailing column dimension)"
                )
            tail = tuple(t.shape[nd:])
            if extra is None:
                extra = tail
            elif tail != extra:
                raise ValueError("parameter-shaped tensors disagree in their trailing column dimension")
            parts.append(t.reshape(-1, *tail))
        return torch.cat(parts, dim=0)

    def unflatten(self, flat: Tensor) -> list[Tensor]:
        """Flat (d,) or (d, k) -> list of tensors of shape ``shape`` or ``shape + (k,)``."""
        if flat.shape[0] != self.dim or flat.dim() > 2:
            raise ValueError(f"expected a vector of length {self.dim} or a ({self.dim}, k) matrix, "
                             f"got shape {tuple(flat.shape)}")
        tail = tuple(flat.shape[1:])
        return [
            flat[o:o + n].reshape(*shape, *tail)
            for o, n, shape in zip(self.offsets, self.numels, self.shapes)
        ]

    def slices(self) -> dict[str, slice]:
        return {n: slice(o, o + k) for n, o, k in zip(self.names, self.offsets, self.numels)}


def trainable_parameters(module: nn.Module) -> list[nn.Parameter]:
    return [p for p in module.parameters() if p.requires_grad]


def as_tensor_list(x: Iterable[Tensor]) -> list[Tensor]:
    return [t for t in x]
