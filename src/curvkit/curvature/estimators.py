"""Curvature estimators: statistics gathered batch by batch, handed out as operators.

The split follows kfac-jax: an **estimator** owns the statistics of one curvature structure and how they
are updated; optimisers, Laplace posteriors and reports **consume** it through :meth:`operator`, which
returns a :class:`~curvkit.linalg.operator.CurvatureOperator`. A new estimator (say an eigenbasis-
corrected Kronecker one) is one new class here that implements :class:`CurvatureEstimator`.

* :class:`KroneckerEstimator` - per layer ``G_l (x) A_l`` (thesis Eqs. 4.2-4.3, PyTorch row-major layout,
  output factor first) with the output factor from ``method``:

  - ``kflr``: the R columns of ``S`` with ``S S^T = H_L`` back-propagated (exact low rank, Sec. 4.3.1);
  - ``kfac``: ``mc_samples`` labels sampled from the model, their NLL gradients back-propagated (Monte
    Carlo Fisher, Sec. 4.3.3; unbiased for KFLR's G);
  - ``projection``: ``mc_samples`` random projections ``S v`` with ``E[v v^T] = I`` (Rademacher or
    Gaussian ``v``, Sec. 4.3.4, Eqs. 4.10-4.11);
  - ``kfra``: the batch-mean recursion ``G_l = (W_{l+1}^T G_{l+1} W_{l+1}) o (Phi_l^T Phi_l / B)``,
    ``Phi_l = phi'(h_l)`` (Sec. 4.3.2, Eq. 4.7, Algorithm 1 erratum fixed), MLP chains only; the recursion
    runs through frozen Linear layers of the chain (their h_l recomputed from the layer before), which get
    no block;
  - ``empirical``: gradients at the DATA labels (empirical Fisher; for comparison, not a GGN estimator).

  Conv2d layers (all methods but ``kfra``) use the KFC "expand" convention: ``A`` sums over the T output
  locations, ``G`` averages over them.
* :class:`DiagonalEstimator` - the diagonal of the GGN (exact, ``ggn``), of the type-2 Fisher with
  sampled labels (``mc_fisher``) or of the empirical Fisher (``empirical``).

Accumulation. Without ``ema`` the statistics are sums over every datum seen, so :meth:`operator` is the
curvature of the whole data set (batches weighted by their size; correct for unequal batches). With
``ema = rho`` each update replaces the statistics by ``rho * old + (1 - rho) * batch mean`` (the first
update initialises them), the curvature "momentum" of thesis Sec. 4.5.

Scale. :meth:`operator` has the scale of ``likelihood``'s loss over the data it describes: per-sample
mean for ``reduction='mean'``; times N (all data seen, or the last batch's size with ``ema``) for
``'sum'``. So ``kflr`` on one datum equals that datum's exact diagonal GGN block (Lemmas 3.21/3.22).

Per-step use inside an optimiser shares the forward pass::

    with est.capture() as cap:
        f = model(X)
    est.accumulate(cap, f, y)      # back-propagates the estimator's vectors (retain_graph)
    loss = lik(f, y); loss.backward()
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any, Literal, Self

import torch
from torch import Tensor, nn

from curvkit.curvature.capture import LayerCapture, output_rows, with_bias_column
from curvkit.curvature.recursion import activation_derivatives
from curvkit.likelihoods import BernoulliBCE, Gaussian, Likelihood
from curvkit.linalg.kron import KroneckerBlock, KroneckerOperator
from curvkit.linalg.layout import ParamLayout
from curvkit.linalg.operator import CurvatureOperator, DiagonalOperator
from curvkit.structure import UnsupportedModelError, read_model
from curvkit.validation import integer, iter_batches, unit_interval

__all__ = ["CurvatureEstimator", "DiagonalEstimator", "KroneckerEstimator"]

Data = tuple[Tensor, Tensor] | Iterable[tuple[Tensor, Tensor]]
KroneckerMethod = Literal["kfac", "kflr", "kfra", "projection", "empirical"]
DiagonalMethod = Literal["ggn", "mc_fisher", "empirical"]


def _output_hessian_sqrt(lik: Likelihood, f: Tensor, y: Tensor | None) -> Tensor:
    """S (B, C, R) with S S^T = H_L per sample; a head whose H_L depends on the label (attribute
    ``hessian_needs_target``, e.g. the Bernoulli mixture of thesis Eq. 4.28) is evaluated at the labels y."""
    if getattr(lik, "hessian_needs_target", False):
        return lik.output_hessian_sqrt(f, y)  # type: ignore[call-arg]
    return lik.output_hessian_sqrt(f)


def _mean_output_hessian(lik: Likelihood, f: Tensor, y: Tensor | None) -> Tensor:
    """(C, C) batch mean of H_L (KFRA's G_L, Eq. 4.7) without a (B, C, C) tensor for the diagonal heads
    (BCE and Gaussian: an autoencoder's C = 784 would need B * 784^2 entries) and in chunks otherwise."""
    if getattr(lik, "hessian_needs_target", False):
        return lik.output_hessian(f, y).mean(0)  # type: ignore[call-arg]
    if isinstance(lik, (BernoulliBCE, Gaussian)):
        return torch.diag(lik.output_hessian_diagonal(f).mean(0))
    B, C = f.shape
    n = max(1, 2**22 // (C * C))
    total = sum(lik.output_hessian(f[i:i + n]).sum(0) for i in range(0, B, n))
    return total / B  # type: ignore[return-value]


def _check_likelihood(likelihood: Any) -> Likelihood:
    if not isinstance(likelihood, Likelihood):
        raise TypeError(f"likelihood must be a curvkit.likelihoods.Likelihood, got {type(likelihood).__name__}")
    return likelihood


class CurvatureEstimator:
    """Base class: statistics updated batch by batch (optionally as a moving average), an operator out.

    Subclasses implement ``_batch_statistics(data) -> (list of statistic tensors summed over the batch,
    batch size)`` and ``_operator(stats, scale) -> CurvatureOperator`` from per-sample MEAN statistics.

    Data-parallel (``distributed=`` a :class:`curvkit.distributed.Reducer`): every update's statistics
    (sums over the rank's batch) and its batch size are all-reduced in one message before they are
    combined (:meth:`_reduce`), so the estimator holds the statistics of the union of the ranks' batches:
    sums of sums, and with ``ema`` the batch mean sum_r S_r / sum_r B_r, which weights unequal shards by
    their size. The finiteness check runs on the reduced statistics, so a NaN on one rank makes every
    rank raise the same error. Every rank must call ``update``/``accumulate`` equally often.
    """

    def __init__(self, model: nn.Module, likelihood: Likelihood, ema: float | None = None, distributed: Any = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
        self.distributed = distributed
        self.model = model
        self.likelihood = _check_likelihood(likelihood)
        self.ema = None if ema is None else unit_interval("ema", ema, closed_left=True)
        self.layout = ParamLayout.from_module(model)
        self.reset()

    def reset(self) -> None:
        """Forget every statistic."""
        self._stats: list[Tensor] | None = None
        self.num_data = 0  # data points behind the statistics (the last batch's size with ema)
        self.num_updates = 0

    def update(self, data: Data) -> Self:
        """Add the statistics of ``data`` (an ``(X, y)`` pair or an iterable of pairs); returns self."""
        for X, y in iter_batches(data):
            stats, B = self._batch_statistics(X, y)
            self._combine(stats, B)
        return self

    def _combine(self, stats: list[Tensor], B: int) -> None:
        if self.distributed is not None:
            stats, B = self._reduce(stats, B)
        for t, name in zip(stats, self._stat_names()):
            if not bool(torch.isfinite(t.sum())):
                raise ValueError(f"{type(self).__name__}: the statistic {name} of this batch contains NaN or inf; "
                                 "check the inputs and the model's parameters")
        if self.ema is None:
            self._stats = stats if self._stats is None else [a + b for a, b in zip(self._stats, stats)]
            self.num_data += B
        else:
            means = [t / B for t in stats]
            rho = self.ema
            self._stats = means if self._stats is None else [rho * a + (1 - rho) * b
                                                             for a, b in zip(self._stats, means)]
            self.num_data = B
        self.num_updates += 1

    def _stat_names(self) -> list[str]:
        return [f"#{i}" for i in range(len(self._stats or []))]

    def _symmetric(self, stats: list[Tensor]) -> list[bool]:
        """Which statistics are symmetric matrices (sent as upper triangles by :meth:`_reduce`)."""
        return [False] * len(stats)

    def _reduce(self, stats: list[Tensor], B: int) -> tuple[list[Tensor], int]:
        """(sum over the ranks of ``stats``, sum of the batch sizes): one all-reduce (class docstring)."""
        count = stats[0].new_tensor([float(B)])
        out = self.distributed.sum_symmetric([*stats, count], [*self._symmetric(stats), False],
                                             f"{type(self).__name__} statistics")
        return out[:-1], round(float(out[-1][0]))

    def _means(self) -> list[Tensor]:
        if self._stats is None:
            raise ValueError(f"{type(self).__name__} has no statistics yet: call update(data) first")
        return list(self._stats) if self.ema is not None else [t / self.num_data for t in self._stats]

    def scale(self) -> float:
        """The factor on per-sample means: 1 for ``reduction='mean'``, N for ``'sum'``."""
        return 1.0 if self.likelihood.reduction == "mean" else float(self.num_data)

    def operator(self) -> CurvatureOperator:
        """The current curvature estimate (scale as the module docstring)."""
        return self._operator(self._means(), self.scale())

    def _batch_statistics(self, X: Tensor, y: Tensor) -> tuple[list[Tensor], int]:
        raise NotImplementedError

    def _operator(self, means: list[Tensor], scale: float) -> CurvatureOperator:
        raise NotImplementedError

    # ------------------------------------------------------------------ checkpointing
    def state_dict(self) -> dict[str, Any]:
        return {"kind": type(self).__name__, "stats": None if self._stats is None else [t.clone() for t in self._stats],
                "num_data": self.num_data, "num_updates": self.num_updates, "ema": self.ema}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("kind") != type(self).__name__:
            raise ValueError(f"state_dict is for {state.get('kind')!r}, not {type(self).__name__}")
        if state.get("ema") != self.ema:
            raise ValueError(f"state_dict has ema={state.get('ema')}, this estimator ema={self.ema}")
        stats = state["stats"]
        if stats is not None:
            ref = self._reference_shapes()
            if ref is not None and [tuple(t.shape) for t in stats] != ref:
                raise ValueError("state_dict statistics do not match this model's layers")
        self._stats = None if stats is None else [t.clone() for t in stats]
        self.num_data, self.num_updates = int(state["num_data"]), int(state["num_updates"])

    def _reference_shapes(self) -> list[tuple[int, ...]] | None:
        return None


class KroneckerEstimator(CurvatureEstimator):
    """Kronecker-factored curvature ``blockdiag_l G_l (x) A_l`` (module docstring for the methods).

    Args:
        model: Linear/Conv2d layers carry every trainable parameter (``kfra``: an MLP chain);
            :meth:`curvkit.structure.ModelStructure.kronecker_layers` names any module it cannot take.
        likelihood: the loss head (its ``reduction`` sets the scale).
        method: ``kfac`` (default, the Monte Carlo Fisher) | ``kflr`` | ``kfra`` | ``projection`` |
            ``empirical``.
        mc_samples: labels (``kfac``) or projections (``projection``) per datum (default 1, the thesis's).
        distribution: ``rademacher`` | ``gaussian`` probe vectors for ``projection``.
        ema: moving-average factor rho in [0, 1) (None: sum over all data).
        seed / generator: the only randomness (labels, projections); a generator on the model's device is
            created from ``seed`` on first use. Batches consume it in order. With ``distributed`` each rank
            seeds its own generator with ``distributed.seed(seed)`` (rank 0 keeps ``seed``).
        distributed: a :class:`curvkit.distributed.Reducer` (class :class:`CurvatureEstimator`): the
            factors of the union of the ranks' batches. ``kfra`` is not linear in the batch (its
            recursion multiplies batch means), so its batch means of H_L and of Phi_l^T Phi_l are
            all-reduced first (one message): the factors of the union batch as one batch.
        keep_per_sample: keep the last batch's per-sample rows in :attr:`per_sample` (name ->
            (inputs (B*T, in_aug), back-propagated vectors (V, B*T, out), weights (V,))) for estimators
            built on top (e.g. eigenbasis corrections or diagonal Fishers of Kronecker layers).
    """

    def __init__(self, model: nn.Module, likelihood: Likelihood, method: KroneckerMethod = "kfac", *,
                 mc_samples: int = 1, distribution: Literal["rademacher", "gaussian"] = "rademacher",
                 ema: float | None = None, seed: int = 0, generator: torch.Generator | None = None,
                 keep_per_sample: bool = False, distributed: Any = None):
        if method not in ("kfac", "kflr", "kfra", "projection", "empirical"):
            raise ValueError(f"unknown Kronecker method {method!r}; use 'kfac', 'kflr', 'kfra', 'projection' "
                             "or 'empirical'")
        if distribution not in ("rademacher", "gaussian"):
            raise ValueError(f"distribution must be 'rademacher' or 'gaussian', got {distribution!r}")
        self.method = method
        self.mc_samples = integer("mc_samples", mc_samples)
        self.distribution = distribution
        self.seed = int(seed) if distributed is None else distributed.seed(int(seed))
        self.generator = generator
        self.keep_per_sample = bool(keep_per_sample)
        self.per_sample: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
        structure = read_model(model)
        self.layers = structure.kronecker_layers(method, allow_conv=method != "kfra")
        self.chain = structure.mlp_chain(method, frozen=True) if method == "kfra" else None
        if self.chain is not None:
            position = {id(m): i for i, m in enumerate(self.chain.linears)}
            if any(id(lay.module) not in position for lay in self.layers):
                raise UnsupportedModelError("kfra: the trainable layers must be nn.Linear layers of the chain")
            self._chain_pos = [position[id(lay.module)] for lay in self.layers]  # increasing (module order)
        super().__init__(model, likelihood, ema, distributed)

    # ------------------------------------------------------------------ per-batch statistics
    def capture(self) -> LayerCapture:
        """A capture to run one forward pass in (``with est.capture() as cap: f = model(X)``)."""
        return LayerCapture(self.layers, self.method)

    def _batch_statistics(self, X: Tensor, y: Tensor) -> tuple[list[Tensor], int]:
        with self.capture() as cap, torch.enable_grad():
            f = self.model(X)
        return self._statistics(cap, f, y)

    def accumulate(self, capture: LayerCapture, f: Tensor, y: Tensor) -> None:
        """Add the statistics of a forward pass the caller ran inside ``capture`` (output ``f``, targets y);
        f's graph is kept for the caller's own backward pass."""
        stats, B = self._statistics(capture, f, y)
        self._combine(stats, B)

    def _statistics(self, cap: LayerCapture, f: Tensor, y: Tensor) -> tuple[list[Tensor], int]:
        if not isinstance(f, Tensor) or f.dim() != 2:
            raise ValueError(f"{self.method}: the model must return a single (batch, outputs) tensor, got "
                             f"{tuple(f.shape) if isinstance(f, Tensor) else type(f).__name__}")
        self.likelihood.check(f.detach(), y)
        outs = cap.outputs()
        B = int(f.shape[0])
        A = [self._input_gram(rec.a, rec.has_bias) for rec in cap.records]
        if self.method == "kfra":
            G = self._kfra(cap, f, y)
        else:
            G = self._backprop(cap, f, y, outs)
        return A + G, B

    @staticmethod
    def _input_gram(a: Tensor | None, bias: bool) -> Tensor:
        """sum over rows of a_hat a_hat^T (in_aug, in_aug), a_hat = [a, 1] with a bias; the bias row and
        column come from sum(a) and the count (no concatenated copy of the inputs)."""
        assert a is not None
        if not bias:
            return a.T @ a
        n = a.shape[1]
        out = a.new_empty(n + 1, n + 1)
        out[:n, :n] = a.T @ a  # (mm into the strided slice directly is slower: 9.7 vs 7.8 ms at 500 x 784)
        s = a.sum(0)
        out[:n, n] = s
        out[n, :n] = s
        out[n, n] = a.shape[0]
        return out

    def _gen(self, device: torch.device) -> torch.Generator:
        if self.generator is None:
            self.generator = torch.Generator(device=device).manual_seed(self.seed)
        return self.generator

    def _vectors(self, f: Tensor, y: Tensor) -> list[tuple[Tensor, float]]:
        """Output-space vectors (B, C) with weights w: G accumulates sum_n w c_n c_n^T at the output."""
        lik = self.likelihood
        if self.method == "kflr":
            S = _output_hessian_sqrt(lik, f, y)
            return [(S[:, :, r], 1.0) for r in range(S.shape[2])]
        if self.method == "empirical":
            return [(lik.output_grad(f, y), 1.0)]
        K, (B, C) = self.mc_samples, f.shape
        if self.method == "projection":
            S = _output_hessian_sqrt(lik, f, y)  # (B, C, R); E[S v v^T S^T] = S S^T = H_L
            gen = self._gen(f.device)
            shape = (K, B, S.shape[2])
            if self.distribution == "gaussian":
                v = torch.randn(shape, generator=gen, device=f.device, dtype=f.dtype)
            else:
                v = torch.randint(0, 2, shape, generator=gen, device=f.device).to(f.dtype).mul_(2).sub_(1)
            return [(torch.einsum("bcr,br->bc", S, v[k]), 1.0 / K) for k in range(K)]
        # kfac: all K draws in one call on f repeated K times (sample-major: row k * B + n)
        f_rep = f.repeat(K, 1)
        Vs = lik.output_grad(f_rep, lik.sample(f_rep, self._gen(f.device))).reshape(K, B, C)
        if K <= C:
            return [(v, 1.0 / K) for v in Vs]
        # More draws than outputs: back-propagate a square root of each datum's sampled output Fisher
        # (1/K) sum_k v_k v_k^T instead (C passes instead of K; the same G in exact arithmetic).
        Fn = torch.einsum("sbc,sbd->bcd", Vs, Vs) / K
        lam, U = torch.linalg.eigh(Fn)
        R = U * lam.clamp_min(0).sqrt()[:, None, :]
        return [(R[:, :, c], 1.0) for c in range(C)]

    def _backprop(self, cap: LayerCapture, f: Tensor, y: Tensor, outs: list[Tensor]) -> list[Tensor]:
        G: list[Tensor | None] = [None] * len(cap.records)
        per: list[list[Tensor]] = [[] for _ in cap.records]
        weights = []
        for V, w in self._vectors(f.detach(), y):
            grads = torch.autograd.grad(f, outs, grad_outputs=V.to(f.dtype), retain_graph=True, allow_unused=True)
            weights.append(w)
            for i, (rec, g) in enumerate(zip(cap.records, grads)):
                if g is None:
                    raise UnsupportedModelError(f"{self.method}: the output does not depend on module "
                                                f"{rec.info.label!r}; freeze it or remove it")
                rows = output_rows(rec.info, g.detach())  # (B*T, out); mean over the T locations below
                term = (rows.T @ rows) * (w / rec.positions)
                G[i] = term if G[i] is None else G[i] + term  # type: ignore[operator]
                if self.keep_per_sample:
                    per[i].append(rows)
        if self.keep_per_sample:
            wt = torch.tensor(weights, dtype=f.dtype, device=f.device)
            self.per_sample = {
                str(rec.info.weight): (with_bias_column(rec.a, rec.has_bias), torch.stack(p), wt)  # type: ignore[arg-type]
                for rec, p in zip(cap.records, per)}
        return G  # type: ignore[return-value]

    def _kfra(self, cap: LayerCapture, f: Tensor, y: Tensor) -> list[Tensor]:
        assert self.chain is not None
        B = f.shape[0]
        G = _mean_output_hessian(self.likelihood, f.detach(), y)
        chain, L, first = self.chain, len(self.chain.linears), self._chain_pos[0]
        h = {l: rec.output.detach() for l, rec in zip(self._chain_pos, cap.records)}  # type: ignore[union-attr]
        grams = {}
        a_prev: Tensor | None = None  # the previous layer's activation
        for l in range(first, L - 1):  # the recursion stops at the first trainable layer
            if l not in h:  # a frozen layer (not captured): its pre-activation from the previous activation
                assert a_prev is not None
                lin = chain.linears[l]
                h[l] = torch.nn.functional.linear(a_prev, lin.weight.detach(),
                                                  None if lin.bias is None else lin.bias.detach())
            a_prev, Phi, _ = activation_derivatives(chain.activations[l], h[l])
            grams[l] = Phi.T @ Phi / B
        if self.distributed is not None:  # batch means of the union (class docstring)
            keys = sorted(grams)
            means, total = self.distributed.weighted_mean([G] + [grams[l] for l in keys], B)
            G, grams = means[0], dict(zip(keys, means[1:]))
            B = round(total)  # the union's: the same numbers on every rank, so identical replicas (_reduce)
        per = {L - 1: G}
        for l in range(L - 2, first - 1, -1):
            W = chain.linears[l + 1].weight.detach()
            G = (W.T @ G @ W) * grams[l]
            per[l] = G
        return [B * per[l] for l in self._chain_pos]  # summed form: B times the batch mean (the thesis: per batch)

    # ------------------------------------------------------------------ output
    def _stat_names(self) -> list[str]:
        return [f"A of layer {lay.label!r}" for lay in self.layers] + [f"G of layer {lay.label!r}"
                                                                       for lay in self.layers]

    def _symmetric(self, stats: list[Tensor]) -> list[bool]:
        return [True] * len(stats)

    def _reduce(self, stats: list[Tensor], B: int) -> tuple[list[Tensor], int]:
        if self.method != "kfra":
            return super()._reduce(stats, B)
        # kfra's G are already the union's (N times its batch means, computed from identical all-reduced
        # means, so bitwise the same on every rank): only A and the count travel
        L = len(self.layers)
        A, N = super()._reduce(stats[:L], B)
        return A + list(stats[L:]), N

    def _reference_shapes(self) -> list[tuple[int, ...]] | None:
        a_shapes: list[tuple[int, ...]] = []
        g_shapes: list[tuple[int, ...]] = []
        for lay in self.layers:
            w: Any = lay.module.weight
            n = int(math.prod(w.shape[1:])) + (lay.bias is not None)
            a_shapes.append((n, n))
            g_shapes.append((int(w.shape[0]), int(w.shape[0])))
        return a_shapes + g_shapes

    def factors(self) -> list[tuple[str, Tensor, Tensor]]:
        """(weight name, G, A) per layer at the operator's scale (G carries the 'sum' factor N)."""
        return [(b.weight_name, b.G, b.A) for b in self.operator().blocks]

    def operator(self) -> KroneckerOperator:
        return self._operator(self._means(), self.scale())

    def _operator(self, means: list[Tensor], scale: float) -> KroneckerOperator:
        L = len(self.layers)
        blocks = [KroneckerBlock.from_gram(G, A, lay.weight, lay.bias, scale_G=scale)  # type: ignore[arg-type]
                  for lay, A, G in zip(self.layers, means[:L], means[L:])]
        return KroneckerOperator(self.layout, blocks)


class DiagonalEstimator(CurvatureEstimator):
    """Diagonal curvature summed (or averaged) over data, as a :class:`DiagonalOperator`.

    ``method``: ``ggn`` (the exact GGN diagonal, = the type-2 Fisher's for the built-in heads; R batched
    backward passes per batch for Linear/Conv2d models), ``mc_fisher`` (squared per-example gradients at
    ``mc_samples`` labels sampled from the model, averaged), ``empirical`` (squared per-example gradients
    at the data labels: the empirical Fisher, EWC's choice). Scale and ``ema`` as
    :class:`CurvatureEstimator`. The batches draw their labels from one generator seeded ``seed``.
    """

    def __init__(self, model: nn.Module, likelihood: Likelihood, method: DiagonalMethod = "ggn", *,
                 mc_samples: int = 1, ema: float | None = None, seed: int = 0, distributed: Any = None):
        if method not in ("ggn", "mc_fisher", "empirical"):
            raise ValueError(f"unknown diagonal method {method!r}; use 'ggn', 'mc_fisher' or 'empirical'")
        self.method = method
        self.mc_samples = integer("mc_samples", mc_samples)
        self._seeds = torch.Generator().manual_seed(int(seed) if distributed is None else distributed.seed(int(seed)))
        super().__init__(model, likelihood, ema, distributed)

    def _batch_statistics(self, X: Tensor, y: Tensor) -> tuple[list[Tensor], int]:
        from curvkit.curvature.exact import EmpiricalFisherOperator, GGNOperator, MCFisherOperator

        lik = self.likelihood.with_reduction("sum")
        op: CurvatureOperator
        if self.method == "ggn":
            op = GGNOperator(self.model, lik, (X, y))
        elif self.method == "empirical":
            op = EmpiricalFisherOperator(self.model, lik, (X, y))
        else:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seeds))
            op = MCFisherOperator(self.model, lik, (X, y), mc_samples=self.mc_samples, seed=seed)
        return [op.diagonal().flat], int(X.shape[0])

    def _stat_names(self) -> list[str]:
        return ["diagonal"]

    def _reference_shapes(self) -> list[tuple[int, ...]] | None:
        return [(self.layout.dim,)]

    def operator(self) -> DiagonalOperator:
        return self._operator(self._means(), self.scale())

    def _operator(self, means: list[Tensor], scale: float) -> DiagonalOperator:
        return DiagonalOperator.from_flat(self.layout, means[0] * scale)
