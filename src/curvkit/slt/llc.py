"""Local learning coefficient λ̂(w*) and WBIC from SGLD draws (paper section 2.2, eq. 18-21).

Estimator (paper eq. 19, as devinterp computes it; the paper's authors used devinterp):

    λ̂(w*) = nβ ( E^β_{w|w*}[ L(w) ] - L(w*) ),

where the expectation is the mean over the kept SGLD draws of the minibatch loss (evaluated before
each step's update) and L(w*) is the *reference (initial) loss*, chosen by ``config.init_loss`` unless
given explicitly:

* ``"minibatch"`` (default): the mean loss at w* over the first minibatch of every chain's stream
  (``num_chains`` batches; with ``shared_batches`` the first shared batch). devinterp 2.0.1 instead
  averages its first ``num_init_loss_batches`` = 32 batches (of its shared stream).
* ``"full"``: the full-data loss L_n(w*), no estimation error.
* ``estimate_llc(..., init_loss=value)``: a number computed elsewhere, e.g. the same L(w*) for
  several runs or implementations that are to be compared (the benchmark gives every arm L_n(w*)).

L(w*) is subtracted from every chain's mean, so its estimation error is shared by all chains: it
shifts λ̂ by nβ·(error) and is *not* in the spread over chains. For the MLP of
``benchmarks/llc.py`` (nβ = 128/ln 128 = 26.4, per-example loss std 0.61 at w*) four minibatches of
128 carry an error of 0.71 in λ̂ (devinterp's 32 batches: 0.25), as large as the standard error over
four chains, which is why ``"full"`` or an explicit value is preferable when estimates are compared.

Per chain c: λ̂_c = nβ (mean_t ℓ_{c,t} - L(w*)); the estimate is the mean over chains, reported with
the standard deviation over chains (ddof = 1; devinterp's ``llc_std`` uses ddof = 0) and its standard
error std/sqrt(C). Statistics that one chain cannot give are undefined, never 0: with ``num_chains=1``
``llc_std``, ``llc_stderr`` and ``rhat`` are NaN (and ``None`` in :meth:`LLCResult.to_dict`, JSON's
null); R-hat is NaN too for fewer than two draws or constant traces.

Where devinterp 2.0.1 (``devinterp.slt.llc.llc``/``sample``) differs, beyond L(w*) above: its update,
noise and nβ are the same as here, and so is the recorded loss (the minibatch mean before each update);
but its chains share one minibatch sequence by default (``SGLDConfig(shared_batches=True)`` here),
replay the first shuffled epoch instead of reshuffling (``epoch_mode="cycle"``; same expectation),
its ``compute_llc`` averages the losses of *every* step including burn-in (here burn-in steps are
dropped; identical at ``num_burnin=0``), and its ``llc_std`` is the ddof = 0 spread.

WBIC (paper eq. 18, devinterp ``OnlineWBICEstimator``) = n · mean over all draws of the sampled loss,
n = data-set size. It is Watanabe's WBIC only when sampled at nβ = n/ln n (``nbeta="n/log n"``,
γ -> 0); the paper's numbers used nβ = m/ln m. The value of nβ is recorded in every result.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.func import grad_and_value, vmap

from curvkit.slt.sampler import (
    MinibatchStream,
    SGLDConfig,
    chunked_grad_fn,
    chunked_loss,
    count,
    model_params,
    module_loss_fn,
    run_sgld,
    stacked_mlp_grad_fn,
)
from curvkit.structure import differentiable, read_model, uncompiled
from curvkit.validation import (
    describe_inputs,
    finite_tensor,
    input_tensors,
    nonnegative,
    num_samples,
    positive,
    take_samples,
)


@dataclass
class LLCResult:
    """λ̂ with its per-chain values and per-draw traces (all (C, T) tensors are float64, on CPU).

    ``llc_std`` (ddof = 1), ``llc_stderr`` and ``rhat`` need at least two chains: with one chain they are
    NaN (undefined, not zero), and :meth:`to_dict` writes them as ``None``.
    """

    llc_mean: float
    llc_std: float
    llc_per_chain: Tensor  # (C,)
    loss_trace: Tensor  # (C, T) sampled losses
    init_loss: float
    nbeta: float
    n: int
    batch_size: int
    config: SGLDConfig
    seconds: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def num_chains(self) -> int:
        return int(self.loss_trace.shape[0])

    @property
    def llc_stderr(self) -> float:
        return self.llc_std / math.sqrt(self.num_chains) if self.num_chains > 1 else math.nan

    @property
    def llc_trace(self) -> Tensor:
        """(C, T) per-draw values nβ (ℓ_t - L(w*))."""
        return self.nbeta * (self.loss_trace - self.init_loss)

    @property
    def moving_average(self) -> Tensor:
        """(C, T) running estimate nβ (mean_{s<=t} ℓ_s - L(w*)); its last column is λ̂_c."""
        T = self.loss_trace.shape[1]
        cum = self.loss_trace.cumsum(dim=1) / torch.arange(1, T + 1, dtype=torch.float64)
        return self.nbeta * (cum - self.init_loss)

    @property
    def wbic(self) -> float:
        """n · mean sampled loss (devinterp's online WBIC), at this result's nβ."""
        return float(self.n * self.loss_trace.mean())

    @property
    def rhat(self) -> float:
        """Gelman-Rubin potential scale reduction of the loss traces (needs >= 2 chains)."""
        return gelman_rubin(self.loss_trace)

    def to_dict(self, traces: bool = False) -> dict[str, Any]:
        """A JSON-ready dict; undefined statistics (NaN: ``llc_std``, ``llc_stderr``, ``rhat`` of one chain)
        are ``None``."""
        out: dict[str, Any] = {
            "llc_mean": self.llc_mean, "llc_std": _defined(self.llc_std), "llc_stderr": _defined(self.llc_stderr),
            "llc_per_chain": self.llc_per_chain.tolist(), "init_loss": self.init_loss,
            "nbeta": self.nbeta, "n": self.n, "batch_size": self.batch_size, "wbic": self.wbic,
            "rhat": _defined(self.rhat), "seconds": self.seconds, "config": self.config.to_dict(), **self.extra,
        }
        if traces:
            out["loss_trace"] = self.loss_trace.tolist()
        return out


def _defined(x: float) -> float | None:
    return None if math.isnan(x) else x


def gelman_rubin(traces: Tensor) -> float:
    """R-hat of (C, T) traces: sqrt(((T-1)/T W + B/T) / W); NaN for one chain or constant traces."""
    C, T = traces.shape
    if C < 2 or T < 2:
        return math.nan
    x = traces.to(torch.float64)
    W = x.var(dim=1, unbiased=True).mean()
    B = T * x.mean(dim=1).var(unbiased=True)
    if W <= 0:
        return math.nan
    return float(torch.sqrt(((T - 1) / T * W + B / T) / W))


def _summarise(losses: Tensor, init_loss: float, nbeta: float, n: int, m: int, cfg: SGLDConfig,
               seconds: float, extra: dict[str, Any] | None = None) -> LLCResult:
    per_chain = nbeta * (losses.mean(dim=1) - init_loss)
    std = float(per_chain.std(unbiased=True)) if per_chain.numel() > 1 else math.nan  # undefined for one chain
    return LLCResult(float(per_chain.mean()), std, per_chain, losses, float(init_loss), nbeta, n, m, cfg,
                     seconds, extra or {})


Criterion = Callable[[Tensor, Tensor], Tensor]
LossKind = str  # "cross_entropy" | "mse_half" | "likelihood" | "callable"

#: the most data rows (summed over the chains) one forward/backward pass of :func:`estimate_llc` takes
DEFAULT_MAX_ROWS = 8192
_PROBE_ROWS = 256


def _mse_half(f: Tensor, y: Tensor) -> Tensor:
    return 0.5 * ((f - y) ** 2).sum(dim=-1).mean() if f.dim() > 1 else 0.5 * ((f - y) ** 2).mean()


def _criterion(loss: str | Criterion | Any) -> tuple[Criterion, LossKind]:
    if hasattr(loss, "nll_per_sample"):  # a curvkit Likelihood: the per-sample mean, whatever its reduction
        return (lambda f, y: loss.nll_per_sample(f, y).mean()), "likelihood"
    if callable(loss):
        return loss, "callable"
    if loss == "cross_entropy":
        return torch.nn.functional.cross_entropy, "cross_entropy"
    if loss == "mse_half":
        return _mse_half, "mse_half"
    raise ValueError(f"unknown loss {loss!r}; pass 'cross_entropy', 'mse_half', a Likelihood or a callable")


def _vmap_or_loop(loss_fn: Any, chain_axis: int | None) -> Any:
    """The chains' gradients and losses, ``vmap``-ped over the chain axis of the parameters (and of the batch
    when the chains have their own); a model whose forward cannot be ``vmap``-ped (data-dependent control
    flow, as Hugging Face's mask code checks ``mask.all()``) takes them one chain at a time from the first
    failure on (the same numbers)."""
    batched = vmap(grad_and_value(loss_fn), in_dims=(0, chain_axis))
    one = grad_and_value(loss_fn)
    loop = False

    def fn(params: dict[str, Tensor], batch: Any) -> tuple[dict[str, Tensor], Tensor]:
        nonlocal loop
        if not loop:
            try:
                return batched(params, batch)  # type: ignore[no-any-return]
            except RuntimeError as err:
                if "vmap" not in str(err):
                    raise
                loop = True
        C = next(iter(params.values())).shape[0]
        outs = [one({k: v[c] for k, v in params.items()},
                    batch if chain_axis is None else (take_samples(batch[0], c), batch[1][c])) for c in range(C)]
        return {k: torch.stack([g[k] for g, _ in outs]) for k in params}, torch.stack([v for _, v in outs])

    return fn


def _dataset(data: Any, device: torch.device) -> tuple[Any, Tensor]:
    """(X, y) on ``device`` from one pair or an iterable of pairs (read once, concatenated in order); X a
    tensor or a mapping of tensors (concatenated key by key)."""
    from curvkit.validation import iter_batches

    if isinstance(data, list) and len(data) == 2 and all(isinstance(t, Tensor) for t in data):
        data = (data[0], data[1])  # [X, y], accepted before iterables were
    batches = list(iter_batches(data, device, mappings=True))
    if len(batches) == 1:
        return batches[0]

    def signature(X: Any, y: Tensor) -> Any:
        return ([(k, tuple(t.shape[1:]), t.dtype) for k, t in input_tensors(X, "X")], tuple(y.shape[1:]), y.dtype)

    first = signature(*batches[0])
    for i, (Xb, yb) in enumerate(batches[1:], start=1):
        if signature(Xb, yb) != first:
            raise ValueError(f"batch {i} of data does not match batch 0: inputs {describe_inputs(Xb)} and targets "
                             f"{tuple(yb.shape)} {yb.dtype}, against {describe_inputs(batches[0][0])} and "
                             f"{tuple(batches[0][1].shape)} {batches[0][1].dtype}; every batch must have the same keys, "
                             "per-sample shapes and dtypes")
    X0 = batches[0][0]
    X: Any = (torch.cat([b[0] for b in batches]) if isinstance(X0, Tensor)  # type: ignore[misc]
              else {k: torch.cat([b[0][k] for b in batches]) for k in X0})  # type: ignore[index]
    return X, torch.cat([b[1] for b in batches])


def _check_targets(kind: LossKind, loss: Any, f: Tensor, y: Tensor) -> None:
    """Targets ``y`` (all n of them) against the model output ``f`` at w* on the first rows."""
    n = y.shape[0]
    if kind == "likelihood":
        loss.check(f, y[:f.shape[0]])
        loss.check(f[:1].expand(n, *f.shape[1:]), y)  # the other targets' shapes and values
        return
    if kind == "cross_entropy":
        if f.dim() != 2:
            raise ValueError(f"loss='cross_entropy' needs model outputs of shape (batch, classes), got "
                             f"{tuple(f.shape)}; flatten the logits inside the model (e.g. end with nn.Flatten())")
        K = f.shape[1]
        if not y.dtype.is_floating_point and y.dtype not in (torch.bool, torch.complex64, torch.complex128):
            if y.dim() != 1:
                raise ValueError(f"loss='cross_entropy': class-index targets must have shape (n,) = ({n},), got "
                                 f"{tuple(y.shape)}; pass y.view(-1) (one class index per sample)")
            lo, hi = int(y.min()), int(y.max())
            if lo < 0 or hi >= K:
                raise ValueError(f"loss='cross_entropy': class-index targets must lie in [0, {K - 1}] for a model "
                                 f"with {K} outputs, got values in [{lo}, {hi}]; relabel the classes as 0..{K - 1} "
                                 "or give the model one output per class")
            return
        if y.dtype.is_floating_point and tuple(y.shape) == (n, K):
            tol = 1e3 * torch.finfo(y.dtype).eps
            if bool((y < 0).any()) or not bool(((y.sum(dim=1) - 1).abs() <= tol).all()):
                raise ValueError(f"loss='cross_entropy': class-probability targets of shape ({n}, {K}) must be >= 0 "
                                 "and sum to 1 for every sample (otherwise the loss is not a cross-entropy); pass "
                                 "normalised probabilities or integer class indices")
            return
        raise ValueError(f"loss='cross_entropy' takes integer class indices of shape ({n},) or class probabilities "
                         f"of shape ({n}, {K}), got {y.dtype} targets of shape {tuple(y.shape)}; for class labels "
                         "stored as floats pass y.long()")
    if kind == "mse_half":
        if y.shape[1:] != f.shape[1:]:
            raise ValueError(f"loss='mse_half': each target must have the shape of the model's output for one "
                             f"sample, {tuple(f.shape[1:])}, got {tuple(y.shape[1:])} (targets {tuple(y.shape)}); "
                             "broadcasting them would measure a different loss. Reshape the targets (e.g. "
                             "y.view(n, -1)) or one-hot encode class labels")
        if not (y.dtype.is_floating_point or y.dtype in (torch.int8, torch.int16, torch.int32, torch.int64,
                                                         torch.uint8)):
            raise ValueError(f"loss='mse_half' needs real-valued targets, got {y.dtype}")


def _check_mean(criterion: Criterion, f: Tensor, y: Tensor) -> None:
    """A callable loss must be a mean over the batch: L(batch) = size-weighted mean of L over its halves."""
    r = f.shape[0]
    if r < 2:
        return
    a = r // 2
    whole = float(criterion(f, y))
    parts = (a * float(criterion(f[:a], y[:a])) + (r - a) * float(criterion(f[a:], y[a:]))) / r
    tol = 1e3 * torch.finfo(f.dtype).eps * (abs(whole) + abs(parts)) + 1e-30
    if abs(whole - parts) > tol:
        raise ValueError(f"the loss must be the MEAN per-sample loss over the batch: on {r} samples it is {whole:.6g} "
                         f"but the size-weighted mean of its values on the two halves is {parts:.6g}. A summed loss "
                         "(reduction='sum') would multiply the LLC by the batch size; use reduction='mean'")


@differentiable()
def estimate_llc(
    model: nn.Module,
    data: Any,
    loss: str | Criterion | Any = "cross_entropy",
    batch_size: int | None = 128,
    config: SGLDConfig | None = None,
    seed: int = 0,
    generator: torch.Generator | None = None,
    init_loss: float | None = None,
    vectorise: str = "auto",
    max_rows: int | None = DEFAULT_MAX_ROWS,
    distributed: Any = None,
    distributed_split: str = "chains",
) -> LLCResult:
    """λ̂(w*) of ``model`` at its current parameters w* on the data set D_n.

    ``data``: an ``(X (n, ...), y (n, ...))`` pair, or any iterable of ``(X, y)`` batches (a list, a
    ``torch.utils.data.DataLoader``), as the curvature operators take it; ``X`` a tensor or a mapping of
    tensors sharing the sample dimension (a Hugging Face batch ``{"input_ids", "attention_mask"}`` through
    :class:`curvkit.hf.HuggingFace`, the labels as the pair's ``y``: ``(batch, batch.pop("labels"))``), whose
    minibatches are the same rows of every tensor. An iterable is read ONCE, its
    batches validated and concatenated in the order it yields them into D_n (n = all its rows; tensors
    are moved to the model's device), so the result is exactly the one for the concatenated pair. The
    SGLD minibatches of ``batch_size`` rows are then drawn from D_n by curvkit's own seeded sampler: the
    loader's batch size, sampler and shuffling are not used, and ``seed`` (or ``generator``) alone fixes
    the numbers, provided the loader yields the rows in a fixed order (``shuffle=False``, or a seeded
    loader ``generator``; a shuffled order changes which rows each minibatch gets).

    ``loss`` is the *mean* per-sample loss: ``"cross_entropy"`` (default, the paper's; targets are class
    indices in [0, K-1] of shape (n,) or class probabilities (n, K)), ``"mse_half"`` (½||f - y||²,
    Gaussian NLL up to a constant; targets have the output's shape), a curvkit Likelihood (its per-sample
    NLL averaged over the batch whatever its ``reduction``; targets checked by its ``check``), or a
    callable (f, y) -> scalar, which must be a mean over the batch (checked on the first rows: a summed
    loss is refused). Targets, inputs and the model's output at w* are validated before sampling; NaN/inf
    data are refused. ``batch_size=None`` uses full-batch gradients. The model is not modified; a model
    with Dropout or BatchNorm in training mode is refused (call ``model.eval()``).

    Memory: one SGLD step evaluates the model on ``num_chains`` x ``batch_size`` rows (x n with
    ``batch_size=None``). Batches larger than ``max_rows`` rows summed over the chains (default
    8192; pieces of ``max_rows // num_chains`` rows per chain) are processed in pieces whose gradients and
    losses are combined with weights (piece size)/(batch size): the same numbers up to rounding, with
    peak memory bounded by a piece instead of the batch (the data set itself is held once). Lower
    ``max_rows`` for wide or convolutional models; ``max_rows=None`` processes every batch whole.

    ``init_loss``: the reference loss L(w*) as a number (it overrides ``config.init_loss``; the
    sampling itself is unchanged). Use it to give several estimates the same L(w*), e.g. the
    full-data loss computed once, or devinterp's value when comparing with it.
    ``vectorise``: ``"auto"`` uses :func:`curvkit.slt.sampler.stacked_mlp_grad_fn` for MLP chains
    (``curvkit.structure.read_model(model).mlp_chain``) on tensor inputs and ``vmap`` over the chains otherwise;
    ``"vmap"`` always uses ``vmap`` (same numbers up to rounding). A forward that ``vmap`` cannot take
    (data-dependent control flow: Hugging Face's mask code) runs one chain at a time (same numbers).
    ``distributed``: a :class:`curvkit.distributed.Reducer`; every rank passes the whole data set and
    gets the same result. ``distributed_split='chains'`` (default) spreads the chains over the ranks (seeds
    derived from ``seed`` per rank), ``'batch'`` computes each SGLD gradient data-parallel within the
    chains (:mod:`curvkit.slt._distributed`).
    """
    if distributed is not None and distributed_split not in ("chains", "batch"):
        raise ValueError(f"distributed_split must be 'chains' or 'batch', got {distributed_split!r}")
    if distributed is not None and distributed_split == "chains":
        from curvkit.slt._distributed import estimate_llc_chains

        return estimate_llc_chains(distributed, model, data, config=config, seed=seed, init_loss=init_loss,
                                   loss=loss, batch_size=batch_size, generator=generator, vectorise=vectorise,
                                   max_rows=max_rows)
    cfg = config or SGLDConfig()
    if not isinstance(cfg, SGLDConfig):
        raise TypeError(f"config must be an SGLDConfig, got {type(cfg).__name__}")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    model = uncompiled(model)  # a compiled model: the module it compiles (same parameters)
    if vectorise not in ("auto", "vmap"):
        raise ValueError(f"vectorise must be 'auto' or 'vmap', got {vectorise!r}")
    if init_loss is not None:
        if isinstance(init_loss, str):
            raise ValueError(f"init_loss must be a finite number (the reference loss L(w*)), got {init_loss!r}; "
                             "to choose how L(w*) is computed use SGLDConfig(init_loss='full' or 'minibatch')")
        if not math.isfinite(float(init_loss)):
            raise ValueError(f"init_loss must be a finite number (the reference loss L(w*)), got {init_loss}")
    if batch_size is not None:
        batch_size = count("batch_size", batch_size)
    rows = count("max_rows", max_rows) if max_rows is not None else None
    structure = read_model(model)
    structure.require_deterministic("estimate_llc")
    structure.require_independent_samples("estimate_llc")
    w_star = model_params(model)
    if not w_star:
        raise ValueError("estimate_llc: the model has no trainable parameters (requires_grad=True)")
    for k, v in w_star.items():
        if not bool(torch.isfinite(v).all()):
            raise ValueError(f"parameter {k!r} of the model at w* contains NaN/inf")
    device = next(iter(w_star.values())).device
    X, y = _dataset(data, device)
    for what, t in input_tensors(X, "data inputs X"):
        if t.is_floating_point():
            finite_tensor(what, t)
    if y.is_floating_point():
        finite_tensor("data targets y", y)
    gen = generator if generator is not None else torch.Generator().manual_seed(seed)
    crit, kind = _criterion(loss)
    loss_fn = module_loss_fn(model, crit)
    # the model's output at w* on the first rows: its shape, finiteness, the targets, the loss's form
    probe = _PROBE_ROWS if rows is None else min(_PROBE_ROWS, rows)
    X0, y0 = take_samples(X, slice(0, probe)), y[:probe]
    buffers = {k: v.detach().clone() for k, v in model.named_buffers()}
    try:
        with torch.no_grad():
            f0 = structure.functional_call(w_star, (X0,), buffers)
    except RuntimeError as err:
        what = (f"shape {tuple(X.shape)}, {X.dtype}" if isinstance(X, Tensor) else describe_inputs(X))
        raise ValueError(f"estimate_llc: the model cannot be evaluated on the inputs ({what}, on "
                         f"{y.device}): {type(err).__name__}: {err}; make the inputs' per-sample "
                         "shape, dtype and device match the model") from err
    b0 = num_samples(X0)
    if not isinstance(f0, Tensor) or f0.dim() == 0 or f0.shape[0] != b0:
        shape = tuple(f0.shape) if isinstance(f0, Tensor) else type(f0).__name__
        raise ValueError(f"estimate_llc: the model must return one tensor with a leading batch dimension "
                         f"({b0}, ...) for inputs of shape {describe_inputs(X0)}, got {shape}")
    if not bool(torch.isfinite(f0).all()):
        raise ValueError("estimate_llc: the model's output at w* contains NaN or inf on the first "
                         f"{b0} samples; check the model's parameters and the inputs")
    _check_targets(kind, loss, f0, y)
    if kind == "cross_entropy" and not y.is_floating_point() and y.dtype != torch.int64:
        y, y0 = y.long(), y0.long()  # torch's cross_entropy takes int64 class indices only
    with torch.no_grad():
        value0 = crit(f0, y0)
    if not isinstance(value0, Tensor) or value0.dim() != 0:
        shape = tuple(value0.shape) if isinstance(value0, Tensor) else type(value0).__name__
        raise ValueError(f"the loss must return a 0-dimensional tensor (the mean per-sample loss over the "
                         f"batch), got shape {shape}; reduce it with .mean()")
    if kind == "callable":
        with torch.no_grad():
            _check_mean(crit, f0, y0)
    stream = MinibatchStream(X, y, batch_size, cfg.num_chains, gen, shared=cfg.shared_batches)
    n, m = stream.n, stream.m
    nbeta = cfg.resolve_nbeta(m, n)
    big = rows if rows is not None else n * cfg.num_chains + 1  # rows of one no-grad evaluation
    per_chain = max(1, big // cfg.num_chains)  # rows per chain of one SGLD forward/backward pass
    # L(w*): given, the full-data loss, or the mean over the first batch of every chain's stream (the
    # same batches those chains then start from; one batch when the chains share their batches).
    with torch.no_grad():
        if init_loss is not None:
            init = float(init_loss)
            first = None
        elif cfg.init_loss == "full" or stream.full:
            init = float(chunked_loss(loss_fn, w_star, (X, y), big))
            first = None
        else:
            xb, yb = next(stream)
            if stream.chain_axis is None:
                init = float(chunked_loss(loss_fn, w_star, (xb, yb), big))
            else:
                init = float(torch.stack([chunked_loss(loss_fn, w_star, (take_samples(xb, c), yb[c]), big)
                                          for c in range(cfg.num_chains)]).mean())
            first = (xb, yb)
    if not math.isfinite(init):
        raise ValueError(f"the loss at w* is {init}; check the model and the data")

    def batches() -> Any:
        nonlocal first
        if first is not None:
            b, first = first, None
            return b
        return next(stream)

    grad_fn = (stacked_mlp_grad_fn(model, crit, stream.chain_axis, input_shape=tuple(X.shape[1:]))
               if vectorise == "auto" and isinstance(X, Tensor) else None)
    if grad_fn is None:
        grad_fn = _vmap_or_loop(loss_fn, stream.chain_axis)
    step_fn = chunked_grad_fn(grad_fn, stream.chain_axis, per_chain)
    if distributed is not None:  # distributed_split='batch': this rank's rows, gradients all-reduced
        from curvkit.slt._distributed import sharded_grad_fn

        step_fn = sharded_grad_fn(step_fn, stream.chain_axis, distributed)
    run = run_sgld(loss_fn, w_star, batches, stream.chain_axis, cfg, nbeta, gen, grad_fn=step_fn)
    return _summarise(run.losses, init, nbeta, n, m, cfg, run.seconds)


@differentiable()
def estimate_llc_potential(
    potential: Callable[[Tensor], Tensor],
    w_star: Tensor,
    config: SGLDConfig,
    seed: int = 0,
    n: int = 1,
) -> LLCResult:
    """λ̂ for an explicit deterministic loss L(w) of a flat parameter vector (toy singular models).

    ``config.nbeta`` must be a number here (there is no batch or data size). ``n`` only scales WBIC.
    """
    if isinstance(config.nbeta, str):
        raise ValueError("estimate_llc_potential needs a numeric nbeta (there is no data set to size it)")
    n = count("n", n)
    if not isinstance(w_star, Tensor) or not w_star.is_floating_point():
        raise ValueError(f"w_star must be a floating-point tensor, got "
                         f"{w_star.dtype if isinstance(w_star, Tensor) else type(w_star).__name__}")
    finite_tensor("w_star", w_star)
    gen = torch.Generator().manual_seed(seed)
    nbeta = float(config.nbeta)

    def loss_fn(params: dict[str, Tensor], batch: Any) -> Tensor:
        return potential(params["w"])

    with torch.no_grad():
        value = potential(w_star.detach())
    if not isinstance(value, Tensor) or value.dim() != 0:
        shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
        raise ValueError(f"the potential must return a 0-dimensional tensor L(w), got shape {shape}")
    init = float(value)
    if not math.isfinite(init):
        raise ValueError(f"the potential at w_star is {init}; it must be finite there")
    run = run_sgld(loss_fn, {"w": w_star.detach()}, lambda: None, None, config, nbeta, gen)
    return _summarise(run.losses, init, nbeta, n, 0, config, run.seconds)


def quadratic_llc(eigenvalues: Tensor, nbeta: float, gamma: float, epsilon: float = 0.0) -> float:
    """λ̂ predicted for a quadratic loss ½ Σ h_i u_i² sampled exactly by SGLD (derived, not in the paper; the
    draws are Gaussian there, so their mean has a closed form):

        λ̂ = ½ Σ_i nβ h_i / (a_i (1 - ε a_i / 4)),   a_i = nβ h_i + γ,

    (ε = 0 gives the continuous-time value ½ Σ nβh_i/(nβh_i + γ) = ½ N_eff(H, γ/nβ)). Eigenvalues
    h_i <= 0 are dropped (the quadratic picture does not hold in those directions).
    """
    nbeta = positive("nbeta", nbeta)
    gamma = nonnegative("gamma", gamma)
    epsilon = nonnegative("epsilon", epsilon)
    h = finite_tensor("eigenvalues", eigenvalues).to(torch.float64)
    h = h[h > 0]
    a = nbeta * h + gamma
    if epsilon > 0 and bool((epsilon * a >= 4).any()):
        raise ValueError(f"epsilon={epsilon} is beyond the SGLD stability limit 4/(nbeta*h_max + gamma)")
    return float(0.5 * (nbeta * h / (a * (1 - epsilon * a / 4))).sum())
