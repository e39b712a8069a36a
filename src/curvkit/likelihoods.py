"""Likelihood heads: the loss on a network's output and its output-space curvature.

A likelihood turns network outputs ``f`` (the natural parameters h_L of thesis Eq. 3.10: logits, or the
Gaussian mean) and targets into the negative log-likelihood, and supplies everything the curvature engine
needs in output space (thesis Secs. 3.4.1 and 3.5).

Shapes: samples and positions. ``f`` is (B, C) - one loss term per sample - or (B, *P, C) with position
dimensions P (tokens of a sequence, pixels of a segmentation map): one loss term per (sample, position),
as ``nn.CrossEntropyLoss`` on logits flattened to (B * T, C). The outputs (classes) are always the LAST
dimension (as Hugging Face models return them; move torch's (B, C, T) layout with ``f.movedim(1, -1)``).
Targets must match the leading dimensions exactly - (B, *P) class indices, or f's shape for BCE/Gaussian -
and anything else is an error, never a re-read. The SAMPLE stays the unit of batching, sampling,
data-parallel splitting and ``num_data``; the POSITION is the unit of the loss.

Padding. A position can be left out of the loss and of every curvature: ``CrossEntropy(ignore_index=-100)``
(torch's convention) and ``Gaussian/BernoulliBCE(ignore_value=v)`` (a position whose targets all equal v).
:meth:`Likelihood.mask` gives the (B, *P) mask of counted positions.

Per-position quantities (f (..., C); every curvature method takes the targets ``y`` optionally: with y,
padded positions get exactly zero, and heads whose Hessian depends on the label use it):

* ``output_grad(f, y)``          - dL/df per position, f's shape (zero at padded positions);
* ``output_hessian(f, y)``       - (..., C, C) H_L = d^2 L / df^2 (for the exponential-family heads
  independent of the label, hence also the output-space Fisher F_L, thesis Eqs. 3.36-3.38);
* ``output_hessian_matvec(f, V, y)`` - H_L V per position for V (*K, ..., C) broadcasting against f, in
  O(C) per position (softmax: p * V - p (p^T V)); never forms a (C, C) matrix;
* ``output_hessian_sqrt(f, y)``  - (..., C, R) with S S^T = H_L, and ``output_hessian_sqrt_columns(f, cols,
  y)`` - the columns ``cols`` of it only (for C in the thousands, chunk the columns: the full factor of a
  50,000-class head is 50,000^2 numbers per position);
* ``output_hessian_diagonal(f, y)`` - (..., C);
* ``sample(f, generator, y)``    - targets drawn from the model p(y | f), padded positions copied from y
  (so their gradient stays zero).

Per-sample and reduced: ``nll_per_sample(f, y)`` (B,) sums each sample's counted positions;
``nll(f, y)`` is the reduced loss. Reduction convention: ``sum`` means L = sum over counted positions;
``mean`` divides by their number (``num_terms``; = B for (B, C) outputs without padding), never by the
output dimension C. Per-position quantities never include the reduction factor; the curvature engine applies
it (``scale(num_terms)``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from curvkit.validation import first_nonfinite

Reduction = Literal["sum", "mean"]


INVERSE_CDF_ENTRIES = 4096
"""Above this many probabilities (rows x classes) :class:`CrossEntropy` samples labels by the inverse CDF instead
of ``torch.multinomial``: the same distribution, a different use of the generator, 6-20x faster from about a
thousand entries (one thread: 1,024 rows x 256 classes 0.38 ms against 6.3 ms, 6,400 x 10 0.24 against 1.7 ms,
256 x 32,000 9.5 against 194 ms). Up to it the draws are curvlinops' from the same generator, which the tests
comparing Monte Carlo factors with curvlinops' rely on."""


class Likelihood:
    """Base class. Subclasses define the per-position quantities; masking and reduction are handled here.

    A subclass implements ``_nll_terms(f, y)`` (per position, unmasked), ``_output_grad``,
    ``_hessian_diagonal`` or ``_hessian`` (and may override ``_hessian_matvec`` / ``_sqrt_columns`` with
    structured forms), ``_sample`` and ``_target_check``; ``_padding(y)`` marks padded positions.
    """

    name = "likelihood"
    #: the output Hessian depends on the label (e.g. the Bernoulli mixture), so y is required
    hessian_needs_target = False

    def __init__(self, reduction: Reduction = "mean"):
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        self.reduction: Reduction = reduction

    # -- what subclasses define -------------------------------------------------------------------
    def _nll_terms(self, f: Tensor, y: Tensor) -> Tensor:
        """(...,) NLL of every position, padding not yet removed."""
        raise NotImplementedError

    def _output_grad(self, f: Tensor, y: Tensor) -> Tensor:
        raise NotImplementedError

    def _hessian(self, f: Tensor) -> Tensor:
        """(..., C, C) H_L per position."""
        return torch.diag_embed(self._hessian_diagonal(f))

    def _hessian_diagonal(self, f: Tensor) -> Tensor:
        return self._hessian(f).diagonal(dim1=-2, dim2=-1)

    def _hessian_matvec(self, f: Tensor, V: Tensor) -> Tensor:
        """H_L V per position; V (*K, ..., C) broadcasts against f (..., C). Diagonal heads by default."""
        return self._hessian_diagonal(f) * V

    def _sqrt_columns(self, f: Tensor, cols: slice) -> Tensor:
        """(..., C, r) columns ``cols`` of S with S S^T = H_L. Diagonal heads by default."""
        d = self._hessian_diagonal(f).sqrt()
        C = f.shape[-1]
        idx = torch.arange(C, device=f.device)[cols]
        return d[..., :, None] * (torch.arange(C, device=f.device)[:, None] == idx[None, :]).to(f.dtype)

    def _sample(self, f: Tensor, generator: torch.Generator | None) -> Tensor:
        raise NotImplementedError

    def _padding(self, y: Tensor) -> Tensor | None:
        """(B, *P) bool, True at padded positions; None when the head has no padding convention set."""
        return None

    def _target_check(self, f: Tensor, y: Tensor) -> None:
        """Raise ValueError when y does not fit f (shape, dtype, range)."""

    # -- masking --------------------------------------------------------------------------------------
    def mask(self, y: Tensor) -> Tensor | None:
        """(B, *P) bool mask of the positions that count, True where a position is in the loss (None: all of
        them)."""
        pad = None if y is None else self._padding(y)
        return None if pad is None else ~pad

    def num_terms(self, f: Tensor, y: Tensor | None = None) -> int:
        """Number of loss terms (counted positions) of a batch: B * prod(P) minus the padded ones."""
        total = math.prod(f.shape[:-1])
        pad = None if y is None else self._padding(y)
        return total if pad is None else total - int(pad.sum())

    def _masked(self, out: Tensor, y: Tensor | None) -> Tensor:
        """Zero ``out`` (..., C[, R]) at padded positions of y (broadcast over leading K dims)."""
        pad = None if y is None else self._padding(y)
        if pad is None:
            return out
        keep = (~pad).to(out.dtype)
        extra = out.dim() - keep.dim()
        return out * keep.reshape(keep.shape + (1,) * extra) if extra > 0 else out * keep

    def _masked_last(self, out: Tensor, f: Tensor, y: Tensor | None) -> Tensor:
        """Zero ``out`` (*K, ..., C) at padded positions, with f (..., C) fixing where positions sit."""
        pad = None if y is None else self._padding(y)
        if pad is None:
            return out
        return out * (~pad).to(out.dtype)[..., None]

    # -- per-position quantities ----------------------------------------------------------------------
    def output_grad(self, f: Tensor, y: Tensor) -> Tensor:
        """dL/df per position (f's shape); zero at padded positions."""
        return self._masked_last(self._output_grad(f, y), f, y)

    def output_hessian(self, f: Tensor, y: Tensor | None = None) -> Tensor:
        """(..., C, C) per-position H_L; zero at padded positions of y (if given)."""
        return self._masked(self._hessian(f), y)

    def output_hessian_diagonal(self, f: Tensor, y: Tensor | None = None) -> Tensor:
        """(..., C) diagonal of H_L; zero at padded positions of y (if given)."""
        return self._masked_last(self._hessian_diagonal(f), f, y)

    def output_hessian_matvec(self, f: Tensor, V: Tensor, y: Tensor | None = None) -> Tensor:
        """H_L V per position in O(C) each (never a (C, C) matrix); V (*K, ..., C) broadcasts against
        f (..., C); zero at padded positions of y (if given)."""
        return self._masked_last(self._hessian_matvec(f, V), f, y)

    #: H_L is diagonal per position (the sum :meth:`output_hessian_sum` then comes from the diagonals)
    diagonal_hessian = False

    def output_hessian_sum(self, f: Tensor, y: Tensor | None = None) -> Tensor:
        """(C, C) sum of H_L over every sample and position of f (B, [*P,] C); zero at padded positions of y.

        Never a (B, C, C) tensor: a head whose H_L needs the label from dense blocks a few positions at a time,
        a diagonal H_L (``diagonal_hessian``) from the diagonals, otherwise from O(C) products
        (:meth:`output_hessian_matvec`) a few positions at a time; subclasses override it with closed forms
        (softmax: ``diag(sum p) - P^T P``). KFLR's output factor of the output layer and KFRA's G_L use it."""
        C = f.shape[-1]
        ff = f.reshape(-1, C)
        yy = None if y is None else y.reshape(ff.shape[0], *y.shape[f.dim() - 1:])
        if self.diagonal_hessian:
            return torch.diag(self.output_hessian_diagonal(ff, yy).sum(0))
        step = max(1, 2**22 // (C * C))
        out = f.new_zeros(C, C)
        if self.hessian_needs_target:
            for s in range(0, ff.shape[0], step):
                out += self.output_hessian(ff[s:s + step], None if yy is None else yy[s:s + step]).sum(0)
            return out
        eye = torch.eye(C, dtype=f.dtype, device=f.device)
        for s in range(0, ff.shape[0], step):
            fs = ff[s:s + step]
            V = eye[:, None, :].expand(C, fs.shape[0], C)
            out += self.output_hessian_matvec(fs, V, None if yy is None else yy[s:s + step]).sum(1)
        return 0.5 * (out + out.T)

    def output_hessian_sqrt(self, f: Tensor, y: Tensor | None = None) -> Tensor:
        """(..., C, R) with S S^T = H_L per position (R = C for the built-in heads); zero at padded positions.

        Holds C x R numbers per position: for large C use :meth:`output_hessian_sqrt_columns` in chunks."""
        return self.output_hessian_sqrt_columns(f, slice(None), y)

    def output_hessian_sqrt_columns(self, f: Tensor, cols: slice, y: Tensor | None = None) -> Tensor:
        """(..., C, r) the columns ``cols`` (a slice of range(R)) of :meth:`output_hessian_sqrt`."""
        return self._masked(self._sqrt_columns(f, cols), y)

    def sqrt_rank(self, f: Tensor) -> int:
        """R, the number of columns of :meth:`output_hessian_sqrt`."""
        return int(f.shape[-1])

    # -- what the Laplace predictives ask (thesis Sec. 5.2; curvkit.laplace.predictive) ------------------
    #: the predictive is a Gaussian ``(mean, variance)`` (regression), not probabilities
    regression = False

    def mean(self, f: Tensor) -> Tensor:
        """The mean parameter of p(y | f) (the inverse link: probabilities for a classifier, f itself for a
        Gaussian); what the MC predictive averages. A head without it takes no Laplace predictive."""
        raise NotImplementedError(f"{type(self).__name__} defines no mean(f) (inverse link), which the Laplace "
                                  "predictives average")

    def probit_mean(self, f: Tensor, variance: Tensor) -> Tensor:
        """The probit approximation of E[mean(f + e)], e ~ N(0, variance) per output: mean(f / sqrt(1 + pi/8 v))
        (MacKay; thesis Sec. 5.2.2). Only for the logistic links (softmax, sigmoid)."""
        raise NotImplementedError(f"{type(self).__name__}: the probit approximation needs a softmax or sigmoid "
                                  "link; use link='mc'")

    def predictive_variance(self, variance: Tensor) -> Tensor:
        """Regression: the predictive variance of y from the variance of the linearised output (adds the noise)."""
        raise NotImplementedError(f"{type(self).__name__} is not a regression head")

    def predictive_nll_terms(self, prediction: Any, y: Tensor) -> Tensor:
        """(B, *P) negative log predictive density of ``y`` under ``prediction`` (what the predictives return)
        per position, padding not yet removed."""
        raise NotImplementedError(f"{type(self).__name__} defines no predictive density")

    def log_likelihood(self, f: Tensor, y: Tensor) -> Tensor:
        """Per-sample log-likelihood (B,) with every normalising constant (the evidence needs them)."""
        return -self.nll_per_sample(f, y)

    def vmap_loss(self) -> Callable[[Tensor, Tensor], Tensor]:
        """The reduced NLL as a function ``(f, y) -> loss`` safe under ``vmap`` (no data-dependent checks)."""
        def loss(f: Tensor, y: Tensor) -> Tensor:
            return self.nll_per_sample(f, y).sum() * self.scale(self.num_terms(f, y))
        return loss

    def check_logits(self, f: Tensor, who: str) -> None:
        """Refuse outputs that are already this head's mean (probabilities after a final softmax or sigmoid)
        where it takes logits: curvature and predictives would be those of softmax(probabilities), silently
        wrong. Nothing to check by default; ``who`` names the caller in the message."""

    # -- the output Fisher F_L = E_{y ~ p(y|f)}[g g^T], g = d(-log p)/df (thesis Eq. 3.36; curvature.output_space)
    def output_fisher_sqrt_columns(self, f: Tensor, cols: slice) -> Tensor:
        """(..., C, r) the columns ``cols`` of a factor S with S S^T = F_L per position. The built-in heads give
        the closed form; another head defines ``output_fisher_sqrt(f)`` (..., C, R) and inherits the rest."""
        return self._custom_fisher_sqrt(f)[..., cols]

    def output_fisher_matvec(self, f: Tensor, V: Tensor) -> Tensor:
        """F_L V per position, V (*K, ..., C) broadcasting against f (..., C); from S for a custom head."""
        S = self._custom_fisher_sqrt(f)  # (..., C, R)
        return (S * (S * V[..., :, None]).sum(-2)[..., None, :]).sum(-1)

    def output_fisher_rank(self, f: Tensor) -> int:
        """R, the columns of the factor S (C for the built-in heads)."""
        return int(self._custom_fisher_sqrt(f).shape[-1])

    def _custom_fisher_sqrt(self, f: Tensor) -> Tensor:
        custom = getattr(self, "output_fisher_sqrt", None)
        if callable(custom):
            out: Tensor = custom(f)
            return out
        raise TypeError(f"no closed-form output Fisher for {type(self).__name__}; define an output_fisher_sqrt(f) "
                        "method on it, or use MCFisherOperator (sampled labels) instead")

    def sample(self, f: Tensor, generator: torch.Generator | None = None, y: Tensor | None = None) -> Tensor:
        """Targets drawn from the model p(y | f), shaped like the data targets; with ``y``, padded positions
        are copied from y (so their gradient, and hence their curvature, stays zero)."""
        out = self._sample(f, generator)
        pad = None if y is None else self._padding(y)
        if y is not None and pad is not None:
            out = torch.where(pad.reshape(pad.shape + (1,) * (out.dim() - pad.dim())), y.to(out.dtype), out)
        return out

    # -- validation -----------------------------------------------------------------------------------
    def check(self, f: Tensor, y: Tensor | None = None) -> None:
        """Validate shapes and finiteness; raises ValueError saying what is wrong."""
        if not isinstance(f, Tensor) or f.dim() < 2:
            shape = tuple(f.shape) if isinstance(f, Tensor) else type(f).__name__
            raise ValueError(f"{self.name}: model output must have shape (batch, outputs) or (batch, positions..., "
                             f"outputs), got {shape}")
        if f.shape[0] == 0:
            raise ValueError(f"{self.name}: the batch is empty (model output of shape {tuple(f.shape)}); pass at "
                             "least one sample")
        if first_nonfinite([f]) is not None:  # one sum when finite
            raise ValueError(
                f"{self.name}: the model output contains NaN or inf ({int((~torch.isfinite(f)).sum())} entries); "
                "check the inputs, the weights and the learning rate"
            )
        if y is not None:
            if not isinstance(y, Tensor):
                raise TypeError(f"{self.name}: targets must be a torch.Tensor, got {type(y).__name__}")
            self._target_check(f, y)

    # -- reduction ----------------------------------------------------------------------------------
    def with_reduction(self, reduction: Reduction) -> Likelihood:
        """A copy of this likelihood with another ``reduction`` (every other setting kept)."""
        if reduction not in ("sum", "mean"):
            raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
        out = copy.copy(self)
        out.reduction = reduction
        return out

    def scale(self, num_terms: int) -> float:
        """Factor that turns a sum over ``num_terms`` loss terms into this reduction (1 or 1 / num_terms)."""
        if self.reduction == "sum":
            return 1.0
        if num_terms <= 0:
            raise ValueError(f"{self.name}: the mean over {num_terms} loss terms is undefined (every position "
                             "is padding or the data are empty)")
        return 1.0 / num_terms

    def nll_per_sample(self, f: Tensor, y: Tensor) -> Tensor:
        """(B,) NLL of each sample: the sum over its counted positions."""
        terms = self._nll_terms(f, y)
        pad = self._padding(y)
        if pad is not None:
            terms = terms.masked_fill(pad, 0.0)
        return terms.reshape(terms.shape[0], -1).sum(1) if terms.dim() > 1 else terms

    def nll(self, f: Tensor, y: Tensor) -> Tensor:
        """Reduced NLL over the batch (mean over counted positions, or their sum)."""
        self.check(f, y)
        return self.nll_per_sample(f, y).sum() * self.scale(self.num_terms(f, y))

    __call__ = nll

    def __repr__(self) -> str:
        return f"{type(self).__name__}(reduction={self.reduction!r})"


def _check_finite_targets(name: str, y: Tensor) -> None:
    if y.is_floating_point() and not bool(torch.isfinite(y).all()):
        raise ValueError(f"{name}: the targets contain NaN or inf ({int((~torch.isfinite(y)).sum())} entries)")


def _check_same_shape(name: str, f: Tensor, y: Tensor) -> None:
    if y.shape != f.shape:
        raise ValueError(f"{name}: targets must have the output's shape {tuple(f.shape)}, got {tuple(y.shape)}")


class _ValuePadding:
    """Padding by a target value: a position whose targets all equal ``ignore_value`` is left out."""

    ignore_value: float | None = None

    def _padding(self, y: Tensor) -> Tensor | None:
        if self.ignore_value is None:
            return None
        return (y == self.ignore_value).all(-1)


def _ignore_value(value: float | None) -> float | None:
    if value is None:
        return None
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"ignore_value must be a finite number (NaN targets are refused as bad data), got {value}")
    return v


def _onehot_columns(f: Tensor, cols: slice) -> tuple[Tensor, Tensor]:
    """(idx (r,), one-hot (C, r)) of the columns ``cols`` of range(C)."""
    C = f.shape[-1]
    idx = torch.arange(C, device=f.device)[cols]
    return idx, (torch.arange(C, device=f.device)[:, None] == idx[None, :]).to(f.dtype)


class CrossEntropy(Likelihood):
    """Softmax cross-entropy; f are logits (B, K) or (B, *P, K), y class indices (B,) or (B, *P).

    H_L = diag(p) - p p^T (rank K-1). ``ignore_index``: targets equal to it are padding, left out of the
    loss, of ``num_terms`` and of every curvature. The default None has no padding, so a target outside
    [0, K-1] is an error (also torch's -100: pass ``ignore_index=-100`` to treat it as ``nn.CrossEntropyLoss``
    and Hugging Face do; curvkit never drops terms unasked).
    """

    name = "softmax cross-entropy"

    def __init__(self, reduction: Reduction = "mean", ignore_index: int | None = None):
        super().__init__(reduction)
        if ignore_index is not None and (isinstance(ignore_index, bool) or not isinstance(ignore_index, int)):
            raise ValueError(f"ignore_index must be an int or None, got {ignore_index!r}")
        self.ignore_index = None if ignore_index is None else int(ignore_index)

    def _target_check(self, f: Tensor, y: Tensor) -> None:
        if y.shape != f.shape[:-1] or y.dtype not in (torch.int64, torch.int32, torch.uint8, torch.int16):
            raise ValueError(
                f"{self.name}: targets must be integer class indices of shape {tuple(f.shape[:-1])} (the logits' "
                f"shape {tuple(f.shape)} without its last, class dimension), got dtype {y.dtype} shape "
                f"{tuple(y.shape)}; classes must be the LAST dimension of the logits (torch's (B, C, T) layout: "
                "pass logits.movedim(1, -1))")
        if y.numel():
            counted = y if self.ignore_index is None else y[y != self.ignore_index]
            if counted.numel() and (int(counted.min()) < 0 or int(counted.max()) >= f.shape[-1]):
                pad = ("padding is not enabled: for padded positions pass CrossEntropy(ignore_index=...)"
                       if self.ignore_index is None else f"or equal ignore_index={self.ignore_index} for padding")
                raise ValueError(f"{self.name}: targets must lie in [0, {f.shape[-1] - 1}] ({pad}), got values in "
                                 f"[{int(counted.min())}, {int(counted.max())}]")

    def _padding(self, y: Tensor) -> Tensor | None:
        if self.ignore_index is None:
            return None
        return y == self.ignore_index  # a tensor even when nothing is padded: no data-dependent branch (vmap)

    def _safe(self, y: Tensor) -> Tensor:
        """Targets with padding replaced by class 0 (its terms are masked afterwards)."""
        return y.long() if self.ignore_index is None else y.long().masked_fill(y == self.ignore_index, 0)

    def _nll_terms(self, f: Tensor, y: Tensor) -> Tensor:
        return -torch.gather(f.log_softmax(-1), -1, self._safe(y)[..., None])[..., 0]

    def _output_grad(self, f: Tensor, y: Tensor) -> Tensor:
        return f.softmax(-1) - F.one_hot(self._safe(y), f.shape[-1]).to(f.dtype)

    def _hessian(self, f: Tensor) -> Tensor:
        p = f.softmax(-1)
        return torch.diag_embed(p) - p[..., :, None] * p[..., None, :]

    def _hessian_diagonal(self, f: Tensor) -> Tensor:
        p = f.softmax(-1)
        return p - p**2

    def _hessian_matvec(self, f: Tensor, V: Tensor) -> Tensor:
        p = f.softmax(-1)
        pV = p * V
        return pV - p * pV.sum(-1, keepdim=True)

    def _sqrt_columns(self, f: Tensor, cols: slice) -> Tensor:
        """Columns of S = diag(sqrt p) - p sqrt(p)^T (S S^T = diag(p) - p p^T; the factor KFLR propagates,
        thesis Sec. 4.3.1): column c is sqrt(p_c) (e_c - p)."""
        p = f.softmax(-1)
        C = f.shape[-1]
        idx = torch.arange(C, device=f.device)[cols]
        sp = p[..., idx].sqrt()  # (..., r)
        r = idx.numel()
        # built column-major, (r, ..., C) in memory, so that the column-batched backward passes of the layerwise
        # diagonal (S.permute(-1, ...)) read it without a copy; returned as the (..., C, r) view
        cols_first = torch.empty((r, *f.shape), dtype=p.dtype, device=p.device)
        torch.mul(p[None], -sp.movedim(-1, 0)[..., None], out=cols_first)  # -sqrt(p_c) p
        flat = cols_first.view(r, -1, C)
        flat[torch.arange(r, device=f.device), :, idx] += sp.reshape(-1, r).T  # + sqrt(p_c) e_c
        return cols_first.movedim(0, -1)

    def mean(self, f: Tensor) -> Tensor:
        return f.softmax(-1)

    def probit_mean(self, f: Tensor, variance: Tensor) -> Tensor:
        return (f / torch.sqrt(1.0 + math.pi / 8 * variance)).softmax(-1)

    def predictive_nll_terms(self, prediction: Any, y: Tensor) -> Tensor:
        self.check(prediction.detach(), y)  # class indices of the right shape and range
        p = prediction.clamp_min(torch.finfo(prediction.dtype).tiny)
        return -torch.log(p.gather(-1, self._safe(y)[..., None]))[..., 0]

    def vmap_loss(self) -> Callable[[Tensor, Tensor], Tensor]:
        """Without padding: ``log_softmax`` + ``gather`` over the classes, several times faster under ``vmap``
        than ``F.cross_entropy`` (which has no batching rule of its own)."""
        if self.ignore_index is not None:
            return super().vmap_loss()

        def ce(f: Tensor, y: Tensor) -> Tensor:
            nll = -f.log_softmax(-1).gather(-1, y.long().unsqueeze(-1))
            return nll.sum() * self.scale(nll.numel())
        return ce

    def check_logits(self, f: Tensor, who: str) -> None:
        """Probabilities are read off the output's last operation (a softmax) and off its values: every row
        non-negative and summing to 1 within 1e3 eps(dtype) per class (at most 0.02: a bf16/fp16 softmax sums to 1
        within a few of its eps); a final log_softmax gives valid logits."""
        op = type(f.grad_fn).__name__ if f.grad_fn is not None else ""
        rows = f.detach()
        tol = min(1e3 * torch.finfo(f.dtype).eps * rows.shape[-1], 0.02)
        # logits almost always have a negative entry: one min over them decides (a NaN min is not >= 0), and
        # only non-negative rows are summed in float64 (no float64 copy of a vocabulary-sized output otherwise)
        probabilities = rows.dim() >= 2 and rows.shape[-1] > 1 and bool(rows.amin() >= 0) and bool(
            ((rows.sum(-1, dtype=torch.float64) - 1).abs() <= tol).all())
        if op.startswith("Softmax") or probabilities:
            raise ValueError(f"{who}: the model's outputs of shape {tuple(f.shape)} look like probabilities (the "
                             "output is probabilities: it ends in a softmax, or every row is non-negative and sums "
                             "to 1), but CrossEntropy takes logits; remove the final softmax (the likelihood applies "
                             "it), or end with log_softmax (its softmax is the same)")

    def output_fisher_sqrt_columns(self, f: Tensor, cols: slice) -> Tensor:
        """Column c of S is sqrt(p_c) (p - e_c): F_L = sum_c p_c (p - e_c)(p - e_c)^T, the expectation over
        the classes written out (= H_L, thesis Eqs. 3.37-3.38)."""
        idx, onehot = _onehot_columns(f, cols)
        p = f.softmax(-1)
        return (p[..., :, None] - onehot) * p[..., idx].sqrt()[..., None, :]

    def output_fisher_matvec(self, f: Tensor, V: Tensor) -> Tensor:
        """p * v - p (p^T v): the sum over c expanded with sum_c p_c = 1 (O(C), no (C, C))."""
        return self._hessian_matvec(f, V)

    def output_fisher_rank(self, f: Tensor) -> int:
        return int(f.shape[-1])

    def _sample(self, f: Tensor, generator: torch.Generator | None) -> Tensor:
        """One class per row of ``softmax(f)``: ``torch.multinomial`` up to :data:`INVERSE_CDF_ENTRIES`
        probabilities (the draws curvlinops makes from the same generator), above by the inverse CDF,
        ``searchsorted(cumsum(p), u)`` with one uniform u per row (the same distribution)."""
        flat = f.reshape(-1, f.shape[-1]).softmax(-1)
        if flat.numel() <= INVERSE_CDF_ENTRIES:
            return torch.multinomial(flat, 1, generator=generator)[:, 0].reshape(f.shape[:-1])
        cdf = flat.cumsum(-1)
        u = torch.rand(flat.shape[0], 1, generator=generator, dtype=cdf.dtype, device=cdf.device) * cdf[:, -1:]
        return torch.searchsorted(cdf, u, right=True)[:, 0].clamp_max(flat.shape[-1] - 1).reshape(f.shape[:-1])

    def output_hessian_sum(self, f: Tensor, y: Tensor | None = None) -> Tensor:
        """``sum_n diag(p_n) - p_n p_n^T`` over the unpadded positions: one (C, N) x (N, C) product."""
        P = f.reshape(-1, f.shape[-1]).softmax(-1)
        keep = self.mask(y) if y is not None else None
        if keep is not None:
            P = P * keep.reshape(-1, 1).to(P.dtype)
        return torch.diag(P.sum(0)) - P.T @ P

    def __repr__(self) -> str:
        extra = "" if self.ignore_index is None else f", ignore_index={self.ignore_index}"
        return f"CrossEntropy(reduction={self.reduction!r}{extra})"


class BernoulliBCE(_ValuePadding, Likelihood):
    """Independent sigmoid Bernoulli outputs; f logits (..., C), y in [0, 1] of f's shape.
    H_L = diag(s(1-s)). ``ignore_value``: a position whose C targets all equal it is padding."""

    name = "sigmoid binary cross-entropy"

    diagonal_hessian = True

    def __init__(self, reduction: Reduction = "mean", ignore_value: float | None = None):
        super().__init__(reduction)
        self.ignore_value = _ignore_value(ignore_value)

    def _target_check(self, f: Tensor, y: Tensor) -> None:
        _check_same_shape(self.name, f, y)
        if y.numel():
            _check_finite_targets(self.name, y)
            pad = self._padding(y)
            counted = y if pad is None else y[~pad]
            if counted.numel() and (bool((counted < 0).any()) or bool((counted > 1).any())):
                raise ValueError(f"{self.name}: targets must be probabilities in [0, 1], got values in "
                                 f"[{float(counted.min()):.3g}, {float(counted.max()):.3g}]")

    def _nll_terms(self, f: Tensor, y: Tensor) -> Tensor:
        return F.binary_cross_entropy_with_logits(f, y.to(f.dtype).clamp(0, 1), reduction="none").sum(-1)

    def _output_grad(self, f: Tensor, y: Tensor) -> Tensor:
        return torch.sigmoid(f) - y.to(f.dtype)

    def _hessian_diagonal(self, f: Tensor) -> Tensor:
        s = torch.sigmoid(f)
        return s * (1 - s)

    def mean(self, f: Tensor) -> Tensor:
        return torch.sigmoid(f)

    def probit_mean(self, f: Tensor, variance: Tensor) -> Tensor:
        return torch.sigmoid(f / torch.sqrt(1.0 + math.pi / 8 * variance))

    def predictive_nll_terms(self, prediction: Any, y: Tensor) -> Tensor:
        p = prediction.clamp_min(torch.finfo(prediction.dtype).tiny)
        q = (1 - prediction).clamp_min(torch.finfo(prediction.dtype).tiny)
        yv = y.to(p.dtype)
        return -(yv * p.log() + (1 - yv) * q.log()).sum(-1)

    def check_logits(self, f: Tensor, who: str) -> None:
        """A final sigmoid, read off the output's last operation."""
        if f.grad_fn is not None and type(f.grad_fn).__name__.startswith("Sigmoid"):
            raise ValueError(f"{who}: BernoulliBCE takes logits, but the model's output is probabilities (it ends "
                             "in a sigmoid); remove the final sigmoid")

    def output_fisher_sqrt_columns(self, f: Tensor, cols: slice) -> Tensor:
        """S = diag(sqrt(s (1 - s))): independent outputs, E[g_i^2] = Var(y_i) = s_i (1 - s_i)."""
        s = torch.sigmoid(f)
        return (s * (1 - s)).sqrt()[..., :, None] * _onehot_columns(f, cols)[1]

    def output_fisher_matvec(self, f: Tensor, V: Tensor) -> Tensor:
        s = torch.sigmoid(f)
        return s * (1 - s) * V

    def output_fisher_rank(self, f: Tensor) -> int:
        return int(f.shape[-1])

    def _sample(self, f: Tensor, generator: torch.Generator | None) -> Tensor:
        return torch.bernoulli(torch.sigmoid(f), generator=generator)


class Gaussian(_ValuePadding, Likelihood):
    """Gaussian with fixed noise std ``sigma``: L = ||f - y||^2 / (2 sigma^2) (+ log-normaliser if asked)
    per position (f and y of shape (B, C) or (B, *P, C)).

    ``sigma=1`` is the thesis's squared error (1/2)||h - y||^2. H_L = I / sigma^2, square root I / sigma.
    Note ``torch.nn.MSELoss(reduction='mean')`` also divides by the output dimension and has no 1/2;
    use ``reduction='sum'`` here and rescale if you need to match it. ``ignore_value``: a position whose C
    targets all equal it is padding.
    """

    name = "Gaussian"

    diagonal_hessian = True

    def __init__(self, reduction: Reduction = "mean", sigma: float = 1.0, include_normaliser: bool = False,
                 ignore_value: float | None = None):
        super().__init__(reduction)
        if not sigma > 0 or not math.isfinite(sigma):
            raise ValueError(f"Gaussian noise std sigma must be positive and finite, got {sigma}")
        self.sigma = float(sigma)
        self.include_normaliser = include_normaliser
        self.ignore_value = _ignore_value(ignore_value)

    def _target_check(self, f: Tensor, y: Tensor) -> None:
        _check_same_shape(self.name, f, y)
        _check_finite_targets(self.name, y)

    def _nll_terms(self, f: Tensor, y: Tensor) -> Tensor:
        out = 0.5 * ((f - y.to(f.dtype)) ** 2).sum(-1) / self.sigma**2
        if self.include_normaliser:
            out = out + 0.5 * f.shape[-1] * math.log(2 * math.pi * self.sigma**2)
        return out

    def _output_grad(self, f: Tensor, y: Tensor) -> Tensor:
        return (f - y.to(f.dtype)) / self.sigma**2

    def _hessian_diagonal(self, f: Tensor) -> Tensor:
        return torch.full_like(f, 1.0 / self.sigma**2)

    def _hessian_matvec(self, f: Tensor, V: Tensor) -> Tensor:
        return V / self.sigma**2

    regression = True

    def mean(self, f: Tensor) -> Tensor:
        return f

    def predictive_variance(self, variance: Tensor) -> Tensor:
        return variance + self.sigma**2

    def predictive_nll_terms(self, prediction: Any, y: Tensor) -> Tensor:
        mean, var = prediction
        yv = y.to(mean.dtype).reshape(mean.shape)
        return (0.5 * ((yv - mean) ** 2 / var + torch.log(2 * math.pi * var))).sum(-1)

    def log_likelihood(self, f: Tensor, y: Tensor) -> Tensor:
        ll = -self.nll_per_sample(f, y)
        if not self.include_normaliser:
            keep = self.mask(y)
            positions = (torch.full_like(ll, math.prod(f.shape[1:-1])) if keep is None
                         else keep.reshape(f.shape[0], -1).sum(1).to(ll.dtype))
            ll = ll - 0.5 * f.shape[-1] * math.log(2 * math.pi * self.sigma**2) * positions
        return ll

    def output_fisher_sqrt_columns(self, f: Tensor, cols: slice) -> Tensor:
        """S = I / sigma: g = -eps / sigma with eps standard normal."""
        onehot = _onehot_columns(f, cols)[1]
        return onehot.expand(*f.shape, onehot.shape[-1]) / self.sigma

    def output_fisher_matvec(self, f: Tensor, V: Tensor) -> Tensor:
        return V / self.sigma**2

    def output_fisher_rank(self, f: Tensor) -> int:
        return int(f.shape[-1])

    def _sample(self, f: Tensor, generator: torch.Generator | None) -> Tensor:
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
        if f.dim() != 2 or f.shape[1] != 3:
            raise ValueError(f"{self.name}: the model must have 3 outputs (h_1 mixing logit, h_2 and h_3 "
                             f"component logits) per sample, output shape (batch, 3); got {tuple(f.shape)}")

    def _target_check(self, f: Tensor, y: Tensor) -> None:
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

    def _nll_terms(self, f: Tensor, y: Tensor) -> Tensor:
        u = self._terms(f, y)[0]
        return -torch.logsumexp(u, dim=-1)

    def _output_grad(self, f: Tensor, y: Tensor) -> Tensor:
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

    def output_hessian(self, f: Tensor, y: Tensor | None = None) -> Tensor:
        """(B, 3, 3) PSD projection of the exact output Hessian at the labels y (class docstring)."""
        lam, U = self._projected(f, y)
        return (U * lam[:, None, :]) @ U.transpose(-1, -2)

    def output_hessian_sqrt_columns(self, f: Tensor, cols: slice, y: Tensor | None = None) -> Tensor:
        """(B, 3, r) columns of S = U diag(sqrt(lam_+)) with S S^T = the projected Hessian."""
        lam, U = self._projected(f, y)
        return (U * lam.sqrt()[:, None, :])[:, :, cols]

    def output_hessian_diagonal(self, f: Tensor, y: Tensor | None = None) -> Tensor:
        return self.output_hessian(f, y).diagonal(dim1=-2, dim2=-1)

    def output_hessian_matvec(self, f: Tensor, V: Tensor, y: Tensor | None = None) -> Tensor:
        return torch.einsum("bij,...bj->...bi", self.output_hessian(f, y), V)

    def prob_one(self, f: Tensor) -> Tensor:
        """(B,) p(y = 1 | h) = s(h_1) s(h_2) + (1 - s(h_1)) s(h_3)."""
        s = torch.sigmoid(f)
        return s[:, 0] * s[:, 1] + (1 - s[:, 0]) * s[:, 2]

    def _sample(self, f: Tensor, generator: torch.Generator | None) -> Tensor:
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
