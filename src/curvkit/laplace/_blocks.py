"""The posterior blocks of a Laplace approximation: one parameter group each, with its own structure.

Each block holds per-datum MEAN curvature statistics and turns them, for a pseudo-data count N and prior
precisions lambda (one per layer, a tensor ``lam`` indexed by layer), into the block's precision,
covariance, log-determinant, samples and its share of the linearised (GLM) predictive variance
``J Sigma J^T``. Nothing is recomputed from data when N or lambda change.

* :class:`KroneckerBlock` - a Linear/Conv2d layer, ``W_hat = [W | b]`` (out, in_aug), precision
  ``(sqrt(N) G + sqrt(lam)/pi I) (x) (sqrt(N) A + pi sqrt(lam) I)`` (thesis Eq. 5.14 in PyTorch's
  output-first layout; ``pi = 1`` is the thesis's omega = 1, ``balance=True`` the trace-norm split of
  Eq. 4.27) or, with ``form='exact'``, ``N G (x) A + lam I`` through the factors' eigendecompositions.
* :class:`DiagonalBlock` - precision ``N diag(F) + lam`` (thesis Eq. 5.11 with its typo fixed).
* :class:`DenseBlock` - precision ``N F + diag(lam)`` (full Laplace of small nets; BatchNorm layers).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from curvkit.linalg.kron import KroneckerBlock as KFactors
from curvkit.linalg.kron import KroneckerOperator, psd_eigh
from curvkit.linalg.krylov import NotPositiveDefiniteError
from curvkit.linalg.layout import ParamLayout
from curvkit.linalg.operator import CurvatureOperator, DenseOperator, DiagonalOperator

__all__ = ["DenseBlock", "DiagonalBlock", "KroneckerBlock", "LayerJacobian", "PosteriorBlock"]


class LayerJacobian:
    """What the GLM variance of a Linear/Conv2d layer needs for a batch of B inputs, without forming the
    Jacobian: the layer's input rows ``a`` (B, T, in_aug) (bias column included when the block has a bias;
    T output locations, 1 for Linear) and the Jacobian of the C network outputs with respect to the layer's
    output ``delta`` (B, C, T, out). The per-sample Jacobian of output c with respect to ``W_hat`` is
    ``sum_t delta[c, t] a[t]^T``."""

    def __init__(self, a: Tensor, delta: Tensor):
        self.a, self.delta = a, delta

    def matrices(self) -> Tensor:
        """The explicit per-sample Jacobians (B, C, out, in_aug) (memory B C out in_aug)."""
        return torch.einsum("bcto,bti->bcoi", self.delta, self.a)


def _chol(M: Tensor, what: str) -> Tensor:
    L, info = torch.linalg.cholesky_ex(0.5 * (M + M.T))
    if int(info) != 0:
        raise NotPositiveDefiniteError(f"{what} is not positive definite; increase the prior precision or N")
    return L


class PosteriorBlock:
    """Base class (module docstring). ``layout`` is the block's own parameter layout; ``layers`` the
    indices (into the posterior's per-layer prior precisions) of the layer of each of its parameters."""

    layout: ParamLayout
    #: 'layer' (Linear/Conv2d: GLM variance from LayerJacobian) or 'generic' (per-sample Jacobian rows)
    jacobian: str = "generic"
    module: Any = None

    def __init__(self, layout: ParamLayout, layers: Sequence[int], dtype: torch.dtype, device: torch.device):
        if len(layers) != len(layout.names):
            raise ValueError("one layer index per parameter is needed")
        self.layout, self.layers = layout, list(layers)
        self.dtype, self.device = dtype, device
        self._cache: dict[str, Any] = {}

    @property
    def dim(self) -> int:
        return self.layout.dim

    def prior_vector(self, lam: Tensor) -> Tensor:
        """The prior precision of every parameter of the block, flat (d_b,)."""
        return torch.cat([lam[i].expand(n) for i, n in zip(self.layers, self.layout.numels)])

    def _cached(self, key: tuple[Any, ...], build: Any) -> Any:
        if self._cache.get("key") != key:
            self._cache = {"key": key, "value": build()}
        return self._cache["value"]

    # interface -------------------------------------------------------------------------------------
    def precision(self, N: float, lam: Tensor) -> CurvatureOperator:
        raise NotImplementedError

    def covariance(self, N: float, lam: Tensor) -> CurvatureOperator:
        raise NotImplementedError

    def logdet(self, N: Tensor, lam: Tensor) -> Tensor:
        """log det of the block's precision; differentiable in N and lam."""
        raise NotImplementedError

    def sample(self, N: float, lam: Tensor, num_samples: int, generator: torch.Generator | None) -> Tensor:
        """(S, d_b) zero-mean draws with the block's covariance, flat in the block's layout."""
        raise NotImplementedError

    def glm_variance(self, N: float, lam: Tensor, jac: Any) -> Tensor:
        """The block's share (B, C, C) of ``J Sigma J^T`` for a LayerJacobian or generic rows (B, C, d_b)."""
        raise NotImplementedError

    def state(self) -> dict[str, Tensor]:
        raise NotImplementedError


# ---------------------------------------------------------------------------------------------- Kronecker
class KroneckerBlock(PosteriorBlock):
    """A Linear/Conv2d layer with per-datum factors ``G`` (out, out) and ``A`` (in_aug, in_aug)."""

    jacobian = "layer"

    def __init__(self, layout: ParamLayout, layer: int, weight: str, bias: str | None, module: Any, G: Tensor,
                 A: Tensor, form: str = "factored", balance: bool = False):
        super().__init__(layout, [layer] * len(layout.names), G.dtype, G.device)
        if form not in ("factored", "exact"):
            raise ValueError(f"prior_form must be 'factored' (thesis Eq. 5.14) or 'exact', got {form!r}")
        self.weight, self.bias, self.module, self.form = weight, bias, module, form
        self.layer = layer
        shapes = dict(zip(layout.names, layout.shapes))
        self.wshape = tuple(shapes[weight])
        self.out, self.in_w = int(self.wshape[0]), int(math.prod(self.wshape[1:]))
        self.in_aug = self.in_w + (bias is not None)
        if G.shape != (self.out, self.out) or A.shape != (self.in_aug, self.in_aug):
            raise ValueError(f"factors of {weight!r}: G {tuple(G.shape)}, A {tuple(A.shape)}; expected "
                             f"({self.out}, {self.out}) and ({self.in_aug}, {self.in_aug})")
        self.G, self.A = G, A
        self.balance = bool(balance)
        self.pi = 1.0
        if self.balance:
            tG, tA = float(G.trace()) / self.out, float(A.trace()) / self.in_aug
            if tG > 0 and tA > 0:
                self.pi = math.sqrt(tA / tG)

    @functools.cached_property
    def _eigen(self) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``(lG, QG, lA, QA)``: the eigendecompositions of G and A (eigenvalues clamped at 0), computed on first
        use - the exact form and the factored form's log-determinant need them, the factored form's sampling
        and predictives do not. :func:`curvkit.linalg.kron.psd_eigh` retries in float64 where LAPACK fails on
        the repeated zero eigenvalues of a rank-deficient factor (MNIST's always-zero border pixels in A)."""
        lG, QG = psd_eigh(self.G)
        lA, QA = psd_eigh(self.A)
        return lG, QG, lA, QA

    @property
    def lG(self) -> Tensor:
        return self._eigen[0]

    @property
    def QG(self) -> Tensor:
        return self._eigen[1]

    @property
    def lA(self) -> Tensor:
        return self._eigen[2]

    @property
    def QA(self) -> Tensor:
        return self._eigen[3]

    def _eye(self, n: int) -> Tensor:
        return torch.eye(n, dtype=self.dtype, device=self.device)

    def factors(self, N: float, lam: Tensor) -> tuple[Tensor, Tensor]:
        """The damped factors ``(P_G, P_A)`` of Eq. 5.14 (form 'factored')."""
        sN, sl = math.sqrt(N), math.sqrt(float(lam[self.layer]))
        return (sN * self.G + (sl / self.pi) * self._eye(self.out),
                sN * self.A + (self.pi * sl) * self._eye(self.in_aug))

    def _cholesky(self, N: float, lam: Tensor) -> tuple[Tensor, Tensor]:
        def build() -> tuple[Tensor, Tensor]:
            PG, PA = self.factors(N, lam)
            return _chol(PG, f"the output factor of {self.weight!r}"), _chol(PA, f"the input factor of {self.weight!r}")

        return self._cached(("chol", N, float(lam[self.layer])), build)  # type: ignore[no-any-return]

    def _spectrum(self, N: float, lam: Tensor) -> Tensor:
        """(out, in_aug) eigenvalues ``N lG lA^T + lam`` of the exact form."""
        return N * torch.outer(self.lG, self.lA) + lam[self.layer]

    def precision(self, N: float, lam: Tensor) -> CurvatureOperator:
        if self.form == "factored":
            PG, PA = self.factors(N, lam)
            return KroneckerOperator(self.layout, [KFactors(PG, PA, self.weight, self.bias)])
        return KroneckerOperator(self.layout, [KFactors(N * self.G, self.A, self.weight, self.bias)],
                                 damping=float(lam[self.layer]))

    def covariance(self, N: float, lam: Tensor) -> CurvatureOperator:
        if self.form == "factored":
            LG, LA = self._cholesky(N, lam)
            iG, iA = torch.cholesky_inverse(LG), torch.cholesky_inverse(LA)
            return KroneckerOperator(self.layout, [KFactors(0.5 * (iG + iG.T), 0.5 * (iA + iA.T), self.weight,
                                                            self.bias)])
        return self.precision(N, lam).inverse()

    def logdet(self, N: Tensor, lam: Tensor) -> Tensor:
        l = lam[self.layer]
        if self.form == "factored":
            sN, sl = N.sqrt(), l.sqrt()
            return (self.in_aug * torch.log(sN * self.lG + sl / self.pi).sum()
                    + self.out * torch.log(sN * self.lA + self.pi * sl).sum())
        return torch.log(N * torch.outer(self.lG, self.lA) + l).sum()

    def _to_flat(self, X: Tensor) -> Tensor:
        """(S, out, in_aug) -> (S, d_b) in the block's layout order."""
        S = X.shape[0]
        parts = {self.weight: X[:, :, :self.in_w].reshape(S, -1)}
        if self.bias is not None:
            parts[self.bias] = X[:, :, self.in_w]
        return torch.cat([parts[n] for n in self.layout.names], dim=1)

    def sample(self, N: float, lam: Tensor, num_samples: int, generator: torch.Generator | None) -> Tensor:
        Z = torch.randn(num_samples, self.out, self.in_aug, dtype=self.dtype, device=self.device,
                        generator=generator)
        if self.form == "factored":
            # W = M + L_G^{-T} Z L_A^{-1}: two triangular solves, Cov(vec_row W) = P_G^{-1} (x) P_A^{-1}
            LG, LA = self._cholesky(N, lam)
            X = torch.linalg.solve_triangular(LG.T, Z, upper=True)
            X = torch.linalg.solve_triangular(LA, X, upper=False, left=False)
        else:
            X = self.QG @ (Z / self._spectrum(N, lam).sqrt()) @ self.QA.T
        return self._to_flat(X)

    def glm_variance(self, N: float, lam: Tensor, jac: LayerJacobian) -> Tensor:
        a, delta = jac.a, jac.delta  # (B, T, in_aug), (B, C, T, out)
        if self.form == "factored":
            LG, LA = self._cholesky(N, lam)
            u = torch.linalg.solve_triangular(LG, delta.unsqueeze(-1), upper=False).squeeze(-1)
            v = torch.linalg.solve_triangular(LA, a.unsqueeze(-1), upper=False).squeeze(-1)
            if a.shape[1] == 1:
                return torch.einsum("bci,bdi->bcd", u[:, :, 0], u[:, :, 0]) * (v[:, 0] ** 2).sum(-1)[:, None, None]
            M = torch.einsum("bcto,bti->bcoi", u, v)
            return torch.einsum("bcoi,bdoi->bcd", M, M)
        ut = delta @ self.QG  # (B, C, T, out) in G's eigenbasis
        vt = a @ self.QA  # (B, T, in_aug)
        inv = 1.0 / self._spectrum(N, lam)
        if a.shape[1] == 1:
            return torch.einsum("bci,bdi,ij,bj->bcd", ut[:, :, 0], ut[:, :, 0], inv, vt[:, 0] ** 2)
        M = torch.einsum("bcto,bti->bcoi", ut, vt)
        return torch.einsum("bcoi,bdoi,oi->bcd", M, M, inv)

    def state(self) -> dict[str, Tensor]:
        return {"G": self.G, "A": self.A}


# ---------------------------------------------------------------------------------------------- diagonal
class DiagonalBlock(PosteriorBlock):
    """Diagonal curvature ``f`` (flat, the block's layout) of one layer's parameters."""

    def __init__(self, layout: ParamLayout, layers: Sequence[int], f: Tensor, module: Any = None,
                 weight: str | None = None, bias: str | None = None):
        super().__init__(layout, layers, f.dtype, f.device)
        if f.shape != (layout.dim,):
            raise ValueError(f"diagonal of shape {tuple(f.shape)}, expected ({layout.dim},)")
        self.f = f.clamp_min(0)
        self.module, self.weight, self.bias = module, weight, bias
        if weight is not None:
            self.jacobian = "layer"
            shapes = dict(zip(layout.names, layout.shapes))
            self.wshape = tuple(shapes[weight])
            self.out, self.in_w = int(self.wshape[0]), int(math.prod(self.wshape[1:]))

    def _prec(self, N: float | Tensor, lam: Tensor) -> Tensor:
        return N * self.f + self.prior_vector(lam)

    def precision(self, N: float, lam: Tensor) -> CurvatureOperator:
        return DiagonalOperator.from_flat(self.layout, self._prec(N, lam))

    def covariance(self, N: float, lam: Tensor) -> CurvatureOperator:
        return self.precision(N, lam).inverse()

    def logdet(self, N: Tensor, lam: Tensor) -> Tensor:
        return torch.log(self._prec(N, lam)).sum()

    def sample(self, N: float, lam: Tensor, num_samples: int, generator: torch.Generator | None) -> Tensor:
        z = torch.randn(num_samples, self.dim, dtype=self.dtype, device=self.device, generator=generator)
        return z / self._prec(N, lam).sqrt()

    def _hat(self, flat: Tensor) -> Tensor:
        """Flat (d_b,) -> (out, in_aug) in the W_hat order."""
        parts = dict(zip(self.layout.names, self.layout.unflatten(flat)))
        W = parts[self.weight].reshape(self.out, self.in_w)  # type: ignore[index]
        return W if self.bias is None else torch.cat([W, parts[self.bias][:, None]], dim=1)

    def glm_variance(self, N: float, lam: Tensor, jac: Any) -> Tensor:
        inv = 1.0 / self._prec(N, lam)
        if isinstance(jac, LayerJacobian):
            ih = self._hat(inv)
            if jac.a.shape[1] == 1:
                d = jac.delta[:, :, 0]
                return torch.einsum("bci,bdi,ij,bj->bcd", d, d, ih, jac.a[:, 0] ** 2)
            M = jac.matrices()
            return torch.einsum("bcoi,bdoi,oi->bcd", M, M, ih)
        return torch.einsum("bck,bdk,k->bcd", jac, jac, inv)

    def state(self) -> dict[str, Tensor]:
        return {"f": self.f}


# ---------------------------------------------------------------------------------------------- dense
class DenseBlock(PosteriorBlock):
    """Dense curvature ``F`` (d_b, d_b) of a parameter group (flat, the block's layout)."""

    def __init__(self, layout: ParamLayout, layers: Sequence[int], F: Tensor):
        super().__init__(layout, layers, F.dtype, F.device)
        if F.shape != (layout.dim, layout.dim):
            raise ValueError(f"dense curvature of shape {tuple(F.shape)}, expected ({layout.dim}, {layout.dim})")
        self.F = 0.5 * (F + F.T)
        self.eig = torch.linalg.eigvalsh(self.F).clamp_min(0)
        self.single_prior = len(set(self.layers)) == 1

    def _matrix(self, N: float, lam: Tensor) -> Tensor:
        return N * self.F + torch.diag(self.prior_vector(lam))

    def _cholesky(self, N: float, lam: Tensor) -> Tensor:
        key = ("chol", N, tuple(float(lam[i]) for i in sorted(set(self.layers))))
        return self._cached(key, lambda: _chol(self._matrix(N, lam), "the dense posterior precision"))  # type: ignore[no-any-return]

    def precision(self, N: float, lam: Tensor) -> CurvatureOperator:
        return DenseOperator(self.layout, self._matrix(N, lam))

    def covariance(self, N: float, lam: Tensor) -> CurvatureOperator:
        C = torch.cholesky_inverse(self._cholesky(N, lam))
        return DenseOperator(self.layout, 0.5 * (C + C.T))

    def logdet(self, N: Tensor, lam: Tensor) -> Tensor:
        if self.single_prior:
            return torch.log(N * self.eig + lam[self.layers[0]]).sum()
        P = N * self.F + torch.diag(self.prior_vector(lam))
        return 2 * torch.linalg.cholesky(0.5 * (P + P.T)).diagonal().log().sum()

    def sample(self, N: float, lam: Tensor, num_samples: int, generator: torch.Generator | None) -> Tensor:
        z = torch.randn(self.dim, num_samples, dtype=self.dtype, device=self.device, generator=generator)
        return torch.linalg.solve_triangular(self._cholesky(N, lam).T, z, upper=True).T

    def glm_variance(self, N: float, lam: Tensor, jac: Tensor) -> Tensor:
        B, C, d = jac.shape
        U = torch.linalg.solve_triangular(self._cholesky(N, lam), jac.reshape(B * C, d).T, upper=False)
        U = U.reshape(d, B, C)
        return torch.einsum("kbc,kbd->bcd", U, U)

    def state(self) -> dict[str, Tensor]:
        return {"F": self.F}
