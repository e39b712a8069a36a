"""Likelihood heads: the loss on a network's output and its output-space curvature.

A likelihood turns network outputs ``f`` of shape (B, C) (the natural parameters h_L of thesis Eq. 3.10:
logits, or the Gaussian mean) and targets into the negative log-likelihood, and supplies everything the
curvature engine needs in output space (thesis Secs. 3.4.1 and 3.5):

* ``nll(f, y)``            - reduced NLL (``reduction='sum'`` or ``'mean'`` over the batch; explicit);
* ``nll_per_sample(f, y)`` - (B,) per-sample NLL L^n;
* ``output_grad(f, y)``    - (B, C) per-sample gradient dL^n/df^n;
* ``output_hessian(f)``    - (B, C, C) per-sample Hessian H_L = d^2 L^n / df^2 (independent of y for
  these exponential-family heads, so it is also the output-space Fisher F_L, thesis Eqs. 3.36-3.38);
* ``output_hessian_sqrt(f)`` - (B, C, R) with S S^T = H_L (used for exact GGN/Fisher diagonals and KFLR);
* ``sample(f, generator)``  - labels drawn from the model p(y | f) (MC Fisher, KFAC).

Reduction convention: ``sum`` means L = sum_n L^n; ``mean`` means L = (1/B) sum_n L^n over the batch
(never over output dimensions). Per-sample quantities never include the reduction factor; the curvature
engine applies it (``scale(B)``).
"""

from __future__ import annotations

import copy
import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

Reduction = Literal["sum", "mean"]


class Likelihood:
    """Base class. Subclasses define the per-sample quantities; reduction is handled here."""

    name = "likelihood"

    def __init__(self, reduction: Reduction = "mean"):
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        self.reduction: Reduction = reduction

    # -- per-sample quantities (subclasses) ---------------------------------------------------------
    def nll_per_sample(self, f: Tensor, y: Tensor) -> Tensor:
        raise NotImplementedError

    def output_grad(self, f: Tensor, y: Tensor) -> Tensor:
        raise NotImplementedError

    def output_hessian(self, f: Tensor) -> Tensor:
        raise NotImplementedError

    def output_hessian_sqrt(self, f: Tensor) -> Tensor:
        raise NotImplementedError

    def output_hessian_diagonal(self, f: Tensor) -> Tensor:
        """(B, C) diagonal of H_L."""
        return self.output_hessian(f).diagonal(dim1=-2, dim2=-1)

    def sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        raise NotImplementedError

    def check(self, f: Tensor, y: Tensor | None = None) -> None:
        """Validate shapes and finiteness; raises ValueError saying what is wrong."""
        if f.dim() != 2:
            raise ValueError(f"{self.name}: model output must have shape (batch, outputs), got {tuple(f.shape)}")
        if not torch.isfinite(f).all():
            raise ValueError(
                f"{self.name}: the model output contains NaN or inf ({int((~torch.isfinite(f)).sum())} entries); "
                "check the inputs, the weights and the learning rate"
            )

    # -- reduction ----------------------------------------------------------------------------------
    def with_reduction(self, reduction: Reduction) -> Likelihood:
        """A copy of this likelihood with another ``reduction`` (every other setting kept)."""
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        out = copy.copy(self)
        out.reduction = reduction
        return out

    def scale(self, batch_size: int) -> float:
        """Factor that turns a sum over a batch of ``batch_size`` per-sample terms into this reduction."""
        return 1.0 if self.reduction == "sum" else 1.0 / batch_size

    def nll(self, f: Tensor, y: Tensor) -> Tensor:
        """Reduced NLL over the batch."""
        self.check(f, y)
        per = self.nll_per_sample(f, y)
        return per.sum() * self.scale(f.shape[0])

    __call__ = nll

    def __repr__(self) -> str:
        return f"{type(self).__name__}(reduction={self.reduction!r})"


def _check_finite_targets(name: str, y: Tensor) -> None:
    if y.is_floating_point() and not bool(torch.isfinite(y).all()):
        raise ValueError(f"{name}: the targets contain NaN or inf ({int((~torch.isfinite(y)).sum())} entries)")


class CrossEntropy(Likelihood):
    """Softmax cross-entropy; f are logits (B, K), y class indices (B,). H_L = diag(p) - p p^T (rank K-1)."""

    name = "softmax cross-entropy"

    def check(self, f: Tensor, y: Tensor | None = None) -> None:
        super().check(f, y)
        if y is not None:
            if y.shape != f.shape[:1] or y.dtype not in (torch.int64, torch.int32, torch.uint8, torch.int16):
                raise ValueError(f"{self.name}: targets must be integer class indices of shape ({f.shape[0]},), "
                                 f"got dtype {y.dtype} shape {tuple(y.shape)}")
            if y.numel() and (int(y.min()) < 0 or int(y.max()) >= f.shape[1]):
                raise ValueError(f"{self.name}: targets must lie in [0, {f.shape[1] - 1}]")

    def nll_per_sample(self, f: Tensor, y: Tensor) -> Tensor:
        return F.cross_entropy(f, y.long(), reduction="none")

    def output_grad(self, f: Tensor, y: Tensor) -> Tensor:
        return f.softmax(-1) - F.one_hot(y.long(), f.shape[-1]).to(f.dtype)

    def output_hessian(self, f: Tensor) -> Tensor:
        p = f.softmax(-1)
        return torch.diag_embed(p) - p[:, :, None] * p[:, None, :]

    def output_hessian_diagonal(self, f: Tensor) -> Tensor:
        p = f.softmax(-1)
        return p - p**2

    def output_hessian_sqrt(self, f: Tensor) -> Tensor:
        """S = diag(sqrt p) - p sqrt(p)^T, (B, K, K): S S^T = diag(p) - p p^T (the factor KFLR propagates,
        thesis Sec. 4.3.1)."""
        p = f.softmax(-1)
        sp = p.sqrt()
        return torch.diag_embed(sp) - p[:, :, None] * sp[:, None, :]

    def sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return torch.multinomial(f.softmax(-1), 1, generator=generator)[:, 0]


class BernoulliBCE(Likelihood):
    """Independent sigmoid Bernoulli outputs; f logits (B, C), y in [0, 1] (B, C). H_L = diag(s(1-s))."""

    name = "sigmoid binary cross-entropy"

    def check(self, f: Tensor, y: Tensor | None = None) -> None:
        super().check(f, y)
        if y is not None and y.shape != f.shape:
            raise ValueError(f"{self.name}: targets must have the output's shape {tuple(f.shape)}, "
                             f"got {tuple(y.shape)}")
        if y is not None and y.numel():
            _check_finite_targets(self.name, y)
            if bool((y < 0).any()) or bool((y > 1).any()):
                raise ValueError(f"{self.name}: targets must be probabilities in [0, 1], got values in "
                                 f"[{float(y.min()):.3g}, {float(y.max()):.3g}]")

    def nll_per_sample(self, f: Tensor, y: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(f, y.to(f.dtype), reduction="none").sum(-1)

    def output_grad(self, f: Tensor, y: Tensor) -> Tensor:
        return torch.sigmoid(f) - y.to(f.dtype)

    def output_hessian_diagonal(self, f: Tensor) -> Tensor:
        s = torch.sigmoid(f)
        return s * (1 - s)

    def output_hessian(self, f: Tensor) -> Tensor:
        return torch.diag_embed(self.output_hessian_diagonal(f))

    def output_hessian_sqrt(self, f: Tensor) -> Tensor:
        return torch.diag_embed(self.output_hessian_diagonal(f).sqrt())

    def sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return torch.bernoulli(torch.sigmoid(f), generator=generator)


class Gaussian(Likelihood):
    """Gaussian with fixed noise std ``sigma``: L^n = ||f - y||^2 / (2 sigma^2) (+ log-normaliser if asked).

    ``sigma=1`` is the thesis's squared error (1/2)||h - y||^2. H_L = I / sigma^2, square root I / sigma.
    Note ``torch.nn.MSELoss(reduction='mean')`` also divides by the output dimension and has no 1/2;
    use ``reduction='sum'`` here and rescale if you need to match it.
    """

    name = "Gaussian"

    def __init__(self, reduction: Reduction = "mean", sigma: float = 1.0, include_normaliser: bool = False):
        super().__init__(reduction)
        if not sigma > 0 or not math.isfinite(sigma):
            raise ValueError(f"Gaussian noise std sigma must be positive and finite, got {sigma}")
        self.sigma = float(sigma)
        self.include_normaliser = include_normaliser

    def check(self, f: Tensor, y: Tensor | None = None) -> None:
        super().check(f, y)
        if y is not None and y.shape != f.shape:
            raise ValueError(f"{self.name}: targets must have the output's shape {tuple(f.shape)}, "
                             f"got {tuple(y.shape)}")
        if y is not None:
            _check_finite_targets(self.name, y)

    def nll_per_sample(self, f: Tensor, y: Tensor) -> Tensor:
        out = 0.5 * ((f - y.to(f.dtype)) ** 2).sum(-1) / self.sigma**2
        if self.include_normaliser:
            out = out + 0.5 * f.shape[-1] * math.log(2 * math.pi * self.sigma**2)
        return out

    def output_grad(self, f: Tensor, y: Tensor) -> Tensor:
        return (f - y.to(f.dtype)) / self.sigma**2

    def output_hessian_diagonal(self, f: Tensor) -> Tensor:
        return torch.full_like(f, 1.0 / self.sigma**2)

    def output_hessian(self, f: Tensor) -> Tensor:
        eye = torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
        return eye.expand(f.shape[0], -1, -1) / self.sigma**2

    def output_hessian_sqrt(self, f: Tensor) -> Tensor:
        eye = torch.eye(f.shape[-1], dtype=f.dtype, device=f.device)
        return eye.expand(f.shape[0], -1, -1) / self.sigma

    def sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        eps = torch.randn(f.shape, dtype=f.dtype, device=f.device, generator=generator)
        return f.detach() + self.sigma * eps

    def __repr__(self) -> str:
        return f"Gaussian(reduction={self.reduction!r}, sigma={self.sigma})"


_BY_NAME: dict[str, type[Likelihood]] = {
    "cross_entropy": CrossEntropy,
    "bce": BernoulliBCE,
    "gaussian": Gaussian,
    "mse": Gaussian,
}


def get_likelihood(name: str, reduction: Reduction = "mean") -> Likelihood:
    """Likelihood by name: 'cross_entropy', 'bce', 'gaussian' (alias 'mse')."""
    try:
        return _BY_NAME[name](reduction=reduction)
    except KeyError:
        raise ValueError(f"unknown likelihood {name!r}; choose one of {sorted(_BY_NAME)}") from None


class BernoulliMixture(Likelihood):
    """Two-component mixture of Bernoulli classifiers for a binary label (thesis Eq. 4.28, Sec. 4.5.3):

        p(y | h) = s(h_1) s(h_2)^y (1 - s(h_2))^(1-y) + (1 - s(h_1)) s(h_3)^y (1 - s(h_3))^(1-y),

    s the logistic sigmoid; f = h (B, 3) are the network outputs, y (B,) labels in {0, 1} (any numeric
    dtype). The head is not an exponential family in h, so its NLL is not convex in h and its output
    Hessian depends on the label: the Gauss-Newton matrix (G_L = H_L at the data labels) and the type-2
    Fisher (G_L replaced by E_{y ~ p(y|h)}[g g^T]) differ, which is what thesis Fig. 4.4 compares.

    Output Hessian (exact, per sample). With log p = logsumexp(u_1, u_2), u_1 = log s(h_1) + log Bern(y|h_2),
    u_2 = log s(-h_1) + log Bern(y|h_3), responsibilities r = softmax(u_1, u_2) and
    grad u_1 = (1 - s_1, y - s_2, 0), grad u_2 = (-s_1, 0, y - s_3):

        -grad log p   = -(r_1 grad u_1 + r_2 grad u_2)                                   (output_grad)
        H_exact       = -sum_k r_k hess u_k - sum_k r_k grad u_k grad u_k^T + grad log p grad log p^T,
        hess u_1 = -diag(s_1(1-s_1), s_2(1-s_2), 0),  hess u_2 = -diag(s_1(1-s_1), 0, s_3(1-s_3)).

    H_exact can be indefinite; the thesis does not say what it used, so ``output_hessian(f, y)`` returns
    its projection onto the PSD cone (eigenvalues clipped at 0: the nearest PSD matrix in Frobenius norm),
    and the counters :attr:`projections` (samples whose smallest eigenvalue was below -rounding level,
    i.e. where the projection acted) and :attr:`evaluations` (samples evaluated) record how often it acts.
    Because H_L needs the label, ``hessian_needs_target = True`` and the Hessian methods take ``y``
    (the Kronecker estimators pass it); ``output_fisher_sqrt(f)`` gives the type-2 Fisher factor
    (two columns sqrt(p(y|h)) g(h, y), y = 0, 1).
    """

    name = "Bernoulli mixture (thesis Eq. 4.28)"
    hessian_needs_target = True

    def __init__(self, reduction: Reduction = "mean"):
        super().__init__(reduction)
        self.projections = 0
        self.evaluations = 0

    def check(self, f: Tensor, y: Tensor | None = None) -> None:
        super().check(f, y)
        if f.shape[1] != 3:
            raise ValueError(f"{self.name}: the model must have 3 outputs (h_1 mixing logit, h_2 and h_3 "
                             f"component logits), got {f.shape[1]}")
        if y is not None:
            if y.shape != f.shape[:1]:
                raise ValueError(f"{self.name}: targets must have shape ({f.shape[0]},), got {tuple(y.shape)}")
            if y.numel() and not bool(((y == 0) | (y == 1)).all()):
                raise ValueError(f"{self.name}: targets must be 0 or 1")

    def _terms(self, f: Tensor, y: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        """(u (B, 2), r (B, 2), grad u_1 (B, 3), grad u_2 (B, 3), s = sigmoid(f) (B, 3))."""
        y = y.to(f.dtype)
        h1, h2, h3 = f.unbind(-1)
        lb2 = -F.binary_cross_entropy_with_logits(h2, y, reduction="none")
        lb3 = -F.binary_cross_entropy_with_logits(h3, y, reduction="none")
        u = torch.stack([F.logsigmoid(h1) + lb2, F.logsigmoid(-h1) + lb3], dim=-1)
        r = u.softmax(-1)
        s = torch.sigmoid(f)
        zero = torch.zeros_like(h1)
        g1 = torch.stack([1 - s[:, 0], y - s[:, 1], zero], dim=-1)
        g2 = torch.stack([-s[:, 0], zero, y - s[:, 2]], dim=-1)
        return u, r, g1, g2, s

    def nll_per_sample(self, f: Tensor, y: Tensor) -> Tensor:
        u = self._terms(f, y)[0]
        return -torch.logsumexp(u, dim=-1)

    def output_grad(self, f: Tensor, y: Tensor) -> Tensor:
        _, r, g1, g2, _ = self._terms(f, y)
        return -(r[:, :1] * g1 + r[:, 1:] * g2)

    def output_hessian_exact(self, f: Tensor, y: Tensor) -> Tensor:
        """(B, 3, 3) exact Hessian of the per-sample NLL in h (possibly indefinite)."""
        _, r, g1, g2, s = self._terms(f, y)
        v = s * (1 - s)
        d1 = torch.stack([v[:, 0], v[:, 1], torch.zeros_like(v[:, 0])], dim=-1)
        d2 = torch.stack([v[:, 0], torch.zeros_like(v[:, 0]), v[:, 2]], dim=-1)
        g = r[:, :1] * g1 + r[:, 1:] * g2
        H = torch.diag_embed(r[:, :1] * d1 + r[:, 1:] * d2)
        H = H - r[:, :1, None] * g1[:, :, None] * g1[:, None, :] - r[:, 1:, None] * g2[:, :, None] * g2[:, None, :]
        return H + g[:, :, None] * g[:, None, :]

    def _projected(self, f: Tensor, y: Tensor | None) -> tuple[Tensor, Tensor]:
        if y is None:
            raise ValueError(f"{self.name}: the output Hessian depends on the label; pass the targets y "
                             "(output_hessian(f, y))")
        H = self.output_hessian_exact(f, y)
        lam, U = torch.linalg.eigh(0.5 * (H + H.transpose(-1, -2)))
        tol = 3 * torch.finfo(f.dtype).eps * lam.abs().amax(-1).clamp_min(torch.finfo(f.dtype).tiny)
        self.projections += int((lam[:, 0] < -tol).sum())
        self.evaluations += int(f.shape[0])
        return lam.clamp_min(0), U

    def output_hessian(self, f: Tensor, y: Tensor | None = None) -> Tensor:  # type: ignore[override]
        """(B, 3, 3) PSD projection of the exact output Hessian at the labels y (class docstring)."""
        lam, U = self._projected(f, y)
        return (U * lam[:, None, :]) @ U.transpose(-1, -2)

    def output_hessian_sqrt(self, f: Tensor, y: Tensor | None = None) -> Tensor:  # type: ignore[override]
        """(B, 3, 3) S = U diag(sqrt(lam_+)) with S S^T = the projected Hessian."""
        lam, U = self._projected(f, y)
        return U * lam.sqrt()[:, None, :]

    def output_hessian_diagonal(self, f: Tensor, y: Tensor | None = None) -> Tensor:  # type: ignore[override]
        return self.output_hessian(f, y).diagonal(dim1=-2, dim2=-1)

    def prob_one(self, f: Tensor) -> Tensor:
        """(B,) p(y = 1 | h) = s(h_1) s(h_2) + (1 - s(h_1)) s(h_3)."""
        s = torch.sigmoid(f)
        return s[:, 0] * s[:, 1] + (1 - s[:, 0]) * s[:, 2]

    def sample(self, f: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return torch.bernoulli(self.prob_one(f), generator=generator)

    def output_fisher_sqrt(self, f: Tensor) -> Tensor:
        """(B, 3, 2) factor of the output Fisher E_{y ~ p(y|h)}[g g^T]: columns sqrt(p(y|h)) g(h, y)."""
        p1 = self.prob_one(f)
        cols = []
        for lab, p in ((0.0, 1 - p1), (1.0, p1)):
            g = self.output_grad(f, torch.full_like(p1, lab))
            cols.append(g * p.clamp_min(0).sqrt()[:, None])
        return torch.stack(cols, dim=-1)

    def accuracy(self, f: Tensor, y: Tensor) -> Tensor:
        """Fraction of samples whose more probable label is y."""
        return ((self.prob_one(f) > 0.5).to(y.dtype) == y).to(f.dtype).mean()
