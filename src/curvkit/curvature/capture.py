"""Per-layer capture of inputs and output gradients of the Kronecker layers, the one hook machinery behind
the Kronecker estimators (:mod:`curvkit.curvature.estimators`) and the Kronecker-factored filters
(:mod:`curvkit.optim.filters`).

For each layer l of :meth:`curvkit.structure.ModelStructure.kronecker_layers` a forward hook records, per
forward pass with autograd enabled,

* the input rows ``a`` (B*T, in) without the bias column: the layer input itself for ``nn.Linear``
  ((B, in), T = 1) and the unfolded patches for ``nn.Conv2d`` (T output locations, any padding mode,
  :func:`curvkit.structure.conv_patches`), and
* the output h_l (B, out, ...) still on the autograd graph, so a caller can back-propagate any output-space
  vectors to it (``torch.autograd.grad(f, capture.outputs(), V)``), and, with ``output_grads=True``, the
  rows of the gradient that the user's own backward pass sends through h_l (B*T, out), each paired with
  the input rows of the forward pass it belongs to.

Every pass counts the calls: :meth:`LayerCapture.check` raises when a layer ran more than once (its input
and output gradient could not be paired) or its output was overwritten in place. Hooks are removed by
:meth:`LayerCapture.close` (also on ``with``-exit and garbage collection).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from curvkit.layerkinds import Site
from curvkit.structure import (
    LayerInfo,
    UnsupportedModelError,
    conv_patches,
    curvature_kernels,
    differentiable,
)

__all__ = ["BlockCapture", "CapturedLayer", "LayerCapture", "check_sample_rows", "input_rows", "output_rows",
           "with_bias_column"]


def input_rows(layer: LayerInfo, x: Tensor, positions: bool = False) -> tuple[Tensor, int]:
    """A layer's input as rows (B*T, in) (no bias column) and the number T of output locations (with
    ``positions``, a Linear on (B, *S, in) gives T = prod(S) rows per example, the weight-sharing expand rows)."""
    if isinstance(layer.module, nn.Conv2d):
        p = conv_patches(layer.module, x)  # (B, T, C*kh*kw)
        return p.reshape(-1, p.shape[-1]), int(p.shape[1])
    if positions and x.dim() > 2:
        return x.reshape(-1, x.shape[-1]), int(x[0].numel() // x.shape[-1])
    if x.dim() != 2:
        raise UnsupportedModelError(
            f"Kronecker factors: module {layer.label!r} (Linear) got an input of shape {tuple(x.shape)}; the "
            "factors need a (batch, features) input: flatten extra dimensions before the layer")
    return x, 1


def output_rows(layer: LayerInfo, g: Tensor) -> Tensor:
    """A tensor shaped like the layer output (B, out[, H, W]) as rows (B*T, out)."""
    if isinstance(layer.module, nn.Conv2d):
        return g.flatten(2).transpose(1, 2).reshape(-1, g.shape[1])
    return g.reshape(-1, g.shape[-1])


@dataclass
class CapturedLayer:
    """What the hooks recorded for one layer (see the module docstring).

    ``a``/``output``/``calls`` describe the last forward pass; with ``output_grads`` every backward pass
    through the layer appends one ``(a, delta)`` pair to ``pairs``, binding the gradient rows to the
    input rows of the SAME forward pass (a later forward without backward cannot mismatch them).
    """

    info: LayerInfo
    a: Tensor | None = None  # (B*T, in) input rows of the last pass, detached, without the bias column
    positions: int = 1  # T
    output: Tensor | None = None  # the layer output of the last pass, on the graph
    calls: int = 0  # calls in the current forward pass of the root (or since reset without a root)
    reused: bool = False  # called more than once in some forward pass since reset
    version: int = 0
    pairs: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (a rows, delta rows) per backward
    pass_sizes: list[int] = field(default_factory=list)  # examples (rows / T) of each backward pass

    @property
    def module(self) -> nn.Module:
        return self.info.module

    @property
    def has_bias(self) -> bool:
        return self.info.bias is not None

    def paired_rows(self) -> tuple[Tensor, Tensor] | None:
        """(input rows (K, in), output-gradient rows (K, out)) of every backward pass since reset, stacked;
        None if there was none."""
        if not self.pairs:
            return None
        if len(self.pairs) > 1:  # stacked once, then kept
            self.pairs[:] = [(torch.cat([a for a, _ in self.pairs]), torch.cat([d for _, d in self.pairs]))]
        return self.pairs[0]


def with_bias_column(a: Tensor, bias: bool) -> Tensor:
    """Rows a (K, in) with a column of ones appended when the layer has a bias."""
    return a if not bias else torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)


@dataclass
class LayerCapture:
    """Hooks on ``layers`` recording their inputs, outputs and (optionally) output gradients.

    Args:
        layers: from :meth:`curvkit.structure.ModelStructure.kronecker_layers`.
        what: the name used in error messages.
        output_grads: also record the gradient rows of every backward pass, paired with their inputs.
        root: the model; its forward pre-hook starts a new pass (call counts restart), so a layer called
            twice within one forward pass is told apart from two forward passes. Without a root every
            call since :meth:`reset` counts.
        positions: take a Linear's (B, *S, in) input as B*prod(S) rows (:func:`input_rows`); otherwise it is
            refused.
    """

    layers: Sequence[LayerInfo]
    what: str = "Kronecker capture"
    output_grads: bool = False
    root: nn.Module | None = None
    positions: bool = False
    records: list[CapturedLayer] = field(init=False)
    _handles: list[Any] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.records = [CapturedLayer(lay) for lay in self.layers]

    # ------------------------------------------------------------------ hooks
    def attach(self) -> LayerCapture:
        """Install the hooks (idempotent)."""
        if not self._handles:
            self._handles = [rec.module.register_forward_hook(self._hook(rec)) for rec in self.records]
            if self.root is not None:
                self._handles.append(self.root.register_forward_pre_hook(self._new_pass))
        return self

    def close(self) -> None:
        """Remove every hook; the capture records nothing afterwards."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> LayerCapture:
        self.reset()
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def reset(self) -> None:
        """Forget everything recorded (call counts, tensors, pairs)."""
        for rec in self.records:
            rec.a, rec.output, rec.calls, rec.reused = None, None, 0, False
            rec.pairs.clear()
            rec.pass_sizes.clear()

    def _new_pass(self, *_: Any) -> None:
        if torch.is_grad_enabled():
            for rec in self.records:
                rec.calls = 0

    def _hook(self, rec: CapturedLayer) -> Any:
        def fwd(mod: nn.Module, inputs: tuple[Any, ...], out: Tensor) -> None:
            if not torch.is_grad_enabled() or not isinstance(out, Tensor) or not out.requires_grad:
                return
            rec.calls += 1
            rec.reused |= rec.calls > 1
            a, rec.positions = input_rows(rec.info, inputs[0].detach(), self.positions)
            rec.a, rec.output, rec.version = a, out, out._version
            if self.output_grads:
                def bwd(grad: Tensor, a: Tensor = a, positions: int = rec.positions) -> None:
                    rec.pairs.append((a, output_rows(rec.info, grad.detach())))
                    rec.pass_sizes.append(a.shape[0] // positions)

                out.register_hook(bwd)

        return fwd

    # ------------------------------------------------------------------ reading
    def check(self) -> None:
        """Raise unless every layer ran exactly once in the last pass and kept its output unchanged."""
        for rec in self.records:
            if rec.calls != 1 or rec.reused:
                raise UnsupportedModelError(
                    f"{self.what}: module {rec.info.label!r} was called {max(rec.calls, 2) if rec.reused else rec.calls} "
                    "times in one forward pass; a Kronecker block pairs one input with one output gradient, so "
                    "shared, repeated or unused layers are not supported (use one module per call, or freeze it)")
            assert rec.output is not None
            if rec.output._version != rec.version:
                raise UnsupportedModelError(
                    f"{self.what}: the output of module {rec.info.label!r} was modified in place later in the "
                    "forward pass" + _IN_PLACE)

    def outputs(self) -> list[Tensor]:
        """The recorded layer outputs (on the graph), in layer order."""
        self.check()
        return [rec.output for rec in self.records]  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------- layer kinds
class BlockCapture:
    """The hooks of the layer-kind handlers (:mod:`curvkit.layerkinds`) on a planned model, for one forward
    pass: every block gets one :class:`~curvkit.layerkinds.Site` (input rows, an output on the graph and how
    to read its gradient). Entering also enters :func:`curvkit.structure.curvature_kernels`, so the forward
    pass inside runs with kernels that have every derivative (math attention, no fast path), and
    :func:`curvkit.structure.differentiable` (out of ``torch.inference_mode``).

    Args:
        plans: from :func:`curvkit.layerkinds.plan`.
        what: the name used in error messages.
        take: called as ``take(block, site)`` (global block position) the moment a site is emitted, inside
            the forward pass; what it returns is kept in :attr:`taken` under the block's position. The
            Kronecker estimators form a block's input statistic there and drop the input rows, so at most
            one layer's input rows (a convolution's unfolded patches) exist at a time.
    """

    def __init__(self, plans: Sequence[Any], what: str = "Kronecker capture",
                 take: Callable[[int, Any], Any] | None = None):
        self.plans = list(plans)
        self.what = what
        self.take = take
        self.taken: dict[int, Any] = {}
        self.specs = [(lp, spec) for lp in self.plans for spec in lp.blocks]
        self._first = []  # first global block position of each layer
        k = 0
        for lp in self.plans:
            self._first.append(k)
            k += len(lp.blocks)
        self._sites: list[list[Any]] = [[] for _ in self.specs]
        self._versions: list[list[int]] = [[] for _ in self.specs]
        self._handles: list[Any] = []
        self._kernels: Any = None
        self.own = False  # set by an estimator whose own forward pass this was (its graph may be freed)
        #: the number of samples of the pass, where the caller knows it (the estimators set it): lets a layer
        #: called without a batch dimension (position ids ``arange(T)``) give every sample its own output rows
        self.batch: int | None = None

    def _emitter(self, layer: int) -> Any:
        first = self._first[layer]

        def emit(site: Any) -> None:
            self._sites[first + site.block].append(site)
            self._versions[first + site.block].append(site.output._version)
            if self.take is not None:
                self.taken[first + site.block] = self.take(first + site.block, site)
        emit.capture = self  # type: ignore[attr-defined]  # handlers read the batch size (batch_of)
        return emit

    def __enter__(self) -> BlockCapture:
        self.reset()
        try:
            for i, lp in enumerate(self.plans):
                self._handles += lp.handler.attach(lp.module, lp.label, lp.blocks, self._emitter(i), self.what)
            self._kernels = ExitStack()
            self._kernels.enter_context(differentiable())
            self._kernels.enter_context(curvature_kernels())
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Remove every hook and leave the kernel settings."""
        for h in self._handles:
            h.remove()
        self._handles.clear()
        if self._kernels is not None:
            kernels, self._kernels = self._kernels, None
            kernels.close()

    def reset(self) -> None:
        for s in self._sites:
            s.clear()
        for v in self._versions:
            v.clear()
        self.taken.clear()

    def substitute(self, batch: int, values: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
        """Per-sample copies ``P = p.expand(batch, ...)`` of the raw parameters of the plan (those of a
        :class:`~curvkit.layerkinds.ParameterHandler`), each emitted as its block's site (the gradient with
        respect to P is the per-sample gradient); returns {name: P} for the forward pass to use. ``values``
        (canonical name -> tensor) gives p where the pass evaluates the model at other parameters."""
        out: dict[str, Tensor] = {}
        self.batch = batch
        for i, lp in enumerate(self.plans):
            if not lp.handler.per_sample_copies:
                continue
            name = lp.blocks[0].weight
            p = values[name] if values is not None and name in values else getattr(lp.module, lp.handler.attr)
            P = p.detach().expand(batch, *p.shape[1:]).requires_grad_()
            out[name] = P
            self._emitter(i)(Site(0, P.detach(), P, _flat_rows(batch)))
        return out

    def sites(self) -> list[Any]:
        """One site per block (global block order), checked: each block fed exactly once, outputs not
        modified in place afterwards; None for a block of an optional layer (one use of a shared parameter,
        :attr:`curvkit.layerkinds.LayerPlan.optional`) that was not called."""
        out: list[Any] = []
        for (lp, _), sites, versions in zip(self.specs, self._sites, self._versions):
            if not sites and lp.optional:  # one use of a shared parameter, not called in this pass
                out.append(None)
                continue
            if len(sites) != 1:
                raise UnsupportedModelError(
                    f"{self.what}: module {lp.label!r} was called {len(sites)} times in "
                    "one forward pass (with autograd on); a Kronecker block pairs one input with one output gradient, "
                    "so shared, repeated or unused layers are not supported (use one module per call, or freeze it)"
                    + (_NO_AUTOGRAD if not any(self._sites) else ""))
            if sites[0].output._version != versions[0]:
                raise UnsupportedModelError(
                    f"{self.what}: the output of module {lp.label!r} was modified in place later in the forward pass"
                    + _IN_PLACE)
            out.append(sites[0])
        return out


def check_sample_rows(blocks: Sequence[tuple[Any, Any]], sites: Sequence[Any], f: Tensor, what: str,
                      coupled: bool = False) -> None:
    """Verify that the first dimension of every block's rows is the SAMPLE, by what it depends on, not by its size.

    The handlers read a layer's input and output gradient as rows (B, R, ...) with the sample first. A
    sequence-first layout ((T, B, E): ``nn.TransformerEncoderLayer(batch_first=False)``, PyTorch's default,
    in a model that transposes internally) or an input without a batch dimension (position ids
    ``torch.arange(T)``) puts positions there; when T happens to equal the batch size B the shapes agree and
    the statistics would be silently wrong (positions summed as samples). So the dependence is traced: one
    backward pass of ``s = <w, f[n]>`` (the outputs of the LAST sample n = B - 1 only, random weights w)
    gives each block's gradient rows; samples are independent, so with samples first every row other than
    row n is exactly zero and row n is not (unless the block does not reach sample n at all, e.g. a dead
    path: then nothing is concluded). Anything else is refused naming the module, the dimension of its output
    where the samples are (found from the same gradient) and the fix. Costs one backward pass of the batch
    (callers run it once per layout: batch size and site shapes). A batch of one sample has nothing to tell
    apart and is only checked by shape.

    ``blocks``: (layer plan, block spec) per site, for the messages; ``f``: the model output (B, ...) on the
    graph of the sites' outputs; ``coupled``: the samples are coupled on purpose (batch statistics with
    ``batch_statistics='couple'``), so only the shapes are checked."""
    B = int(f.shape[0])
    for (lp, _), site in zip(blocks, sites):
        if site.inputs.shape[0] != B:
            raise _not_samples_first(what, lp, site, B, None)
    if B < 2 or coupled or not f.requires_grad:
        return
    outs: list[Tensor] = []
    for site in sites:
        if site.output.requires_grad and all(site.output is not o for o in outs):
            outs.append(site.output)
    n = B - 1
    gen = torch.Generator(device=f.device).manual_seed(0)
    w = torch.randn(f.shape[1:], generator=gen, device=f.device, dtype=f.dtype)
    with torch.enable_grad():  # the caller's grad mode may be off (torch.no_grad(), inference mode)
        grads = torch.autograd.grad((f[n] * w).sum(), outs, retain_graph=True, allow_unused=True)
    by_id = {id(o): g for o, g in zip(outs, grads)}
    for (lp, _), site in zip(blocks, sites):
        g = by_id.get(id(site.output))
        if g is None:
            continue
        with torch.no_grad():
            rows = site.read(g).reshape(B, -1).abs().sum(1)
        if bool(rows.sum() > 0) and (bool(rows[n] == 0) or bool(rows[:n].sum() > 1e-6 * rows[n])):
            raise _not_samples_first(what, lp, site, B, g)


def _not_samples_first(what: str, lp: Any, site: Any, B: int, g: Tensor | None) -> UnsupportedModelError:
    shape = tuple(site.output.shape)
    if g is not None:  # the dimensions along which sample B-1's gradient sits at one index only
        nz = g.detach() != 0
        dims = [d for d in range(g.dim()) if g.shape[d] == B and int(nz.movedim(d, 0)[:B - 1].sum()) == 0]
        where = (f"; the samples are along dimension {dims[0]} of its output (shape {shape})" if len(dims) == 1
                 else f"; its output (shape {shape}) has no single sample dimension")
    else:
        where = (f"; its first dimension ({site.inputs.shape[0]}) is not the batch ({B}) (a capture that knows the "
                 "batch size gives ids without a batch dimension one copy per sample: update((X, y)), "
                 "f, _ = est.forward(cap, X), or cap.batch = len(X))")
    return UnsupportedModelError(
        f"{what}: module {lp.label!r} ({type(lp.module).__name__}) does not run on its inputs with the samples "
        f"first{where}. A sequence-first layout (e.g. nn.TransformerEncoderLayer/nn.Transformer with "
        "batch_first=False, PyTorch's default, in a model that transposes (B, T) to (T, B) inside) or an input "
        "without a batch dimension (position ids torch.arange(T), shared by every sample) has no per-sample rows "
        "to factorise; build the layers with batch_first=True, give such inputs the batch dimension "
        "(ids.expand(batch, -1)), or freeze the module (requires_grad_(False))")


_IN_PLACE = (" (an in-place activation: nn.ReLU(inplace=True), x.tanh_(), F.silu(x, inplace=True), x.mul_(...)), so "
             "its output gradient is not the layer's; make that operation out of place (inplace=False, x.tanh(), "
             "x * torch.sigmoid(x)), or use an exact operator or diagonal, which handle it")
_NO_AUTOGRAD = ("; no layer was called with autograd on: a forward pass under torch.no_grad() or "
                "torch.inference_mode() records nothing, so run the pass inside the capture with autograd enabled")


def _flat_rows(batch: int) -> Any:
    return lambda g: g.reshape(batch, -1)

