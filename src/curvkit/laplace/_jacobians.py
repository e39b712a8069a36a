"""The pieces of the Jacobian that the GLM predictive variance ``J Sigma J^T`` needs, in chunks whose memory
is bounded by the batch size, never the full Jacobian.

Outputs are (B, C) or (B, *P, C) (per-token classification); an output ENTRY is one output of one position,
``e = p * C + c`` (:mod:`curvkit.laplace._glm`). Two routes:

* :func:`engine_variance` - for parameters in blocks of the layer kinds (:mod:`curvkit.layerkinds`: Linear,
  convolutions, embeddings, attention, normalisation layers, raw parameters): ONE forward pass at the
  posterior mean with the layer kinds' hooks (:class:`curvkit.curvature.capture.BlockCapture`), then, for
  each chunk of k output entries, one batched backward pass of their one-hot vectors to the blocks' outputs;
  each block's output rows (k, B, R, out) (or per-sample gradients (k, B, P)) go straight into its
  :class:`~curvkit.laplace._glm.GLMTerm` and are dropped. Memory: k x B x (the blocks' output rows).
  A block whose output rows are the model's outputs (the head) takes its closed form and no backward pass.
  The backward passes run inside the forward pass's ``functional_call`` (a forward hook on the model), so
  everything a layer kind reads back (a BatchNorm's running statistics) is the posterior's, not the
  module's current state.
* :func:`generic_variance` - any other parameters: per-sample Jacobian rows (k, B, d) of a chunk of k
  entries with respect to those parameters (``torch.func.vmap`` of ``jacrev``; a model that vmap cannot
  take, e.g. Hugging Face's attention-mask code, is differentiated one sample at a time).

Inputs ``X`` are a tensor or a mapping of tensors (:data:`curvkit.validation.Inputs`); the model is called
as ``model(X)``.

k is chosen so that one chunk holds about ``BUDGET`` numbers (at least one entry; whole positions when the
(C, C) covariances are asked for).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.func import jacrev, vmap

from curvkit.curvature.capture import BlockCapture, check_sample_rows, per_sample_grads
from curvkit.laplace._glm import GLMTerm
from curvkit.structure import ModelStructure
from curvkit.validation import Inputs, map_inputs, num_samples, take_samples

__all__ = ["BUDGET", "engine_variance", "generic_variance", "new_variance"]

#: numbers held by one chunk of output entries (their back-propagated rows, or Jacobian rows)
BUDGET = 2**25


def new_variance(f: Tensor, dtype: torch.dtype, diagonal: bool) -> Tensor:
    """Zero variances for outputs f (B, *P, C): (B, P*C) entries, or (B, P, C, C) per position."""
    B, C = f.shape[0], f.shape[-1]
    P = math.prod(f.shape[1:-1])
    if diagonal:
        return torch.zeros(B, P * C, dtype=dtype, device=f.device)
    return torch.zeros(B, P, C, C, dtype=dtype, device=f.device)


def _chunk_size(per_entry: int, total: int, C: int, diagonal: bool) -> int:
    k = max(1, min(total, BUDGET // max(1, per_entry)))
    return k if diagonal else C * max(1, k // C)


def _one_hot(f: Tensor, e0: int, e1: int) -> Tensor:
    """(e1 - e0, *f.shape): vector j is 1 at entry e0 + j of every sample."""
    B = f.shape[0]
    V = torch.zeros(e1 - e0, B, f[0].numel(), dtype=f.dtype, device=f.device)
    V[torch.arange(e1 - e0, device=f.device), :, torch.arange(e0, e1, device=f.device)] = 1
    return V.reshape(e1 - e0, *f.shape)


def _add(var: Tensor, part: Tensor, e0: int, e1: int, C: int, diagonal: bool) -> None:
    """Add a chunk's (k, B) variances or (B, n, C, C) covariances of entries [e0, e1) into ``var``."""
    if diagonal:
        var[:, e0:e1] += part.T.to(var.dtype)
    else:
        var[:, e0 // C:e1 // C] += part.to(var.dtype)


def _batched_grad(f: Tensor, outs: Sequence[Tensor], V: Tensor) -> list[Tensor]:
    """The gradients (k, *o.shape) of every vector of V (k, *f.shape) with respect to each of ``outs``."""
    if not outs:
        return []
    try:
        return list(torch.autograd.grad(f, outs, grad_outputs=V, retain_graph=True, is_grads_batched=True))
    except RuntimeError:  # an operation without a batching rule: one backward pass per vector
        per = [torch.autograd.grad(f, outs, grad_outputs=v, retain_graph=True) for v in V]
        return [torch.stack([p[i] for p in per]) for i in range(len(outs))]


def _read(site: Any, g: Tensor) -> Tensor:
    """The site's rows of every vector of g (k, *output shape): (k, B, R, out) or (k, B, P)."""
    try:
        return vmap(site.read)(g)  # type: ignore[no-any-return]
    except RuntimeError:
        return torch.stack([site.read(v) for v in g])


def _inputs(spec: Any, site: Any) -> Tensor | None:
    """A block's input rows with the bias column (B, R, in_aug), its token ids (B, R), or None (gradients)."""
    if spec.form == "grad":
        return None
    a = site.inputs
    if spec.ids or spec.bias is None:
        return a  # type: ignore[no-any-return]
    return torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)


def _is_output_layer(spec: Any, site: Any, f: Tensor) -> bool:
    """Whether the block's output rows are the model's outputs themselves (R = positions, out = C, the rows
    a reshape of f), so that its closed form applies (:meth:`GLMTerm.root`)."""
    if site.output is not f or spec.form != "kron" or spec.ids or spec.out_features != f.shape[-1]:
        return False
    probe = (torch.arange(f.numel(), device=f.device) % 16777213).to(f.dtype).reshape(f.shape)
    try:
        rows = site.read(probe)
    except RuntimeError:
        return False
    P = math.prod(f.shape[1:-1])
    return tuple(rows.shape) == (f.shape[0], P, f.shape[-1]) and torch.equal(rows.reshape(-1), probe.reshape(-1))


def engine_variance(structure: ModelStructure, plans: Sequence[Any], terms: Sequence[GLMTerm],
                    params: Mapping[str, Tensor], buffers: Mapping[str, Tensor], X: Inputs, diagonal: bool,
                    dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(f, variances) at ``params`` for the blocks of ``plans`` (:func:`curvkit.layerkinds.plan`), one term
    per block in plan order: variances (B, P*C) of every entry, or (B, P, C, C) per position."""
    names = {n for lp in plans if not lp.handler.per_sample_copies for spec in lp.blocks for n in spec.names}
    leaves = {n: t.detach().requires_grad_(n in names) for n, t in params.items()}
    cap = BlockCapture(plans, "Laplace GLM predictive")
    result: dict[str, Tensor] = {}

    def at_end(module: Any, args: Any, out: Any) -> None:  # inside functional_call: the posterior's state
        result["var"] = _from_sites(cap, out, terms, diagonal, dtype)
        result["f"] = out.detach()

    with cap:
        raw = cap.substitute(num_samples(X), values=params)
        handle = structure.model.register_forward_hook(at_end)
        try:
            with torch.enable_grad():
                structure.functional_call({**leaves, **raw}, (X,), buffers)
        finally:
            handle.remove()
    return result["f"], result["var"]


def _from_sites(cap: BlockCapture, f: Tensor, terms: Sequence[GLMTerm], diagonal: bool,
                dtype: torch.dtype) -> Tensor:
    sites = cap.sites()
    check_sample_rows(cap.specs, sites, f, "Laplace GLM predictive")
    specs = [spec for _, spec in cap.specs]
    B, C = f.shape[0], f.shape[-1]
    var = new_variance(f, dtype, diagonal)
    K = var.shape[1] if diagonal else var.shape[1] * C
    roots = [_is_output_layer(spec, site, f) for spec, site in zip(specs, sites)]
    rest = [i for i, r in enumerate(roots) if not r]
    outs: list[Tensor] = []
    shared: list[Tensor] = []  # outputs every sample uses (Site.shared): their per-sample gradients
    for i in rest:
        into = shared if sites[i].shared else outs
        if sites[i].output is not f and all(sites[i].output is not o for o in into):
            into.append(sites[i].output)
    per_entry = 2 * sum(int(o.numel()) for o in outs) + 2 * B * sum(int(o.numel()) for o in shared) + 2 * sum(
        int(sites[i].output.numel()) * (B if sites[i].shared else 1) if specs[i].form == "kron"
        else B * specs[i].in_features for i in rest)
    k = _chunk_size(per_entry, K, C, diagonal)
    states = [term.prepare(_inputs(spec, site), spec.ids, k) if term.rows == "kron" else None
              for spec, site, term in zip(specs, sites, terms)]
    for i, root in enumerate(roots):
        if root:
            part = terms[i].root(states[i], diagonal)
            assert part is not None
            (var.view(B, -1, C) if diagonal else var).add_(part.to(dtype))
    if not rest:
        return var
    for e0 in range(0, K, k):
        e1 = min(K, e0 + k)
        V = _one_hot(f, e0, e1)
        grads = dict(zip(map(id, outs), _batched_grad(f, outs, V)))
        if shared:  # (k, B, *o.shape): each sample's gradient of the output they all use
            grads.update(zip(map(id, shared), per_sample_grads(f, shared, V)))
        for i in rest:
            g = V if sites[i].output is f else grads[id(sites[i].output)]
            D = _read(sites[i], g)
            part = terms[i].diag(states[i], D) if diagonal else terms[i].full(states[i], D, C)
            _add(var, part, e0, e1, C, diagonal)
    return var


def generic_rows(structure: ModelStructure, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
                 names: Sequence[str], X: Inputs, e0: int, e1: int) -> Tensor:
    """Per-sample Jacobian rows (e1 - e0, B, d) of output entries [e0, e1) with respect to the parameters
    ``names`` (flat, in the given order), by ``vmap(jacrev)`` over the batch, or one sample at a time where
    vmap fails (a warning says so)."""
    sub = {n: params[n].detach() for n in names}
    rest = {n: t.detach() for n, t in params.items() if n not in sub}

    def single(p: dict[str, Tensor], x: Inputs) -> Tensor:
        out = structure.functional_call({**rest, **p}, (map_inputs(lambda t: t.unsqueeze(0), x),), buffers)
        return out.reshape(-1)[e0:e1]  # type: ignore[no-any-return]

    B = num_samples(X)
    try:
        J = vmap(jacrev(single), in_dims=(None, 0))(sub, X)
    except (RuntimeError, NotImplementedError) as err:
        warnings.warn(f"Laplace GLM predictive: torch.func.vmap failed ({err}); the Jacobian rows are computed "
                      "one sample at a time", RuntimeWarning, stacklevel=2)
        rows = [jacrev(single)(sub, take_samples(X, i)) for i in range(B)]
        J = {n: torch.stack([r[n] for r in rows]) for n in names}
    return torch.cat([J[n].reshape(B, e1 - e0, -1) for n in names], dim=-1).transpose(0, 1)


def generic_variance(structure: ModelStructure, params: Mapping[str, Tensor], buffers: Mapping[str, Tensor],
                     blocks: Sequence[tuple[Sequence[str], GLMTerm]], X: Inputs, var: Tensor, C: int,
                     diagonal: bool) -> None:
    """Add the variances of the ``blocks`` (their parameter names and a gradient-rows term each) into ``var``
    (:func:`new_variance`'s form), from per-sample Jacobian rows in chunks of entries."""
    names = [n for ns, _ in blocks for n in ns]
    dims = [sum(int(params[n].numel()) for n in ns) for ns, _ in blocks]
    B = num_samples(X)
    K = var.shape[1] if diagonal else var.shape[1] * C
    k = _chunk_size(2 * B * sum(dims), K, C, diagonal)
    for e0 in range(0, K, k):
        e1 = min(K, e0 + k)
        J = generic_rows(structure, params, buffers, names, X, e0, e1)
        start = 0
        for (_, term), d in zip(blocks, dims):
            rows = J[:, :, start:start + d]
            start += d
            _add(var, term.diag(None, rows) if diagonal else term.full(None, rows, C), e0, e1, C, diagonal)
