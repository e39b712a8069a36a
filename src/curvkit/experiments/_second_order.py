"""Shared machinery of the thesis chapter-4 experiments (``autoencoder``, ``alignment``, ``mixture``).

* Data: the bundled MNIST as autoencoder targets (grey values in [0, 1] read as Bernoulli means) or as
  odd/even labels; CURVES and FACES from user-supplied files (:func:`load_user_dataset`; they cannot be
  downloaded offline).
* Models: the thesis's architectures with the Glorot-uniform initialisation (Glorot & Bengio 2010; zero
  biases) drawn from a seed, so every optimiser starts from the same weights.
* :class:`RunSpec` / :func:`train_run`: one optimiser run (the damped Gauss-Newton optimiser, or Adam with
  the thesis's "halve the learning rate every T updates" schedule) on a :class:`Task`, every run seeing the
  same sequence of minibatches. A run checkpoints atomically every ``checkpoint_every`` updates (model,
  optimiser, minibatch generator, curves) and writes ``result.pt`` when it finishes, so an interrupted run
  resumes where it stopped and produces the same numbers as an uninterrupted one, and a finished run is
  never redone. Divergence (a non-finite loss, or a step the optimiser refuses) ends a run and is
  recorded, not hidden.
* Curves: the minibatch objective E (loss + weight decay) before every update, the cumulative training
  wall-clock (evaluation and checkpointing excluded), and a full evaluation of the task's metrics on a
  fixed subset of the training set every ``eval_every`` updates.
* Summaries: smoothing with a window of 10 (as thesis Fig. 4.1), the top-k average of a first-order grid,
  values at a given update or wall-clock time.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from curvkit import checkpoint
from curvkit.likelihoods import Likelihood
from curvkit.optim import GaussNewton
from curvkit.structure import UnsupportedModelError

__all__ = [
    "RunSpec", "Task", "adam_grid", "glorot_", "load_mnist", "load_user_dataset", "smooth", "topk_mean",
    "train_run", "value_at",
]

MNIST_TRAIN = 50_000  # thesis Sec. 4.5: the first 50,000 training images
#: in the keys of stored Gauss-Newton runs: 2 = ``ema=None`` is the current minibatch's curvature (issue 24)
GAUSS_NEWTON_FORMAT = 2


# ---------------------------------------------------------------------------------------------- data
def load_mnist(n: int | None = MNIST_TRAIN, dtype: torch.dtype = torch.float32) -> tuple[Tensor, Tensor]:
    """The first ``n`` bundled MNIST training images flattened to (n, 784) in [0, 1], and their digits."""
    from curvkit.data import mnist, transforms

    X, y = mnist(train=True)
    X = transforms.flatten(transforms.to_unit(X, dtype))
    return (X, y) if n is None else (X[:n], y[:n])


_USER_DATA = {
    # name: (environment variable, input dimension, value range, thesis training-set size)
    "curves": ("CURVKIT_CURVES", 784, (0.0, 1.0), 20_000),
    "faces": ("CURVKIT_FACES", 625, (-math.inf, math.inf), 103_500),
}


def load_user_dataset(name: str, path: str | os.PathLike[str] | None = None) -> Tensor | None:
    """CURVES or FACES (Hinton & Salakhutdinov 2006) as a float32 (N, D) matrix of training images, from a
    user-supplied file: ``path``, else the environment variable ``CURVKIT_CURVES`` / ``CURVKIT_FACES``.

    Accepted files: ``.npy`` (an (N, D) array), ``.npz`` (the array ``train``, else the only array) or a
    MATLAB ``.mat`` file (the only 2-D numeric array with D columns or D rows; e.g. ``curves.mat`` or
    ``newfaces_rot_single.mat``), D = 784 (CURVES, values in [0, 1]) or 625 (FACES). Returns None when
    neither ``path`` nor the variable is given (the experiment then reports the dataset as not run);
    raises ``FileNotFoundError``/``ValueError`` naming the file when it is given but unusable.
    """
    if name not in _USER_DATA:
        raise ValueError(f"unknown dataset {name!r}; user-supplied datasets: {sorted(_USER_DATA)}")
    env, D, (lo, hi), n_thesis = _USER_DATA[name]
    where = path if path is not None else (os.environ.get(env) or None)
    if where is None:
        return None
    p = Path(where).expanduser()
    if not p.is_file():
        raise FileNotFoundError(f"{name.upper()}: {p} (from {'path' if path is not None else env}) is not a file; "
                                f"give a .npy/.npz/.mat file with the (N, {D}) training images")
    if p.suffix == ".npy":
        arr = np.load(p, allow_pickle=False)
    elif p.suffix == ".npz":
        with np.load(p, allow_pickle=False) as z:
            keys = list(z.keys())
            if "train" in keys:
                arr = z["train"]
            elif len(keys) == 1:
                arr = z[keys[0]]
            else:
                raise ValueError(f"{name.upper()}: {p} holds arrays {keys}; name the training images 'train'")
    elif p.suffix == ".mat":
        from scipy.io import loadmat

        mats = [v for k, v in loadmat(p).items() if not k.startswith("__") and isinstance(v, np.ndarray)
                and v.ndim == 2 and np.issubdtype(v.dtype, np.number) and D in v.shape]
        if len(mats) != 1:
            raise ValueError(f"{name.upper()}: {p} must hold exactly one 2-D numeric array with {D} columns or "
                             f"rows, found {len(mats)}")
        arr = mats[0] if mats[0].shape[1] == D else mats[0].T
    else:
        raise ValueError(f"{name.upper()}: {p} has suffix {p.suffix!r}; use .npy, .npz or .mat")
    if arr.ndim != 2 or arr.shape[1] != D:
        raise ValueError(f"{name.upper()}: {p} holds an array of shape {arr.shape}, expected (N, {D})")
    X = torch.from_numpy(np.ascontiguousarray(arr, dtype=np.float32))
    if not bool(torch.isfinite(X).all()) or float(X.min()) < lo or float(X.max()) > hi:
        raise ValueError(f"{name.upper()}: {p} has values outside [{lo}, {hi}] or non-finite entries")
    return X[:n_thesis]


# ---------------------------------------------------------------------------------------------- models
def glorot_(model: nn.Module, seed: int) -> nn.Module:
    """Glorot-uniform weights U(-b, b), b = sqrt(6 / (fan_in + fan_out)), and zero biases, drawn from
    ``torch.Generator().manual_seed(seed)`` (thesis Sec. 4.5: identical initialisation for every optimiser)."""
    g = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                b = math.sqrt(6.0 / (m.in_features + m.out_features))
                w = torch.rand(m.weight.shape, generator=g, dtype=torch.float64) * 2 * b - b
                m.weight.copy_(w.to(m.weight.dtype))
                if m.bias is not None:
                    m.bias.zero_()
    return model


# ---------------------------------------------------------------------------------------------- runs
@dataclass(frozen=True)
class RunSpec:
    """One optimiser run.

    ``kind='gauss_newton'`` uses :class:`curvkit.optim.GaussNewton` with the thesis's default damping
    (``curvature``, ``ema``, ``inversion``; everything else at its default; ``ema=None`` is the curvature of
    the current minibatch, the thesis's solid curves, ``0.9`` its dashed ones); ``kind='adam'`` uses
    ``torch.optim.Adam`` (default betas, eps) with learning rate ``lr`` halved every ``halving`` updates
    (None: never); ``kind='adamw'`` the same schedule with ``torch.optim.AdamW`` (decoupled weight decay:
    each update also shrinks the weights by ``lr * weight_decay``, Loshchilov & Hutter 2019).
    ``options``: further keyword arguments of :class:`curvkit.optim.GaussNewton` as (name, value) pairs
    (e.g. ``(("weight_sharing", "reduce"),)``); left out of the stored run's key when empty, so runs stored
    before the field existed are still read back.
    """

    name: str
    kind: str
    steps: int
    curvature: str = "kfra"
    ema: float | str | None = None
    inversion: str = "factored"
    lr: float = 1e-3
    halving: int | None = None
    eval_every: int = 50
    checkpoint_every: int = 50
    options: tuple[tuple[str, Any], ...] = ()

    def lr_at(self, t: int) -> float:
        """Adam's learning rate for update t (0-based): lr * 0.5^floor(t / halving)."""
        return self.lr if self.halving is None else self.lr * 0.5 ** (t // self.halving)


@dataclass
class Task:
    """What a run trains: a model factory (shared initialisation), the likelihood, the training data, the
    minibatch size, the weight decay, and ``metrics(f, y) -> {name: SUM over the chunk}`` evaluated on the
    first ``eval_n`` training points (divided by ``eval_n`` in the records); with ``test=(X, Y)`` the same
    metrics on that held-out set too, recorded as ``test_<name>``. Evaluation runs in eval mode (BatchNorm's
    running statistics), the model's mode restored afterwards."""

    name: str
    model_fn: Callable[[], nn.Module]
    likelihood: Likelihood
    X: Tensor
    Y: Tensor
    batch_size: int
    weight_decay: float
    metrics: Callable[[Tensor, Tensor], dict[str, float]]
    eval_n: int
    extra: dict[str, Any] = field(default_factory=dict)
    test: tuple[Tensor, Tensor] | None = None


def adam_grid(lrs_log2: Sequence[int], fractions: Sequence[float], steps: int, eval_every: int,
              checkpoint_every: int) -> list[RunSpec]:
    """Adam over learning rates 2^e and halving periods ``fraction * steps`` (thesis Sec. 4.5.1)."""
    out = []
    for e in lrs_log2:
        for fr in fractions:
            T = max(1, round(fr * steps))
            out.append(RunSpec(f"adam-lr2^{e}-T{round(100 * fr):g}%", "adam", steps, lr=2.0**e,
                               halving=None if fr >= 1 else T, eval_every=eval_every,
                               checkpoint_every=checkpoint_every))
    return out


class _Batches:
    """Minibatches of a fixed size from shuffled epochs of a seeded generator (state saved in checkpoints)."""

    def __init__(self, n: int, batch_size: int, seed: int):
        self.n, self.B = n, batch_size
        self.gen = torch.Generator().manual_seed(int(seed))
        self.perm = torch.randperm(n, generator=self.gen)
        self.pos = 0

    def next(self) -> Tensor:
        if self.pos + self.B > self.n:
            self.perm = torch.randperm(self.n, generator=self.gen)
            self.pos = 0
        idx = self.perm[self.pos:self.pos + self.B]
        self.pos += self.B
        return idx

    def state(self) -> dict[str, Any]:
        return {"gen": self.gen.get_state(), "perm": self.perm.clone(), "pos": self.pos}

    def load(self, st: dict[str, Any]) -> None:
        self.gen.set_state(st["gen"])
        self.perm, self.pos = st["perm"].clone(), int(st["pos"])


@torch.no_grad()
def evaluate(task: Task, model: nn.Module, chunk: int = 1000) -> dict[str, float]:
    """The task's metrics on its first ``eval_n`` training points and, with ``task.test``, on the test set
    (``test_<name>``), per point, in eval mode (the model's mode is restored)."""
    sets = [("", task.X[:task.eval_n], task.Y[:task.eval_n])]
    if task.test is not None:
        sets.append(("test_", *task.test))
    was_training = model.training
    model.eval()
    try:
        out: dict[str, float] = {}
        for prefix, X, Y in sets:
            tot: dict[str, float] = {}
            n = int(X.shape[0])
            for s in range(0, n, chunk):
                for k, v in task.metrics(model(X[s:s + chunk]), Y[s:s + chunk]).items():
                    tot[k] = tot.get(k, 0.0) + float(v)
            out.update({prefix + k: v / n for k, v in tot.items()})
        return out
    finally:
        model.train(was_training)


def _objective(task: Task, model: nn.Module, loss: Tensor) -> float:
    wd = task.weight_decay
    reg = 0.5 * wd * sum(float((p.detach() ** 2).sum()) for p in model.parameters()) if wd else 0.0
    return float(loss) + reg


def _make_optimizer(task: Task, spec: RunSpec, model: nn.Module) -> torch.optim.Optimizer:
    if spec.kind == "gauss_newton":
        return GaussNewton(model.parameters(), model=model, likelihood=task.likelihood,
                           curvature=spec.curvature, ema=spec.ema, inversion=spec.inversion,  # type: ignore[arg-type]
                           weight_decay=task.weight_decay, **dict(spec.options))
    if spec.options:
        raise ValueError(f"run {spec.name!r}: options {dict(spec.options)} are GaussNewton's; kind {spec.kind!r} "
                         "takes none")
    if spec.kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=spec.lr, weight_decay=task.weight_decay)
    if spec.kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=spec.lr, weight_decay=task.weight_decay)
    raise ValueError(f"unknown run kind {spec.kind!r}; use 'gauss_newton', 'adam' or 'adamw'")


def train_run(task: Task, spec: RunSpec, run_dir: Path, batch_seed: int = 0, stop_after: int | None = None,
              on_step: Callable[[int], None] | None = None, keep_model: bool = False) -> dict[str, Any] | None:
    """Train one run (module docstring) and return its record; ``stop_after`` stops after that many
    updates in this call (a simulated interruption: the checkpoint is written and None returned).
    ``keep_model``: also store the final weights (``state_dict``) in ``run_dir / "model.pt"`` (read them
    with :func:`curvkit.checkpoint.load`)."""
    run_dir.mkdir(parents=True, exist_ok=True)
    done, ck_path = run_dir / "result.pt", run_dir / "checkpoint.pt"
    spec_key = asdict(spec)
    if not spec.options:  # the key of runs stored before ``options`` existed
        del spec_key["options"]
    key = {"task": task.name, "spec": spec_key, "batch_seed": batch_seed, "batch_size": task.batch_size,
           "weight_decay": task.weight_decay, "n": int(task.X.shape[0]), "eval_n": task.eval_n}
    if task.test is not None:
        key["test_n"] = int(task.test[0].shape[0])
    if spec.kind == "gauss_newton":  # runs of curvkit 0.1 (ema=None was the running mean) are not reused
        key["gauss_newton"] = GAUSS_NEWTON_FORMAT
    model_path = run_dir / "model.pt"
    if done.exists() and (model_path.exists() or not keep_model):
        finished = checkpoint.load(done)
        if finished.get("key") == key:
            return finished  # type: ignore[no-any-return]
    model = task.model_fn()
    opt = _make_optimizer(task, spec, model)
    batches = _Batches(int(task.X.shape[0]), task.batch_size, batch_seed)
    rec: dict[str, Any] = {"key": key, "name": spec.name, "loss": [], "time": [], "evals": [], "diverged": None,
                           "alpha": [], "rho": [], "tau": [], "zeta": []}
    start = 0
    if ck_path.exists():
        ck = checkpoint.load(ck_path)
        if ck.get("key") == key:
            model.load_state_dict(ck["model"])
            opt.load_state_dict(ck["opt"])
            batches.load(ck["batches"])
            rec, start = ck["record"], int(ck["step"])
    if start == 0 and not rec["evals"]:
        rec["evals"].append({"step": 0, "time": 0.0, **evaluate(task, model)})
    elapsed = rec["time"][-1] if rec["time"] else 0.0

    def save(step: int) -> None:
        _count(rec, lik, counters0)
        checkpoint.save({"key": key, "model": model.state_dict(), "opt": opt.state_dict(),
                         "batches": batches.state(), "record": rec, "step": step}, ck_path)

    lik = task.likelihood
    counters0 = [getattr(lik, "projections", 0), getattr(lik, "evaluations", 0)]
    t = start
    for t in range(start, spec.steps):
        idx = batches.next()
        X, Y = task.X[idx], task.Y[idx]
        t0 = time.perf_counter()
        try:
            if isinstance(opt, GaussNewton):
                E = float(opt.step(batch=(X, Y)))
                h = opt.history[-1]
                for k in ("alpha", "rho", "tau", "zeta"):
                    rec[k].append(h[k])
            else:
                for group in opt.param_groups:
                    group["lr"] = spec.lr_at(t)
                opt.zero_grad()
                loss = task.likelihood(model(X), Y)
                E = _objective(task, model, loss.detach())
                if not math.isfinite(E):
                    raise FloatingPointError(f"the loss is {E}")
                loss.backward()
                opt.step()
        except (FloatingPointError, ValueError) as err:
            if isinstance(err, UnsupportedModelError):  # a model the optimiser refuses did not diverge
                raise
            rec["diverged"] = {"step": t + 1, "error": str(err)[:300]}
            break
        elapsed += time.perf_counter() - t0
        rec["loss"].append(E)
        rec["time"].append(elapsed)
        if on_step is not None:
            on_step(t + 1)
        if (t + 1) % spec.eval_every == 0 or t + 1 == spec.steps:
            rec["evals"].append({"step": t + 1, "time": elapsed, **evaluate(task, model)})
        if stop_after is not None and t + 1 - start >= stop_after and t + 1 < spec.steps:
            save(t + 1)
            return None
        if (t + 1) % spec.checkpoint_every == 0 and t + 1 < spec.steps:
            save(t + 1)
    if rec["diverged"] is not None:  # marks the run's end: its objective counts as infinite from here on
        rec["evals"].append({"step": rec["diverged"]["step"], "time": elapsed,
                             **{k: math.inf for k in rec["evals"][0] if k not in ("step", "time")}})
    _count(rec, lik, counters0)
    if keep_model:
        checkpoint.save(model.state_dict(), model_path)
    checkpoint.save(rec, done)
    if ck_path.exists():
        ck_path.unlink()
    return rec


def _count(rec: dict[str, Any], lik: Likelihood, base: list[int]) -> None:
    """Add the likelihood's PSD-projection counts since ``base`` (the Bernoulli mixture's counters) to the
    record and move ``base`` to now (so each count is added once, across checkpoints and resumes)."""
    if not hasattr(lik, "projections"):
        return
    now = [int(lik.projections), int(lik.evaluations)]  # type: ignore[attr-defined]
    c = rec.setdefault("likelihood_counters", {"projections": 0, "evaluations": 0})
    c["projections"] += now[0] - base[0]
    c["evaluations"] += now[1] - base[1]
    base[:] = now


# ---------------------------------------------------------------------------------------------- summaries
def smooth(xs: Sequence[float], window: int = 10) -> np.ndarray:
    """Trailing moving average over ``window`` values (thesis Fig. 4.1 averages with a window of ten)."""
    a = np.asarray(xs, dtype=np.float64)
    if len(a) == 0:
        return a
    c = np.cumsum(np.insert(a, 0, 0.0))
    out = np.empty_like(a)
    for i in range(len(a)):
        lo = max(0, i + 1 - window)
        out[i] = (c[i + 1] - c[lo]) / (i + 1 - lo)
    return out


def value_at(rec: dict[str, Any], update: int | None = None, time_s: float | None = None) -> float:
    """The smoothed minibatch objective of a run after ``update`` updates, or at training wall-clock
    ``time_s`` (the last update finished by then); inf if the run diverged before, nan if it has not got
    that far."""
    s = smooth(rec["loss"])
    if update is not None:
        if update <= len(s):
            return float(s[update - 1])
        return math.inf if rec["diverged"] else math.nan
    assert time_s is not None
    times = np.asarray(rec["time"])
    k = int(np.searchsorted(times, time_s, side="right"))
    if k == 0:
        return math.nan
    if k == len(times) and rec["diverged"]:
        return math.inf
    return float(s[k - 1])


def topk_mean(recs: Sequence[dict[str, Any]], k: int) -> tuple[list[dict[str, Any]], np.ndarray]:
    """The k runs with the lowest final smoothed objective (diverged runs last) and the mean of their
    smoothed curves (over the updates all of them reached)."""
    def final(r: dict[str, Any]) -> float:
        return math.inf if r["diverged"] or not r["loss"] else float(smooth(r["loss"])[-1])

    best = sorted(recs, key=final)[:k]
    n = min(len(r["loss"]) for r in best)
    return best, np.mean([smooth(r["loss"])[:n] for r in best], axis=0)
