"""Layer kinds for the Kronecker engine: one handler per kind, found through a registry.

A handler (:class:`LayerHandler`, one module per kind) knows what one kind of module computes and
nothing about curvature estimation: which parameters it owns, which configurations it refuses, its
curvature blocks (:class:`BlockSpec`: a matrix view of some parameter entries) and, on every forward pass,
its input rows and a tensor whose gradient gives its output rows (:class:`Site`), all in one
weight-sharing format (B, R, features). The Kronecker estimators
(:mod:`curvkit.curvature.estimators`) turn those into factors with no kind-specific code.

Built in (module -> handler: blocks):

* ``nn.Linear`` on (B, in) or (B, *S, in) -> :class:`LinearHandler`: ``G (x) A`` of ``[W | b]``;
* ``nn.Conv1d``, ``nn.Conv2d``, ``nn.Conv3d`` (any groups) -> :class:`ConvHandler`: one ``G (x) A`` per group;
* ``nn.Embedding`` -> :class:`EmbeddingHandler`: ``G (x) diag(token counts)`` of ``W^T``;
* ``nn.LayerNorm``, ``nn.RMSNorm``, ``nn.GroupNorm``, BatchNorm (eval; training mode with
  ``batch_statistics='couple'``) -> :class:`NormHandler`: the exact (or diagonal) block of (weight, bias) from
  per-sample gradients;
* ``nn.MultiheadAttention`` -> :class:`AttentionHandler`: query, key, value and output projections;
* GPT-2's ``transformers.pytorch_utils.Conv1D`` (a Linear with its weight stored (in, out)) ->
  :class:`TransposedLinearHandler`: ``G (x) A`` of ``[W^T | b]``, registered when first met (recognised by
  its class's qualified name, :data:`curvkit.layerkinds.transposed.LAZY`; ``transformers`` stays optional);
* a raw parameter of shape (1, ...) used in a module's own forward around planned layers ->
  :class:`ParameterHandler` (not in the registry: :func:`plan` gives it to parameters no handler owns);
* any other module's own trainable parameters, whatever its class (RMSNorm variants, ``LayerNorm2d``,
  layer scale, transposed convolutions, LSTM/GRU, subclasses with their own forward) ->
  :class:`ModuleHandler`, the exact per-sample fallback (:mod:`curvkit.layerkinds.generic`).

Registry. :func:`register` maps a module type to a handler; :func:`handler_for` resolves a module along
its class's MRO, so a subclass of a registered type gets its parent's handler - unless the subclass
defines its own ``forward`` (then what it computes is not what the handler knows, and the module gets the
per-sample fallback unless a handler is registered for it). A new kind is one module with its handler, a
``register`` call, and one line in the conformance test (``tests/test_layerkinds_conformance.py``).

:func:`plan` reads a model (through :func:`curvkit.structure.read_model`) into :class:`LayerPlan` entries:
one per module that owns trainable parameters, with its handler and blocks. Frozen parameters get no
block. A parameter shared by several modules (weight tying) is planned once per module that holds it (each
one USE, :attr:`LayerPlan.optional`; :func:`shared_groups` groups their blocks, whose curvature is the sum of
their terms: docs/architecture.md, "Shared and tied weights"). A module registered under two names, random or
sample-coupling modules, and a parameter a module uses around planned layers of its own (not replayable;
without a leading dimension of size 1) are refused with an :class:`~curvkit.structure.UnsupportedModelError`
that names the module and says how to fix it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import nn

from curvkit.layerkinds._base import BlockSpec, Emit, LayerHandler, Site, UnfoldedSite
from curvkit.layerkinds.attention import AttentionHandler
from curvkit.layerkinds.conv import ConvHandler
from curvkit.layerkinds.embedding import EmbeddingHandler
from curvkit.layerkinds.generic import DENSE_LIMIT, ModuleHandler
from curvkit.layerkinds.linear import LinearHandler
from curvkit.layerkinds.norm import NormHandler
from curvkit.layerkinds.parameter import ParameterHandler
from curvkit.layerkinds.transposed import LAZY, TransposedLinearHandler
from curvkit.structure import LayerInfo, ModelStructure, UnsupportedModelError, refuse

__all__ = [
    "BATCH_STATISTICS_HINT",
    "DENSE_LIMIT",
    "AttentionHandler",
    "BlockSpec",
    "ConvHandler",
    "EmbeddingHandler",
    "Emit",
    "LayerHandler",
    "LayerPlan",
    "LinearHandler",
    "ModuleHandler",
    "NormHandler",
    "ParameterHandler",
    "Site",
    "TransposedLinearHandler",
    "UnfoldedSite",
    "handler_for",
    "plan",
    "refuse_shared",
    "register",
    "registered",
    "shared_groups",
    "sum_label",
]

_REGISTRY: dict[type[nn.Module], LayerHandler] = {}


def register(module_type: type[nn.Module], handler: LayerHandler) -> None:
    """Let ``handler`` take modules of ``module_type`` (and of subclasses that keep its ``forward``);
    replaces an earlier registration of that type."""
    if not (isinstance(module_type, type) and issubclass(module_type, nn.Module)):
        raise TypeError(f"module_type must be an nn.Module subclass, got {module_type!r}")
    if not isinstance(handler, LayerHandler):
        raise TypeError(f"handler must be a curvkit.layerkinds.LayerHandler, got {type(handler).__name__}")
    _REGISTRY[module_type] = handler


def registered() -> dict[type[nn.Module], LayerHandler]:
    """A copy of the registry (module type -> handler)."""
    return dict(_REGISTRY)


def handler_for(module: nn.Module) -> tuple[LayerHandler | None, str | None]:
    """(handler, None) for a module of a registered kind; (None, why) otherwise (None when the type and
    its bases are simply unknown)."""
    cls = type(module)
    for base in cls.__mro__:
        handler = _REGISTRY.get(base)
        if handler is None and (base.__module__, base.__qualname__) in LAZY:  # an optional library's class
            handler = LAZY[base.__module__, base.__qualname__]()
            register(base, handler)
        if handler is None:
            continue
        if base is not cls and getattr(cls, "forward", None) is not getattr(base, "forward", None):
            return None, (f"is a subclass of {base.__name__} with its own forward, so the {handler.kind} handler "
                          "does not know what it computes")
        return handler, None
    return None, None


for _t, _h in ((nn.Linear, LinearHandler()), (nn.Conv1d, ConvHandler()), (nn.Conv2d, ConvHandler()),
               (nn.Conv3d, ConvHandler()),
               (nn.Embedding, EmbeddingHandler()), (nn.LayerNorm, NormHandler()), (nn.RMSNorm, NormHandler()),
               (nn.GroupNorm, NormHandler()), (nn.modules.batchnorm._BatchNorm, NormHandler()),
               (nn.MultiheadAttention, AttentionHandler())):
    register(_t, _h)


@dataclass
class LayerPlan:
    """One module with trainable parameters, its handler and its blocks (in order)."""

    label: str
    module: nn.Module
    handler: LayerHandler
    blocks: list[BlockSpec]
    info: LayerInfo
    #: the layer is one use of a parameter that several modules share (weight tying): a pass in which it is
    #: not called (T5's ``shared`` embedding beside its ``encoder.embed_tokens`` alias) gives it no statistics
    optional: bool = False


def _get(module: nn.Module, path: str) -> Any:
    obj: Any = module
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


#: The fix every refusal of batch statistics (BatchNorm in training mode) by the Kronecker engine appends; public
#: so that consumers that re-check the mode (GaussNewton) word it the same way.
BATCH_STATISTICS_HINT = (", or pass batch_statistics='couple' (KroneckerEstimator, GaussNewton) for Kronecker "
                         "factors from the coupled backward pass of the batch (an approximation beyond per-sample "
                         "curvature, docs/architecture.md)")


def plan(structure: ModelStructure, what: str, raw: bool = True, batch_statistics: str | None = None) -> list[LayerPlan]:
    """The blocks of every module that owns trainable parameters (module docstring), or an error naming
    the first module that cannot be taken. With ``raw``, a trainable parameter of shape (1, ...) that a
    module without a handler uses in its own forward (a ViT's class token) gets a :class:`ParameterHandler`
    block (one :class:`LayerPlan` per parameter, labelled by its name); the other parameters no handler owns
    go to their module's :class:`ModuleHandler` (the per-sample fallback). A module that couples the samples
    (BatchNorm with batch statistics) is refused unless ``batch_statistics='couple'`` (the Kronecker
    estimators' explicit opt-in, :class:`curvkit.curvature.estimators.KroneckerEstimator`); the refusal names
    that option only for callers that take it (``batch_statistics='refuse'``), not for None."""
    _refuse_sharing(structure, what)
    structure.require_deterministic(what)
    if batch_statistics != "couple":
        structure.require_independent_samples(what, BATCH_STATISTICS_HINT if batch_statistics == "refuse" else "")
    trainable = set(structure.trainable)
    shared = set(structure.shared_parameters)
    owned: dict[str, list[nn.Module]] = {}  # canonical parameter name -> the modules of the plans that own it
    infos = {lay.label: lay for lay in structure.layers}
    out: list[LayerPlan] = []

    def taken(name: str, module: nn.Module) -> bool:
        """Whether a plan already owns ``name`` for ``module``: any plan for an unshared parameter; for a
        shared one (each owner module is a use of its own) a plan of this module or of a module around it
        (an attention module owns its ``out_proj``'s parameters)."""
        holders = owned.get(name, [])
        return bool(holders) and (name not in shared or any(_inside(module, h) for h in holders))

    for mname, mod in structure.modules:
        label = mname or "<root>"
        handler, _ = handler_for(mod)
        if handler is None:
            continue
        paths = handler.owned(mod)
        names: dict[str, str | None] = {}
        for path in paths:
            p = _get(mod, path)
            cname = structure.canonical_name(p) if p is not None else None
            names[path] = cname if cname in trainable else None
        if not any(n is not None for n in names.values()) or all(taken(n, mod) for n in names.values() if n):
            continue
        handler.check(mod, label, what)
        blocks = handler.blocks(mod, label, names, what)
        for n in names.values():
            if n is not None:
                owned.setdefault(n, []).append(mod)
        info = infos.get(label) or LayerInfo(label, mod, None, None, tuple(n for n in names.values() if n is not None))
        out.append(LayerPlan(label, mod, handler, blocks, info))
    for lay in structure.layers:
        loose = [n for n in lay.params if not taken(n, lay.module)]
        if not loose:
            continue
        handler, _ = handler_for(lay.module)
        params = dict(lay.module.named_parameters(recurse=False))
        attrs = {structure.canonical_name(t): a for a, t in params.items()}
        inner = [lp.label for lp in out if lp.module is not lay.module and _inside(lp.module, lay.module)]
        aliases = [n for n in loose if n in shared and any(_inside(h, lay.module) for h in owned.get(n, []))]
        if aliases and len(aliases) == len(loose):  # an alias of a parameter a planned layer inside uses
            continue  # (RoBERTa's lm_head.bias is lm_head.decoder.bias); a use of its own is caught at run time
        if handler is not None or isinstance(lay.module, (nn.ParameterList, nn.ParameterDict)):
            # a registered kind with parameters its handler does not know; a container never called itself
            _refuse_unowned(what, lay, loose, raw)
        leading_one = all(params[attrs[n]].dim() >= 2 and params[attrs[n]].shape[0] == 1 for n in loose)
        if raw and leading_one and inner and not shared.intersection(loose):  # a class token around planned layers
            for n in loose:
                ph = ParameterHandler(attrs[n])
                out.append(LayerPlan(n, lay.module, ph, ph.blocks(lay.module, lay.label, {attrs[n]: n}, what), lay))
            continue
        if inner:
            _refuse_unowned(what, lay, loose, raw, inner)
        mh = ModuleHandler([attrs[n] for n in loose])
        names = {attrs[n]: n for n in loose}
        for n in loose:
            owned.setdefault(n, []).append(lay.module)
        out.append(LayerPlan(lay.label, lay.module, mh, mh.blocks(lay.module, lay.label, names, what), lay))
    if not out:
        raise UnsupportedModelError(f"{what}: {type(structure.model).__name__} has no trainable parameters")
    for lp in out:
        lp.optional = any(n in shared for spec in lp.blocks for n in spec.names)
    return out


def _inside(child: nn.Module, parent: nn.Module) -> bool:
    return any(m is child for m in parent.modules())


def _refuse_unowned(what: str, lay: LayerInfo, loose: list[str], raw: bool, inner: list[str] | None = None) -> None:
    _, why = handler_for(lay.module)
    params = ", ".join(repr(n) for n in loose)
    if inner:
        raise refuse(what, lay.label, lay.module, f"uses its own trainable parameter(s) {params} around layers that "
                     f"have their own blocks ({', '.join(inner[:3])}{', ...' if len(inner) > 3 else ''}); the "
                     "per-sample fallback re-runs a module without planned layers inside it, and raw parameters "
                     "are substituted per sample only with a leading dimension of size 1 (1, ...)",
                     "move the parameter into a small module of its own (e.g. a layer-scale module "
                     "computing x * gamma), freeze it (requires_grad_(False)) or use an exact or diagonal curvature")
    if why is not None:
        raise refuse(what, lay.label, lay.module, why, "register a handler for it (curvkit.layerkinds.register), "
                     "freeze its parameters (requires_grad_(False)) or use an exact or diagonal curvature")
    kinds = ", ".join(sorted({t.__name__ for t in _REGISTRY}))
    extra = " (raw parameters are taken when they have a leading dimension of size 1: (1, ...))" if raw else ""
    raise refuse(what, lay.label, lay.module, f"owns trainable parameter(s) {params} that no layer kind handles "
                 f"(handled: {kinds}){extra}", "freeze them (requires_grad_(False)), register a handler "
                 "(curvkit.layerkinds.register) or use an exact or diagonal curvature")


def _refuse_sharing(structure: ModelStructure, what: str) -> None:
    modules = dict(structure.modules)
    if structure.reused_modules:
        name, aliases = next(iter(structure.reused_modules.items()))
        raise refuse(what, name or "<root>", modules[name], f"is registered under {len(aliases)} names "
                     f"({', '.join(aliases)}), so it runs more than once per forward pass and its input and "
                     "output gradient cannot be paired", "use one module per call")


def refuse_shared(structure: ModelStructure, what: str) -> None:
    """Raise for a trainable parameter shared by several modules (weight tying), for the routes that keep one
    Kronecker block per layer and no sum of terms (KFRA's recursion along a chain), naming the parameter, its
    modules and the fixes."""
    modules = dict(structure.modules)
    for pname, owners in structure.shared_parameters.items():
        uses = ", ".join(f"{o!r} ({type(modules[o if o != '<root>' else '']).__name__})" for o in owners)
        raise UnsupportedModelError(
            f"{what}: parameter {pname!r} is shared by modules {uses} (weight tying); {what} keeps one Kronecker "
            "block per layer, not a sum of its uses' terms; untie the weights (e.g. causal_lm(tie_weights="
            "False), or a Hugging Face model built with config.tie_word_embeddings=False), freeze the shared "
            "parameter (requires_grad_(False)), or use GaussNewton / Laplace(structure='kron'), which take tied "
            "weights")


def shared_groups(plans: list[LayerPlan], shared: set[str] | list[str]) -> list[list[int]]:
    """The blocks of ``plans`` (global positions, in block order) grouped by the shared parameters they read:
    the blocks of all uses of a shared parameter (and, through them, the other parameters they read, a tied
    head's bias) form one group, whose curvature is the SUM of their terms; every other block is a group of
    its own. Groups are listed in the order of their first block."""
    specs = [spec for lp in plans for spec in lp.blocks]
    parent = list(range(len(specs)))

    def root(i: int) -> int:
        while parent[i] != i:
            i = parent[i]
        return i

    first: dict[str, int] = {}
    for i, spec in enumerate(specs):
        for n in spec.names:
            if n in shared:
                if n in first:
                    parent[root(i)] = root(first[n])
                else:
                    first[n] = i
    groups: dict[int, list[int]] = {}
    for i in range(len(specs)):
        groups.setdefault(root(i), []).append(i)
    return sorted(groups.values(), key=lambda g: g[0])


def sum_label(plans: list[LayerPlan], members: list[int]) -> str:
    """The label of the sum block of a group of :func:`shared_groups`: its uses' block labels joined by ' + '."""
    specs = [spec for lp in plans for spec in lp.blocks]
    return " + ".join(specs[i].label for i in members)
