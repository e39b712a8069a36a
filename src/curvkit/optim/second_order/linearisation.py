"""Products with the EXACT minibatch Gauss-Newton matrix that the step size needs (thesis Eqs. 4.17-4.20).

For directions d_1..d_k (parameter-shaped), the Gram matrix of the minibatch GGN

    M_ij = d_i^T G d_j = w sum_n (J_n d_i)^T H_L^n (J_n d_j),   w = 1/(counted positions) ('mean') or 1 ('sum'),

needs only the Jacobian-vector products J d_i (the R-operator of Schraudolph 2002; one forward-mode pass,
no backward pass) and products with the output Hessians H_L^n, never a (B, C, C) tensor. Outputs may have
positions, (B, *P, C): n then runs over samples and positions, padded positions count for nothing, and
``mean`` divides by the counted positions (the likelihood's ``num_terms``), as the loss does.

* :class:`Linearisation` records one forward pass and returns J V for k directions at once: from the
  recorded activations by tangent propagation when the model is a plain ``nn.Sequential`` of
  Linear/Conv layers and parameter-free modules (:class:`curvkit.curvature._tangent.SequentialTangent`,
  about two forward passes' matrix products for k = 1), otherwise from one forward pass on dual numbers per
  direction (``torch.autograd.forward_ad``) through :meth:`curvkit.structure.ModelStructure.functional_call`,
  with the closed-form rules of :mod:`curvkit.curvature._dual_rules` for linear maps, layer norm and
  multi-head attention, and the primals of the linear maps taken from the recorded pass (:meth:`Linearisation.record`;
  the same J d as ``torch.func.jvp`` to rounding, about 0.65x its time on the ViT of
  ``benchmarks/gauss_newton_vit.py``, 0.85x without the kept primals; the user's module is
  never changed; a BatchNorm in training mode normalises with the batch's statistics, so J is that of the
  coupled batch, and runs on copies of its running statistics). Its
  default forward pass runs inside :func:`curvkit.structure.curvature_kernels`. The recorded input ``X`` is
  a tensor or a mapping of tensors (:data:`curvkit.validation.Inputs`, e.g. a Hugging Face batch with its
  attention mask); the model is called as ``model(X)`` either way.
* :func:`output_gram` contracts J V with H_L in output space through ``likelihood.output_hessian_matvec``
  (softmax cross-entropy v^T (diag p - p p^T) u = sum p v u - (p.v)(p.u) in O(C); sigmoid BCE
  sum s(1-s) v u; Gaussian sum v u / sigma^2; a head whose H_L depends on the label at y).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.autograd.forward_ad as fwAD
from torch import Tensor, nn

from curvkit.curvature._dual_rules import PrimalRecord, PrimalRecorder, ReplayMismatch, dual_rules
from curvkit.curvature._tangent import SequentialTangent
from curvkit.likelihoods import Likelihood
from curvkit.structure import ModelStructure, couples_samples, curvature_kernels
from curvkit.validation import Inputs

__all__ = ["Linearisation", "apply_output_hessian", "output_gram"]


class Linearisation:
    """J V of one recorded forward pass (module docstring).

    Args:
        model: the network; ``structure`` its :class:`ModelStructure`.
        names: canonical names of the parameters the directions live in (the optimiser's order).
    """

    def __init__(self, model: nn.Module, structure: ModelStructure, names: Sequence[str]):
        self.model = model
        self.structure = structure
        self.names = list(names)
        self.tangent = SequentialTangent.for_model(model, self.names)
        self._X: Inputs | None = None
        self._primals: PrimalRecord | None = None

    @property
    def route(self) -> str:
        """``'tangent'`` (recorded activations) or ``'dual'`` (one dual-number pass per direction)."""
        return "tangent" if self.tangent is not None else "dual"

    def record(self, X: Inputs, forward: Callable[[], Tensor] | None = None, keep_primals: bool = True) -> Tensor:
        """Run the forward pass ``forward()`` (default ``model(X)``) and keep what J V needs; returns f.

        On the dual-number route with ``keep_primals`` the outputs of the pass's linear maps are kept until
        :meth:`release` (or the next record), and the products take their primals from them instead of
        recomputing them: one matrix product in three per linear map less, for the memory of those outputs
        that autograd does not keep anyway (about 70 MB on the ViT of ``benchmarks/gauss_newton_vit.py``,
        batch 128). A later pass that does not repeat the recorded one (checked per call: the input's
        fingerprint, the output's shape and version counter) recomputes its primals instead."""
        fwd = forward if forward is not None else (lambda: self._forward(X))
        self._X = X
        self._primals = None
        if self.tangent is not None:
            return self.tangent.record(fwd)
        if not keep_primals:
            return fwd()
        record = PrimalRecord()
        # the record is of the model's last call (an estimator may first run it on a few samples)
        handle = self.model.register_forward_pre_hook(lambda *_: record.clear())
        try:
            with PrimalRecorder(record):
                f = fwd()
        finally:
            handle.remove()
        self._primals = record
        return f

    def release(self) -> None:
        """Drop the primal outputs kept by :meth:`record` (the products recompute them from then on)."""
        self._primals = None

    def _forward(self, X: Inputs) -> Tensor:
        with curvature_kernels():
            return self.model(X)  # type: ignore[no-any-return]

    def __call__(self, directions: Sequence[Sequence[Tensor]]) -> Tensor:
        """(k, B, [*P,] C) J d_i for k directions, each a list of parameter-shaped tensors in ``names`` order.

        Uses the parameter values of the recorded pass: call before changing the parameters in place.
        """
        if self._X is None:
            raise RuntimeError("Linearisation: record a forward pass first")
        if self.tangent is not None:
            V = tuple(torch.stack([d[j] for d in directions]) for j in range(len(self.names)))
            with torch.no_grad():
                return self.tangent(V)
        params = dict(self.model.named_parameters())
        primals = [params[n].detach() for n in self.names]
        X = self._X

        coupled = couples_samples(self.model)  # BatchNorm in training mode: batch statistics, buffers copied
        buffers = dict(self.model.named_buffers()) if coupled else {}

        def tangent(d: Sequence[Tensor], record: PrimalRecord | None) -> Tensor:
            with torch.no_grad(), fwAD.dual_level(), dual_rules(record):
                duals = {n: fwAD.make_dual(p, t.detach()) for n, p, t in zip(self.names, primals, d)}
                copies = {n: b.clone() for n, b in buffers.items()} if coupled else None
                f, Jd = fwAD.unpack_dual(self.structure.functional_call(duals, (X,), copies))
                if record is not None:
                    record.finished()
                return torch.zeros_like(f) if Jd is None else Jd

        out = []
        for d in directions:
            if self._primals is not None:
                self._primals.rewind()
                try:
                    out.append(tangent(d, self._primals))
                    continue
                except ReplayMismatch:  # not the recorded pass (a model that changes between passes)
                    self._primals = None
            out.append(tangent(d, None))
        return torch.stack(out)


def apply_output_hessian(likelihood: Likelihood, f: Tensor, y: Tensor | None, V: Tensor) -> Tensor:
    """(k, B, [*P,] C) w H_L v per position for V of that shape: the output-space part of a GGN product
    (module docstring; w = 1/(counted positions) for ``reduction='mean'``, 1 for ``'sum'``; zero at padding)."""
    f = f.detach()
    w = likelihood.scale(likelihood.num_terms(f, y))
    return w * likelihood.output_hessian_matvec(f, V, y)


def output_gram(likelihood: Likelihood, f: Tensor, y: Tensor | None, JV: Tensor) -> Tensor:
    """(k, k) M_ij = w sum_n (J_n d_i)^T H_L^n (J_n d_j) from JV (k, B, [*P,] C) (module docstring)."""
    HJV = apply_output_hessian(likelihood, f, y, JV)
    return JV.reshape(JV.shape[0], -1) @ HJV.reshape(HJV.shape[0], -1).T
