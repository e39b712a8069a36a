"""Per-layer records of the Kronecker-factored filters on top of the layer kinds' sites
(:class:`curvkit.curvature.capture.PairCapture`): for each Kronecker layer, the input rows x and the
back-propagated output-gradient rows delta of the user's own backward pass, paired per pass.

Kronecker layers: those whose handler reads the layer's one block as its weight matrix
``W_hat = [W.reshape(out, -1) | b]`` with paired rows (:meth:`curvkit.layerkinds.LayerHandler.paired_rows`):
``nn.Linear`` (x: (B*T, in[+1]) rows, T = 1 or the positions of a weight-shared input (B, *S, in), delta:
(B*T, out)) and groups=1 ``nn.Conv1d/2d/3d`` (x: unfolded patches (B*L, C*k[+1]), delta: (B*L, out), L output
locations, any padding mode); the rows are example-major (example n's T rows are consecutive). The model is read by
:func:`curvkit.layerkinds.plan`, which raises an ``UnsupportedModelError`` naming an unknown module with
trainable parameters or a module registered twice; the other trainable parameters, and those of layers that hold
a parameter shared with another module in a way no record takes (weight tying), are returned as
:class:`DiagonalParam` (the filters' diagonal form; :func:`collect_layers` says why); a layer called twice in one
forward pass is refused at the step. A tied weight read by a head (a Linear layer in the weight's standard view)
and by embedding lookups of its table (or Linear layers in the standard view without a bias) is ONE record in
the head's view whose rows are the stacked rows of its uses (:meth:`LayerRecord.rows`). The input rows are stored
without the bias column; ``x_rows(k)`` appends the column of ones on demand, so a caller that needs only k
of the B rows does not copy all of them. Several backward passes before one step (gradient
accumulation) stack their rows, matching the summed gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from curvkit import layerkinds
from curvkit.curvature.capture import PairCapture, PairedBlock
from curvkit.curvature.estimators import shared_terms
from curvkit.structure import UnsupportedModelError, read_model

#: a tied weight whose head has more outputs (a vocabulary) than this keeps the diagonal form: its Kronecker
#: record would hold a dense (V, V) output factor (GPT-2's 50,257 tokens: 10 GB in float32)
TIED_OUTPUT_LIMIT = 8192


@dataclass
class TiedUse:
    """Another use of a record's tied weight: its capture and whether it is an embedding lookup (token ids, one-hot
    rows) or a Linear layer in the weight's standard view without a bias."""

    name: str
    cap: PairedBlock
    ids: bool


@dataclass
class LayerRecord:
    name: str
    module: nn.Module
    weight: nn.Parameter
    bias: nn.Parameter | None
    weight_name: str
    bias_name: str | None
    cap: PairedBlock
    kind: str  # the layer kind's name, for messages
    uses: list[TiedUse] = field(default_factory=list)  # the other uses of a tied weight (head's view)

    @property
    def a(self) -> Tensor | None:
        """The input rows (K, in) of every backward pass since the last step (None: nothing captured)."""
        rows = self.cap.paired_rows()
        return None if rows is None else rows[0]

    @property
    def delta(self) -> Tensor | None:
        """The output-gradient rows (K, out) paired with :attr:`a`."""
        rows = self.cap.paired_rows()
        return None if rows is None else rows[1]

    @property
    def positions(self) -> int:
        """T, the rows per example (of every use, for a tied weight)."""
        return self.cap.positions + sum(u.cap.positions for u in self.uses)

    @property
    def examples(self) -> int:
        """The examples of the backward passes captured since the last step."""
        return sum(self.cap.pass_sizes)

    def check_positions(self) -> None:
        """Raise unless every use's rows are the same number of rows per example in every backward pass since the
        last step (then the rows group per example, :meth:`rows`)."""
        B = self.examples
        for name, cap in [(self.name, self.cap)] + [(u.name, u.cap) for u in self.uses]:
            rows = cap.paired_rows()
            if rows is not None and (sum(cap.pass_sizes) != B or rows[1].shape[0] != B * cap.positions):
                raise ValueError(f"layer {name!r}: the backward passes accumulated since the last step have "
                                 "different positions per example (or did not all run it); step after each, or give "
                                 "the inputs one shape")

    def rows(self, scale: float, n: int | None = None) -> tuple[Tensor, Tensor]:
        """The first ``n`` (all when None) paired rows, X (n, N) with the bias column and D (n, M), every use's
        output-gradient rows multiplied by ``scale``: with the loss scale, the Fisher samples in
        summed-log-likelihood units; example n's rows give its per-example gradient E_n = D_n^T X_n and all rows
        the gradient D^T X.

        A tied weight (:attr:`uses`), in the head's view [W | b] (M = V outputs): example n's rows are the head's
        T_h rows (x, 1; delta) and then each use's: an embedding lookup's one-hot rows u (V,) on the output side
        against its output-gradient rows (delta_e, 0) on the input side (the lookup's gradient u^T delta_e is
        W's; its bias column is 0, since it does not read the head's bias), a Linear use's (x, 0; delta). Rows
        are example-major (T = :attr:`positions` per example)."""
        if self.a is None or self.delta is None:
            raise ValueError(f"no activations captured for layer {self.name!r}: run forward and backward (with "
                             "autograd enabled) on the minibatch before step()")
        if not self.uses:
            return self.x_rows(n), (self.delta if n is None else self.delta[:n]) * scale
        self.check_positions()
        B, M = self.examples, self.out_dim
        xs, ds = [self.x_rows().reshape(B, -1, self.in_dim)], [(self.delta * scale).reshape(B, -1, M)]
        for use in self.uses:
            rows = use.cap.paired_rows()
            if rows is None:
                raise ValueError(f"the tied weight of layer {self.name!r}: its use {use.name!r} was not run since "
                                 "the last step; run the whole model forward and backward before step()")
            a, d = rows
            if use.ids:   # a lookup: one-hot rows on the output side, its output gradient on the input side
                ids = a.reshape(B, -1)
                u = torch.nn.functional.one_hot(ids.clamp_min(0), M).to(d.dtype) * (ids >= 0)[..., None]
                x, dd = d.reshape(B, ids.shape[1], -1) * scale, u
            else:
                x, dd = a.reshape(B, -1, a.shape[-1]), (d * scale).reshape(B, -1, M)
            if self.bias is not None:   # the use does not read the head's bias
                x = torch.cat([x, x.new_zeros(*x.shape[:2], 1)], dim=2)
            xs.append(x)
            ds.append(dd)
        X, D = torch.cat(xs, dim=1).reshape(-1, self.in_dim), torch.cat(ds, dim=1).reshape(-1, M)
        return (X, D) if n is None else (X[:n], D[:n])

    def x_rows(self, k: int | None = None) -> Tensor:
        """The first ``k`` (all when None) captured input rows, with the bias column of ones appended."""
        a = self.a
        if a is None:
            raise ValueError(f"no activations captured for layer {self.name!r}")
        a = a if k is None else a[:k]
        return a if self.bias is None else torch.cat([a, a.new_ones(a.shape[0], 1)], dim=1)

    @property
    def in_dim(self) -> int:
        w = self.weight
        n = int(w[0].numel())
        return n + (1 if self.bias is not None else 0)

    @property
    def out_dim(self) -> int:
        return int(self.weight.shape[0])

    def grad_parts(self) -> tuple[Tensor, Tensor | None]:
        """(dW as an (out, in) matrix (convolution weights flattened to (out, C*k)), db or None): the
        gradient without concatenating it."""
        if self.weight.grad is None:
            raise ValueError(f"layer {self.name!r} has no gradient; call loss.backward() before step()")
        gb = None
        if self.bias is not None:
            if self.bias.grad is None:
                raise ValueError(f"bias of layer {self.name!r} has no gradient")
            gb = self.bias.grad
        return self.weight.grad.reshape(self.out_dim, -1), gb

    def weight_matrix_grad(self, out: Tensor | None = None) -> Tensor:
        """[dW | db] as an (out, in[+1]) matrix (written into ``out`` when given)."""
        gW, gb = self.grad_parts()
        if gb is None:
            return gW if out is None else out.copy_(gW)
        return torch.cat([gW, gb[:, None]], dim=1, out=out)

    def weight_matrix(self) -> Tensor:
        """A copy of W_hat = [W | b], (out, in[+1])."""
        W = self.weight.detach().reshape(self.out_dim, -1).clone()
        if self.bias is not None:
            W = torch.cat([W, self.bias.detach()[:, None]], dim=1)
        return W

    def _split(self, M: Tensor) -> tuple[Tensor, Tensor | None]:
        """An (out, in[+1]) matrix as (weight-shaped part, bias column or None)."""
        k = self.weight[0].numel()
        return M[:, :k].reshape(self.weight.shape), (M[:, k] if self.bias is not None else None)

    def add_to_matrix(self, inc: Tensor) -> None:
        """W_hat += inc in place (inc (out, in[+1])), without forming W_hat."""
        w, b = self._split(inc)
        with torch.no_grad():
            self.weight.add_(w)
            if self.bias is not None and b is not None:
                self.bias.add_(b)

    def write_matrix(self, W: Tensor) -> None:
        """W_hat <- W (out, in[+1])."""
        w, b = self._split(W)
        with torch.no_grad():
            self.weight.copy_(w)
            if self.bias is not None and b is not None:
                self.bias.copy_(b)


@dataclass
class DiagonalParam:
    """A trainable parameter outside the filter's Kronecker layers: it gets the diagonal (factorised) form of the
    filter (module docstring). ``layer`` and ``kind`` (its layer-kind handler's) are for messages."""

    name: str
    param: nn.Parameter
    layer: str
    kind: str


def _tied_heads(plans: Sequence[layerkinds.LayerPlan], tied: Any) -> dict[int, list[layerkinds.LayerPlan]]:
    """The tied weights a record takes in its head's view: {id(head plan): the plans of its other uses}. A group of
    uses of one tied weight (:func:`curvkit.layerkinds.shared_groups`) is taken when each use is one block,
    :func:`curvkit.curvature.estimators.shared_terms` finds a head in the weight's standard view (a Linear layer
    with paired rows, with or without a bias) and every other use is an embedding lookup of the table or a Linear
    layer in the standard view without a bias, and the head has at most :data:`TIED_OUTPUT_LIMIT` outputs."""
    specs = [(lp, spec) for lp in plans for spec in lp.blocks]
    out = {}
    for members in layerkinds.shared_groups(list(plans), set(tied)):
        if len(members) < 2:
            continue
        lps = [specs[j][0] for j in members]
        group = [specs[j][1] for j in members]
        if any(len(lp.blocks) != 1 for lp in lps) or len({id(lp) for lp in lps}) != len(lps):
            continue
        terms = shared_terms(group)
        if terms is None:
            continue
        head, rest = lps[terms[0]], [lps[i] for i in terms[1]]
        if head.handler.paired_rows(head.module) != "samples" or head.blocks[0].out_features > TIED_OUTPUT_LIMIT:
            continue
        if all(lp.blocks[0].ids or (lp.blocks[0].index is None and lp.handler.paired_rows(lp.module) == "samples")
               for lp in rest):
            out[id(head)] = rest
    return out


def collect_layers(model: nn.Module, optimiser: str, params: Sequence[Tensor] | None = None
                   ) -> tuple[list[LayerRecord], PairCapture, list[DiagonalParam]]:
    """The filter's Kronecker layers with their (attached) capture, and the other trainable parameters (each
    with the diagonal form of the filter).

    The model is read by :func:`curvkit.layerkinds.plan`, which names and refuses what no layer kind takes (an
    unknown module with trainable parameters, a module registered twice, random or sample-coupling modules in
    training mode). A Kronecker layer is a planned layer whose handler has paired rows
    (:meth:`curvkit.layerkinds.LayerHandler.paired_rows`: ``'samples'`` or ``'positions'``). A parameter shared by
    several modules (weight tying) is one record in its head's view when :func:`_tied_heads` takes its uses (a
    tied head and embedding: the per-example gradient is the sum of its uses', ``delta_h x_h^T + u delta_e^T``,
    the stacked rows of :meth:`LayerRecord.rows`); otherwise it, and the other parameters of the layers that hold
    it, get the diagonal form, whose Fisher sample is the parameter's own gradient, the sum of its uses'.
    ``params`` (default: all trainable parameters) selects what is optimised: each must be a trainable parameter
    of the model; a Kronecker layer whose weight is selected must bring its trainable bias too; a bias selected
    without its weight is diagonal."""
    structure = read_model(model)
    plans = layerkinds.plan(structure, optimiser)
    tied = structure.shared_parameters  # name -> the modules that hold it
    heads = _tied_heads(plans, tied)
    named = dict(model.named_parameters())
    names = {id(p): n for n, p in named.items()}
    if params is not None:
        for p in params:
            if id(p) not in names:
                raise ValueError(f"{optimiser}: a parameter of shape {tuple(p.shape)} is not a parameter of the "
                                 "model; pass model.parameters()")
    chosen = {names[id(p)] for p in params} if params is not None else set(structure.trainable)
    chosen &= set(structure.trainable)
    if not chosen:
        raise ValueError(f"{optimiser}: none of the given parameters is trainable (frozen parameters, "
                         "requires_grad=False, are left out)")
    kron, where = [], {}
    for lp in plans:
        for spec in lp.blocks:
            for n in spec.names:
                where[n] = (" + ".join(tied[n]), "tied") if n in tied else (lp.label, lp.handler.kind)
        rows = lp.handler.paired_rows(lp.module)
        if rows is None:
            continue
        if id(lp) not in heads and any(n in tied for spec in lp.blocks for n in spec.names):  # the diagonal form
            continue
        spec = lp.blocks[0]
        if spec.weight not in chosen:
            continue
        if spec.bias is not None and spec.bias not in chosen:
            raise ValueError(f"{optimiser}: layer {lp.label!r} is optimised without its bias; pass both")
        kron.append(lp)
    uses = [u for lp in kron for u in heads.get(id(lp), [])]
    in_layers = {n for lp in kron for n in lp.blocks[0].names}
    diagonal = [DiagonalParam(n, p, *where[n]) for n, p in named.items() if n in chosen and n not in in_layers]
    capture = PairCapture(kron + uses, optimiser, root=model).attach()
    caps = dict(zip([id(lp) for lp in kron + uses], capture.records))
    records = []
    for lp in kron:
        spec = lp.blocks[0]
        name = "" if lp.label == "<root>" else lp.label  # the qualified module name (fisher_samples keys)
        b = named[spec.bias] if spec.bias is not None else None
        tied_uses = [TiedUse(u.label, caps[id(u)], bool(u.blocks[0].ids)) for u in heads.get(id(lp), [])]
        records.append(LayerRecord(name, lp.module, named[spec.weight], b, spec.weight, spec.bias, caps[id(lp)],
                                   "tied" if tied_uses else lp.handler.kind, tied_uses))
    return records, capture, diagonal


def check_captured(records: Sequence[LayerRecord], optimiser: str) -> None:
    """Raise if a layer was called more than once in a forward pass since the last step."""
    for rec in records:
        for name, cap in [(rec.name, rec.cap)] + [(u.name, u.cap) for u in rec.uses]:
            if cap.reused:
                raise UnsupportedModelError(
                    f"{optimiser}: module {name!r} was called more than once in one forward pass; its input and "
                    "output gradient cannot be paired into per-example Fisher samples. Use one module per call")
