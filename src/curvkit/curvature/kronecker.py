"""Kronecker-factored curvature per layer: KFAC, KFLR, KFRA (thesis section 4.3; digest 002 section 3.3).

Each layer's block of the GGN (= type-2 Fisher for the exponential-family likelihoods of
:mod:`curvkit.likelihoods`) is approximated by the factored expectation (thesis Eqs. 4.2-4.3)

    C_l ~ G_l (x) A_l    (PyTorch row-major ``W_hat = [W | b]`` layout, output factor first),
    A_l = (1/N) sum_n a_hat^n a_hat^{nT}           (input factor, uncentred second moment; bias entry 1 last),
    G_l = (1/N) sum_n sum_k g_k^n g_k^{nT} * s     (output factor, pre-activation curvature),

where ``g_k^n = J_{h_l}^{nT} c_k^n`` back-propagates an output-space vector ``c_k^n`` to the layer's
pre-activation ``h_l`` (thesis Eq. 4.6), and the estimators differ only in the vectors:

* :func:`kflr` (exact low rank, Sec. 4.3.1): the columns of ``S^n`` with ``S S^T = H_L`` (the likelihood's
  ``output_hessian_sqrt``); ``sum_k g_k g_k^T`` is then the exact per-sample pre-activation GGN.
* :func:`kfac` (Monte Carlo Fisher, Sec. 4.3.3; Martens & Grosse 2015): ``c^n = dL(y_hat^n)/dh_L`` for
  labels ``y_hat ~ p(y | h_L)`` sampled from the MODEL with a seeded generator, averaged over
  ``mc_samples`` samples. Unbiased for KFLR's G.
* :func:`empirical_kfac`: ``c^n = dL(y^n)/dh_L`` at the DATA labels (empirical Fisher; not a GGN estimator,
  thesis digest section 2.6; provided for comparisons only).
* :func:`kfra` (recursive, Sec. 4.3.2, Eq. 4.7): propagates the batch-mean matrix,
  ``G_L = mean_n H_L^n``, ``G_l = (W_{l+1}^T G_{l+1} W_{l+1}) o (Phi_l^T Phi_l / B)`` with
  ``Phi_l = phi'(h_l)`` (B, d_l) - the activation DERIVATIVE, not the activation (erratum of Algorithm 1).

Scale (reduction). The factors are per-sample averages over all N data points. The returned operator has
the scale of the exact GGN of ``likelihood.nll`` over the data: ``s = 1`` for ``reduction='mean'`` and
``s = N`` for ``reduction='sum'`` (the factor N is put on G). So ``kflr`` on ONE datum equals the exact
diagonal GGN block (Lemma 3.21/3.22), for either reduction.

Layers. Works on any module tree whose parameter-bearing modules are ``nn.Linear`` (with or without bias;
input (B, in)) or, for the hook-based estimators, ``nn.Conv2d`` (groups = 1); all other modules must be
parameter-free and must not mix samples (e.g. no BatchNorm). A parameter-bearing module of another type
raises a ValueError naming it - nothing is skipped silently. KFRA needs the MLP chain of
:mod:`curvkit.curvature.recursion`.

Conv2d (KFC, Grosse & Martens 2016, "expand" convention). With T output locations, patches
``a_hat_{n,t}`` (C*kh*kw unfolded inputs in the weight's (C, kh, kw) order, then 1 for the bias) and
pre-activation vectors ``g_{n,t}`` (out,):

    A = (1/N) sum_n sum_t a_hat_{n,t} a_hat_{n,t}^T     (SUM over locations),
    G = (1/N) sum_n (1/T) sum_t g_{n,t} g_{n,t}^T       (MEAN over locations).

This is KFC's Omega (x) Gamma under spatial homogeneity and spatially uncorrelated derivatives, so that
``G (x) A ~ sum_t E[g_t g_t^T] (x) E[a_t a_t^T]``; for a 1x1 output (T = 1) it equals the Linear case.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from curvkit.curvature.recursion import chain_forward, iterate_data, mlp_chain
from curvkit.likelihoods import Likelihood
from curvkit.linalg.kron import KroneckerBlock, KroneckerOperator
from curvkit.linalg.layout import ParamLayout

__all__ = ["empirical_kfac", "kfac", "kflr", "kfra", "kronecker_layers"]

Data = tuple[Tensor, Tensor] | Iterable[tuple[Tensor, Tensor]]
# (f detached (B, C), targets) -> list of (vectors (B, C), weight): G accumulates weight * g g^T
VectorFn = Callable[[Tensor, Tensor], list[tuple[Tensor, float]]]


@dataclass
class _Layer:
    name: str
    module: nn.Module
    weight_name: str
    bias_name: str | None


def kronecker_layers(model: nn.Module, allow_conv: bool = True) -> list[_Layer]:
    """The modules that carry trainable parameters, checked to be supported (else a ValueError naming them)."""
    layers = []
    for name, m in model.named_modules():
        params = [(n, p) for n, p in m.named_parameters(recurse=False) if p.requires_grad]
        if not params:
            continue
        label = name or "<root>"
        supported = (nn.Linear, nn.Conv2d) if allow_conv else (nn.Linear,)
        if type(m) not in supported:
            raise ValueError(
                f"module {label!r} ({type(m).__name__}) has trainable parameters but is not supported by the "
                f"Kronecker-factored approximation (supported: {', '.join(s.__name__ for s in supported)}); "
                "freeze its parameters (requires_grad=False) or use an exact/diagonal curvature"
            )
        if isinstance(m, nn.Conv2d) and m.groups != 1:
            raise ValueError(f"module {label!r} (Conv2d) has groups={m.groups}; only groups=1 is supported")
        weight = getattr(m, "weight", None)
        if weight is None or not weight.requires_grad:
            raise ValueError(f"module {label!r} ({type(m).__name__}) has a trainable bias but a frozen weight; "
                             "the Kronecker block needs the weight (freeze both or neither)")
        prefix = f"{name}." if name else ""
        bias = getattr(m, "bias", None)
        layers.append(_Layer(label, m, prefix + "weight",
                             prefix + "bias" if bias is not None and bias.requires_grad else None))
    if not layers:
        raise ValueError(f"{type(model).__name__} has no trainable parameters")
    return layers


def _unfold(conv: nn.Conv2d, x: Tensor) -> Tensor:
    """Conv2d input (B, C, H, W) -> patches (B, T, C*kh*kw), matching ``weight.reshape(out, -1)``."""
    mode = "constant" if conv.padding_mode == "zeros" else conv.padding_mode
    x = F.pad(x, conv._reversed_padding_repeated_twice, mode=mode)
    cols = F.unfold(x, conv.kernel_size, dilation=conv.dilation, padding=0, stride=conv.stride)
    return cols.transpose(1, 2)


def _layer_input(layer: _Layer, x: Tensor, augment: bool = True) -> Tensor:
    """Augmented inputs a_hat: (B, T, in_aug) (T = 1 for Linear); without the bias 1 if not ``augment``."""
    m = layer.module
    if isinstance(m, nn.Conv2d):
        if x.dim() != 4:
            raise ValueError(f"module {layer.name!r} (Conv2d): expected a (B, C, H, W) input, got {tuple(x.shape)}")
        a = _unfold(m, x)
    else:
        if x.dim() != 2:
            raise ValueError(f"module {layer.name!r} (Linear): the Kronecker factors need a (batch, features) "
                             f"input, got shape {tuple(x.shape)}; flatten extra dimensions first")
        a = x[:, None, :]
    if augment and layer.bias_name is not None:
        a = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)
    return a


def _input_gram(layer: _Layer, x: Tensor) -> Tensor:
    """sum over samples and locations of a_hat a_hat^T (in_aug, in_aug), a_hat = [a, 1] with a bias.

    The bias row/column is filled from sum(a) and the count instead of concatenating a column of ones
    to the inputs (same numbers, no copy of the inputs).
    """
    a = _layer_input(layer, x, augment=False)
    a = a.reshape(-1, a.shape[-1])  # (B*T, in)
    if layer.bias_name is None:
        return a.T @ a
    n = a.shape[1]
    out = a.new_empty(n + 1, n + 1)
    torch.mm(a.T, a, out=out[:n, :n])
    s = a.sum(0)
    out[:n, n] = s
    out[n, :n] = s
    out[n, n] = a.shape[0]
    return out


def _layer_grad(layer: _Layer, g: Tensor) -> Tensor:
    """Gradient w.r.t. the layer output -> (B, T, out)."""
    return g.flatten(2).transpose(1, 2) if isinstance(layer.module, nn.Conv2d) else g[:, None, :]


class _Recorder:
    """Forward hooks that record each layer's input and output (and the output's version counter)."""

    def __init__(self, n: int):
        self.inputs: list[list[Tensor]] = [[] for _ in range(n)]
        self.outputs: list[list[Tensor]] = [[] for _ in range(n)]
        self.versions: list[int] = [0] * n

    def hook(self, i: int) -> Callable[..., None]:
        def record(mod: nn.Module, args: tuple[Tensor, ...], out: Tensor) -> None:
            self.inputs[i].append(args[0].detach())
            self.outputs[i].append(out)
            self.versions[i] = out._version

        return record


def _add(acc: Tensor | None, x: Tensor) -> Tensor:
    return x if acc is None else acc + x


def _hook_factors(model: nn.Module, likelihood: Likelihood, data: Data, vectors: VectorFn,
                  method: str) -> KroneckerOperator:
    layers = kronecker_layers(model)
    layout = ParamLayout.from_module(model)
    A_sum: list[Tensor | None] = [None] * len(layers)
    G_sum: list[Tensor | None] = [None] * len(layers)
    N = 0
    for X, y in iterate_data(data):
        rec = _Recorder(len(layers))
        handles = [lay.module.register_forward_hook(rec.hook(i)) for i, lay in enumerate(layers)]
        try:
            with torch.enable_grad():
                f = model(X)
        finally:
            for h in handles:
                h.remove()
        if not isinstance(f, Tensor):
            raise ValueError(f"{method}: the model must return a single (batch, outputs) tensor")
        likelihood.check(f, y)
        for i, lay in enumerate(layers):
            if len(rec.outputs[i]) != 1:
                raise ValueError(f"{method}: module {lay.name!r} was called {len(rec.outputs[i])} times in one "
                                 "forward pass; shared or unused layers are not supported")
            if rec.outputs[i][0]._version != rec.versions[i]:
                raise ValueError(f"{method}: the output of module {lay.name!r} was modified in place later in "
                                 "the forward pass (e.g. nn.ReLU(inplace=True)); use inplace=False")
        N += X.shape[0]
        outs = [o[0] for o in rec.outputs]
        for i, lay in enumerate(layers):
            A_sum[i] = _add(A_sum[i], _input_gram(lay, rec.inputs[i][0]))
        for V, w in vectors(f.detach(), y):
            grads = torch.autograd.grad(f, outs, grad_outputs=V.to(f.dtype), retain_graph=True,
                                        allow_unused=True)
            for i, (lay, g) in enumerate(zip(layers, grads)):
                if g is None:
                    raise ValueError(f"{method}: the output does not depend on module {lay.name!r}")
                gt = _layer_grad(lay, g.detach())  # (B, T, out)
                g2 = gt.reshape(-1, gt.shape[-1])  # mean over the T locations below
                G_sum[i] = _add(G_sum[i], (g2.T @ g2) * (w / gt.shape[1]))
        del f, outs, rec
    return _operator(layout, layers, A_sum, G_sum, N, likelihood)


def _operator(layout: ParamLayout, layers: list[_Layer], A_sum: list[Tensor | None],
              G_sum: list[Tensor | None], N: int, likelihood: Likelihood) -> KroneckerOperator:
    """Blocks ``(s/N) G_sum (x) A_sum/N`` with s = N for reduction 'sum', 1 for 'mean'."""
    s = 1.0 if likelihood.reduction == "mean" else float(N)
    blocks = []
    for lay, A_i, G_i in zip(layers, A_sum, G_sum):
        if A_i is None or G_i is None:  # pragma: no cover - every layer is visited for every batch
            raise RuntimeError(f"no data reached layer {lay.name!r}")
        for what, M in (("G", G_i), ("A", A_i)):
            if not math.isfinite(float(M.sum())):  # one reduction; NaN/inf anywhere makes the sum non-finite
                raise ValueError(f"the {what} factor of layer {lay.name!r} contains NaN or inf entries; check "
                                 "the inputs and the model's parameters")
        # G_i, A_i are sums of Gram matrices (symmetric by construction): skip the generic validation
        blocks.append(KroneckerBlock.from_gram(G_i, A_i, lay.weight_name, lay.bias_name,
                                               scale_G=s / N, scale_A=1.0 / N))
    return KroneckerOperator(layout, blocks)


def kflr(model: nn.Module, likelihood: Likelihood, data: Data) -> KroneckerOperator:
    """KFLR (thesis Sec. 4.3.1): back-propagate the R columns of ``likelihood.output_hessian_sqrt(f)``.

    ``G_l = s/N sum_n sum_r g_r^n g_r^{nT}`` is the exact data-mean of the pre-activation GGNs (Eq. 4.6);
    costs R backward passes per batch (R = number of outputs). Conv2d layers use the KFC convention of the
    module docstring (then the block is no longer exact for one datum).
    """

    def vectors(f: Tensor, y: Tensor) -> list[tuple[Tensor, float]]:
        S = likelihood.output_hessian_sqrt(f)  # (B, C, R)
        return [(S[:, :, r], 1.0) for r in range(S.shape[2])]

    return _hook_factors(model, likelihood, data, vectors, "kflr")


def kfac(model: nn.Module, likelihood: Likelihood, data: Data, mc_samples: int = 1,
         seed: int = 0) -> KroneckerOperator:
    """KFAC (thesis Sec. 4.3.3, Eqs. 4.8-4.9): Monte Carlo type-2 Fisher with labels sampled from the model.

    For each data batch and each of ``mc_samples`` draws, ``y_hat ~ likelihood.sample(f, generator)`` and
    ``c = likelihood.output_grad(f, y_hat)`` (the per-sample NLL gradient at the sampled label, one vector
    per datum) is back-propagated to every layer; ``G`` averages ``g g^T`` over data and draws. The
    generator is ``torch.Generator().manual_seed(seed)`` on the output's device (the global RNG is not
    used), shared across batches in order; the S draws of a batch come from one call on ``f`` repeated S
    times (sample-major). Thesis default: ``mc_samples=1``. When ``mc_samples`` exceeds the
    output dimension C, the C columns of a square root of each datum's sampled output Fisher
    ``(1/S) sum_s c_s c_s^T`` are back-propagated instead of the S vectors (same G, fewer passes).
    """
    if int(mc_samples) != mc_samples or mc_samples < 1:
        raise ValueError(f"mc_samples must be a positive integer, got {mc_samples}")
    state: dict[str, torch.Generator] = {}

    def vectors(f: Tensor, y: Tensor) -> list[tuple[Tensor, float]]:
        if "g" not in state:
            state["g"] = torch.Generator(device=f.device).manual_seed(int(seed))
        S, (B, C) = int(mc_samples), f.shape
        f_rep = f.repeat(S, 1)  # all S draws in one call, sample-major: row s * B + n
        Vs = likelihood.output_grad(f_rep, likelihood.sample(f_rep, state["g"])).reshape(S, B, C)
        if S <= C:
            return [(v, 1.0 / S) for v in Vs]
        # More draws than outputs: back-propagate a square root of each datum's sampled output Fisher
        # F_n = (1/S) sum_s v_s v_s^T instead (C passes instead of S; identical G in exact arithmetic).
        Fn = torch.einsum("sbc,sbd->bcd", Vs, Vs) / S
        lam, U = torch.linalg.eigh(Fn)
        R = U * lam.clamp_min(0).sqrt()[:, None, :]  # (B, C, C), R R^T = F_n
        return [(R[:, :, c], 1.0) for c in range(C)]

    return _hook_factors(model, likelihood, data, vectors, "kfac")


def empirical_kfac(model: nn.Module, likelihood: Likelihood, data: Data) -> KroneckerOperator:
    """Kronecker-factored EMPIRICAL Fisher: ``c = likelihood.output_grad(f, y)`` at the data labels.

    Not an estimator of the GGN/Fisher (it is biased; digest 002 section 2.6); for comparisons only.
    """
    return _hook_factors(model, likelihood, data, lambda f, y: [(likelihood.output_grad(f, y), 1.0)],
                         "empirical_kfac")


def kfra(model: nn.Module, likelihood: Likelihood, data: Data) -> KroneckerOperator:
    """KFRA (thesis Sec. 4.3.2, Eq. 4.7 / Algorithm 1 with the Phi = phi'(h) erratum fixed).

    Per batch of size B: ``G_L = (1/B) sum_n H_L^n``, then ``G_l = (W_{l+1}^T G_{l+1} W_{l+1}) o
    (Phi_l^T Phi_l / B)`` with ``W_{l+1}`` without its bias column. With several batches, each batch's
    ``G_l`` is averaged with weight B/N (the thesis computes KFRA per minibatch); ``A_l`` is the mean over
    all N points. Exact for B = 1 and under the assumptions of Lemma 4.1; biased otherwise (nested
    expectation). Needs an MLP chain (:func:`curvkit.curvature.recursion.mlp_chain`); scale as KFLR.
    """
    layers = kronecker_layers(model, allow_conv=False)  # names an unsupported parameter-bearing module
    chain = mlp_chain(model, "kfra")
    layout = ParamLayout.from_module(model)
    by_module = {id(lay.module): lay for lay in layers}
    chain_layers = [by_module[id(lin)] for lin in chain.linears]
    L = len(chain.linears)
    A_sum: list[Tensor | None] = [None] * L
    G_sum: list[Tensor | None] = [None] * L
    N = 0
    for X, y in iterate_data(data):
        fw = chain_forward(chain, X)
        likelihood.check(fw.output, y)
        B = X.shape[0]
        N += B
        G = likelihood.output_hessian(fw.output).mean(0)
        per = [G]
        for l in range(L - 2, -1, -1):
            W = chain.linears[l + 1].weight.detach()
            Phi = fw.d1[l]
            G = (W.T @ G @ W) * (Phi.T @ Phi / B)
            per.append(G)
        per.reverse()
        for l in range(L):
            a = fw.inputs[l]
            A_sum[l] = _add(A_sum[l], a.T @ a)
            G_sum[l] = _add(G_sum[l], B * per[l])
    return _operator(layout, chain_layers, A_sum, G_sum, N, likelihood)
