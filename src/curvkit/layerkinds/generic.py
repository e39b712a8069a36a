"""The exact fallback for any module whose trainable parameters no registered kind owns: per-sample
gradients of the owning module's own parameters, whatever its class.

Every Llama/Qwen2/Mistral/T5 RMSNorm, a ConvNeXt ``LayerNorm2d``, a layer-scale module (``x * gamma``), an
LSTM/GRU, a registered class's subclass with its own ``forward`` (BART's learned positional embedding,
scaled embeddings) or any custom module with parameters gets a block here instead of a refusal.

How. For a module m with parameters theta used as ``y = m(x)``, each sample n gets its own copy
``Theta[n] = theta`` (one flat tensor per block, ``theta.expand(B, P)``, on the graph to theta), and the
module's output is REPLACED (a forward hook) by the same computation run sample by sample on the copies:
``y[n] = m(x[n]; Theta[n])`` (``torch.func.vmap`` over size-1 slices of the batch; a plain loop over the
samples where vmap has no batching rule, e.g. ``aten::lstm``). The values are those of the original output
(checked on every pass: a module whose samples are not independent along the batch dimension, or that the
per-sample replay computes differently, is refused with an error naming it), and the gradient of a
back-propagated vector with respect to ``Theta`` is, row by row, the per-sample gradient u_n of the block's
parameters: the block is ``sum_n u_n u_n^T`` (``form='grad'``, as for a normalisation layer: the exact
per-layer GGN block for KFLR's vectors and (B, C) outputs) or its diagonal.

Blocks. A module with at most two trainable parameters (a norm's scale and shift) gets one joint block;
otherwise one block per parameter (an LSTM's weight_ih/weight_hh/biases). A block is dense when the
estimator's ``norm_structure`` is ``'full'`` AND it has at most :data:`DENSE_LIMIT` entries; above that
size (an LSTM weight, a large embedding subclass) it is its diagonal, so memory stays O(P).

Batch dimension. Never inferred from a shape coincidence: the module's first tensor argument carries the
batch in dimension 0 (in dimension 1 for a sequence-first ``nn.RNNBase``, read from ``batch_first``, whose
hidden states carry it in dimension 1); other tensor arguments are taken per sample when their batch
dimension has the batch's size, shared otherwise; every tensor of the output carries the batch where the
input does (dimension 1 for an RNN's hidden states). An output with a batch dimension of size 1 (BART's
decoder position embedding looks up (1, T) positions) is shared by the samples: it is replaced by its
per-sample copies (B, ...), which broadcasting gives anyway. The equality check above catches a wrong guess.

Cost: one extra forward and backward of the module per pass (B module calls for the loop), and the (B, P)
per-sample gradients; this is a fallback, registered kinds stay the fast paths.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import functional_call, vmap
from torch.utils import _pytree as pytree

from curvkit.layerkinds._base import (
    BlockSpec,
    Emit,
    LayerHandler,
    Site,
    recording,
    replay,
    replaying,
    row_index,
)
from curvkit.structure import UnsupportedModelError, refuse

__all__ = ["DENSE_LIMIT", "ModuleHandler"]

#: the largest block (parameter entries) kept dense; larger blocks are diagonal (P x P would not fit)
DENSE_LIMIT = 4096


class ModuleHandler(LayerHandler):
    """Per-sample gradients of a module's own trainable parameters ``attrs`` (module docstring)."""

    kind = "module"

    def __init__(self, attrs: Sequence[str]):
        self.attrs = tuple(attrs)

    def owned(self, module: nn.Module) -> tuple[str, ...]:
        return self.attrs

    def groups(self, names: Mapping[str, str | None]) -> list[tuple[str, ...]]:
        """The attribute groups of the blocks: one joint block for at most two parameters, else one each."""
        live = tuple(a for a in self.attrs if names.get(a) is not None)
        return [live] if len(live) <= 2 else [(a,) for a in live]

    def blocks(self, module: nn.Module, label: str, names: Mapping[str, str | None], what: str) -> list[BlockSpec]:
        out = []
        groups = self.groups(names)
        for group in groups:
            P = sum(int(getattr(module, a).numel()) for a in group)
            first, second = names[group[0]], names[group[1]] if len(group) > 1 else None
            assert first is not None
            name = label if len(groups) == 1 else f"{label}.{group[0]}"
            out.append(BlockSpec(name, first, second, 1, P, form="grad", index=row_index(P),
                                 roles=("module", *group)))
        return out

    def attach(self, module: nn.Module, label: str, blocks: Sequence[BlockSpec], emit: Emit, what: str) -> list[Any]:
        groups = [spec.roles[1:] for spec in blocks]

        def hook(mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any) -> Any:
            if replaying() or not torch.is_grad_enabled():
                return None
            leaves = [t for t in pytree.tree_leaves(out) if isinstance(t, Tensor)]
            if not any(recording(t) for t in leaves):
                return None
            in_dim, out_dims = _batch_dims(mod, args, out, label, what)
            x0 = args[0]
            B = int(x0.shape[in_dim])
            flats, theta = [], {}
            for group in groups:
                ps = [getattr(mod, a) for a in group]
                flat = torch.cat([p.reshape(-1) for p in ps]).expand(B, -1)  # on the graph to the parameters
                flats.append(flat)
                s = 0
                for a, p in zip(group, ps):
                    theta[a] = flat[:, s:s + p.numel()].reshape(B, *p.shape)
                    s += p.numel()
            new = _replay(mod, theta, args, kwargs, in_dim, out_dims, B)
            _check_same(new, out, label, mod, what)
            x = x0.detach().movedim(in_dim, 0)
            for j, flat in enumerate(flats):
                emit(Site(j, x, flat, _flat(B)))
            return new

        return [module.register_forward_hook(hook, with_kwargs=True)]


def _flat(B: int) -> Any:
    return lambda g: g.reshape(B, -1)


def _batch_dims(mod: nn.Module, args: tuple[Any, ...], out: Any, label: str, what: str) -> tuple[int, Any]:
    """(batch dimension of the first argument, out_dims pytree for the output) (module docstring)."""
    if not args or not isinstance(args[0], Tensor) or args[0].dim() < 1:
        got = type(args[0]).__name__ if args else "no positional argument"
        raise refuse(what, label, mod, f"was called with {got} as its first argument; the per-sample fallback "
                     "needs a tensor with the batch dimension first", "freeze it or register a handler for it")
    if isinstance(mod, nn.RNNBase):
        first = 0 if mod.batch_first or args[0].dim() == 2 else 1  # (T, C) unbatched input: refused below
        if args[0].dim() == 2:
            raise refuse(what, label, mod, "ran on an input without a batch dimension",
                         "give it (batch, time, features) inputs")
        # output (batch at the input's place), hidden state(s) (layers, batch, H)
        return first, (first, pytree.tree_map(lambda t: 1, out[1]))
    if not all(isinstance(t, Tensor) for t in pytree.tree_leaves(out)):
        raise refuse(what, label, mod, "returns something other than tensors", "freeze it or register a handler")
    return 0, pytree.tree_map(lambda t: 0, out)


def _replay(mod: nn.Module, theta: dict[str, Tensor], args: tuple[Any, ...], kwargs: dict[str, Any],
            in_dim: int, out_dims: Any, B: int) -> Any:
    """The module's output computed sample by sample with the per-sample copies ``theta`` (B, *shape)."""
    if isinstance(mod, nn.RNNBase):
        dims: list[Any] = [in_dim] + [1 if isinstance(a, Tensor) else None for a in args[1:]]
        if len(args) > 1 and isinstance(args[1], tuple):
            dims[1] = pytree.tree_map(lambda t: 1, args[1])  # type: ignore[call-overload]
    else:
        dims = [in_dim] + [0 if isinstance(a, Tensor) and a.dim() > 0 and a.shape[0] == B else None
                           for a in args[1:]]
    kw_dims = {k: 0 if isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == B else None for k, v in kwargs.items()}

    def one(th: dict[str, Tensor], a: tuple[Any, ...], kw: dict[str, Any]) -> Any:
        with replay():
            return functional_call(mod, th, a, kw)

    def split(t: Any, d: Any) -> Any:  # keep a batch dimension of size 1 for the module
        return t if d is None else t.unflatten(d, (B, 1))

    a_s = tuple(pytree.tree_map(lambda t, d=d: split(t, d), a) if d is not None else a for a, d in zip(args, dims))
    kw_s = {k: split(v, kw_dims[k]) for k, v in kwargs.items()}
    in_dims = (0, tuple(dims), kw_dims)
    try:
        with warnings.catch_warnings():  # torch's note that an op runs through its slow batching fallback
            warnings.filterwarnings("ignore", message="There is a performance drop")
            res = vmap(one, in_dims=in_dims, out_dims=out_dims)(theta, a_s, kw_s)
        return pytree.tree_map(lambda t, d: t.flatten(d, d + 1), res, out_dims)
    except RuntimeError as exc:
        if "Batching rule not implemented" not in str(exc) and "vmap" not in str(exc):
            raise
    # a loop over the samples (no batching rule, e.g. aten::lstm)
    parts = []
    for n in range(B):
        a_n = tuple(pytree.tree_map(lambda t, d=d, n=n: t.narrow(d, n, 1), a) if d is not None else a
                    for a, d in zip(args, dims))
        kw_n = {k: v if kw_dims[k] is None else v.narrow(0, n, 1) for k, v in kwargs.items()}
        parts.append(one({k: v[n] for k, v in theta.items()}, a_n, kw_n))
    flat_dims = pytree.tree_leaves(out_dims)
    leaves = [pytree.tree_flatten(p)[0] for p in parts]
    spec = pytree.tree_flatten(parts[0])[1]
    return pytree.tree_unflatten([torch.cat([lv[i] for lv in leaves], dim=d) for i, d in enumerate(flat_dims)], spec)


def _check_same(new: Any, old: Any, label: str, mod: nn.Module, what: str) -> None:
    a, b = pytree.tree_leaves(new), pytree.tree_leaves(old)
    ok = len(a) == len(b)
    for s, t in zip(a, b):
        if not isinstance(t, Tensor):
            continue
        if isinstance(s, Tensor) and s.shape != t.shape and t.dim() == s.dim() and t.shape[0] == 1 \
                and t.shape[1:] == s.shape[1:]:
            t = t.expand(s.shape)  # an output shared by the samples (batch dimension 1): each gets its copy
        if not isinstance(s, Tensor) or s.shape != t.shape:
            ok = False
            break
        if not bool(torch.isfinite(t.detach()).all()):
            raise ValueError(f"{what}: module {label!r} ({type(mod).__name__}) produced NaN or inf in the forward "
                             "pass; check the inputs and the model's parameters")
        scale = float(t.detach().abs().max()) if t.numel() else 0.0
        tol = 1e-4 if t.dtype in (torch.float16, torch.bfloat16) else (1e-5 if t.dtype == torch.float32 else 1e-10)
        if not torch.allclose(s.detach(), t.detach(), rtol=tol, atol=tol * scale + tol):
            ok = False
            break
    if not ok:
        raise UnsupportedModelError(
            f"{what}: module {label!r} ({type(mod).__name__}) owns trainable parameters no layer kind handles, and "
            "computed sample by sample (the per-sample fallback, batch in the first argument's dimension 0) it "
            "gives a different output: its samples are not independent along that dimension (batch statistics, "
            "a sequence-first layout); freeze it, register a handler (curvkit.layerkinds.register) or use an "
            "exact or diagonal curvature")
