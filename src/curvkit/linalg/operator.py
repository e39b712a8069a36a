"""The one curvature type every part of curvkit speaks: a symmetric linear operator on parameters.

``CurvatureOperator`` is a (d, d) symmetric matrix over a model's parameters (layout in
:mod:`curvkit.linalg.layout`). Subclasses implement ``_matmat`` (a (d, k) -> (d, k) product) and may
override ``diagonal``/``to_dense``/``trace`` with cheaper exact formulas. Everything else (``@`` with a
flat vector, a (d, k) matrix or a parameter-shaped list; traces, eigenvalues, solves, scipy export) is
shared here, so an exact Hessian, a KFAC approximation, MESU's sigma-based estimate and a filter's
posterior precision can all be compared with the same code.

Representations:
* :class:`DenseOperator` - an explicit (d, d) matrix (references, tiny models).
* :class:`DiagonalOperator` - a diagonal, stored per parameter tensor.
* :class:`curvkit.linalg.kron.KroneckerOperator` - block-diagonal over layers, each block G (x) A.
* :class:`ScaledSumOperator` - ``a * P + b * Q`` (damping, sums of curvatures).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Literal, overload

import torch
from torch import Tensor

from curvkit.linalg.krylov import NotPositiveDefiniteError
from curvkit.linalg.layout import ParamLayout
from curvkit.validation import check_damping

TraceMethod = Literal["exact", "hutchinson", "hutch++"]


class CurvatureOperator:
    """A symmetric (d, d) linear operator over the parameters described by ``layout``.

    The interface every representation has (closed forms in the subclasses, a correct general default
    here):

    * ``op @ x`` / :meth:`matvec`: x a flat (d,) vector, a (d, k) matrix or a list of parameter-shaped
      tensors; the result has the same form.
    * :meth:`diagonal` (``method='exact'`` or ``'hutchinson'``), :meth:`trace` (``'exact'``,
      ``'hutchinson'``, ``'hutch++'``), :meth:`quadratic_form`, :meth:`eigenvalues`, :meth:`to_dense`.
    * :meth:`solve` ``(self + damping I)^{-1} b``, :meth:`inverse` ``(self + damping I)^{-1}`` as an
      operator, :meth:`logdet` ``log det(self + damping I)``: general defaults by conjugate gradients and
      dense or Lanczos-quadrature log-determinants; closed forms where the structure has them.
    * :meth:`block` the restriction to some parameters, ``P^T C P``, as an operator on their layout.
    * :meth:`add_identity`, ``+``, scalar ``*``, :meth:`to_scipy`.

    Every method checks the shapes of what it is given; ``solve``, ``inverse`` and ``logdet`` refuse a
    non-finite damping or right-hand side.
    """

    layout: ParamLayout
    dtype: torch.dtype
    device: torch.device

    #: dimension up to which the general ``logdet(method='exact')`` forms the dense matrix
    max_dense_dim: int = 8192

    def __init__(self, layout: ParamLayout, dtype: torch.dtype, device: torch.device | str = "cpu"):
        self.layout = layout
        self.dtype = dtype
        self.device = torch.device(device)

    # ------------------------------------------------------------------ core products
    def _matmat(self, M: Tensor) -> Tensor:
        """(d, k) -> (d, k). Subclasses implement this."""
        raise NotImplementedError

    @property
    def shape(self) -> tuple[int, int]:
        return (self.layout.dim, self.layout.dim)

    def _as_columns(self, x: Tensor, what: str) -> Tensor:
        """Validate a flat (d,) vector or a (d, k) matrix and return it as (d, k) in the operator's dtype."""
        if not isinstance(x, Tensor):
            raise TypeError(f"{what}: expected a tensor or a list of parameter-shaped tensors, got "
                            f"{type(x).__name__}")
        if x.dim() not in (1, 2) or x.shape[0] != self.layout.dim:
            raise ValueError(
                f"{what}: operator of shape {self.shape} cannot "
                f"{'multiply' if what == 'product' else 'take'} a tensor of shape {tuple(x.shape)}; "
                f"pass a flat vector of length {self.layout.dim}, a ({self.layout.dim}, k) matrix, "
                "or a list of parameter-shaped tensors"
            )
        M = x if x.dim() == 2 else x[:, None]
        return M.to(device=self.device, dtype=self.dtype)

    def _apply_to(self, x: Any, fn: Callable[[Tensor], Tensor], what: str) -> Any:
        """Apply a (d, k) -> (d, k) map to x in any accepted form, returning the same form."""
        if isinstance(x, (list, tuple)):
            flat = self.layout.flatten([t.to(self.dtype) for t in x])
            return self.layout.unflatten(self._apply_to(flat, fn, what))
        M = self._as_columns(x, what)
        out = fn(M)
        return out if x.dim() == 2 else out[:, 0]

    @overload
    def __matmul__(self, x: Tensor) -> Tensor: ...
    @overload
    def __matmul__(self, x: Sequence[Tensor]) -> list[Tensor]: ...
    def __matmul__(self, x: Any) -> Any:
        """Product with a flat (d,) vector, a (d, k) matrix, or a list of parameter-shaped tensors."""
        if not isinstance(x, (Tensor, list, tuple)):
            raise TypeError(f"cannot multiply a CurvatureOperator by {type(x).__name__}")
        return self._apply_to(x, self._matmat, "product")

    def matvec(self, v: Tensor) -> Tensor:
        return self @ v

    # ------------------------------------------------------------------ dense / diagonal
    def to_dense(self) -> Tensor:
        """The explicit (d, d) matrix (O(d^2) memory: only for small models)."""
        eye = torch.eye(self.layout.dim, dtype=self.dtype, device=self.device)
        return self._matmat(eye)

    def diagonal(self, method: Literal["exact", "hutchinson"] = "exact", num_probes: int = 100,
                 generator: torch.Generator | None = None) -> DiagonalOperator:
        """The diagonal as a :class:`DiagonalOperator`.

        ``exact`` (default): subclasses override with cheap exact formulas; the general route is d
        unit-vector products (chunks of 256). ``hutchinson``: the unbiased estimate
        (1/m) sum_i z_i * (C z_i) from ``num_probes`` Rademacher probes
        (:func:`curvkit.linalg.trace.hutchinson_diagonal`).
        """
        if method == "hutchinson":
            from curvkit.linalg.trace import hutchinson_diagonal

            return DiagonalOperator.from_flat(self.layout, hutchinson_diagonal(
                self._matmat, self.layout.dim, num_probes, self.dtype, self.device, generator=generator))
        if method != "exact":
            raise ValueError(f"unknown diagonal method {method!r}; use 'exact' or 'hutchinson'")
        return self._exact_diagonal()

    def _exact_diagonal(self) -> DiagonalOperator:
        d = self.layout.dim
        out = torch.empty(d, dtype=self.dtype, device=self.device)
        chunk = 256
        for s in range(0, d, chunk):
            e = torch.zeros(d, min(chunk, d - s), dtype=self.dtype, device=self.device)
            idx = torch.arange(e.shape[1], device=self.device)
            e[s + idx, idx] = 1
            out[s:s + e.shape[1]] = self._matmat(e)[s + idx, idx]
        return DiagonalOperator.from_flat(self.layout, out)

    def quadratic_form(self, M: Tensor) -> Tensor:
        """v^T A v for each column v of M (d, k) -> (k,) (a flat (d,) vector -> 0-d). Default (M * A M).sum(0);
        subclasses with a cheaper form override it (used by ``trace(method='hutchinson')``)."""
        if M.dim() == 1:
            return self.quadratic_form(M[:, None])[0]
        M = self._as_columns(M, "quadratic_form")
        return (M * self._matmat(M)).sum(0)

    # ------------------------------------------------------------------ spectral / trace
    def trace(
        self,
        method: TraceMethod = "exact",
        num_probes: int = 100,
        generator: torch.Generator | None = None,
        distribution: Literal["rademacher", "gaussian"] = "rademacher",
    ) -> Tensor:
        """Trace. ``exact`` sums the exact diagonal; ``hutchinson``/``hutch++`` use ``num_probes`` products."""
        from curvkit.linalg import trace as _trace

        if method == "exact":
            return self.diagonal().flat.sum()
        if method == "hutchinson":
            return _trace.hutchinson(self._matmat, self.layout.dim, num_probes, self.dtype, self.device,
                                     generator=generator, distribution=distribution,
                                     quadform=self.quadratic_form)
        if method == "hutch++":
            return _trace.hutchpp(self._matmat, self.layout.dim, num_probes, self.dtype, self.device,
                                  generator=generator, distribution=distribution)
        raise ValueError(f"unknown trace method {method!r}; use 'exact', 'hutchinson' or 'hutch++'")

    def eigenvalues(self, k: int = 1, which: Literal["largest", "smallest"] = "largest",
                    num_iter: int | None = None, generator: torch.Generator | None = None) -> Tensor:
        """Top-k (or bottom-k) eigenvalues by Lanczos with full reorthogonalisation, descending order."""
        from curvkit.linalg.krylov import lanczos_eigenvalues

        return lanczos_eigenvalues(self._matmat, self.layout.dim, k, self.dtype, self.device,
                                   which=which, num_iter=num_iter, generator=generator)

    # ------------------------------------------------------------------ inverse, solve, logdet
    def solve(self, b: Any, damping: float = 0.0, *, tol: float | None = None,
              max_iter: int | None = None) -> Any:
        """``(self + damping I)^{-1} b`` for b flat (d,), (d, k) or parameter-shaped (same form back).

        General route: conjugate gradients (``tol`` relative residual, default 1e-10 in float64 and 1e-5
        otherwise; ``max_iter`` default 2d); raises if the damped operator is not positive definite.
        Subclasses with a closed form ignore ``tol``/``max_iter``.
        """
        damping = check_damping(damping)
        return self._apply_to(b, lambda B: self._solve(_finite(B, "solve"), damping, tol, max_iter), "solve")

    def _solve(self, B: Tensor, damping: float, tol: float | None, max_iter: int | None) -> Tensor:
        from curvkit.linalg.krylov import _default_tol, conjugate_gradient

        op = self if damping == 0 else self.add_identity(damping)
        return conjugate_gradient(op._matmat, B, tol=_default_tol(self.dtype) if tol is None else tol,
                                  max_iter=max_iter)

    def inverse(self, damping: float = 0.0) -> CurvatureOperator:
        """``(self + damping I)^{-1}`` as an operator. General route: an :class:`InverseOperator` whose
        products are conjugate-gradient solves; subclasses return closed forms."""
        return InverseOperator(self, check_damping(damping))

    def logdet(self, damping: float = 0.0, *, method: Literal["exact", "slq"] = "exact", num_probes: int = 30,
               num_iter: int = 60, generator: torch.Generator | None = None) -> Tensor:
        """``log det(self + damping I)`` (raises if that is not positive definite).

        ``exact`` (default): closed forms in the subclasses; the general route forms the dense matrix
        (refused above ``max_dense_dim``, 8192). ``slq``: stochastic Lanczos quadrature with
        ``num_probes`` probes of ``num_iter`` Lanczos steps (an ESTIMATE, never taken silently;
        :func:`curvkit.linalg.trace.slq_logdet` gives its standard error).
        """
        damping = check_damping(damping)
        if method == "slq":
            from curvkit.linalg.trace import slq_logdet

            op = self if damping == 0 else self.add_identity(damping)
            return slq_logdet(op._matmat, self.layout.dim, num_probes, num_iter, self.dtype, self.device,
                              generator=generator)[0]
        if method != "exact":
            raise ValueError(f"unknown logdet method {method!r}; use 'exact' or 'slq'")
        return self._logdet(damping)

    def _logdet(self, damping: float) -> Tensor:
        d = self.layout.dim
        if d > self.max_dense_dim:
            raise ValueError(f"the exact log-determinant of this {type(self).__name__} forms a dense {d} x {d} "
                             f"matrix (d > {self.max_dense_dim}); pass method='slq' for a stochastic estimate")
        return _dense_logdet(self.to_dense(), damping, type(self).__name__)

    # ------------------------------------------------------------------ blocks
    def block(self, names: Sequence[str]) -> CurvatureOperator:
        """The restriction ``P^T C P`` to the parameters ``names`` (in layout order), as an operator on
        their own layout: the diagonal block of those parameters (e.g. one layer's weight and bias)."""
        return RestrictedOperator(self, _sub_names(self.layout, names))

    # ------------------------------------------------------------------ algebra
    def add_identity(self, damping: float) -> CurvatureOperator:
        """self + damping * I (stays in the same representation where the subclass allows)."""
        return ScaledSumOperator(self, 1.0, IdentityOperator(self.layout, self.dtype, self.device),
                                 check_damping(damping))

    def __add__(self, other: CurvatureOperator) -> CurvatureOperator:
        return ScaledSumOperator(self, 1.0, other, 1.0)

    def __mul__(self, scale: float) -> CurvatureOperator:
        return ScaledSumOperator(self, check_damping(scale, "scale"), None, 0.0)

    __rmul__ = __mul__

    def to_scipy(self) -> Any:
        """A ``scipy.sparse.linalg.LinearOperator`` (float64 numpy in and out)."""
        import numpy as np
        from scipy.sparse.linalg import LinearOperator

        def mv(x: Any) -> Any:
            t = torch.as_tensor(np.asarray(x), dtype=self.dtype, device=self.device)
            t = t.reshape(self.layout.dim, -1)
            return self._matmat(t).detach().cpu().numpy().astype(np.float64).reshape(np.shape(x))

        return LinearOperator(self.shape, matvec=mv, matmat=mv, rmatvec=mv, dtype=np.float64)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(d={self.layout.dim}, dtype={self.dtype})"


def _finite(M: Tensor, what: str) -> Tensor:
    if not bool(torch.isfinite(M).all()):
        raise ValueError(f"{what}: the right-hand side contains NaN or inf ({int((~torch.isfinite(M)).sum())} "
                         "entries)")
    return M


def _dense_logdet(A: Tensor, damping: float, what: str) -> Tensor:
    if damping != 0:
        A = A + damping * torch.eye(A.shape[0], dtype=A.dtype, device=A.device)
    L, info = torch.linalg.cholesky_ex(0.5 * (A + A.T))
    if int(info) != 0:
        raise NotPositiveDefiniteError(f"logdet: {what} plus damping {damping:g} is not positive definite; increase the damping")
    return 2 * L.diagonal().log().sum()


def _sub_names(layout: ParamLayout, names: Sequence[str]) -> list[str]:
    """``names`` validated against ``layout`` and put in layout order."""
    if isinstance(names, str):
        names = [names]
    wanted = list(names)
    unknown = [n for n in wanted if n not in layout.names]
    if unknown or not wanted:
        raise ValueError(f"block: unknown parameter name(s) {unknown or '[]'}; the operator's parameters are "
                         f"{', '.join(layout.names)}")
    if len(set(wanted)) != len(wanted):
        raise ValueError(f"block: repeated parameter names in {wanted}")
    return [n for n in layout.names if n in set(wanted)]


def sub_layout(layout: ParamLayout, names: Sequence[str]) -> ParamLayout:
    """The layout of the parameters ``names`` (in ``layout``'s order)."""
    shapes = dict(zip(layout.names, layout.shapes))
    names = _sub_names(layout, names)
    return ParamLayout(tuple(names), tuple(shapes[n] for n in names))


class DenseOperator(CurvatureOperator):
    """An explicit (d, d) symmetric matrix. Inverse, solve and logdet by Cholesky."""

    def __init__(self, layout: ParamLayout, matrix: Tensor):
        if not isinstance(matrix, Tensor) or matrix.shape != (layout.dim, layout.dim):
            shape = tuple(matrix.shape) if isinstance(matrix, Tensor) else type(matrix).__name__
            raise ValueError(f"matrix shape {shape} does not match d={layout.dim}")
        super().__init__(layout, matrix.dtype, matrix.device)
        self.matrix = matrix

    def _matmat(self, M: Tensor) -> Tensor:
        return self.matrix @ M

    def to_dense(self) -> Tensor:
        return self.matrix

    def _exact_diagonal(self) -> DiagonalOperator:
        return DiagonalOperator.from_flat(self.layout, self.matrix.diagonal().clone())

    def _cholesky(self, damping: float) -> Tensor:
        A = self.matrix + damping * torch.eye(self.layout.dim, dtype=self.dtype, device=self.device)
        L, info = torch.linalg.cholesky_ex(0.5 * (A + A.T))
        if int(info) != 0:
            raise NotPositiveDefiniteError(f"DenseOperator plus damping {damping:g} is not positive definite; increase the "
                             "damping")
        return L

    def _solve(self, B: Tensor, damping: float, tol: float | None, max_iter: int | None) -> Tensor:
        return torch.cholesky_solve(B, self._cholesky(damping))

    def inverse(self, damping: float = 0.0) -> DenseOperator:
        """``(A + damping I)^{-1}`` by Cholesky (raises if not positive definite)."""
        L = self._cholesky(check_damping(damping))
        inv = torch.cholesky_inverse(L)
        return DenseOperator(self.layout, 0.5 * (inv + inv.T))

    def _logdet(self, damping: float) -> Tensor:
        return 2 * self._cholesky(damping).diagonal().log().sum()

    def block(self, names: Sequence[str]) -> DenseOperator:
        sub = sub_layout(self.layout, names)
        idx = _indices(self.layout, sub.names, self.device)
        return DenseOperator(sub, self.matrix[idx[:, None], idx[None, :]])

    def add_identity(self, damping: float) -> DenseOperator:
        damping = check_damping(damping)
        return DenseOperator(self.layout, self.matrix + damping * torch.eye(self.layout.dim, dtype=self.dtype,
                                                                             device=self.device))


def _indices(layout: ParamLayout, names: Sequence[str], device: torch.device) -> Tensor:
    """Flat indices of the parameters ``names`` (in the given order)."""
    sl = layout.slices()
    return torch.cat([torch.arange(sl[n].start, sl[n].stop, device=device) for n in names])


class DiagonalOperator(CurvatureOperator):
    """A diagonal curvature, stored as one tensor per parameter (same shapes as the parameters)."""

    def __init__(self, layout: ParamLayout, tensors: Sequence[Tensor]):
        tensors = list(tensors)
        if not tensors:
            raise ValueError("DiagonalOperator needs at least one tensor")
        if len(tensors) != len(layout.names):
            raise ValueError(f"DiagonalOperator needs one tensor per parameter ({len(layout.names)}), got "
                             f"{len(tensors)}")
        for name, shape, t in zip(layout.names, layout.shapes, tensors):
            if t.shape != shape:
                raise ValueError(f"diagonal for {name!r} has shape {tuple(t.shape)}, expected {tuple(shape)}")
        super().__init__(layout, tensors[0].dtype, tensors[0].device)
        self.tensors = tensors

    @classmethod
    def from_flat(cls, layout: ParamLayout, flat: Tensor) -> DiagonalOperator:
        return cls(layout, layout.unflatten(flat))

    @property
    def flat(self) -> Tensor:
        return self.layout.flatten(self.tensors)

    def _matmat(self, M: Tensor) -> Tensor:
        return self.flat[:, None] * M

    def to_dense(self) -> Tensor:
        return torch.diag(self.flat)

    def _exact_diagonal(self) -> DiagonalOperator:
        return self

    def trace(
        self,
        method: TraceMethod = "exact",
        num_probes: int = 100,
        generator: torch.Generator | None = None,
        distribution: Literal["rademacher", "gaussian"] = "rademacher",
    ) -> Tensor:
        """Exact trace for ``method='exact'``; the stochastic estimators otherwise (e.g. to study them)."""
        if method == "exact":
            return self.flat.sum()
        return super().trace(method, num_probes, generator, distribution)

    def add_identity(self, damping: float) -> DiagonalOperator:
        damping = check_damping(damping)
        return DiagonalOperator(self.layout, [t + damping for t in self.tensors])

    def _damped(self, damping: float, what: str) -> Tensor:
        flat = self.flat + damping
        if not bool((flat > 0).all()):
            raise NotPositiveDefiniteError(f"{what}: the diagonal plus damping {damping:g} has non-positive entries (smallest "
                             f"{float(flat.min()):.3g}); increase the damping")
        return flat

    def inverse(self, damping: float = 0.0) -> DiagonalOperator:
        """(D + damping I)^{-1}; raises if an entry is not positive after damping."""
        return DiagonalOperator.from_flat(self.layout, 1.0 / self._damped(check_damping(damping), "inverse"))

    def _solve(self, B: Tensor, damping: float, tol: float | None, max_iter: int | None) -> Tensor:
        return B / self._damped(damping, "solve")[:, None]

    def _logdet(self, damping: float) -> Tensor:
        return torch.log(self._damped(damping, "logdet")).sum()

    def eigenvalues(self, k: int = 1, which: Literal["largest", "smallest"] = "largest",
                    num_iter: int | None = None, generator: torch.Generator | None = None) -> Tensor:
        vals = torch.sort(self.flat, descending=True).values
        return vals[:k] if which == "largest" else vals[-k:]

    def block(self, names: Sequence[str]) -> DiagonalOperator:
        sub = sub_layout(self.layout, names)
        by_name = dict(zip(self.layout.names, self.tensors))
        return DiagonalOperator(sub, [by_name[n] for n in sub.names])


class IdentityOperator(CurvatureOperator):
    def _matmat(self, M: Tensor) -> Tensor:
        return M

    def _exact_diagonal(self) -> DiagonalOperator:
        return DiagonalOperator.from_flat(self.layout, torch.ones(self.layout.dim, dtype=self.dtype,
                                                                   device=self.device))


class ScaledSumOperator(CurvatureOperator):
    """a * P + b * Q (Q may be None)."""

    def __init__(self, P: CurvatureOperator, a: float, Q: CurvatureOperator | None, b: float):
        if Q is not None and Q.layout.dim != P.layout.dim:
            raise ValueError(f"cannot add operators of sizes {P.layout.dim} and {Q.layout.dim}")
        super().__init__(P.layout, P.dtype, P.device)
        self.P, self.a, self.Q, self.b = P, a, Q, b

    def _matmat(self, M: Tensor) -> Tensor:
        out = self.a * self.P._matmat(M)
        return out if self.Q is None else out + self.b * self.Q._matmat(M)

    def _exact_diagonal(self) -> DiagonalOperator:
        flat = self.a * self.P.diagonal().flat
        if self.Q is not None:
            flat = flat + self.b * self.Q.diagonal().flat
        return DiagonalOperator.from_flat(self.layout, flat)


class FunctionOperator(CurvatureOperator):
    """Wrap a (d, k) -> (d, k) function as a curvature operator."""

    def __init__(self, layout: ParamLayout, matmat: Callable[[Tensor], Tensor], dtype: torch.dtype,
                 device: torch.device | str = "cpu"):
        super().__init__(layout, dtype, device)
        self._fn = matmat

    def _matmat(self, M: Tensor) -> Tensor:
        return self._fn(M)


class InverseOperator(CurvatureOperator):
    """``(C + damping I)^{-1}`` of any operator C, products by conjugate gradients (the general
    :meth:`CurvatureOperator.inverse`).

    Each product is a CG solve to relative residual ``tol`` (default 1e-10 in float64, 1e-5 otherwise);
    raises if ``C + damping I`` is not positive definite. ``logdet()`` is ``-C.logdet(damping)`` and
    ``inverse()`` gives back ``C + damping I``.
    """

    def __init__(self, op: CurvatureOperator, damping: float = 0.0, tol: float | None = None,
                 max_iter: int | None = None):
        super().__init__(op.layout, op.dtype, op.device)
        self.op = op
        self.damping = check_damping(damping)
        self.tol, self.max_iter = tol, max_iter

    def _matmat(self, M: Tensor) -> Tensor:
        return self.op._solve(_finite(M, "inverse product"), self.damping, self.tol, self.max_iter)

    def _logdet(self, damping: float) -> Tensor:
        if damping == 0:
            return -self.op.logdet(self.damping)
        return super()._logdet(damping)

    def inverse(self, damping: float = 0.0) -> CurvatureOperator:
        if check_damping(damping) == 0:
            return self.op.add_identity(self.damping) if self.damping != 0 else self.op
        return super().inverse(damping)


class RestrictedOperator(CurvatureOperator):
    """``P^T C P``: the diagonal block of C for a subset of its parameters (the general
    :meth:`CurvatureOperator.block`). Products pad with zeros, multiply and read back the rows."""

    def __init__(self, op: CurvatureOperator, names: Sequence[str]):
        sub = sub_layout(op.layout, names)
        super().__init__(sub, op.dtype, op.device)
        self.op = op
        self.index = _indices(op.layout, sub.names, op.device)

    #: columns padded to full size at a time (bounds memory to about d * chunk entries)
    chunk: int = 64

    def _matmat(self, M: Tensor) -> Tensor:
        out = []
        for s in range(0, M.shape[1], self.chunk):
            part = M[:, s:s + self.chunk]
            full = part.new_zeros(self.op.layout.dim, part.shape[1])
            full[self.index] = part
            out.append(self.op._matmat(full)[self.index])
        return out[0] if len(out) == 1 else torch.cat(out, dim=1)

    def _exact_diagonal(self) -> DiagonalOperator:
        return self.op.diagonal().block(self.layout.names)
