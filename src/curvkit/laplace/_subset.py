"""Which parameters a Laplace posterior covers (``subset``), grouped by the layer that owns them.

``subset`` is ``'all'`` (every trainable parameter), ``'last_layer'`` or a sequence of module labels and/or
canonical parameter names. Parameters outside the subset stay fixed at their values at fitting time.

``'last_layer'`` is read off the forward pass (:func:`last_layer_names`, on the first batch of
``Laplace.fit``), never off the registration order: it is the smallest module that owns trainable
parameters and produces the output, in the sense that every path from the output back to a trainable
parameter passes through that module's output (the last ``nn.Linear`` of an MLP; for a LoRA-adapted last
layer, the adapted module with both adapters). When no such module exists short of the model itself (a
forward that combines raw parameters directly), the call stops with an error listing the candidates and
asking for explicit names.

The curvature estimators of :mod:`curvkit.curvature` act on a model's trainable parameters; to restrict
them to a subset, :func:`only_trainable` switches ``requires_grad`` off for every other parameter while
an estimator is built or updated and restores every flag afterwards (also on errors).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
from torch import Tensor, nn

from curvkit.curvature._graph import graph_leaves
from curvkit.layerkinds import handler_for
from curvkit.structure import LayerInfo, curvature_kernels, read_model
from curvkit.validation import Inputs

__all__ = ["ModuleCall", "last_layer_names", "only_trainable", "resolve_subset", "subset_layers", "traced_forward"]

ModuleCall = tuple[str, nn.Module, tuple[Any, ...]]
"""(qualified module name, module, the ``grad_fn`` nodes of its tensor outputs) of one module call."""


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
            raise ValueError("subset='last_layer' is found from a forward pass: use last_layer_names(model, f, calls)")
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
    """The layers (modules owning parameters of ``names``) with weight/bias restricted to ``names``. A
    parameter shared by several modules (a tied weight) belongs to the FIRST of them only (``named_modules``
    order; its prior precision is that layer's); a layer left without parameters is dropped."""
    with only_trainable(model, names):
        layers = list(read_model(model).layers)
    seen: set[str] = set()
    out: list[LayerInfo] = []
    for lay in layers:
        own = tuple(n for n in lay.params if n not in seen)
        seen.update(own)
        if not own:
            continue
        if own != tuple(lay.params):
            lay = replace(lay, params=own, weight=lay.weight if lay.weight in own else None,
                          bias=lay.bias if lay.bias in own else None)
        out.append(lay)
    return out


def traced_forward(model: nn.Module, X: Inputs, record: bool = True) -> tuple[Tensor, list[ModuleCall]]:
    """``model(X)`` with its autograd graph, and (``record``) every module call in completion order with
    the ``grad_fn`` nodes of its outputs. The hooks are removed afterwards; nothing else changes (the
    callers refuse modules that write state in the forward pass, such as BatchNorm in training mode)."""
    calls: list[ModuleCall] = []

    def hook(name: str) -> Any:
        def record_call(mod: nn.Module, args: Any, out: Any) -> None:
            outs = out if isinstance(out, (tuple, list)) else (out,)
            nodes = tuple(t.grad_fn for t in outs if isinstance(t, Tensor) and t.grad_fn is not None)
            calls.append((name, mod, nodes))
        return record_call

    handles = [mod.register_forward_hook(hook(name)) for name, mod in model.named_modules()] if record else []
    try:
        with torch.enable_grad(), curvature_kernels():  # the kernels every curvature pass uses (no MHA fast path)
            f = model(X)
    finally:
        for h in handles:
            h.remove()
    return f, calls


def last_layer_names(model: nn.Module, f: Tensor, calls: Sequence[ModuleCall]) -> list[str]:
    """Canonical names (``named_parameters()`` order) of the trainable parameters of the module that
    produces the output ``f`` (module docstring), from :func:`traced_forward`; raises ValueError listing
    the candidates when only the model as a whole does."""
    structure = read_model(model)
    trainable = {id(p): n for n, p in model.named_parameters() if p.requires_grad}
    names = set(trainable.values())
    last_call = {name: (mod, nodes) for name, mod, nodes in calls}  # a module called twice: its last call
    best: tuple[int, str, list[str]] | None = None
    for name, (mod, nodes) in last_call.items():
        own = [n for n in (structure.canonical_name(p) for p in mod.parameters()) if n in names]
        if not own or not nodes or (best is not None and len(own) >= best[0]):
            continue
        if not graph_leaves(f, stop=nodes).intersection(trainable):  # every path to a parameter passes it
            best = (len(own), name, own)
    root = next((lay for lay in structure.layers if lay.label == "<root>"), None)
    # the whole model is a last layer only where it is itself a layer of a known kind (an nn.Linear as the model)
    if best is not None and (best[1] != "" or (root is not None and handler_for(root.module)[0] is not None)):
        wanted = set(best[2])
        return [n for n in structure.trainable if n in wanted]
    shown = [f"{lay.label} ({', '.join(lay.params)})" for lay in structure.layers]
    more = f", ... ({len(shown) - 12} more)" if len(shown) > 12 else ""
    raise ValueError(
        f"subset='last_layer': no module of {type(model).__name__} short of the whole model produces its output "
        "(its forward combines the trainable parameters itself), so there is no last layer to choose; the "
        f"candidates, by owning module: {'; '.join(shown[:12])}{more}. Pass subset=[...] with the module or "
        "parameter names the posterior should cover")
