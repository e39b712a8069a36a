"""Terms of the linearised (GLM) predictive variance ``J Sigma J^T``, one per posterior block part, computed
from the pieces of the Jacobian that the layer kinds hand out, never from the full Jacobian.

An output ENTRY e is one output of one position of a sample (``(p, c)`` of outputs (B, *P, C), flattened
``e = p * C + c``). For a Kronecker block with matrix view ``W_hat`` (out, in_aug) the Jacobian of entry e
of sample b is ``J_e = sum_r D_er a_r^T``: the block's input rows ``a_r`` (B, R, in_aug; the bias column
appended) and the gradient of entry e with respect to its output rows ``D_er`` (k, B, R, out) for k
entries at once. For a block read from per-sample gradients (a normalisation layer or raw parameter, the
``factored=False`` blocks, and the rows of :func:`curvkit.laplace._jacobians.generic_rows`), the rows are
the Jacobian itself, ``J`` (k, B, P). Each term returns, for a chunk of entries, their variances (k, B)
(:meth:`GLMTerm.diag`) or, for whole positions, the (C, C) covariances (:meth:`GLMTerm.full`), so that the
probit and Gaussian predictives, which use only the diagonal, never form (B, C, C).

* :class:`FactoredTerm` - ``Sigma = S_G (x) P_A^{-1}`` (thesis Eq. 5.14: the inverse of the damped
  factors): ``J_e Sigma J_e'^T = sum_{r,s} (D_er^T S_G D_e's) K_rs`` with the input kernel
  ``K_rs = a_r^T P_A^{-1} a_s`` (B, R, R) formed once per batch, or, when R is large and the layer narrow
  (convolutions), ``<M_e, S_G M_e'>`` with ``M_e = sum_r D_er v_r^T`` and ``v = L_A^{-1} a`` (k, B, out,
  in_aug): the cheaper of the two by size.
* :class:`SpectralTerm` - ``Sigma = (QG (x) QA) diag(s) (QG (x) QA)^T`` (the exact form ``(N G (x) A +
  lam I)^{-1}`` with ``s = 1 / (N lG lA^T + lam)``, and a diagonal posterior with QG = QA = I and s the
  posterior variances): ``J_e Sigma J_e'^T = sum_{o,i} s_oi Mt_e[o,i] Mt_e'[o,i]``, ``Mt_e = QG^T J_e QA``;
  for R = 1 ``sum_o Dt_e[o] Dt_e'[o] w[o]`` with ``w = s (vt o vt)`` (B, out).
* :class:`GradTerm` - Jacobian rows J (k, B, P) against a covariance given by a Cholesky factor of the
  precision, a diagonal (the variances) or a dense matrix.

The OUTPUT layer (a block whose output rows are the model's outputs themselves, e.g. the classification
head) needs no backward pass: ``D_(p,c)r = [r = p] e_c``, so :meth:`GLMTerm.root` gives its variances in
closed form: ``S_G[c, c'] K_pp`` (factored) or ``sum_o QG[c,o] QG[c',o] w[p,o]`` (spectral), O(C) per
position and sample for the diagonal (a 1,000-class head never forms C x C per sample).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from curvkit.linalg.kron import LowRankFactor

__all__ = ["FactoredTerm", "GLMTerm", "GradTerm", "SpectralTerm", "SumTerm"]


def _pairs(D: Tensor, Y: Tensor, C: int) -> Tensor:
    """(B, n, C, C) covariances ``<D_pc, Y_pd>`` of entries (n * C, B, ...) grouped by position."""
    k, B = D.shape[:2]
    n = k // C
    return torch.einsum("pcbx,pdbx->bpcd", D.reshape(n, C, B, -1), Y.reshape(n, C, B, -1))


class GLMTerm:
    """Base class (module docstring). ``prepare`` runs once per input batch, given the block's input rows
    (B, R, in_aug) or token ids (B, R) (None for gradient rows) and the chunk size k; ``diag`` and ``full``
    take the chunk's rows; ``root`` is the closed form of an output layer (None where there is none)."""

    rows = "kron"  # 'kron': D (k, B, R, out) with input rows; 'grad': Jacobian rows (k, B, P)

    def prepare(self, inputs: Tensor | None, ids: bool, k: int) -> Any:
        return None

    def diag(self, state: Any, D: Tensor) -> Tensor:
        """(k, B) variances of the chunk's entries."""
        raise NotImplementedError

    def full(self, state: Any, D: Tensor, C: int) -> Tensor:
        """(B, n, C, C) covariances of a chunk of n whole positions (k = n * C entries, class-minor)."""
        raise NotImplementedError

    def root(self, state: Any, diagonal: bool) -> Tensor | None:
        """For an output layer (output rows = the model's outputs, R = positions, out = C): (B, R, C) or
        (B, R, C, C) in closed form."""
        return None


class _PairTerm(GLMTerm):
    """A term whose chunk variances are ``sum X * Y`` over a block's output rows for a pair ``(X, Y) =
    self._y(state, D)`` with ``Y = X Sigma_block`` in the block's own basis (factored and spectral blocks)."""

    def _y(self, state: Any, D: Tensor) -> tuple[Tensor, Tensor]:
        raise NotImplementedError

    def diag(self, state: Any, D: Tensor) -> Tensor:
        X, Y = self._y(state, D)
        return (X * Y).flatten(2).sum(-1)

    def full(self, state: Any, D: Tensor, C: int) -> Tensor:
        X, Y = self._y(state, D)
        return _pairs(X, Y, C)


# ---------------------------------------------------------------------------------------------- factored
@dataclass
class _FactoredState:
    path: str  # 'kin' or 'm'
    kin_diag: Tensor  # (B, R): a_r^T P_A^{-1} a_r
    kin: Tensor | None = None  # (B, R, R)
    v: Tensor | None = None  # (B, R, in_aug) = L_A^{-1} a


class FactoredTerm(_PairTerm):
    """``Sigma = S_G (x) P_A^{-1}``: ``S_G`` (out, out) the inverse output factor (or a
    :class:`~curvkit.linalg.kron.LowRankFactor`: a vocabulary-sized output, applied in its thin form), ``L_A``
    the Cholesky factor of ``P_A`` (in_aug, in_aug), or the square root of a diagonal ``P_A`` (in_aug,)."""

    def __init__(self, S_G: Tensor | LowRankFactor, L_A: Tensor):
        self.S_G, self.L_A = S_G, L_A

    def prepare(self, inputs: Tensor | None, ids: bool, k: int) -> _FactoredState:
        assert inputs is not None
        L = self.L_A
        if ids:  # one-hot rows: K_rs = [id_r = id_s] / P_A[id_r], -1 marks a row without a trainable input
            valid = inputs >= 0
            d = (1.0 / L**2)[inputs.clamp_min(0)] * valid
            same = (inputs[:, :, None] == inputs[:, None, :]) & valid[:, :, None]
            return _FactoredState("kin", d, kin=same * d[:, :, None])
        a = inputs.to(L.dtype)
        if L.dim() == 1:
            v = a / L
        else:
            v = torch.linalg.solve_triangular(L, a.transpose(1, 2), upper=False).transpose(1, 2)
        _, R, n_in = v.shape
        out = self.S_G.shape[0]
        kin_diag = (v * v).sum(-1)
        if R > 1 and k * out * n_in < R * R + k * R * out:  # M_e (k, B, out, in_aug) is the smaller form
            return _FactoredState("m", kin_diag, v=v)
        return _FactoredState("kin", kin_diag, kin=v @ v.transpose(1, 2))

    def _y(self, st: _FactoredState, D: Tensor) -> tuple[Tensor, Tensor]:
        """(X, Y) with ``<X_e, Y_e'>`` = the covariance of entries e, e'."""
        D = D.to(self.S_G.dtype)  # the rows of a bf16/fp16 model's pass: the posterior's dtype (curvkit.precision)
        if st.path == "m":
            assert st.v is not None
            M = torch.einsum("kbro,bri->kboi", D, st.v)
            return M, (M.transpose(-1, -2) @ self.S_G).transpose(-1, -2)  # S_G M (S_G symmetric)
        assert st.kin is not None
        E = D @ self.S_G
        if D.shape[2] == 1:
            return D, E * st.kin[None, :, :, :]
        return D, torch.einsum("brs,kbso->kbro", st.kin, E)

    def root(self, state: Any, diagonal: bool) -> Tensor:
        kd = state.kin_diag  # (B, R)
        if diagonal:
            return kd[:, :, None] * self.S_G.diagonal()
        S = self.S_G.to_dense() if isinstance(self.S_G, LowRankFactor) else self.S_G
        return kd[:, :, None, None] * S


# ---------------------------------------------------------------------------------------------- sums
class SumTerm(GLMTerm):
    """The sum of terms on the same rows: a low-rank output factor's exact posterior, the spectral term of
    its span plus the factored term of its complement (:class:`curvkit.laplace._blocks.KroneckerBlock`)."""

    def __init__(self, terms: list[GLMTerm]):
        self.terms = terms
        self.rows = terms[0].rows

    def prepare(self, inputs: Tensor | None, ids: bool, k: int) -> Any:
        return [t.prepare(inputs, ids, k) for t in self.terms]

    def diag(self, state: Any, D: Tensor) -> Tensor:
        return sum((t.diag(s, D) for t, s in zip(self.terms[1:], state[1:])), self.terms[0].diag(state[0], D))

    def full(self, state: Any, D: Tensor, C: int) -> Tensor:
        return sum((t.full(s, D, C) for t, s in zip(self.terms[1:], state[1:])), self.terms[0].full(state[0], D, C))

    def root(self, state: Any, diagonal: bool) -> Tensor | None:
        parts = [t.root(s, diagonal) for t, s in zip(self.terms, state)]
        total = parts[0]
        for p in parts[1:]:
            total = None if total is None or p is None else total + p
        return total


# ---------------------------------------------------------------------------------------------- spectral
@dataclass
class _SpectralState:
    path: str  # 'w' (R = 1), 'k' (kernel per output row) or 'm'
    w: Tensor  # (B, R, out): sum_i s_oi vt_ri^2
    kern: Tensor | None = None  # (B, out, R, R)
    vt: Tensor | None = None  # (B, R, in_aug)


class SpectralTerm(_PairTerm):
    """``Sigma = (QG (x) QA) diag(s) (QG (x) QA)^T``; ``QG``/``QA`` None for the identity, ``s`` (out, in_aug)."""

    def __init__(self, QG: Tensor | None, QA: Tensor | None, s: Tensor):
        self.QG, self.QA, self.s = QG, QA, s

    def prepare(self, inputs: Tensor | None, ids: bool, k: int) -> _SpectralState:
        assert inputs is not None
        s = self.s
        out = s.shape[0]
        if ids:  # one-hot rows (QA is the identity): s[o, id_r], zero for rows without a trainable input
            valid = inputs >= 0
            w = s[:, inputs.clamp_min(0)].permute(1, 2, 0) * valid[:, :, None]
            if inputs.shape[1] == 1:
                return _SpectralState("w", w)
            same = (inputs[:, :, None] == inputs[:, None, :]) & valid[:, :, None]
            return _SpectralState("k", w, kern=same[:, None] * w.transpose(1, 2)[:, :, :, None])
        vt = inputs.to(s.dtype) if self.QA is None else inputs.to(s.dtype) @ self.QA
        w = (vt * vt) @ s.T
        _, R, n_in = vt.shape
        if R == 1:
            return _SpectralState("w", w)
        if k * out * n_in < out * R * R + k * R * out:
            return _SpectralState("m", w, vt=vt)
        kern = ((vt[:, :, None, :] * vt[:, None, :, :]) @ s.T).permute(0, 3, 1, 2)  # (B, out, R, R)
        return _SpectralState("k", w, kern=kern)

    def _y(self, st: _SpectralState, D: Tensor) -> tuple[Tensor, Tensor]:
        D = D.to(self.s.dtype)
        Dt = D if self.QG is None else D @ self.QG
        if st.path == "w":
            return Dt, Dt * st.w[None]
        if st.path == "m":
            assert st.vt is not None
            M = torch.einsum("kbro,bri->kboi", Dt, st.vt)
            return M, M * self.s
        assert st.kern is not None
        return Dt, torch.einsum("bors,kbso->kbro", st.kern, Dt)

    def root(self, state: Any, diagonal: bool) -> Tensor:
        w = state.w  # (B, R, out = C)
        if self.QG is None:
            return w if diagonal else torch.diag_embed(w)
        if diagonal:
            return w @ (self.QG * self.QG).T
        return (self.QG * w[:, :, None, :]) @ self.QG.T


# ---------------------------------------------------------------------------------------------- gradient rows
class GradTerm(GLMTerm):
    """Jacobian rows J (k, B, P) against ``chol`` (the lower Cholesky factor of the precision), ``inverse``
    (the posterior variances of a diagonal posterior, (P,)), ``dense`` (the covariance, (P, P)) or
    ``operator`` (the covariance as an operator on the P entries, applied to the rows: a block with no
    closed-form rows of its own, e.g. a tied weight's sum of two Kronecker terms, never densified)."""

    rows = "grad"

    def __init__(self, chol: Tensor | None = None, inverse: Tensor | None = None, dense: Tensor | None = None,
                 operator: Any = None):
        if sum(t is not None for t in (chol, inverse, dense, operator)) != 1:
            raise ValueError("GradTerm takes exactly one of chol, inverse, dense, operator")
        self.chol, self.inverse, self.dense, self.operator = chol, inverse, dense, operator

    def _y(self, J: Tensor) -> tuple[Tensor, Tensor]:
        if self.inverse is not None:
            return J, J * self.inverse
        if self.dense is not None:
            return J, J @ self.dense
        if self.operator is not None:
            k, B, P = J.shape
            return J, self.operator._matmat(J.reshape(k * B, P).T).T.reshape(k, B, P)
        assert self.chol is not None
        k, B, P = J.shape
        U = torch.linalg.solve_triangular(self.chol, J.reshape(k * B, P).T, upper=False).T.reshape(k, B, P)
        return U, U

    def diag(self, state: Any, D: Tensor) -> Tensor:
        X, Y = self._y(D.to(self._dtype()))
        return (X * Y).sum(-1)

    def full(self, state: Any, D: Tensor, C: int) -> Tensor:
        X, Y = self._y(D.to(self._dtype()))
        return _pairs(X, Y, C)

    def _dtype(self) -> torch.dtype:
        if self.operator is not None:
            return self.operator.dtype  # type: ignore[no-any-return]
        t = next(t for t in (self.chol, self.inverse, self.dense) if t is not None)
        return t.dtype
