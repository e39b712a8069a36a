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

from curvkit.linalg.layout import ParamLayout

TraceMethod = Literal["exact", "hutchinson", "hutch++"]


class CurvatureOperator:
    """A symmetric (d, d) linear operator over the parameters described by ``layout``."""

    layout: ParamLayout
    dtype: torch.dtype
    device: torch.device

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

    @overload
    def __matmul__(self, x: Tensor) -> Tensor: ...
    @overload
    def __matmul__(self, x: Sequence[Tensor]) -> list[Tensor]: ...
    def __matmul__(self, x: Any) -> Any:
        """Product with a flat (d,) vector, a (d, k) matrix, or a list of parameter-shaped tensors."""
        if isinstance(x, Tensor):
            if x.dim() not in (1, 2) or x.shape[0] != self.layout.dim:
                raise ValueError(
                    f"operator of shape {self.shape} cannot multiply a tensor of shape {tuple(x.shape)}; "
                    f"pass a flat vector of length {self.layout.dim}, a ({self.layout.dim}, k) matrix, "
                    "or a list of parameter-shaped tensors"
                )
            M = x if x.dim() == 2 else x[:, None]
            out = self._matmat(M.to(self.dtype))
            return out if x.dim() == 2 else out[:, 0]
        if isinstance(x, (list, tuple)):
            flat = self.layout.flatten([t.to(self.dtype) for t in x])
            return self.layout.unflatten(self @ flat)
        raise TypeError(f"cannot multiply a CurvatureOperator by {type(x).__name__}")

    def matvec(self, v: Tensor) -> Tensor:
        return self @ v

    # ------------------------------------------------------------------ dense / diagonal
    def to_dense(self) -> Tensor:
        """The explicit (d, d) matrix (O(d^2) memory: only for small models)."""
        eye = torch.eye(self.layout.dim, dtype=self.dtype, device=self.device)
        return self._matmat(eye)

    def diagonal(self) -> DiagonalOperator:
        """The exact diagonal. Default: d unit-vector products (subclasses override)."""
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
        return (M * self._matmat(M.to(self.dtype))).sum(0)

    # ------------------------------------------------------------------ spectral / trace / solve
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

    def solve(self, b: Any, damping: float = 0.0, tol: float = 1e-10, max_iter: int | None = None) -> Any:
        """Solve (self + damping I) x = b by conjugate gradients; b flat, (d, k) or parameter-shaped."""
        from curvkit.linalg.krylov import conjugate_gradient

        if isinstance(b, (list, tuple)):
            return self.layout.unflatten(self.solve(self.layout.flatten(b), damping, tol, max_iter))
        op = self if damping == 0 else self.add_identity(damping)
        return conjugate_gradient(op._matmat, b.to(self.dtype), tol=tol, max_iter=max_iter)

    # ------------------------------------------------------------------ algebra
    def add_identity(self, damping: float) -> CurvatureOperator:
        """self + damping * I (stays in the same representation where the subclass allows)."""
        return ScaledSumOperator(self, 1.0, IdentityOperator(self.layout, self.dtype, self.device), damping)

    def __add__(self, other: CurvatureOperator) -> CurvatureOperator:
        return ScaledSumOperator(self, 1.0, other, 1.0)

    def __mul__(self, scale: float) -> CurvatureOperator:
        return ScaledSumOperator(self, float(scale), None, 0.0)

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


class DenseOperator(CurvatureOperator):
    """An explicit (d, d) symmetric matrix."""

    def __init__(self, layout: ParamLayout, matrix: Tensor):
        if matrix.shape != (layout.dim, layout.dim):
            raise ValueError(f"matrix shape {tuple(matrix.shape)} does not match d={layout.dim}")
        super().__init__(layout, matrix.dtype, matrix.device)
        self.matrix = matrix

    def _matmat(self, M: Tensor) -> Tensor:
        return self.matrix @ M

    def to_dense(self) -> Tensor:
        return self.matrix

    def diagonal(self) -> DiagonalOperator:
        return DiagonalOperator.from_flat(self.layout, self.matrix.diagonal().clone())


class DiagonalOperator(CurvatureOperator):
    """A diagonal curvature, stored as one tensor per parameter (same shapes as the parameters)."""

    def __init__(self, layout: ParamLayout, tensors: Sequence[Tensor]):
        tensors = list(tensors)
        if not tensors:
            raise ValueError("DiagonalOperator needs at least one tensor")
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

    def diagonal(self) -> DiagonalOperator:
        return self

    def trace(
        self,
        method: TraceMethod = "exact",
        num_probes: int = 100,
        generator: torch.Generator | None = None,
        distribution: Literal["rademacher", "gaussian"] = "rademacher",
    ) -> Tensor:
        """Exact trace (the method arguments are accepted for interface compatibility)."""
        return self.flat.sum()

    def add_identity(self, damping: float) -> DiagonalOperator:
        return DiagonalOperator(self.layout, [t + damping for t in self.tensors])

    def inverse(self, damping: float = 0.0) -> DiagonalOperator:
        """(D + damping I)^{-1}; raises if an entry is not positive after damping."""
        flat = self.flat + damping
        if not bool((flat > 0).all()):
            raise ValueError("cannot invert a diagonal with non-positive entries; add damping")
        return DiagonalOperator.from_flat(self.layout, 1.0 / flat)

    def solve(self, b: Any, damping: float = 0.0, tol: float = 0.0, max_iter: int | None = None) -> Any:
        return self.inverse(damping) @ b

    def logdet(self, damping: float = 0.0) -> Tensor:
        return torch.log(self.flat + damping).sum()

    def eigenvalues(self, k: int = 1, which: Literal["largest", "smallest"] = "largest",
                    num_iter: int | None = None, generator: torch.Generator | None = None) -> Tensor:
        vals = torch.sort(self.flat, descending=True).values
        return vals[:k] if which == "largest" else vals[-k:]


class IdentityOperator(CurvatureOperator):
    def _matmat(self, M: Tensor) -> Tensor:
        return M

    def diagonal(self) -> DiagonalOperator:
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

    def diagonal(self) -> DiagonalOperator:
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
