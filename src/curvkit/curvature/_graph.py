"""What a model's output depends on, read off its autograd graph (a walk over ``grad_fn`` nodes; no
backward pass, nothing changes).

* :func:`graph_leaves` - the leaf tensors (parameters, or the fresh leaves of a functional evaluation)
  that an output reaches, optionally without passing through given nodes (used by
  :mod:`curvkit.laplace._subset` to find the layer that produces the output);
* :func:`lowest_tensors` - of some tensors on a graph, those below which no other lies: a backward pass asking
  for their gradients reaches all of them (the Kronecker estimators read every layer's gradient by hooks while
  asking only for these);
* :func:`warn_unused` - the one check that every curvature operator, estimator and Laplace fit runs: a
  trainable parameter the output does not depend on (an unused head, an adapter bypassed by a fused fast
  path) gets a curvature of exactly zero, so it is named in one :class:`UnusedParameterWarning` per model
  and set of such parameters, however many operators, batches or fits meet it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
import weakref
from collections.abc import Collection, Sequence
from types import FrameType
from typing import Any

import torch
from torch import Tensor, nn

from curvkit.curvature._functional import FunctionalModel
from curvkit.validation import Inputs

__all__ = ["UnusedParameterWarning", "graph_leaves", "lowest_tensors", "warn_unused", "warn_unused_functional"]

# model -> the sets of unused parameter names already reported for it (warn once)
_REPORTED: weakref.WeakKeyDictionary[nn.Module, set[tuple[str, ...]]] = weakref.WeakKeyDictionary()


class UnusedParameterWarning(UserWarning):
    """A trainable parameter is not in the graph of the model output: its curvature is exactly zero."""


def graph_leaves(outputs: Tensor | Sequence[Tensor], stop: Collection[Any] = ()) -> set[int]:
    """``id`` s of the leaf tensors requiring grad that ``outputs`` reach through their autograd graph,
    not walking past any node in ``stop`` (``grad_fn`` objects). A leaf output counts itself."""
    outs = [outputs] if isinstance(outputs, Tensor) else list(outputs)
    found = {id(t) for t in outs if t.grad_fn is None and t.requires_grad}
    stack: list[Any] = [t.grad_fn for t in outs if t.grad_fn is not None]
    seen: set[Any] = set(stop)
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        var = getattr(node, "variable", None)  # AccumulateGrad: the leaf it accumulates into
        if var is not None:
            found.add(id(var))
        stack.extend(child for child, _ in node.next_functions)
    return found


def warn_unused(what: str, model: nn.Module, names: Sequence[str], tensors: Sequence[Tensor],
                output: Tensor) -> list[str]:
    """Warn (once per model and set of names) if any of ``tensors`` (the parameters ``names``, as leaves
    of ``output``'s graph) is not reached from ``output``; returns the unused names."""
    reached = graph_leaves(output)
    unused = tuple(n for n, t in zip(names, tensors) if id(t) not in reached)
    if unused:
        reported = _REPORTED.setdefault(model, set())
        if unused not in reported:
            reported.add(unused)
            warnings.warn(
                f"{what}: trainable parameter(s) {list(unused)} are not in the graph of the model output (the "
                "output does not depend on them), so their curvature is exactly zero and a posterior over them "
                "is the prior. If that is intended, freeze them (requires_grad_(False)) or leave them out of "
                "the subset; otherwise check the forward pass (an unused head, an adapter bypassed by a fused "
                "path)", UnusedParameterWarning, stacklevel=_caller_level())
    return list(unused)


def _caller_level() -> int:
    """The ``stacklevel`` of the first frame outside curvkit (the user's call), seen from ``warn_unused``."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    frame: FrameType | None = sys._getframe(2)
    level = 2
    while frame is not None and (os.path.abspath(frame.f_code.co_filename).startswith(package + os.sep)
                                 or frame.f_code.co_filename == contextlib.__file__):  # (curvkit's decorators)
        frame, level = frame.f_back, level + 1
    return level


def warn_unused_functional(what: str, fmodel: FunctionalModel, X: Inputs) -> list[str]:
    """:func:`warn_unused` for a functional snapshot: one forward pass of ``X`` with fresh leaves (the
    snapshot and the module are not changed)."""
    leaves = tuple(p.detach().requires_grad_() for p in fmodel.params)
    with torch.enable_grad():
        f = fmodel(leaves, X)
    return warn_unused(what, fmodel.module, fmodel.names, leaves, f)


def lowest_tensors(outs: Sequence[Tensor]) -> list[int]:
    """The positions of the tensors of ``outs`` below which (towards the inputs, in the autograd graph) no
    other tensor of ``outs`` lies: a backward pass to these reaches every tensor of ``outs``. One memoised
    pass over the graph below the tensors (iterative: graphs are deep)."""
    sites = {o.grad_fn for o in outs if o.grad_fn is not None}
    leaves = {id(o) for o in outs if o.grad_fn is None}
    holds: dict[Any, bool] = {}  # node -> a tensor of outs is produced at or below it

    def children(n: Any) -> list[Any]:
        return [m for m, _ in n.next_functions if m is not None]

    def solve(root: Any) -> bool:
        stack = [(root, False)]
        while stack:
            n, expanded = stack.pop()
            if n in holds:
                continue
            if n in sites or id(getattr(n, "variable", None)) in leaves:
                holds[n] = True
            elif expanded:
                holds[n] = any(holds[m] for m in children(n))
            else:
                stack.append((n, True))
                stack.extend((m, False) for m in children(n) if m not in holds)
        return holds[root]

    return [j for j, o in enumerate(outs) if o.grad_fn is None or not any(solve(m) for m in children(o.grad_fn))]
