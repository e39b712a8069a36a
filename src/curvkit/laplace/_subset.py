"""Which parameters a Laplace posterior covers (``subset``), grouped by the layer that owns them.

``subset`` is ``'all'`` (every trainable parameter), ``'last_layer'`` (the trainable parameters of the last
module, in registration order, that owns any: the output layer of an ``nn.Sequential``) or a sequence of
module labels and/or canonical parameter names. Parameters outside the subset stay fixed at their values
at fitting time.

The curvature estimators of :mod:`curvkit.curvature` act on a model's trainable parameters; to restrict
them to a subset, :func:`only_trainable` switches ``requires_grad`` off for every other parameter while
an estimator is built or updated and restores every flag afterwards (also on errors).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from torch import nn

from curvkit.structure import LayerInfo, read_model

__all__ = ["only_trainable", "resolve_subset", "subset_layers"]


def resolve_subset(model: nn.Module, subset: Any) -> list[str]:
    """Canonical names (in ``named_parameters()`` order) of the trainable parameters in ``subset``."""
    structure = read_model(model)
    trainable = list(structure.trainable)
    if not trainable:
        raise ValueError(f"{type(model).__name__} has no trainable parameters")
    if isinstance(subset, str):
        if subset == "all":
            return trainable
        if subset == "last_layer":
            return list(structure.layers[-1].params)
        raise ValueError(f"subset must be 'all', 'last_layer' or a list of module/parameter names, got {subset!r}")
    if not isinstance(subset, Sequence) or not subset:
        raise ValueError(f"subset must be 'all', 'last_layer' or a non-empty list of module/parameter names, "
                         f"got {subset!r}")
    by_label = {lay.label: lay for lay in structure.layers}
    chosen: set[str] = set()
    for item in subset:
        if item in by_label:
            chosen.update(by_label[item].params)
        elif item in trainable:
            chosen.add(item)
        else:
            raise ValueError(f"subset entry {item!r} is neither a module owning trainable parameters "
                             f"({', '.join(by_label)}) nor a trainable parameter ({', '.join(trainable)})")
    return [n for n in trainable if n in chosen]


@contextmanager
def only_trainable(model: nn.Module, names: Sequence[str]) -> Iterator[None]:
    """Within the block, exactly the parameters ``names`` have ``requires_grad=True``; every flag is
    restored afterwards."""
    keep = set(names)
    saved = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for n, p in model.named_parameters():
            p.requires_grad_(n in keep)
        yield
    finally:
        for p, flag in saved:
            p.requires_grad_(flag)


def subset_layers(model: nn.Module, names: Sequence[str]) -> list[LayerInfo]:
    """The layers (modules owning parameters of ``names``) with weight/bias restricted to ``names``."""
    with only_trainable(model, names):
        return list(read_model(model).layers)
