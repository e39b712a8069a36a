"""Hugging Face ``transformers`` models in curvkit: :class:`HuggingFace`, a wrapper that returns the logits.

curvkit calls a model with ONE batch argument and expects ONE tensor back: ``f = model(X)`` with ``X`` a
tensor or a mapping of tensors (:mod:`curvkit.validation`, "Model inputs") and ``f`` of shape (B, C) or
(B, *P, C). A ``transformers`` model takes keyword tensors (``input_ids``, ``attention_mask``,
``pixel_values``, ...) and returns a ``ModelOutput``; ``HuggingFace(model)`` bridges the two::

    hf = HuggingFace(model)                       # output="logits"
    batch = {"input_ids": ids, "attention_mask": mask}
    G = GGNOperator(hf, CrossEntropy(ignore_index=-100), (batch, labels))

The wrapper holds the model as its submodule ``model`` (no copy: the parameters are the user's, named
``model.<name>``) and changes nothing in it: no configuration, attention implementation, mode or
``requires_grad`` flag is touched. Per call it passes ``use_cache=False`` (when the forward takes it: no
key/value cache is built or returned) and ``return_dict=True`` (when the forward accepts it), plus the fixed
keyword options given at construction, and returns the output's ``output`` entry (``logits`` by default).

Calling conventions of :meth:`HuggingFace.forward` (the batch must hold tensors only; options that are not
tensors go to the constructor):

* ``hf(batch)`` - a mapping of tensors, passed as keywords: ``model(**batch)`` (what curvkit does with a
  mapping batch);
* ``hf(**batch)`` - the same tensors as keywords;
* ``hf(tensor)`` - one tensor, passed as the model's main input (``model.main_input_name``: ``input_ids``
  for text models, ``pixel_values`` for vision models), optionally with further keyword tensors.

Checked on every call, with errors that name what is wrong (nothing in the model is changed):

* the batch holds the model's main input (or ``inputs_embeds`` where the forward takes it) and every
  parameter of the forward without a default value (read from its signature), only keys the forward names,
  and no ``labels`` (the targets are the ``y`` of curvkit's ``(X, y)`` pairs: the model's own
  loss would be computed and thrown away);
* a padded batch has an attention mask: when the configuration has a ``pad_token_id``, ``input_ids``
  contain it and the batch has no ``attention_mask``, the padding would be attended to silently, so the call
  is refused (real tokens that share the padding id: pass ``attention_mask=torch.ones_like(input_ids)``);
  inside ``torch.func.vmap`` over samples the batch was already checked whole, and the check is skipped;
* the output has the requested entry (an error lists the entries it has).

Position ids. Some models build their position ids without a batch dimension ((1, T): GPT-2, BERT); the
exact operators do not mind, but a Kronecker block of that position embedding needs per-sample inputs, and
the estimators refuse it with an error naming the module. Pass them with the batch dimension in the batch
(``batch["position_ids"] = torch.arange(T).expand(B, T)``, what those models compute by default without a
cache) or freeze the position embedding.

``peft`` models. ``HuggingFace(get_peft_model(model, config))`` works with or without ``task_type``: a peft
wrapper passes its ``*args``/``**kwargs`` on to ``get_base_model()``, so the keys it takes are its own named
parameters plus those of the wrapped model's forward (``position_ids`` included). An unwrapped peft model is
refused by curvkit with the same fix as an unwrapped ``transformers`` model.

Activation checkpointing (``gradient_checkpointing_enable()``) is bypassed by every curvature pass
(:func:`curvkit.structure.without_checkpointing`); during such a pass the adapter also suspends the forward
hooks that ``enable_input_require_grads`` (called by ``gradient_checkpointing_enable``) put on the input
embeddings (``output.requires_grad_()``, which ``torch.func`` refuses and which only the reentrant recomputation
needs), and puts them back, in their place, after the call.

``transformers`` is an optional dependency: this module never imports it (a model is recognised by its
class's module), so curvkit imports without it.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from curvkit.structure import checkpointing_bypassed, uncompiled
from curvkit.validation import describe_inputs

__all__ = ["HuggingFace", "is_transformers_model", "peft_base", "require_wrapped"]


def _defined_in(model: Any, package: str) -> bool:
    forward = getattr(type(model), "forward", None)
    return isinstance(model, nn.Module) and str(getattr(forward, "__module__", "")).split(".")[0] == package


def peft_base(model: Any) -> nn.Module | None:
    """The model a ``peft`` wrapper passes its calls on to (``PeftModel``, ``PeftModelForCausalLM``, ... from
    ``get_peft_model``: ``model.get_base_model()``, the user's model with the adapters injected), or None for
    anything else. Recognised without importing ``peft``."""
    get = getattr(model, "get_base_model", None)
    if not _defined_in(model, "peft") or not callable(get):
        return None
    base = get()
    return base if isinstance(base, nn.Module) and base is not model else None


def is_transformers_model(model: Any) -> bool:
    """Whether ``model`` is a ``transformers`` model called as such: its ``forward`` is defined in the
    ``transformers`` package (keyword tensors in, a ``ModelOutput`` out), or it is a ``peft`` wrapper of one
    (:func:`peft_base`). Recognised without importing either package; a user's subclass with its own
    ``forward`` is not one."""
    base = peft_base(model)
    return _defined_in(model, "transformers") or (base is not None and is_transformers_model(base))


def require_wrapped(model: Any, what: str) -> None:
    """Raise a TypeError naming the fix when ``model`` is an unwrapped ``transformers`` model: curvkit calls
    ``model(X)`` and needs one tensor back (module docstring)."""
    if is_transformers_model(model):
        kind = "a peft-wrapped Hugging Face transformers model" if peft_base(model) is not None else \
            "a Hugging Face transformers model"
        raise TypeError(f"{what}: {type(model).__name__} is {kind}, whose forward takes "
                        "keyword tensors and returns a ModelOutput; wrap it so that it takes the batch and returns "
                        "the logits tensor: curvkit.hf.HuggingFace(model) (the model is not copied or changed)")


def _typed_kwargs(param: inspect.Parameter) -> frozenset[str] | None:
    """The keys of a ``**kwargs: Unpack[SomeTypedDict]`` parameter (``transformers``' ``TransformersKwargs``),
    or None when its keys are not declared."""
    args = typing.get_args(param.annotation) if typing.get_origin(param.annotation) is typing.Unpack else ()
    keys = getattr(args[0], "__annotations__", None) if args else None
    if not keys:
        return None
    return frozenset(keys) | frozenset(getattr(args[0], "__optional_keys__", ()))


def _input_grad_hooks(model: nn.Module) -> list[Any]:
    """The handles of the hooks ``enable_input_require_grads`` registered in ``model`` (its modules'
    ``_require_grads_hooks``)."""
    handles: dict[int, Any] = {}
    for mod in model.modules():
        for h in getattr(mod, "_require_grads_hooks", None) or []:
            handles[id(h)] = h
    return list(handles.values())


@contextmanager
def _suspended(handles: list[Any]) -> Iterator[None]:
    """Take the forward hooks of ``handles`` out of their modules' hook dicts, and put each back at its place
    (before the hooks that followed it, of those still there) on exit."""
    taken = []
    for h in handles:
        hooks = h.hooks_dict_ref()
        if hooks is not None and h.id in hooks:
            after = list(hooks)[list(hooks).index(h.id) + 1:]
            taken.append((hooks, h.id, hooks.pop(h.id), after))
    try:
        yield
    finally:
        for hooks, hid, fn, after in reversed(taken):
            items = list(hooks.items())
            cut = next((i for i, (k, _) in enumerate(items) if k in after), len(items))
            hooks.clear()
            hooks.update(items[:cut])
            hooks[hid] = fn
            hooks.update(items[cut:])


def _forward_parameters(model: nn.Module) -> dict[str, inspect.Parameter]:
    """The parameters a call of ``model`` takes, read from its forward's signature. A ``peft`` wrapper
    (:func:`peft_base`) passes its ``*args``/``**kwargs`` on to the model it wraps: its own named parameters
    (``PeftModelForCausalLM``'s ``input_ids``, ``attention_mask``, ...) come first, then those of the wrapped
    model's forward (``position_ids``, ``use_cache``, ...), and its ``**kwargs`` are the wrapped model's (open
    or typed). Without this a ``PeftModel`` (no ``task_type``) would seem to take nothing."""
    own = dict(inspect.signature(model.forward).parameters)
    base = peft_base(model)
    if base is None:
        return own
    inner = _forward_parameters(base)
    named = {n: p for n, p in own.items() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    named.update({n: p for n, p in inner.items() if n not in named and p.kind is not p.VAR_POSITIONAL})
    return named


class HuggingFace(nn.Module):
    """A ``transformers`` model as curvkit calls a model: ``hf(X)`` returns the ``output`` tensor (module
    docstring).

    Args:
        model: the ``transformers`` model (any ``nn.Module`` whose forward takes keyword tensors and returns
            a mapping, a ``ModelOutput``, works the same way). It becomes this module's submodule ``model``;
            it is not copied or changed.
        output: the entry of the model's output to return (``"logits"``; e.g. ``"last_hidden_state"`` for a
            model without a head).
        **options: fixed keyword options passed on every call (e.g. ``interpolate_pos_encoding=True``,
            ``output_hidden_states=True``); each must be a parameter of the model's forward or a key of its
            declared ``**kwargs`` (``transformers``' ``TransformersKwargs``); a forward with undeclared
            ``**kwargs`` receives any option as such.

    Raises TypeError for a model that is not an ``nn.Module`` and ValueError for options the forward does
    not take. The keys of a batch must be parameters the forward names (a misspelt ``attention_masks`` is
    refused, not passed on).
    """

    def __init__(self, model: nn.Module, output: str = "logits", **options: Any):
        super().__init__()
        if not isinstance(model, nn.Module):
            raise TypeError(f"HuggingFace: model must be a torch.nn.Module (a transformers model), got "
                            f"{type(model).__name__}")
        if not isinstance(output, str) or not output:
            raise ValueError(f"HuggingFace: output must be the name of an output entry (e.g. 'logits'), got "
                             f"{output!r}")
        model = self.model = uncompiled(model)  # a compiled transformers model: the model it compiles
        self.output = output
        params = _forward_parameters(model)
        self._named = tuple(n for n, p in params.items()
                            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY))
        var = [p for p in params.values() if p.kind is p.VAR_KEYWORD]
        typed = _typed_kwargs(var[0]) if var else frozenset()
        open_kwargs = bool(var) and typed is None  # **kwargs without a TypedDict: anything is passed on
        self._main = str(getattr(model, "main_input_name", self._named[0] if self._named else "input_ids"))
        self._required = tuple(n for n in self._named if params[n].default is params[n].empty and n not in options)
        unknown = [k for k in options if k not in self._named and k not in (typed or ())]
        if unknown and not open_kwargs:
            raise ValueError(f"HuggingFace: option(s) {unknown} are not parameters of "
                             f"{type(model).__name__}.forward (it takes: {', '.join(self._named)})")
        fixed: dict[str, Any] = {}
        if "use_cache" in self._named:
            fixed["use_cache"] = False
        if "return_dict" in self._named or var:
            fixed["return_dict"] = True
        fixed.update(options)
        self._fixed = fixed

    @property
    def _what(self) -> str:
        return f"HuggingFace({type(self.model).__name__})"

    def forward(self, batch: Tensor | Mapping[str, Tensor] | None = None, /, **tensors: Tensor) -> Tensor:
        """The model's ``output`` entry for a batch (the calling conventions of the module docstring)."""
        inputs = self._inputs(batch, tensors)
        self._check_padding(inputs)
        if checkpointing_bypassed():
            with _suspended(_input_grad_hooks(self.model)):
                out = self.model(**inputs, **self._fixed)
        else:
            out = self.model(**inputs, **self._fixed)
        return self._pick(out)

    # ------------------------------------------------------------------ inputs
    def _inputs(self, batch: Any, tensors: dict[str, Any]) -> dict[str, Any]:
        if batch is None:
            inputs = dict(tensors)
        elif isinstance(batch, Tensor):
            inputs = {self._main: batch, **tensors}
            if self._main in tensors:
                raise ValueError(f"{self._what}: the main input {self._main!r} was given twice (positionally and "
                                 "as a keyword)")
        elif isinstance(batch, Mapping):
            twice = sorted(set(batch) & set(tensors))
            if twice:
                raise ValueError(f"{self._what}: key(s) {twice} given both in the batch and as keywords")
            inputs = {**batch, **tensors}
        else:
            raise TypeError(f"{self._what}: the batch must be a mapping of tensors (e.g. {{'{self._main}': ..., "
                            f"'attention_mask': ...}}) or one tensor (the model's {self._main!r}), got "
                            f"{type(batch).__name__}")
        self._check_keys(inputs)
        return inputs

    def _check_keys(self, inputs: dict[str, Any]) -> None:
        if "labels" in inputs or any(not isinstance(v, Tensor) for v in inputs.values()) or any(
                k not in self._named or k in self._fixed for k in inputs):
            self._refuse_keys(inputs)
        alternatives = [self._main] + (["inputs_embeds"] if self._main == "input_ids" and
                                       "inputs_embeds" in self._named else [])
        if not any(k in inputs for k in alternatives):
            need = " or ".join(repr(k) for k in alternatives)
            raise ValueError(f"{self._what}: the batch has no {need}, which {type(self.model).__name__}.forward "
                             f"needs; got {describe_inputs(inputs)}")
        missing = [k for k in self._required if k not in inputs and k not in alternatives]
        if missing:
            raise ValueError(f"{self._what}: the batch has no {missing}, which {type(self.model).__name__}.forward "
                             f"requires (parameters without a default); got {describe_inputs(inputs)}")

    def _refuse_keys(self, inputs: dict[str, Any]) -> None:
        """The error for a batch with labels, entries that are not tensors, or keys the forward does not name."""
        given = describe_inputs(inputs)
        if "labels" in inputs:
            raise ValueError(f"{self._what}: the batch holds 'labels' ({given}); pass the targets as the y of the "
                             "(X, y) pair instead (e.g. (batch, batch.pop('labels'))): the model would compute "
                             "its own loss on every evaluation")
        not_tensors = [k for k, v in inputs.items() if not isinstance(v, Tensor)]
        if not_tensors:
            raise TypeError(f"{self._what}: batch entries {not_tensors} are not tensors ({given}); pass fixed "
                            "options to the constructor: HuggingFace(model, name=value)")
        unknown = sorted(k for k in inputs if k not in self._named)
        if unknown:
            raise ValueError(f"{self._what}: the batch has key(s) {unknown} that {type(self.model).__name__}.forward "
                             f"does not take (it takes: {', '.join(self._named)}); got {given}")
        clash = sorted(k for k in inputs if k in self._fixed)
        raise ValueError(f"{self._what}: key(s) {clash} are fixed by the adapter or its options; remove them "
                         "from the batch")

    def _check_padding(self, inputs: dict[str, Any]) -> None:
        """Refuse input ids that contain the padding id without an attention mask (module docstring)."""
        ids = inputs.get("input_ids")
        pad = getattr(getattr(self.model, "config", None), "pad_token_id", None)
        if ids is None or pad is None or "attention_mask" in inputs or "attention_mask" not in self._named:
            return
        if torch._C._functorch.is_functorch_wrapped_tensor(ids):  # one sample inside vmap: checked whole before
            return
        count = int((ids == pad).sum())
        if count:
            raise ValueError(f"{self._what}: input_ids contain the padding id {pad} (config.pad_token_id) at {count} "
                             "position(s) but the batch has no attention_mask, so the model would attend to the "
                             "padding; pass attention_mask (1 for tokens, 0 for padding), or, if these are real "
                             "tokens, attention_mask=torch.ones_like(input_ids)")

    # ------------------------------------------------------------------ output
    def _pick(self, out: Any) -> Tensor:
        if isinstance(out, Tensor):
            raise TypeError(f"{self._what}: the model returned a tensor, not an output with entries; use the "
                            "model directly (it already returns one tensor)")
        if not isinstance(out, Mapping):
            raise TypeError(f"{self._what}: the model returned a {type(out).__name__}, not a ModelOutput with "
                            f"named entries (is config.return_dict False?); expected an output with {self.output!r}")
        value = out.get(self.output)
        if not isinstance(value, Tensor):
            has = ", ".join(repr(k) for k, v in out.items() if isinstance(v, Tensor)) or "none"
            raise ValueError(f"{self._what}: the model's output ({type(out).__name__}) has no {self.output!r} tensor "
                             f"(its tensor entries: {has}); pass HuggingFace(model, output=...) with one of them, "
                             "or use a model with a head that returns logits (e.g. ...ForCausalLM, "
                             "...ForSequenceClassification)")
        return value

    def extra_repr(self) -> str:
        return f"output={self.output!r}"
