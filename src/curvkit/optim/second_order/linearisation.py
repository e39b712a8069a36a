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
  about two forward passes' matrix products for k = 1), otherwise with ``torch.func.jvp`` through
  :meth:`curvkit.structure.ModelStructure.functional_call` (the user's module is never changed; a BatchNorm in
  training mode normalises with the batch's statistics, so J is that of the coupled batch, and runs on copies
  of its running statistics). Its
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
from torch import Tensor, nn
from torch.func import jvp

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

    @property
    def route(self) -> str:
        """``'tangent'`` (recorded activations) or ``'torch.func'``."""
        return "tangent" if self.tangent is not None else "torch.func"

    def record(self, X: Inputs, forward: Callable[[], Tensor] | None = None) -> Tensor:
        """Run the forward pass ``forward()`` (default ``model(X)``) and keep what J V needs; returns f."""
        fwd = forward if forward is not None else (lambda: self._forward(X))
        self._X = X
        if self.tangent is not None:
            return self.tangent.record(fwd)
        return fwd()

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
        primals = tuple(params[n].detach() for n in self.names)
        X = self._X

        coupled = couples_samples(self.model)  # BatchNorm in training mode: batch statistics, buffers copied
        buffers = dict(self.model.named_buffers()) if coupled else {}

        def fn(*p: Tensor) -> Tensor:
            copies = {n: b.clone() for n, b in buffers.items()} if coupled else None
            return self.structure.functional_call(dict(zip(self.names, p)), (X,), copies)

        out = []
        for d in directions:
            out.append(jvp(fn, primals, tuple(t.detach() for t in d))[1])
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
