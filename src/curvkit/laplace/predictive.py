"""Predictive distributions of a fitted :class:`~curvkit.laplace.Laplace` posterior.

* :func:`mc_predictive` - thesis Eq. 5.9: ``p(y|x) ~ (1/K) sum_k p(y | x, theta_k)``, theta_k drawn from the
  posterior; PROBABILITIES are averaged (not logits). Regression returns the moments of the Gaussian
  mixture (mean of the sampled outputs; their variance plus the noise variance).
* :func:`glm_predictive` - the linearised model ``f(x; theta) ~ f(x; theta*) + J (theta - theta*)``
  (not in the thesis; what users of Laplace libraries expect): ``f ~ N(f*, J Sigma J^T)``; classification
  by the probit approximation ``softmax(f* / sqrt(1 + pi/8 diag(J Sigma J^T)))`` (MacKay 1992;
  ``link='mc'`` samples f instead), regression in closed form ``N(f*, J Sigma J^T + sigma^2 I)``.
  ``link='mc'`` draws f either from the (C, C) covariance ``J Sigma J^T`` per position (``sampler=
  'covariance'``) or as ``f* + J delta`` with ``delta = theta - theta*`` a posterior draw pushed through the
  network by one forward-mode product (``sampler='jvp'``: the same distribution, never a Jacobian or a
  (C, C) matrix; one JVP per sample for the whole batch, so a 50,257-token vocabulary costs what a small
  one does). ``'auto'``: ``jvp`` above ``JVP_CLASSES`` = 512 classes. With ``sampler='jvp'`` the probit
  link takes the variances ``diag(J Sigma J^T)`` as the mean square of the same ``num_samples`` draws
  ``J delta`` (an unbiased Monte Carlo estimate, relative error about sqrt(2 / num_samples)) instead of
  exactly; ``'auto'`` does so above ``JVP_OUTPUTS`` = 4096 outputs per sample (positions x classes: a
  language model over a sequence), where the exact variances cost one backward pass per output row
  (the byte-level GPT of 16 x 64 tokens and 256 classes: 5,000 gradient passes) and the draws cost one
  forward-mode product each.
* :func:`functional_variance` - ``J Sigma J^T`` per input, batch by batch (memory bounded by
  ``batch_size``; see :mod:`curvkit.laplace._jacobians`).
* :func:`predictive_nll` - the mean negative log predictive density of targets (used to select N and the
  prior precision on validation data, thesis Sec. 5.1.1).

Inputs ``X`` are a tensor or a mapping of tensors (:data:`curvkit.validation.Inputs`, e.g. a Hugging Face
batch with its attention mask), processed in chunks of ``batch_size`` samples; Monte Carlo predictions draw
their posterior samples once (from ``generator``, or the given ``samples``) and use the same samples for
every chunk.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any, Literal

import torch
from torch import Tensor

from curvkit import layerkinds
from curvkit.laplace._glm import GLMTerm, GradTerm, SpectralTerm
from curvkit.laplace._jacobians import engine_variance, generic_variance, new_variance
from curvkit.laplace._subset import only_trainable
from curvkit.linalg.kron import BlockIndex
from curvkit.structure import UnsupportedModelError, differentiable, read_model
from curvkit.validation import (
    Inputs,
    check_inputs,
    describe_inputs,
    finite_tensor,
    input_tensors,
    inputs_to,
    integer,
    map_inputs,
    num_samples,
    ordinary,
    take_samples,
)

__all__ = ["JVP_CLASSES", "JVP_OUTPUTS", "functional_variance", "glm_predictive", "linearised_samples", "mc_predictive",
           "predictive_function", "predictive_nll"]


def _chunks(X: Inputs, batch_size: int) -> list[Inputs]:
    b = integer("batch_size", batch_size)
    return [take_samples(X, slice(i, i + b)) for i in range(0, num_samples(X), b)]


def _fitted_on(dtype: torch.dtype, shape: tuple[int, ...]) -> str:
    """'inputs (B, *shape) of dtype ...', for errors."""
    return f"inputs (B, {', '.join(map(str, shape))}) of dtype {dtype}" if shape else f"inputs (B,) of dtype {dtype}"


def _check_inputs(post: Any, X: Any) -> Inputs:
    """``X`` on the posterior's device, after checking it against the inputs :meth:`Laplace.fit` saw
    (``post.input_spec``): the same dtype (any integer dtype for integer inputs such as token ids), the same
    number of dimensions, and a one-row forward pass of the model that must succeed (so a wrong feature
    count is named here, with what was expected, not deep inside a matrix product). ``X`` may be a mapping
    of tensors (:data:`curvkit.validation.Inputs`): then the same keys as at the fit, each checked so."""
    if isinstance(X, Tensor) and (X.dim() < 1 or X.shape[0] == 0):
        raise ValueError(f"X must be a non-empty tensor of inputs (B, ...), got shape {tuple(X.shape)}")
    if not isinstance(X, (Tensor, Mapping)):
        raise TypeError(f"X must be a torch.Tensor of inputs (B, ...) or a mapping of such tensors (e.g. "
                        f"{{'input_ids': ..., 'attention_mask': ...}}), got {type(X).__name__}")
    X = map_inputs(ordinary, check_inputs(X, "X"))
    for label, t in input_tensors(X, "X"):
        if t.is_floating_point() and not bool(torch.isfinite(t).all()):
            raise ValueError(f"{label} contains NaN or inf ({int((~torch.isfinite(t)).sum())} entries)")
    post._require_fit()
    X = inputs_to(X, post.device)
    spec = post.input_spec
    if spec is None:
        return X
    if isinstance(spec, dict):
        fitted = "a mapping {" + ", ".join(f"{k!r}: {_fitted_on(v[0], v[1])}" for k, v in spec.items()) + "}"
        if not isinstance(X, dict) or set(X) != set(spec):
            raise ValueError(f"X is {describe_inputs(X)}, but the posterior was fitted on {fitted}; pass the same "
                             "input keys")
        entries = [(f"X[{k!r}]", X[k], spec[k]) for k in X]
    else:
        fitted = _fitted_on(*spec)
        if not isinstance(X, Tensor):
            raise ValueError(f"X is a mapping {describe_inputs(X)}, but the posterior was fitted on {fitted}")
        entries = [("X", X, spec)]
    for label, t, (dtype, shape) in entries:
        where = _fitted_on(dtype, shape) if label == "X" else fitted
        same_kind = t.dtype == dtype or not (t.is_floating_point() or t.is_complex() or dtype.is_floating_point)
        if not same_kind:
            raise ValueError(f"{label} has dtype {t.dtype}, but the posterior was fitted on {where}; convert it with "
                             f"{label}.to({dtype})")
        if t.dim() != len(shape) + 1:
            raise ValueError(f"{label} has shape {tuple(t.shape)}, but the posterior was fitted on {where}")
    buffers = {n: b.clone() for n, b in post.buffers.items()}  # a probe never writes the fitted state
    try:
        with torch.no_grad():
            read_model(post.model).functional_call(post.params, (take_samples(X, slice(0, 1)),), buffers)
    except (RuntimeError, ValueError, IndexError) as err:
        raise ValueError(f"X of shape {describe_inputs(X)} does not fit the model: the posterior was fitted on "
                         f"{fitted} ({type(err).__name__}: {err})") from err
    return X


def _link(post: Any, f: Tensor) -> Tensor:
    """Output -> the likelihood's mean parameter (probabilities; the mean itself for regression)."""
    return post.likelihood.mean(f)


def predictive_function(post: Any, samples: Tensor, batch_size: int | None = None) -> Callable[[Inputs], Tensor]:
    """``x -> (1/K) sum_k p(. | x, theta_k)`` for FIXED flat samples (K, d), differentiable in x (adversarial
    attacks through the MC predictive; thesis Sec. 5.2.3). Regression: the mean of the sampled outputs."""
    structure = read_model(post.model)
    params = [post.sample_params(s) for s in samples]

    def fn(x: Inputs) -> Tensor:
        out = None
        for p in params:
            y = _link(post, structure.functional_call(p, (x,), post.buffers))
            out = y if out is None else out + y
        assert out is not None
        return out / len(params)

    return fn


@differentiable()
def mc_predictive(post: Any, X: Inputs, num_samples: int = 100, generator: torch.Generator | None = None,
                  samples: Tensor | None = None, batch_size: int = 1024, sample_batch: int = 10) -> Any:
    """Thesis Eq. 5.9 (module docstring). ``samples`` (K, d) overrides ``num_samples``/``generator``.
    Returns probabilities (B, C) for classification, ``(mean, variance)`` for regression.

    Memory: posterior samples are drawn ``sample_batch`` at a time (each group of (sample_batch, d) is used
    on every input chunk, then dropped) and the inputs are evaluated ``batch_size`` rows at a time, so the
    peak is about ``sample_batch x d`` floats plus one chunk's activations, whatever ``num_samples`` and
    ``len(X)``. The draws depend on ``sample_batch`` (the generator is read group by group)."""
    X = _check_inputs(post, X)
    group = integer("sample_batch", sample_batch)
    if samples is None:
        K = integer("num_samples", num_samples)
        groups: Any = (post.sample(min(group, K - i), generator) for i in range(0, K, group))
    else:
        if not (isinstance(samples, Tensor) and samples.dim() == 2 and samples.shape[0] > 0
                and samples.shape[1] == post.layout.dim):
            raise ValueError(f"samples must be a (K, {post.layout.dim}) tensor of flat parameter draws with K >= 1 "
                             f"(post.sample(K)), got {tuple(samples.shape) if isinstance(samples, Tensor) else samples!r}")
        finite_tensor("samples", samples)
        K = int(samples.shape[0])
        groups = (samples[i:i + group] for i in range(0, K, group))
    structure = read_model(post.model)
    regression = post.likelihood.regression
    chunks = _chunks(X, batch_size)
    acc: list[Any] = [0.0] * len(chunks)
    sq: list[Any] = [0.0] * len(chunks)
    with torch.no_grad():
        for thetas in groups:
            for theta in thetas:
                p = post.sample_params(theta)
                for j, xb in enumerate(chunks):
                    f = structure.functional_call(p, (xb,), post.buffers).to(post.dtype)  # float32 or wider
                    y = _link(post, f)
                    acc[j] = acc[j] + y
                    if regression:
                        sq[j] = sq[j] + y * y
    mean = torch.cat([a / K for a in acc])
    if regression:
        second = torch.cat([q / K for q in sq])
        return mean, (second - mean**2).clamp_min(0) + post.likelihood.sigma**2
    return mean


def _glm_setup(post: Any) -> dict[str, Any]:
    """What the GLM variance of ``post`` needs, once per call: the layer kinds' plan of the covered
    parameters with one :class:`~curvkit.laplace._glm.GLMTerm` per block (:func:`_jacobians.engine_variance`),
    and the posterior blocks whose parameters take per-sample Jacobian rows (:func:`_jacobians.generic_variance`).

    ``kron``: every block is a layer kind's block (the fit used them). ``diag``: the layer kinds' blocks where
    the model has them (raw parameters and models the layer kinds refuse, e.g. tied weights, take Jacobian
    rows), the posterior variances read through each block's index. ``full``: Jacobian rows."""
    N, lam = post._hyper()
    structure = read_model(post.model)
    setup: dict[str, Any] = {"structure": structure, "plans": [], "terms": [], "generic": []}
    if post.structure == "full":
        return _generic_setup(post, setup)
    try:
        with only_trainable(post.model, post.names):  # the plan covers exactly the posterior's parameters
            plans = layerkinds.plan(read_model(post.model), "Laplace GLM predictive")
    except UnsupportedModelError:
        if post.structure == "kron":
            raise
        return _generic_setup(post, setup)
    if post.structure == "kron":
        by_key = {}
        for b in post.blocks:
            for fac, term in zip(b.factors, b.glm_terms(N, lam)):
                if term is not None:  # a tied weight's two-term block takes Jacobian rows (below)
                    by_key[(fac.weight_name, fac.label if fac.index is not None else None)] = term
        # a sum of a shared parameter's uses (one dense block or two Kronecker terms, no use's own) takes
        # Jacobian rows, and so do the other blocks of the layers that use it
        def key(spec: Any) -> tuple[str, str | None]:
            return spec.weight, spec.label if spec.index is not None else None

        rows: set[str] = set()
        while True:
            dropped = {n for lp in plans if any(key(spec) not in by_key or rows & set(spec.names) for spec in lp.blocks)
                       for spec in lp.blocks for n in spec.names}
            grown = rows | {n for b in post.blocks if dropped & set(b.layout.names) for n in b.layout.names}
            if grown == rows:
                break
            rows = grown
        setup["plans"] = [lp for lp in plans if not rows & {n for spec in lp.blocks for n in spec.names}]
        setup["terms"] = [by_key[key(spec)] for lp in setup["plans"] for spec in lp.blocks]
        setup["generic"] = [(list(b.layout.names), b.generic_term(N, lam)) for b in post.blocks
                            if rows & set(b.layout.names)]
        return setup
    # raw parameters take Jacobian rows, and so do the layers that read a shared parameter (a tied weight's
    # variance has the cross terms between its uses, which blocks read one use at a time do not)
    shared = set(structure.shared_parameters)
    plans = [lp for lp in plans if not lp.handler.per_sample_copies
             and not shared & {n for spec in lp.blocks for n in spec.names}]
    covered = {n for lp in plans for spec in lp.blocks for n in spec.names}
    variances = torch.empty(post.layout.dim, dtype=post.dtype, device=post.device)
    for b, idx in zip(post.blocks, post._block_index):
        variances[idx] = b.variances(N, lam)
    terms: list[GLMTerm] = []
    for lp in plans:
        for spec in lp.blocks:
            s = BlockIndex(post.layout, spec.weight, spec.bias, post.device, spec.index).gather(variances[:, None])[..., 0]
            terms.append(GradTerm(inverse=s.reshape(-1)) if spec.form == "grad" else SpectralTerm(None, None, s))
    setup["plans"], setup["terms"] = plans, terms
    rest = [n for n in post.names if n not in covered]
    if rest:
        where = post.layout.slices()
        setup["generic"] = [(rest, GradTerm(inverse=torch.cat([variances[where[n]] for n in rest])))]
    return setup


def _generic_setup(post: Any, setup: dict[str, Any]) -> dict[str, Any]:
    """``setup`` changed to take every posterior block's Jacobian rows (no layer kinds' plan)."""
    N, lam = post._hyper()
    setup["plans"], setup["terms"] = [], []
    setup["generic"] = [(list(b.layout.names), b.generic_term(N, lam)) for b in post.blocks]
    return setup


def _variance_batch(post: Any, setup: dict[str, Any], xb: Inputs, diagonal: bool) -> tuple[Tensor, Tensor]:
    """(f, variances) of one batch of inputs: (B, *P, C) and (B, *P, C) or (B, *P, C, C). A ``diag`` posterior
    whose layer-kind pass is refused at run time (an activation that overwrites a layer's output in place)
    takes Jacobian rows instead."""
    structure = setup["structure"]
    if setup["plans"]:
        try:
            f, var = engine_variance(structure, setup["plans"], setup["terms"], post.params, post.buffers, xb,
                                     diagonal, post.dtype)
        except UnsupportedModelError:
            if post.structure == "kron":
                raise
            return _variance_batch(post, _generic_setup(post, setup), xb, diagonal)
    else:
        with torch.no_grad():
            f = structure.functional_call(post.params, (xb,), post.buffers)
        var = new_variance(f, post.dtype, diagonal)
    if not isinstance(f, Tensor) or f.dim() < 2:
        raise ValueError(f"the model must return (batch, outputs) or (batch, positions..., outputs), got "
                         f"{tuple(f.shape) if isinstance(f, Tensor) else type(f).__name__}")
    if setup["generic"]:
        generic_variance(structure, post.params, post.buffers, setup["generic"], xb, var, f.shape[-1], diagonal)
    shape = f.shape if diagonal else (*f.shape, f.shape[-1])
    if not diagonal:
        var = 0.5 * (var + var.transpose(-1, -2))
    return f.detach(), var.reshape(shape)


@differentiable()
def functional_variance(post: Any, X: Inputs, batch_size: int = 256, diagonal: bool = False) -> tuple[Tensor, Tensor]:
    """``(f*, J Sigma J^T)`` at the posterior mean, batch by batch: outputs (B, C) and their covariances
    (B, C, C), or with positions (B, *P, C) and per-position covariances (B, *P, C, C) (the positions'
    joint covariance is not formed); ``diagonal=True`` gives only the variances (B, *P, C), never forming
    C x C per position (what the probit and Gaussian predictives use). Memory: one batch's chunks of the
    Jacobian pieces (:mod:`curvkit.laplace._jacobians`)."""
    X = _check_inputs(post, X)
    setup = _glm_setup(post)
    parts = [_variance_batch(post, setup, xb, diagonal) for xb in _chunks(X, batch_size)]
    return torch.cat([f for f, _ in parts]), torch.cat([v for _, v in parts])


JVP_CLASSES = 512  # sampler='auto': above this many classes link='mc' samples through JVPs
JVP_OUTPUTS = 4096  # sampler='auto': above this many outputs per sample (positions x classes) link='probit' too


def _output_shape(post: Any, X: Inputs) -> tuple[int, ...]:
    """The model's output shape for one sample (*P, C), from a one-row pass."""
    with torch.no_grad():
        out = read_model(post.model).functional_call(post.params, (take_samples(X, slice(0, 1)),),
                                                     {n: b.clone() for n, b in post.buffers.items()})
    return tuple(out.shape[1:])


def _by_jvp(link: str, sampler: str, shape: tuple[int, ...]) -> bool:
    """Whether classification takes the forward-mode route (module docstring): asked for, or 'auto' with
    more than JVP_CLASSES classes (``mc``) or more than JVP_OUTPUTS outputs per sample (``mc``, ``probit``)."""
    if sampler != "auto":
        return sampler == "jvp"
    return math.prod(shape) > JVP_OUTPUTS or (link == "mc" and shape[-1] > JVP_CLASSES)


@differentiable()
def linearised_samples(post: Any, X: Inputs, deltas: Tensor) -> tuple[Tensor, Tensor]:
    """``(f*, f* + J delta_k)``: the outputs at the posterior mean (B, *P, C) and the linearised model's
    outputs for each flat parameter offset ``delta_k`` (rows of ``deltas`` (K, d), :attr:`layout` order),
    (K, B, *P, C): one ``torch.func.jvp`` per offset through the model (math attention kernels), no
    Jacobian formed."""
    structure = read_model(post.model)
    names = list(post.names)

    def f(*covered: Tensor) -> Tensor:
        params = dict(post.params)
        params.update(zip(names, covered))
        out: Tensor = structure.functional_call(params, (X,), post.buffers)
        return out

    primals = tuple(post.params[n] for n in names)
    f0: Tensor | None = None
    outs = []
    for delta in deltas:
        tangents = tuple(t.to(p.dtype) for t, p in zip(post.layout.unflatten(delta), primals))
        value, jd = torch.func.jvp(f, primals, tangents)[:2]
        f0 = value
        outs.append(value + jd)
    if f0 is None:
        raise ValueError("deltas must hold at least one row")
    return f0.detach(), torch.stack(outs).detach()


@differentiable()
def glm_predictive(post: Any, X: Inputs, link: Literal["probit", "mc"] = "probit", batch_size: int = 256,
                   num_samples: int = 100, generator: torch.Generator | None = None,
                   sampler: Literal["auto", "covariance", "jvp"] = "auto") -> Any:
    """The linearised predictive (module docstring); ``link`` for classification only. Outputs with
    positions give per-position predictions (B, *P, C). Batch by batch; the probit link and regression use
    only the variances of ``J Sigma J^T``; ``link='mc'`` samples the linearised outputs from the (C, C)
    covariance per position (``sampler='covariance'``) or by forward-mode products of posterior draws
    (``'jvp'``; ``'auto'``: ``jvp`` above ``JVP_CLASSES`` classes); with ``jvp`` the probit link's variances
    are the mean squares of ``num_samples`` such draws (``'auto'``: above ``JVP_OUTPUTS`` outputs per
    sample, for ``mc`` too). With ``jvp`` the posterior draws are the same for every chunk of ``X``."""
    lik = post.likelihood
    if link not in ("probit", "mc"):
        raise ValueError(f"link must be 'probit' or 'mc', got {link!r}")
    if sampler not in ("auto", "covariance", "jvp"):
        raise ValueError(f"sampler must be 'auto', 'covariance' or 'jvp', got {sampler!r}")
    S = integer("num_samples", num_samples)
    X = _check_inputs(post, X)
    if not lik.regression and (sampler == "jvp" or sampler == "auto") and \
            _by_jvp(link, sampler, _output_shape(post, X)):
        deltas = post.sample(S, generator) - post.mean
        out_jvp = []
        for xb in _chunks(X, batch_size):
            f, fs = linearised_samples(post, xb, deltas)
            if link == "mc":
                out_jvp.append(_link(post, fs).mean(0))
            else:  # probit with the variances of J delta (mean zero) estimated from the S draws
                V = (fs - f).square().mean(0)
                out_jvp.append(lik.probit_mean(f, V))
        return torch.cat(out_jvp)
    setup = _glm_setup(post)
    diagonal = lik.regression or link == "probit"
    out: list[Tensor] = []
    variances: list[Tensor] = []
    for xb in _chunks(X, batch_size):
        f, V = _variance_batch(post, setup, xb, diagonal)
        if lik.regression:
            out.append(f)
            variances.append(lik.predictive_variance(V))
        elif link == "probit":
            out.append(lik.probit_mean(f, V.clamp_min(0)))
        else:
            C = f.shape[-1]
            jitter = 1e-10 * (1 + V.diagonal(dim1=-2, dim2=-1).abs().amax(-1))[..., None, None]
            L, _ = torch.linalg.cholesky_ex(V + jitter * torch.eye(C, dtype=f.dtype, device=f.device))
            z = torch.randn(S, *f.shape, dtype=f.dtype, device=f.device, generator=generator)
            fs = f + (L @ z[..., None]).squeeze(-1)
            out.append(_link(post, fs).mean(0))
    if lik.regression:
        return torch.cat(out), torch.cat(variances)
    return torch.cat(out)


def predictive_nll(post: Any, prediction: Any, y: Tensor) -> float:
    """Mean negative log predictive density of targets ``y`` under ``prediction`` (what
    :func:`mc_predictive`/:func:`glm_predictive` returned; regression uses the Gaussian with the predicted
    mean and variance): the mean over samples, or with positions over the counted positions (padding, the
    likelihood's ``ignore_index``/``ignore_value``, left out)."""
    lik = post.likelihood
    y = y.to(post.device)
    terms = lik.predictive_nll_terms(prediction, y)
    keep = lik.mask(y)
    if keep is None:
        return float(terms.mean())
    count = int(keep.sum())
    if count == 0:
        raise ValueError("predictive_nll: every position of y is padding; there is nothing to score")
    return float(terms[keep].sum() / count)
