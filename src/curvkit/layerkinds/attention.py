"""``nn.MultiheadAttention`` as people use it: packed ``in_proj_weight`` / ``in_proj_bias`` and ``out_proj``.

Four Kronecker blocks, each a weight-shared linear map over the sequence positions: the query, key and
value projections (rows ``[0, E)``, ``[E, 2E)``, ``[2E, 3E)`` of the packed (3E, E) weight and of the
packed bias) and the output projection (``out_proj.weight``, ``out_proj.bias``). They are the blocks the
same model written with four separate ``nn.Linear`` projections would get.

No module hook fires inside the module's forward: ``F.multi_head_attention_forward`` reads the packed
weight and ``out_proj.weight`` directly. While the capture records, a forward pre-hook enters a
``TorchFunctionMode`` (left again by a forward hook that runs also on errors) that catches the call of
``F.multi_head_attention_forward`` made by this module and evaluates it with its projections as separate
tensors: :func:`attention_forward` (the same operations as torch's, in the same order: its in-projection
for self-, encoder-decoder or general attention - the packed projection split by views -, masks,
scaled dot products, softmax, output projection),
so the projections' inputs and outputs are on the graph and no computation is repeated. The module and
its parameters are never changed.

Refused with an error naming the module: ``kdim``/``vdim`` different from ``embed_dim`` (separate
projection weights), ``bias_k``/``bias_v`` (``add_bias_kv``), ``add_zero_attn``, dropout in training
mode (random), unbatched (2-D) inputs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from curvkit.layerkinds._base import BlockSpec, Emit, LayerHandler, Site, weight_and_bias
from curvkit.linalg.kron import standard_index
from curvkit.structure import UnsupportedModelError, refuse

__all__ = ["AttentionHandler", "attention_forward"]

_PARTS = ("q", "k", "v")


class AttentionHandler(LayerHandler):
    """``nn.MultiheadAttention`` (module docstring)."""

    kind = "attention"

    def owned(self, module: nn.Module) -> tuple[str, ...]:
        names = ("in_proj_weight", "in_proj_bias", "out_proj.weight", "out_proj.bias",
                 "q_proj_weight", "k_proj_weight", "v_proj_weight", "bias_k", "bias_v")
        return tuple(n for n in names if _get(module, n) is not None)

    def check(self, module: nn.Module, label: str, what: str) -> None:
        mod: Any = module
        if not mod._qkv_same_embed_dim:
            raise refuse(what, label, module, f"has kdim={mod.kdim} / vdim={mod.vdim} different from "
                         f"embed_dim={mod.embed_dim} (separate projection weights)",
                         "use kdim = vdim = embed_dim, or freeze the module")
        if mod.bias_k is not None or mod.bias_v is not None:
            raise refuse(what, label, module, "has add_bias_kv=True (learned key/value rows)",
                         "build it with add_bias_kv=False, or freeze the module")
        if mod.add_zero_attn:
            raise refuse(what, label, module, "has add_zero_attn=True", "build it with add_zero_attn=False, or "
                         "freeze the module")
        if mod.training and mod.dropout > 0:
            raise refuse(what, label, module, f"applies attention dropout (p={mod.dropout}) in training mode, so "
                         "its output is random", "call model.eval() (or set its dropout to 0)")

    def blocks(self, module: nn.Module, label: str, names: Mapping[str, str | None], what: str) -> list[BlockSpec]:
        mod: Any = module
        E = int(mod.embed_dim)
        out: list[BlockSpec] = []
        w, b = weight_and_bias(module, label, {"weight": names.get("in_proj_weight"),
                                                      "bias": names.get("in_proj_bias")}, what)
        if w is not None:
            index = standard_index((3 * E, E), b is not None)
            out += [BlockSpec(f"{label}.{p}", w, b, E, E, index=index[i * E:(i + 1) * E], roles=(p,))
                    for i, p in enumerate(_PARTS)]
        w, b = weight_and_bias(module, label, {"weight": names.get("out_proj.weight"),
                                                      "bias": names.get("out_proj.bias")}, what)
        if w is not None:
            out.append(BlockSpec(f"{label}.out_proj", w, b, E, E, roles=("out",)))
        return out

    def attach(self, module: nn.Module, label: str, blocks: Sequence[BlockSpec], emit: Emit, what: str) -> list[Any]:
        where = {spec.roles[0]: i for i, spec in enumerate(blocks)}
        mode = _Intercept(module, label, where, emit, what)

        def enter(*_: Any) -> None:
            if torch.is_grad_enabled():
                mode.check_and_enter()

        def leave(*_: Any) -> None:
            mode.leave()

        return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]


def _get(module: nn.Module, path: str) -> Any:
    obj: Any = module
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


class _Intercept(TorchFunctionMode):
    """Active during one forward of ``module``: evaluates its ``F.multi_head_attention_forward`` call with
    :func:`attention_forward`, emitting the projections' sites."""

    def __init__(self, module: nn.Module, label: str, where: dict[str, int], emit: Emit, what: str):
        super().__init__()
        self.module, self.label, self.where, self.emit, self.what = module, label, where, emit, what
        self.active = False

    def check_and_enter(self) -> None:
        AttentionHandler().check(self.module, self.label, self.what)  # the train/eval mode may have changed
        self.__enter__()
        self.active = True

    def leave(self) -> None:
        if self.active:
            self.active = False
            self.__exit__(None, None, None)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward and len(args) > 5 and args[5] is _get(self.module, "in_proj_weight"):
            self.rows: dict[int, Tensor] = {}
            try:
                return attention_forward(*args, sites=self._sites, **kwargs)
            finally:
                self.rows = {}
        return func(*args, **kwargs)

    def _sites(self, part: str, inputs: Tensor, output: Tensor, cols: slice | None) -> None:
        """``inputs`` (L, N, E) seq-first, ``output`` (L, N, ...) or (L * N, E) on the graph."""
        i = self.where.get(part)
        if i is None:
            return
        L, N = inputs.shape[0], inputs.shape[1]
        rows_in = self.rows.get(id(inputs))
        if rows_in is None:  # one tensor for the projections of one input (self-attention's q, k, v)
            rows_in = self.rows[id(inputs)] = inputs.detach().transpose(0, 1)  # (N, L, E), a view

        def read(g: Tensor) -> Tensor:
            g = g.reshape(L, N, -1)
            g = g if cols is None else g[..., cols]
            return g.transpose(0, 1)  # (N, L, E)

        self.emit(Site(i, rows_in, output, read))


def _canonical(mask: Tensor | None, dtype: torch.dtype) -> Tensor | None:
    """A boolean mask (True = not allowed) as an additive float mask (-inf there), as torch does."""
    if mask is None or torch.is_floating_point(mask):
        return mask
    if mask.dtype != torch.bool:
        raise UnsupportedModelError(f"attention masks must be bool or floating point, got {mask.dtype}")
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))


def attention_forward(query: Tensor, key: Tensor, value: Tensor, embed_dim_to_check: int, num_heads: int,
                      in_proj_weight: Tensor, in_proj_bias: Tensor | None, bias_k: Tensor | None,
                      bias_v: Tensor | None, add_zero_attn: bool, dropout_p: float, out_proj_weight: Tensor,
                      out_proj_bias: Tensor | None, training: bool = True, key_padding_mask: Tensor | None = None,
                      need_weights: bool = True, attn_mask: Tensor | None = None, use_separate_proj_weight: bool = False,
                      q_proj_weight: Tensor | None = None, k_proj_weight: Tensor | None = None,
                      v_proj_weight: Tensor | None = None, static_k: Tensor | None = None,
                      static_v: Tensor | None = None, average_attn_weights: bool = True, is_causal: bool = False,
                      *, sites: Any) -> tuple[Tensor, Tensor | None]:
    """``F.multi_head_attention_forward`` for packed projections (module docstring), reporting each
    projection's input and output through ``sites(part, inputs, output, cols)``. Same arguments."""
    if use_separate_proj_weight or bias_k is not None or bias_v is not None or add_zero_attn or \
            static_k is not None or static_v is not None:
        raise UnsupportedModelError("multi-head attention: separate projection weights, add_bias_kv, add_zero_attn "
                                    "and static keys/values are not supported by the Kronecker capture")
    if query.dim() != 3:
        raise UnsupportedModelError(f"multi-head attention: the Kronecker blocks need batched (3-D) inputs, got a "
                                    f"query of shape {tuple(query.shape)}")
    tgt_len, bsz, E = query.shape
    if E != embed_dim_to_check:
        raise ValueError(f"was expecting embedding dimension of {embed_dim_to_check}, but got {E}")
    head_dim = E // num_heads
    key_padding_mask = _canonical(key_padding_mask, query.dtype)
    if is_causal and attn_mask is None:
        raise RuntimeError("Need attn_mask if specifying the is_causal hint.")
    if is_causal and key_padding_mask is None and not need_weights:
        attn_mask = None
    else:
        attn_mask = _canonical(attn_mask, query.dtype)
        if key_padding_mask is not None:
            is_causal = False

    # in-projection, as torch's _in_projection_packed (one packed product for self-attention)
    W, b = in_proj_weight, in_proj_bias
    if key is value and query is key:
        proj = F.linear(query, W, b)  # (L, N, 3E)
        for i, part in enumerate(_PARTS):
            sites(part, query, proj, slice(i * E, (i + 1) * E))
        q, k, v = proj.chunk(3, dim=-1)  # views (torch's unflatten/transpose/select copies and zero-fills)
    elif key is value:
        w_q, w_kv = W.split([E, 2 * E])
        b_q, b_kv = (None, None) if b is None else b.split([E, 2 * E])
        q = F.linear(query, w_q, b_q)
        kv = F.linear(key, w_kv, b_kv)
        sites("q", query, q, None)
        sites("k", key, kv, slice(0, E))
        sites("v", key, kv, slice(E, 2 * E))
        k, v = kv.chunk(2, dim=-1)
    else:
        ws = W.chunk(3)
        bs = (None,) * 3 if b is None else b.chunk(3)
        q, k, v = (F.linear(x, w, bb) for x, w, bb in zip((query, key, value), ws, bs))
        for part, x, y in zip(_PARTS, (query, key, value), (q, k, v)):
            sites(part, x, y, None)

    if attn_mask is not None and attn_mask.dim() == 2:
        attn_mask = attn_mask.unsqueeze(0)
    q = q.reshape(tgt_len, bsz * num_heads, head_dim).transpose(0, 1)
    k = k.reshape(k.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    v = v.reshape(v.shape[0], bsz * num_heads, head_dim).transpose(0, 1)
    src_len = k.size(1)
    if key_padding_mask is not None:
        key_padding_mask = (key_padding_mask.view(bsz, 1, 1, src_len).expand(-1, num_heads, -1, -1)
                            .reshape(bsz * num_heads, 1, src_len))
        attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
    if not training:
        dropout_p = 0.0
    weights: Tensor | None = None
    if need_weights:
        q_scaled = q * math.sqrt(1.0 / float(head_dim))
        if attn_mask is not None:
            scores = torch.baddbmm(attn_mask, q_scaled, k.transpose(-2, -1))
        else:
            scores = torch.bmm(q_scaled, k.transpose(-2, -1))
        weights = F.softmax(scores, dim=-1)
        if dropout_p > 0.0:
            weights = F.dropout(weights, p=dropout_p)
        out = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len * bsz, E)
        weights = weights.view(bsz, num_heads, tgt_len, src_len)
        if average_attn_weights:
            weights = weights.mean(dim=1)
    else:
        if attn_mask is not None:
            if attn_mask.size(0) == 1 and attn_mask.dim() == 3:
                attn_mask = attn_mask.unsqueeze(0)
            else:
                attn_mask = attn_mask.view(bsz, num_heads, -1, src_len)
        q = q.view(bsz, num_heads, tgt_len, head_dim)
        k = k.view(bsz, num_heads, src_len, head_dim)
        v = v.view(bsz, num_heads, src_len, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
        out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, E)
    attn_in = out
    out = F.linear(attn_in, out_proj_weight, out_proj_bias)
    sites("out", attn_in.view(tgt_len, bsz, E), out, None)
    return out.view(tgt_len, bsz, out.size(1)), weights
