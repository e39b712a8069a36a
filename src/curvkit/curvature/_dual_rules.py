"""Forward-mode rules for the hot operations of a dual-number pass (``torch.autograd.forward_ad``).

A Jacobian-vector product J v of a general model is one forward pass on dual numbers (primal p, tangent t).
PyTorch's built-in forward-mode rules compute the right numbers, but three of them cost far more than the
operations they differentiate (measured on the ViT of ``benchmarks/gauss_newton_vit.py``, 1 thread; see
docs/benchmarks.md, "Gauss-Newton on a ViT"):

* ``F.linear`` on a non-contiguous 3-D input that carries a tangent (``nn.MultiheadAttention``'s in-projection
  of the sequence-first view) is not folded into one matrix product: ``matmul`` broadcasts the weight and runs
  a batched product per position, 1.35x the three matrix products the rule needs, plus copies;
* ``F.layer_norm``'s rule is written as some twenty elementwise passes (tens of ms per call on that ViT against
  about 1 ms for the primal);
* every rule adds its terms with separate ``add`` passes over the output.

:class:`DualRules` is a ``TorchFunctionMode`` that evaluates these calls itself when one of their inputs is a
dual tensor: it unpacks the duals, computes the primal with the same kernel the plain forward uses and the
tangent with the closed forms below, and returns ``fwAD.make_dual(primal, tangent)``; every other call, and any
call it does not take (tensor subclasses, shapes or options outside the cases below), goes to PyTorch's own
rule, so the pass computes the same J v to rounding (tests compare with ``torch.func.jvp`` in float64).

* ``F.linear(x, W, b)`` (x (..., i), W (o, i)): y = x W^T + b, t_y = t_x W^T + x t_W^T + t_b, the batch
  dimensions folded into one matrix product and the three terms accumulated in place (``addmm``).
* ``F.layer_norm`` over the last dimensions D with gamma, beta: xhat = (x - mu) r, r = (var + eps)^(-1/2),
  t_xhat = r (t_x - mean_D t_x - xhat mean_D(xhat t_x)), t_y = gamma t_xhat + xhat t_gamma + t_beta.
* ``F.multi_head_attention_forward`` (``nn.MultiheadAttention``): evaluated by
  :func:`curvkit.layerkinds.attention.attention_forward` (torch's operations in torch's order) with this mode
  active inside, so its projections take the linear rule; the cases that function refuses take torch's own
  path. The scaled dot products keep torch's rule: a closed form (t_S = s (t_q k^T + q t_k^T),
  t_P = P (t_S - sum_j P t_S), t_o = t_P v + P t_v) measured the same 57 ms as torch's per call on that ViT,
  three times the primal's 18 ms, which is what the three batched products cost.

**Primals from a recorded pass.** The tangent of a linear map needs two matrix products, its primal a third.
When the same model has just run on the same batch at the same parameters (the Gauss-Newton step's captured
forward pass), :class:`PrimalRecorder` keeps the outputs of its linear calls in a :class:`PrimalRecord` (the
calls :class:`DualRules` makes, attention evaluated the same way), and ``DualRules(record)`` takes each call's
primal from it instead. Each replayed call checks that it is the recorded one: its weight and bias, where they
are parameters, by their memory and version counter (a dual tensor's primal is a view of the parameter), the
fingerprints of its input and of any other operand (:func:`_fingerprint`, to sqrt(eps) relative, compared for
all calls at once when the pass is :meth:`~PrimalRecord.finished`), the output's shape and that the recorded
output was not changed in place since (its version counter); anything else raises :class:`ReplayMismatch`,
and the caller recomputes the pass without the record.

Nothing outside the call changes: the modes hold no state but the record they are given and are entered only
around one pass (:func:`dual_rules`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from curvkit.validation import storage_key

__all__ = ["DualRules", "PrimalRecord", "PrimalRecorder", "ReplayMismatch", "dual_rules"]


def _plain(*ts: Any) -> bool:
    """Every argument None or a plain (not subclassed) tensor."""
    return all(t is None or type(t) is Tensor or type(t) is torch.nn.Parameter for t in ts)


def _unpack(t: Tensor) -> tuple[Tensor, Tensor | None]:
    """(primal, tangent or None) of a dual or plain tensor."""
    p, tangent = fwAD.unpack_dual(t)
    return p, tangent


def _unpack_optional(t: Tensor | None) -> tuple[Tensor | None, Tensor | None]:
    return (None, None) if t is None else _unpack(t)


def _accumulate(total: Tensor | None, term: Tensor) -> Tensor:
    return term if total is None else total.add_(term)


def _takes_linear(input: Any, weight: Any, bias: Any = None) -> bool:
    """The linear rule takes the call ``F.linear(input, weight, bias)`` (the same answer with and without
    tangents)."""
    x, W, b = input, weight, bias
    return (_plain(x, W, b) and W.dim() == 2 and x.dim() >= 1 and (b is None or b.dim() <= 1)
            and x.shape[-1] == W.shape[1] and len({t.dtype for t in (x, W, b) if t is not None}) == 1)


def _fingerprint(x: Tensor) -> Tensor:
    """(2, m) float64: sums and absolute sums over the leading dimensions of the first m <= 4 features of x (one
    pass over N * m entries): identifies an input up to rounding at a negligible cost."""
    cols = x.detach()[..., :4].to(torch.float64)
    lead = tuple(range(cols.dim() - 1))
    return torch.stack([cols.sum(lead), cols.abs().sum(lead)]) if lead else torch.stack([cols, cols.abs()])


class ReplayMismatch(RuntimeError):
    """The pass being replayed did not make the recorded pass's linear calls (:class:`PrimalRecord`)."""


class PrimalRecord:
    """The outputs of the linear calls of one forward pass, in call order, with what identifies each call's
    operands, so that a later dual-number pass at the same parameters on the same batch takes the primal
    y = x W^T + b from here instead of recomputing it (one of the three matrix products per call).

    A weight or bias that is a parameter is identified by its memory and version counter (no pass over it: a
    parameter is only changed in place); any other operand, the input x always, by its fingerprint
    (:func:`_fingerprint`), compared to sqrt(eps) relative for all calls at once by :meth:`finished`."""

    def __init__(self) -> None:
        self.outputs: list[Tensor] = []
        self.prints: list[Tensor] = []  # per call: the fingerprints of its input (and of a computed weight/bias)
        self.params: list[tuple[Any, ...]] = []  # per call: (W, its storage_key, b, its key) for parameters, else Nones
        self.versions: list[int] = []  # an output changed in place since (by the model, in any pass) is stale
        self.position = 0
        self.checks: list[tuple[Tensor, Tensor, float]] = []  # per replayed call: (now, then, tol) for finished()

    @staticmethod
    def _operands(x: Tensor, W: Tensor, b: Tensor | None, params: tuple[Any, ...] | None) -> Tensor:
        """The fingerprints of a call: x's, and W's / b's where they are not identified as parameters."""
        parts = [_fingerprint(x)]
        if params is None or params[0] is None:
            parts.append(_fingerprint(W))
        if b is not None and (params is None or params[2] is None):
            parts.append(_fingerprint(b))
        return torch.cat(parts, 1) if len(parts) > 1 else parts[0]

    def add(self, x: Tensor, W: Tensor, y: Tensor, b: Tensor | None = None) -> None:
        weight = (W, storage_key(W)) if isinstance(W, torch.nn.Parameter) else (None, None)  # W held: key valid
        bias = (b, storage_key(b)) if isinstance(b, torch.nn.Parameter) else (None, None)
        self.params.append((*weight, *bias))
        self.outputs.append(y.detach())
        self.prints.append(self._operands(x, W, b, self.params[-1]))
        self.versions.append(y._version)

    def next(self, x: Tensor, W: Tensor, shape: tuple[int, ...], b: Tensor | None = None) -> Tensor:
        """The recorded output of the next call ``F.linear(x, W, b)``. The call's shape, the output's version and
        its parameters' identities are checked here; its fingerprints are compared by :meth:`finished` (all
        calls in one read of the device), which raises :class:`ReplayMismatch` for any difference."""
        i = self.position
        if i >= len(self.outputs) or tuple(self.outputs[i].shape) != shape:
            raise ReplayMismatch(f"linear call {i}: not the recorded pass's")
        if self.outputs[i]._version != self.versions[i]:
            raise ReplayMismatch(f"linear call {i}: its recorded output was changed in place")
        Wr, Wk, br, bk = self.params[i]
        if (Wr is not None and storage_key(W) != Wk) or (br is not None and (b is None or storage_key(b) != bk)):
            raise ReplayMismatch(f"linear call {i}: its weight or bias is not the recorded pass's")
        now, then = self._operands(x, W, b, self.params[i]), self.prints[i]
        if now.shape != then.shape:
            raise ReplayMismatch(f"linear call {i}: its input or weight differs from the recorded pass's")
        self.checks.append((now, then, torch.finfo(x.dtype).eps ** 0.5))
        self.position += 1
        return self.outputs[i]

    def rewind(self) -> None:
        self.position = 0
        self.checks = []

    def clear(self) -> None:
        """Forget what was recorded (a new call of the model starts: the record is of its last call)."""
        self.outputs, self.prints, self.params, self.versions, self.position, self.checks = [], [], [], [], 0, []

    def finished(self) -> None:
        """Raise :class:`ReplayMismatch` unless the pass made every recorded call with the recorded operands: the
        fingerprints of all calls are compared here, in one vectorised comparison and ONE read of the device (a
        read per call would stall a GPU's queue once per linear layer); a pass that took a wrong primal is then
        discarded by the caller."""
        if self.position != len(self.outputs):
            raise ReplayMismatch(f"the pass made {self.position} of the {len(self.outputs)} recorded linear calls")
        if not self.checks:
            return
        now = torch.cat([c[0] for c in self.checks], 1)
        then = torch.cat([c[1] for c in self.checks], 1)
        widths = [c[0].shape[1] for c in self.checks]
        tol = torch.tensor([c[2] for c in self.checks], dtype=now.dtype).repeat_interleave(
            torch.tensor(widths)).to(now.device)
        same = (now[0] - then[0]).abs() <= tol * (then[1] + now[1] + tol)
        if not bool(same.all()):
            column = int((~same).nonzero()[0, 0])
            i = next(j for j, end in enumerate(torch.tensor(widths).cumsum(0).tolist()) if column < end)
            raise ReplayMismatch(f"linear call {i}: its input or weight differs from the recorded pass's")


def _linear(input: Tensor, weight: Tensor, bias: Tensor | None = None, *,
            record: PrimalRecord | None = None) -> Tensor | None:
    x, W, b = input, weight, bias
    if not _takes_linear(x, W, b):
        return None
    (xp, xt), (Wp, Wt), (bp, bt) = _unpack(x), _unpack(W), _unpack_optional(b)
    out_shape = (*x.shape[:-1], W.shape[0])
    known = None if record is None else record.next(xp, Wp, out_shape, bp)
    if xt is None and Wt is None and bt is None:
        return known
    x2 = xp.reshape(-1, W.shape[1])
    if known is not None:
        y = known
    else:
        y = (x2 @ Wp.t() if bp is None else torch.addmm(bp, x2, Wp.t())).reshape(out_shape)
    t: Tensor | None = None
    if xt is not None:
        xt2 = xt.reshape(-1, W.shape[1])
        t = xt2 @ Wp.t() if bt is None else torch.addmm(bt.expand(W.shape[0]), xt2, Wp.t())
    elif bt is not None:
        t = bt.expand(x2.shape[0], W.shape[0]).clone()
    if Wt is not None:
        t = x2 @ Wt.t() if t is None else t.addmm_(x2, Wt.t())
    assert t is not None
    return fwAD.make_dual(y, t.reshape(out_shape))


def _layer_norm(input: Tensor, normalized_shape: Any, weight: Tensor | None = None, bias: Tensor | None = None,
                eps: float = 1e-5) -> Tensor | None:
    x = input
    if not _plain(x, weight, bias):
        return None
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    (xp, xt), (wp, wt), (bp, bt) = _unpack(x), _unpack_optional(weight), _unpack_optional(bias)
    if xt is None and wt is None and bt is None:
        return None
    if not shape or tuple(x.shape[x.dim() - len(shape):]) != shape:
        return None
    y, mean, rstd = torch.native_layer_norm(xp, list(shape), wp, bp, eps)
    dims = tuple(range(x.dim() - len(shape), x.dim()))
    xhat = (xp - mean) * rstd
    t: Tensor | None = None
    if xt is not None:
        centred = xt - xt.mean(dims, keepdim=True)
        t = centred.sub_(xhat * (xhat * xt).mean(dims, keepdim=True)).mul_(rstd)
        if wp is not None:
            t.mul_(wp)
    if wt is not None:
        t = _accumulate(t, xhat * wt)
    if bt is not None:
        t = bt.expand_as(y).clone() if t is None else t.add_(bt)
    assert t is not None
    return fwAD.make_dual(y, t)


def _takes_attention(args: Any, kwargs: Any) -> bool:
    """``F.multi_head_attention_forward``'s call is one :func:`~curvkit.layerkinds.attention.attention_forward`
    evaluates (packed or shared projections, batched inputs, no learned key/value rows, no dropout)."""
    mha = dict(zip(_MHA_ARGS, args), **kwargs)
    return not (mha.get("use_separate_proj_weight") or mha.get("bias_k") is not None
                or mha.get("bias_v") is not None or mha.get("add_zero_attn") or mha.get("static_k") is not None
                or mha.get("static_v") is not None or mha["query"].dim() != 3
                or (mha.get("training", True) and mha.get("dropout_p", 0.0) > 0))


def _attention(mode: TorchFunctionMode, args: Any, kwargs: Any) -> Any:
    from curvkit.layerkinds.attention import attention_forward

    with mode:  # re-entered: the projections inside are seen by the mode
        return attention_forward(*args, sites=_no_sites, **kwargs)


class DualRules(TorchFunctionMode):
    """The mode of the module docstring: the hot operations' forward-mode rules in closed form; with ``record``
    (a :class:`PrimalRecord` of a forward pass on the same batch at the same parameters) the linear calls take
    their primal outputs from it."""

    def __init__(self, record: PrimalRecord | None = None):
        super().__init__()
        self.record = record

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            out = _linear(*args, **kwargs, record=self.record)
        elif func is F.layer_norm:
            out = _layer_norm(*args, **kwargs)
        elif func is F.multi_head_attention_forward and _takes_attention(args, kwargs):
            out = _attention(self, args, kwargs)
        else:
            out = None
        return func(*args, **kwargs) if out is None else out


def _linear_args(args: Any, kwargs: Any) -> tuple[Tensor, Tensor, Tensor | None]:
    """(input, weight, bias) of a call of ``F.linear``."""
    named = dict(zip(("input", "weight", "bias"), args), **kwargs)
    return named["input"], named["weight"], named.get("bias")


class PrimalRecorder(TorchFunctionMode):
    """Records the linear calls of a plain forward pass into a :class:`PrimalRecord`: the calls, in the order,
    that :class:`DualRules` makes in a dual-number pass of the same model (attention evaluated the same way)."""

    def __init__(self, record: PrimalRecord):
        super().__init__()
        self.record = record

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is F.multi_head_attention_forward and _takes_attention(args, kwargs):
            return _attention(self, args, kwargs)
        out = func(*args, **kwargs)
        if func is F.linear and _takes_linear(*args, **kwargs):
            x, W, b = _linear_args(args, kwargs)
            self.record.add(x, W, out, b)
        return out


def _no_sites(*_: Any) -> None:
    return None


_MHA_ARGS = ("query", "key", "value", "embed_dim_to_check", "num_heads", "in_proj_weight", "in_proj_bias", "bias_k",
             "bias_v", "add_zero_attn", "dropout_p", "out_proj_weight", "out_proj_bias", "training",
             "key_padding_mask", "need_weights", "attn_mask", "use_separate_proj_weight", "q_proj_weight",
             "k_proj_weight", "v_proj_weight", "static_k", "static_v", "average_attn_weights", "is_causal")


@contextmanager
def dual_rules(record: PrimalRecord | None = None) -> Iterator[None]:
    """Run a dual-number pass with the closed-form rules of :class:`DualRules` (primals from ``record``)."""
    with DualRules(record):
        yield
