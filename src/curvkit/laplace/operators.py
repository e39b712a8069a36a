"""The direct sum of curvature operators on disjoint parameter groups: how a Laplace posterior hands out
its precision and covariance as one :class:`~curvkit.linalg.operator.CurvatureOperator`.

A Laplace posterior is block-diagonal over parameter groups (a Kronecker block per Linear/Conv2d layer,
a diagonal or dense block per normalisation layer, one dense block for the ``full`` structure), each block
with its own representation. :class:`BlockSumOperator` puts them side by side: products, diagonal, trace,
solves, inverses and log-determinants are computed block by block with each block's closed form.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor

from curvkit.linalg.layout import ParamLayout
from curvkit.linalg.operator import CurvatureOperator, DiagonalOperator, TraceMethod, _indices, sub_layout
from curvkit.validation import check_damping

__all__ = ["BlockSumOperator"]


class BlockSumOperator(CurvatureOperator):
    """``blockdiag(C_1, ..., C_k)`` over ``layout``: each part acts on its own subset of the parameters.

    Args:
        layout: the parameters the operator acts on.
        parts: operators whose layouts are sub-layouts of ``layout`` (same names and shapes), disjoint
            and together covering every parameter of ``layout``.
    """

    def __init__(self, layout: ParamLayout, parts: Sequence[CurvatureOperator]):
        parts = list(parts)
        if not parts:
            raise ValueError("BlockSumOperator needs at least one part")
        dtype, device = parts[0].dtype, parts[0].device
        super().__init__(layout, dtype, device)
        shapes = dict(zip(layout.names, layout.shapes))
        seen: dict[str, int] = {}
        for i, p in enumerate(parts):
            if p.dtype != dtype or p.device != device:
                raise ValueError(f"part {i} has dtype/device {p.dtype}/{p.device}, expected {dtype}/{device}")
            for n, s in zip(p.layout.names, p.layout.shapes):
                if n not in shapes:
                    raise ValueError(f"part {i} acts on {n!r}, which is not in the layout ({', '.join(layout.names)})")
                if tuple(shapes[n]) != tuple(s):
                    raise ValueError(f"part {i}: parameter {n!r} has shape {tuple(s)}, the layout says "
                                     f"{tuple(shapes[n])}")
                if n in seen:
                    raise ValueError(f"parameter {n!r} belongs to parts {seen[n]} and {i}; parts must be disjoint")
                seen[n] = i
        missing = [n for n in layout.names if n not in seen]
        if missing:
            raise ValueError(f"no part covers parameter(s) {', '.join(missing)}")
        self.parts = parts
        self._index = [_indices(layout, p.layout.names, self.device) for p in parts]

    def _matmat(self, M: Tensor) -> Tensor:
        M = M.to(self.dtype)
        out = torch.empty_like(M)
        for p, idx in zip(self.parts, self._index):
            out[idx] = p._matmat(M[idx])
        return out

    def to_dense(self) -> Tensor:
        d = self.layout.dim
        D = torch.zeros(d, d, dtype=self.dtype, device=self.device)
        for p, idx in zip(self.parts, self._index):
            D[idx[:, None], idx[None, :]] = p.to_dense()
        return D

    def _exact_diagonal(self) -> DiagonalOperator:
        flat = torch.empty(self.layout.dim, dtype=self.dtype, device=self.device)
        for p, idx in zip(self.parts, self._index):
            flat[idx] = p.diagonal().flat
        return DiagonalOperator.from_flat(self.layout, flat)

    def trace(self, method: TraceMethod = "exact", num_probes: int = 100,
              generator: torch.Generator | None = None,
              distribution: Literal["rademacher", "gaussian"] = "rademacher") -> Tensor:
        if method != "exact":
            return super().trace(method, num_probes, generator, distribution)
        return sum((p.trace() for p in self.parts), torch.zeros((), dtype=self.dtype, device=self.device))

    def _solve(self, B: Tensor, damping: float, tol: float | None, max_iter: int | None) -> Tensor:
        out = torch.empty_like(B)
        for p, idx in zip(self.parts, self._index):
            out[idx] = p._solve(B[idx], damping, tol, max_iter)
        return out

    def inverse(self, damping: float = 0.0) -> BlockSumOperator:
        """Block by block ``(C_i + damping I)^{-1}`` (each part's own closed form)."""
        damping = check_damping(damping)
        return BlockSumOperator(self.layout, [p.inverse(damping) for p in self.parts])

    def _logdet(self, damping: float) -> Tensor:
        return sum((p.logdet(damping) for p in self.parts), torch.zeros((), dtype=self.dtype, device=self.device))

    def add_identity(self, damping: float) -> BlockSumOperator:
        damping = check_damping(damping)
        return BlockSumOperator(self.layout, [p.add_identity(damping) for p in self.parts])

    def eigenvalues(self, k: int = 1, which: Literal["largest", "smallest"] = "largest",
                    num_iter: int | None = None, generator: torch.Generator | None = None) -> Tensor:
        vals = torch.cat([p.eigenvalues(min(k, p.layout.dim), which, num_iter, generator) for p in self.parts])
        vals = torch.sort(vals, descending=True).values
        return vals[:k] if which == "largest" else vals[-k:]

    def block(self, names: Sequence[str]) -> CurvatureOperator:
        """The restriction to ``names``: a BlockSumOperator of whole parts when ``names`` is a union of parts
        (each part's own ``block`` for names inside one part), else the general restriction."""
        sub = sub_layout(self.layout, names)
        wanted = set(sub.names)
        keep = []
        for p in self.parts:
            inside = wanted.intersection(p.layout.names)
            if not inside:
                continue
            keep.append(p if len(inside) == len(p.layout.names) else p.block([n for n in p.layout.names
                                                                             if n in inside]))
        return keep[0] if len(keep) == 1 and keep[0].layout.names == sub.names else BlockSumOperator(sub, keep)

    def __repr__(self) -> str:
        return f"BlockSumOperator(d={self.layout.dim}, parts=[{', '.join(type(p).__name__ for p in self.parts)}])"
