"""Kronecker-factored curvature per layer: KFAC, KFLR, KFRA (thesis Sec. 4.3).

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
* :func:`empirical_kfac`: ``c^n = dL(y^n)/dh_L`` at the DATA labels (empirical Fisher; not a GGN estimator:
  the thesis's Fisher, Eq. 3.35, samples labels from the model; provided for comparisons only).
* :func:`kfra` (recursive, Sec. 4.3.2, Eq. 4.7): propagates the batch-mean matrix,
  ``G_L = mean_n H_L^n``, ``G_l = (W_{l+1}^T G_{l+1} W_{l+1}) o (Phi_l^T Phi_l / B)`` with
  ``Phi_l = phi'(h_l)`` (B, d_l) - the activation DERIVATIVE, not the activation (erratum of Algorithm 1).

Scale (reduction). The factors are per-sample averages over all N data points. The returned operator has
the scale of the exact GGN of ``likelihood.nll`` over the data: ``s = 1`` for ``reduction='mean'`` and
``s = N`` for ``reduction='sum'`` (the factor N is put on G). So ``kflr`` on ONE datum equals the exact
diagonal GGN block (Lemma 3.21/3.22), for either reduction.

Layers. Every trainable parameter must belong to a layer kind of :mod:`curvkit.layerkinds` (Linear and
convolutions with weight sharing, grouped convolutions, Embedding, normalisation layers, multi-head
attention, raw (1, ...) parameters; ``docs/architecture.md`` has the table); other modules must be
deterministic and must not mix samples (BatchNorm only in eval mode). :func:`curvkit.layerkinds.plan`
decides, and a module it cannot take raises an error naming it - nothing is skipped silently. KFRA needs an
MLP chain. Outputs may have positions ((B, T, C) logits): the weight-sharing convention and the
cross-position terms of KFLR are in ``docs/architecture.md`` ("Weight sharing", "Outputs with positions").

These functions are one-shot conveniences over :class:`curvkit.curvature.estimators.KroneckerEstimator`
(which also updates batch by batch, keeps a moving average and feeds optimisers and posteriors), and take its
keyword options (``kflr(model, lik, data, weight_sharing="reduce")``: :class:`curvkit.curvature.CurvatureConfig`'s
options or ``config=``, ``seed``, ...) with the same names and defaults.

Weight sharing (KFC, Grosse & Martens 2016; Eschenhagen et al. 2023). With T positions sharing a weight
(convolution locations, tokens, patches), rows ``a_hat_{n,t}`` (then 1 for the bias) and pre-activation
vectors ``g_{n,t}`` (out,), the default ``weight_sharing='expand'`` of the estimator is

    A = (1/N) sum_n sum_t a_hat_{n,t} a_hat_{n,t}^T     (SUM over positions),
    G = (1/N) sum_n (1/T) sum_t g_{n,t} g_{n,t}^T       (MEAN over positions),

KFC's Omega (x) Gamma under spatial homogeneity and uncorrelated derivatives (``G (x) A ~ sum_t E[g_t
g_t^T] (x) E[a_t a_t^T]``; for T = 1 it equals the Linear case); ``'reduce'`` uses the mean input and the
summed gradient of each sample (:class:`~curvkit.curvature.estimators.KroneckerEstimator`).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from curvkit.curvature.estimator import Data
from curvkit.curvature.estimators import KroneckerEstimator
from curvkit.likelihoods import Likelihood
from curvkit.linalg.kron import KroneckerOperator

__all__ = ["empirical_kfac", "kfac", "kflr", "kfra"]


def _one_shot(est: KroneckerEstimator, data: Data) -> KroneckerOperator:
    """The operator of ``data`` by an estimator nobody keeps: its statistics are handed over, not copied
    (:meth:`KroneckerEstimator.operator` with ``release=True``; an ``ema`` estimator copies)."""
    return est.update(data).operator(release=est.ema is None)


def kflr(model: nn.Module, likelihood: Likelihood, data: Data, **options: Any) -> KroneckerOperator:
    """KFLR (thesis Sec. 4.3.1): back-propagate the R columns of ``likelihood.output_hessian_sqrt(f)``.

    ``G_l = s/N sum_n sum_r g_r^n g_r^{nT}`` is the exact data-mean of the pre-activation GGNs (Eq. 4.6);
    costs R backward passes per batch (R = the number of classes C: one per column of the output Hessian's
    square root, every position at once; for a vocabulary of 50,000 use :func:`kfac`). Weight-shared layers
    use the convention of the module docstring (then the block is no longer exact for one datum).
    """
    return _one_shot(KroneckerEstimator(model, likelihood, "kflr", **options), data)


def kfac(model: nn.Module, likelihood: Likelihood, data: Data, mc_samples: int = 1,
         seed: int = 0, **options: Any) -> KroneckerOperator:
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
    return _one_shot(KroneckerEstimator(model, likelihood, "kfac", mc_samples=mc_samples, seed=seed, **options),
                     data)


def empirical_kfac(model: nn.Module, likelihood: Likelihood, data: Data, **options: Any) -> KroneckerOperator:
    """Kronecker-factored EMPIRICAL Fisher: ``c = likelihood.output_grad(f, y)`` at the data labels.

    Not an estimator of the GGN/Fisher (it is biased: the thesis's Fisher, Eq. 3.35, samples the labels from
    the model); for comparisons only.
    """
    return _one_shot(KroneckerEstimator(model, likelihood, "empirical", **options), data)


def kfra(model: nn.Module, likelihood: Likelihood, data: Data, **options: Any) -> KroneckerOperator:
    """KFRA (thesis Sec. 4.3.2, Eq. 4.7 / Algorithm 1 with the Phi = phi'(h) erratum fixed).

    Per batch of size B: ``G_L = (1/B) sum_n H_L^n``, then ``G_l = (W_{l+1}^T G_{l+1} W_{l+1}) o
    (Phi_l^T Phi_l / B)`` with ``W_{l+1}`` without its bias column. With several batches, each batch's
    ``G_l`` is averaged with weight B/N (the thesis computes KFRA per minibatch); ``A_l`` is the mean over
    all N points. Exact for B = 1 and under the assumptions of Lemma 4.1; biased otherwise (nested
    expectation). Needs an MLP chain (:meth:`curvkit.structure.ModelStructure.mlp_chain`); scale as KFLR.
    """
    return _one_shot(KroneckerEstimator(model, likelihood, "kfra", **options), data)
