"""The capture of the layer-kind handlers' sites (:mod:`curvkit.layerkinds`): the one hook machinery behind the
Kronecker estimators (:mod:`curvkit.curvature.estimators`, :class:`BlockCapture`: one forward pass of their own)
and the Kronecker-factored filters (:mod:`curvkit.optim.filters`, :class:`PairCapture`: hooks that stay on the
user's model and pair every backward pass's output-gradient rows with the input rows of its forward pass).

Both install the handlers' own hooks (:meth:`curvkit.layerkinds.LayerHandler.attach`), which emit one
:class:`~curvkit.layerkinds.Site` per block and forward pass: the block's input rows (B, R, in) and a tensor on
the graph whose gradient ``site.read`` turns into its output rows (B, R, out). Neither knows a layer kind.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from curvkit.curvature._graph import lowest_tensors
from curvkit.layerkinds import Site
from curvkit.structure import (
    UnsupportedModelError,
    curvature_kernels,
    differentiable,
)

__all__ = ["BlockCapture", "PairCapture", "PairedBlock", "SiteOutput", "check_sample_rows", "check_sample_shapes",
           "grad_inputs", "indexed_hook", "per_sample_grads"]


# ---------------------------------------------------------------------------------------------- paired rows
@dataclass
class PairedBlock:
    """What the hooks of a :class:`PairCapture` recorded for one block.

    Every backward pass through the block appends one ``(x, delta)`` pair to ``pairs``: its input rows (B*R, in)
    (no bias column) and output-gradient rows (B*R, out), R positions per sample, binding the gradient rows to
    the input rows of the SAME forward pass (a later forward pass without backward cannot mismatch them).
    """

    plan: Any  # the curvkit.layerkinds.LayerPlan
    block: int  # the block's position in the plan
    positions: int = 1  # R of the last pass
    calls: int = 0  # calls in the current forward pass of the root (or since reset)
    reused: bool = False  # called more than once in some forward pass since reset
    pairs: list[tuple[Tensor, Tensor]] = field(default_factory=list)  # (x rows, delta rows) per backward
    pass_sizes: list[int] = field(default_factory=list)  # samples B of each backward pass

    @property
    def spec(self) -> Any:
        """The block's :class:`~curvkit.layerkinds.BlockSpec`."""
        return self.plan.blocks[self.block]

    def paired_rows(self) -> tuple[Tensor, Tensor] | None:
        """(input rows (K, in), output-gradient rows (K, out)) of every backward pass since reset, stacked;
        None if there was none."""
        if not self.pairs:
            return None
        if len(self.pairs) > 1:  # stacked once, then kept
            self.pairs[:] = [(torch.cat([a for a, _ in self.pairs]), torch.cat([d for _, d in self.pairs]))]
        return self.pairs[0]


class PairCapture:
    """Hooks of the layer-kind handlers of ``plans`` that stay on the user's model (until :meth:`close`) and
    record, for every block, the (input rows, output-gradient rows) pair of each backward pass the user runs
    (:class:`PairedBlock`); for consumers that read a block's Fisher samples x (x) delta from the user's own
    training passes (the Kronecker filters). Unlike :class:`BlockCapture` it changes no kernel setting: the
    passes are the user's.

    Args:
        plans: from :func:`curvkit.layerkinds.plan` (any blocks with ``form='kron'`` and input rows).
        what: the name used in error messages.
        root: the model; its forward pre-hook starts a new pass (call counts restart), so a layer called
            twice within one forward pass is told apart from two forward passes.
    """

    def __init__(self, plans: Sequence[Any], what: str = "Kronecker capture", root: nn.Module | None = None):
        self.plans = list(plans)
        self.what = what
        self.root = root
        self.records = [PairedBlock(lp, j) for lp in self.plans for j in range(len(lp.blocks))]
        self._handles: list[Any] = []

    def attach(self) -> PairCapture:
        """Install the hooks (idempotent)."""
        if not self._handles:
            k = 0
            for lp in self.plans:
                records = self.records[k:k + len(lp.blocks)]
                k += len(lp.blocks)
                self._handles += lp.handler.attach(lp.module, lp.label, lp.blocks, self._emitter(records), self.what)
            if self.root is not None:
                self._handles.append(self.root.register_forward_pre_hook(self._new_pass))
        return self

    def close(self) -> None:
        """Remove every hook; the capture records nothing afterwards."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def __enter__(self) -> PairCapture:
        self.reset()
        return self.attach()

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def reset(self) -> None:
        """Forget everything recorded (call counts, pairs)."""
        for rec in self.records:
            rec.calls, rec.reused, rec.positions = 0, False, 1
            rec.pairs.clear()
            rec.pass_sizes.clear()

    def _new_pass(self, *_: Any) -> None:
        if torch.is_grad_enabled():
            for rec in self.records:
                rec.calls = 0

    @staticmethod
    def _emitter(records: list[PairedBlock]) -> Callable[[Site], None]:
        def emit(site: Site) -> None:
            rec = records[site.block]
            rec.calls += 1
            rec.reused |= rec.calls > 1
            inputs = site.inputs  # (B, R, in), formed now (a convolution's patches)
            B, rec.positions = int(inputs.shape[0]), int(inputs.shape[1])
            x = inputs.reshape(-1, inputs.shape[-1])

            def backward(grad: Tensor, x: Tensor = x, B: int = B, read: Callable[[Tensor], Tensor] = site.read) -> None:
                d = read(grad.detach())
                rec.pairs.append((x, d.reshape(-1, d.shape[-1])))
                rec.pass_sizes.append(B)

            site.output.register_hook(backward)
        return emit


# ---------------------------------------------------------------------------------------------- layer kinds
class SiteOutput:
    """A site's output tensor as a lean capture keeps it (:class:`BlockCapture`'s ``lean``): its place in the
    autograd graph (``torch.autograd.graph.get_gradient_edge``: the node that produced it and the output's
    number), its shape, dtype and device, and a weak reference, but not its storage, so that an output the
    rest of the forward pass does not keep (an eval-mode BatchNorm's or a LayerNorm's, which no backward
    formula saves) is freed as in a plain training pass instead of living until the statistics are read.

    What the estimators read of an output works on it: :attr:`shape`, :attr:`requires_grad`, :attr:`grad_fn`
    (:func:`~curvkit.curvature._graph.lowest_tensors`), :meth:`register_hook` (the gradient of the output as the
    backward pass reaches its node, the node's pre-hook: the gradient with respect to the values the layer
    produced, also when a later operation changed them in place) and :attr:`edge` as an input of
    ``torch.autograd.grad`` (where the node is not run, so its hooks do not fire: :func:`grad_inputs`). Every
    site of one tensor shares one object, as they share the tensor; :meth:`BlockCapture.sites` gives back the
    tensor itself only for the model output.
    """

    def __init__(self, t: Tensor):
        self.edge = torch.autograd.graph.get_gradient_edge(t)
        self.shape, self.dtype, self.device = t.shape, t.dtype, t.device
        self.requires_grad = t.requires_grad
        self._ref = weakref.ref(t)

    @property
    def grad_fn(self) -> Any:
        return self.edge.node

    def tensor(self) -> Tensor | None:
        """The output tensor while something else keeps it alive, else None."""
        return self._ref()

    def new_empty(self, *size: int) -> Tensor:
        return torch.empty(*size, dtype=self.dtype, device=self.device)

    def register_hook(self, fn: Callable[[Tensor], None]) -> Any:
        """Call ``fn(gradient of the output)`` when a backward pass runs the producing node; returns a handle
        with ``remove()``."""
        nr = self.edge.output_nr

        def pre(grad_outputs: tuple[Tensor | None, ...]) -> None:
            if grad_outputs[nr] is not None:
                fn(grad_outputs[nr])  # type: ignore[arg-type]
        return self.edge.node.register_prehook(pre)


def grad_inputs(outs: Sequence[Any]) -> list[Any]:
    """``outs`` (tensors or :class:`SiteOutput`) as inputs of ``torch.autograd.grad``: a :class:`SiteOutput`
    by its gradient edge. The nodes of such inputs are not run, so their hooks do not fire: the caller reads
    their gradients from what ``torch.autograd.grad`` returns."""
    return [o.edge if isinstance(o, SiteOutput) else o for o in outs]


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
        lean: keep the sites' outputs as :class:`SiteOutput` (their place in the graph, not their storage);
            the Kronecker estimators' captures are lean except KFRA's, which reads the outputs' values.
    """

    def __init__(self, plans: Sequence[Any], what: str = "Kronecker capture",
                 take: Callable[[int, Any], Any] | None = None, lean: bool = False):
        self.plans = list(plans)
        self.what = what
        self.take = take
        self.lean = lean
        self._outputs: dict[tuple[int, int], SiteOutput] = {}
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
            # a lean capture does not hold an output's storage (SiteOutput), except an output every sample uses
            # (Site.shared: its per-sample gradients are asked of autograd for the tensor itself; it has no
            # batch dimension, so it is small)
            if self.lean and site.output.grad_fn is not None and not site.shared:
                edge = torch.autograd.graph.get_gradient_edge(site.output)
                key = (id(edge.node), edge.output_nr)
                if key not in self._outputs:
                    self._outputs[key] = SiteOutput(site.output)
                site.output = self._outputs[key]
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
        self._outputs.clear()

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

    def sites(self, model_output: Tensor | None = None) -> list[Any]:
        """One site per block (global block order), checked: each block fed exactly once, outputs not
        modified in place afterwards; None for a block of an optional layer (one use of a shared parameter,
        :attr:`curvkit.layerkinds.LayerPlan.optional`) that was not called. A lean capture's outputs stay
        :class:`SiteOutput` (so that the backward pass frees those it has finished with, as a training pass
        does), except ``model_output`` (a head's output is the model output f, which consumers compare with f
        by identity)."""
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
            kept = sites[0].output
            if isinstance(kept, SiteOutput):  # a lean capture: its tensor, where it is still alive, to check
                kept = kept.tensor()
                if kept is not None and kept is model_output:
                    sites[0].output = kept
            if kept is not None and kept._version != versions[0]:
                raise UnsupportedModelError(
                    f"{self.what}: the output of module {lp.label!r} was modified in place later in the forward pass"
                    + _IN_PLACE)
            out.append(sites[0])
        return out


def check_sample_rows(blocks: Sequence[tuple[Any, Any]], sites: Sequence[Any], f: Tensor, what: str,
                      coupled: bool = False, always_pass: bool = False) -> None:
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
    ``batch_statistics='couple'``), so only the shapes are checked. ``always_pass``: run the backward pass even
    where it concludes nothing (one sample, none, coupled samples): on an FSDP2 model every backward pass runs
    FSDP2's collectives, so every rank must run the same passes whatever its number of samples."""
    B = int(f.shape[0])
    check_sample_shapes(blocks, sites, B, what)
    conclude = B >= 2 and not coupled
    if not f.requires_grad or not (conclude or always_pass):
        return
    kept = [k for k, s in enumerate(sites) if not s.shared]  # a shared site's rows are per sample by construction
    blocks, sites = [blocks[k] for k in kept], [sites[k] for k in kept]
    outs: list[Any] = []  # tensors or SiteOutput
    feeds: list[list[int]] = []  # the sites (positions in ``sites``) each output feeds
    for i, site in enumerate(sites):
        if not site.output.requires_grad:
            continue
        j = next((j for j, o in enumerate(outs) if site.output is o), None)
        if j is None:
            outs.append(site.output)
            feeds.append([i])
        else:
            feeds[j].append(i)
    if not outs:
        return
    n = B - 1
    gen = torch.Generator(device=f.device).manual_seed(0)
    w = torch.randn(f.shape[1:], generator=gen, device=f.device, dtype=f.dtype)
    failed: list[tuple[int, Tensor]] = []

    def check(j: int, g: Tensor) -> None:  # each output's gradient is reduced to row sums as it passes
        if not conclude:  # the pass runs for FSDP2's collectives only (always_pass)
            return
        with torch.no_grad():
            for i in feeds[j]:
                r = sites[i].read(g.detach())  # per-sample absolute sums without a copy of the rows:
                rows = torch.linalg.vector_norm(r, 1, dim=tuple(range(1, r.dim())))
                if bool(rows.sum() > 0) and (bool(rows[n] == 0) or bool(rows[:n].sum() > 1e-6 * rows[n])):
                    failed.append((i, g.detach()))

    # gradients asked for the lowest outputs only (lowest_tensors), read by hooks: one output's at a time
    handles = [o.register_hook(indexed_hook(check, j)) for j, o in enumerate(outs) if o is not f]
    try:
        with torch.enable_grad():  # the caller's grad mode may be off (torch.no_grad(), inference mode)
            low = lowest_tensors(outs)
            s = (f[n] * w).sum() if B else f.sum() * 0
            grads = torch.autograd.grad(s, grad_inputs([outs[j] for j in low]), retain_graph=True, allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for j, g in zip(low, grads):  # a lean output asked for: its node did not run (grad_inputs)
        if isinstance(outs[j], SiteOutput) and g is not None:
            check(j, g)
    for j, o in enumerate(outs):  # the model output itself (a head's site) has no hook: its gradient is direct
        if o is f and conclude:
            check(j, torch.zeros_like(f).index_copy_(0, torch.tensor([n], device=f.device), w[None]))
    del grads
    if failed:  # the first block in the plan's order, as a reader expects
        i, g = min(failed, key=lambda t: t[0])
        raise _not_samples_first(what, blocks[i][0], sites[i], B, g)


def check_sample_shapes(blocks: Sequence[tuple[Any, Any]], sites: Sequence[Any], B: int, what: str) -> None:
    """The shape part of :func:`check_sample_rows`: every site's input rows have the batch size B first."""
    for (lp, _), site in zip(blocks, sites):
        if site.inputs.shape[0] != B:
            raise _not_samples_first(what, lp, site, B, None)


def indexed_hook(fn: Callable[[int, Tensor], None], j: int) -> Callable[[Tensor], None]:
    """A tensor hook that calls ``fn(j, gradient)``: one per output, each knowing its index."""
    def hook(g: Tensor) -> None:
        fn(j, g)
    return hook


def per_sample_grads(f: Tensor, outs: Sequence[Tensor], V: Tensor, retain_graph: bool = True) -> list[Tensor]:
    """Per-sample gradients of tensors that every sample uses (:attr:`curvkit.layerkinds.Site.shared`): for
    vectors V (L, *f.shape) and each o of ``outs``, the (L, B, *o.shape) gradients of ``<V[l, n], f[n]>`` (sample
    n's part of vector l alone), in ONE batched backward pass of the L * B vectors ``V[l] * e_n``
    (``is_grads_batched``; one pass per vector where an operation has no batching rule). Memory: L * B times
    that backward pass's."""
    L, B = V.shape[0], f.shape[0]
    Vb = V.new_zeros(L, B, *f.shape)
    n = torch.arange(B, device=V.device)
    Vb[:, n, n] = V[:, n]
    Vb = Vb.reshape(L * B, *f.shape)
    try:
        grads = torch.autograd.grad(f, list(outs), grad_outputs=Vb, retain_graph=retain_graph, is_grads_batched=True)
    except RuntimeError:  # an operation without a batching rule: one backward pass per vector
        per = [torch.autograd.grad(f, list(outs), grad_outputs=v, retain_graph=True) for v in Vb]
        grads = tuple(torch.stack([p[i] for p in per]) for i in range(len(outs)))
    return [g.reshape(L, B, *o.shape) for g, o in zip(grads, outs)]


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

