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
a parameter shared with another module (weight tying), are returned as :class:`DiagonalParam` (the filters'
diagonal form; :func:`collect_layers` says why); a layer called twice in one forward pass is
refused at the step. The input rows are stored
without the bias column; ``x_rows(k)`` appends the column of ones on demand, so a caller that needs only k
of the B rows does not copy all of them. Several backward passes before one step (gradient
accumulation) stack their rows, matching the summed gradient.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from curvkit import layerkinds
from curvkit.curvature.capture import PairCapture, PairedBlock
from curvkit.structure import UnsupportedModelError, read_model


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
        return self.cap.positions

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


def collect_layers(model: nn.Module, optimiser: str, params: Sequence[Tensor] | None = None
                   ) -> tuple[list[LayerRecord], PairCapture, list[DiagonalParam]]:
    """The filter's Kronecker layers with their (attached) capture, and the other trainable parameters (each
    with the diagonal form of the filter).

    The model is read by :func:`curvkit.layerkinds.plan`, which names and refuses what no layer kind takes (an
    unknown module with trainable parameters, a module registered twice, random or sample-coupling modules in
    training mode). A Kronecker layer is a planned layer whose handler has paired rows
    (:meth:`curvkit.layerkinds.LayerHandler.paired_rows`: ``'samples'`` or ``'positions'``), none of whose
    parameters is shared by several modules (weight tying: the parameter's per-example gradient is the sum of its
    uses', ``delta_h x_h^T + u delta_e^T`` for a tied head and embedding in one view, whose rows are not stacked
    into one record; such a parameter, and the other parameters of the layers that hold it, get the diagonal
    form, whose Fisher sample is the parameter's own gradient, the sum of its uses'). ``params`` (default: all trainable parameters)
    selects what is optimised: each must be a trainable parameter of the model; a Kronecker layer whose weight
    is selected must bring its trainable bias too; a bias selected without its weight is diagonal."""
    structure = read_model(model)
    plans = layerkinds.plan(structure, optimiser)
    tied = structure.shared_parameters  # name -> the modules that hold it
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
        if any(n in tied for spec in lp.blocks for n in spec.names):  # the diagonal form (docstring)
            continue
        spec = lp.blocks[0]
        if spec.weight not in chosen:
            continue
        if spec.bias is not None and spec.bias not in chosen:
            raise ValueError(f"{optimiser}: layer {lp.label!r} is optimised without its bias; pass both")
        kron.append(lp)
    in_layers = {n for lp in kron for n in lp.blocks[0].names}
    diagonal = [DiagonalParam(n, p, *where[n]) for n, p in named.items() if n in chosen and n not in in_layers]
    capture = PairCapture(kron, optimiser, root=model).attach()
    records = []
    for lp, cap in zip(kron, capture.records):
        spec = lp.blocks[0]
        name = "" if lp.label == "<root>" else lp.label  # the qualified module name (fisher_samples keys)
        b = named[spec.bias] if spec.bias is not None else None
        records.append(LayerRecord(name, lp.module, named[spec.weight], b, spec.weight, spec.bias, cap,
                                   lp.handler.kind))
    return records, capture, diagonal


def check_captured(records: Sequence[LayerRecord], optimiser: str) -> None:
    """Raise if a layer was called more than once in a forward pass since the last step."""
    for rec in records:
        if rec.cap.reused:
            raise UnsupportedModelError(
                f"{optimiser}: module {rec.name!r} was called more than once in one forward pass; its input and "
                "output gradient cannot be paired into per-example Fisher samples. Use one module per call")
