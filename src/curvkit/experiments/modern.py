"""``modern``: curvkit's second-order optimiser, Laplace posteriors and online Laplace on modern architectures
(issue 22, section 2), on the bundled real MNIST with the bundled KMNIST test set as out-of-distribution data.

Models (:mod:`curvkit.architectures`): a small ViT (7x7 patches as 16 tokens, a class token and a position
table, pre-norm transformer blocks) and a small ResNet with BatchNorm (a conv stem and BasicBlocks).
Images are (N, 1, 28, 28) grey values in [0, 1]; the likelihood is the softmax cross-entropy (mean over
the minibatch).

1. Optimisation (per architecture): AdamW (decoupled weight decay 1e-4) over a small constant
   learning-rate grid against :class:`curvkit.optim.GaussNewton` (``weight_decay`` 1e-4 in the objective,
   the current minibatch's curvature, ``FAST_ADAPTATION``'s damping schedule) with KFAC and KFLR factors,
   weight sharing ``expand`` and ``reduce`` (docs/architecture.md, "Weight sharing: expand and reduce").
   Every run sees the same minibatches from the same initialisation
   (:func:`curvkit.experiments._second_order.train_run`: checkpointed, resumable). Recorded per update and
   per training wall-clock: the minibatch objective and, every ``eval_every`` updates, the training loss
   and the test accuracy. GaussNewton's Kronecker factors are those of per-sample curvature, which BatchNorm
   in training mode (batch statistics couple the samples) does not have, so by default it refuses the ResNet
   in training mode; the experiment records that refusal (its message) and trains the ResNet with the
   explicit opt-in ``batch_statistics='couple'`` (:data:`RESNET_GN_OPTIONS`: the factors of the coupled
   backward pass of the minibatch, as KFAC is used on ResNets (Osawa et al. 2019), with alpha* and rho from
   the exact GGN of the coupled minibatch loss, running statistics updated once per step; docs/architecture.md).
   (A ResNet trained in eval mode would use fixed running statistics, i.e. no normalisation at all; that would
   not be the ResNet-BN of the comparison.)
2. Uncertainty (per architecture, on the MAP network = the AdamW run of the grid whose final network has
   the lowest training loss in eval mode, :func:`choose_map`): Laplace posteriors with the prior precision maximising the marginal
   likelihood (:func:`curvkit.laplace.optimize_prior_precision`, one shared value), evaluated with the
   linearised (GLM, probit) predictive: Kronecker (KFLR) over all weights, diagonal (sampled-label Fisher)
   over all weights, Kronecker over the last layer, and (ViT) Kronecker over LoRA adapters (rank
   ``lora_rank`` on every ``nn.Linear`` outside the attention modules, the rest frozen, fine-tuned from
   the MAP network by AdamW for ``lora_steps`` updates: the posterior covers exactly the adapters). The
   curvature is summed over the first ``laplace_fit_n`` training images and scaled to the N images the
   network was trained on (``num_data=N``). Metrics on the MNIST test set: accuracy, NLL, ECE (15 bins);
   out-of-distribution: AUROC of telling MNIST test from KMNIST test images by the predictive entropy.
   A variant a curvkit version refuses (an ``UnsupportedModelError``) is listed as not run with the message.
3. Continual (ViT): 3 permuted-MNIST tasks (the first one unpermuted: a ViT is not equivariant to pixel
   permutations), task-aware training with Adam (:func:`curvkit.continual.task_sequence.train_task_sequence`
   through :func:`curvkit.experiments._laplace_continual.run_method`: checkpointed per task): online
   Kronecker-factored Laplace, online diagonal Laplace (penalty strength ``lam``) and plain fine-tuning;
   the mean test accuracy over the tasks seen so far after each task.

There is no paper table for this experiment; the report checks what a researcher would expect:
GaussNewton reaching the best AdamW run's final training objective in fewer updates (and, separately, in
less wall-clock), every Laplace variant improving test NLL and ECE over the MAP network and the KMNIST
AUROC, and online KF Laplace keeping a higher mean accuracy over the seen tasks than diagonal Laplace and
fine-tuning after the last task.

Scales: ``smoke`` (seconds; tiny models and subsets, for the tests), ``medium`` (about 35 minutes on 2
shared CPU cores), ``paper`` (the full protocol, sized for a GPU: full MNIST, several epochs, the whole
training set for the curvature, 10 tasks). Every stage is stored under ``out`` (runs, MAP and LoRA weights,
one file per Laplace variant, continual checkpoints per task), so a re-run resumes where it stopped and
gives the same numbers (training wall-clock times aside).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

from curvkit import checkpoint
from curvkit.architectures import add_lora, resnet, vit
from curvkit.continual.streams import PermutedTasks
from curvkit.continual.task_sequence import SequenceConfig
from curvkit.data import kmnist_test, mnist
from curvkit.experiments._laplace_continual import Method, run_method
from curvkit.experiments._laplace_mnist import entropy
from curvkit.experiments._report import (
    cached_stage,
    machine_info,
    markdown_table,
    new_figure,
    save_figure,
    single_threaded,
    write_json,
)
from curvkit.experiments._second_order import RunSpec, Task, smooth, train_run
from curvkit.experiments.laplace_ood import auroc, ece
from curvkit.experiments.registry import register
from curvkit.laplace import Laplace, optimize_prior_precision
from curvkit.likelihoods import CrossEntropy
from curvkit.optim import GaussNewton
from curvkit.optim.second_order.gauss_newton import FAST_ADAPTATION
from curvkit.structure import UnsupportedModelError, curvature_kernels

WEIGHT_DECAY = 1e-4
RESNET_GN_OPTIONS: tuple[tuple[str, Any], ...] = (("batch_statistics", "couple"),)
"""GaussNewton's options on the ResNet-BN in training mode (module docstring)."""


@dataclass(frozen=True)
class Scale:
    """Sizes of one scale (module docstring)."""

    n_train: int | None  # MNIST training images (None: all 60,000)
    n_test: int | None  # MNIST test images for the optimisation curves and the Laplace metrics (None: 10,000)
    n_ood: int | None  # KMNIST test images (None: 10,000)
    batch: int
    steps: int  # updates per optimisation run (ViT)
    resnet_steps: int
    eval_every: int
    eval_n: int  # training images for the training-loss evaluations
    adamw_lrs: tuple[float, ...]
    gn: tuple[tuple[str, str], ...]  # (curvature, weight_sharing) of the GaussNewton runs
    vit: dict[str, Any] = field(default_factory=dict)  # keyword arguments of curvkit.architectures.vit
    resnet_widths: tuple[int, ...] = (8, 16)
    laplace_fit_n: int | None = None  # training images for the curvature (None: all)
    lora_rank: int = 4
    lora_steps: int = 100
    marglik_steps: int = 100
    tasks: int = 3
    task_train: int | None = None  # training images per task (validation included)
    task_test: int | None = None
    task_epochs: int = 2
    task_lr: float = 1e-3
    lams: tuple[float, ...] = (1.0,)
    checkpoint_every: int = 50


SCALES: dict[str, Scale] = {
    "smoke": Scale(n_train=512, n_test=256, n_ood=256, batch=64, steps=6, resnet_steps=4, eval_every=3, eval_n=128,
                   adamw_lrs=(1e-3, 3e-3), gn=(("kfac", "expand"), ("kfac", "reduce"), ("kflr", "reduce")),
                   vit=dict(dim=16, depth=2, heads=2, mlp_dim=32), resnet_widths=(4, 8), laplace_fit_n=128,
                   lora_rank=2, lora_steps=4, marglik_steps=20, task_train=300, task_test=100, task_epochs=1,
                   checkpoint_every=2),
    "medium": Scale(n_train=20_000, n_test=2_000, n_ood=2_000, batch=128, steps=400, resnet_steps=400,
                    eval_every=50, eval_n=1_000, adamw_lrs=(1e-3, 3e-3, 1e-2),
                    gn=(("kfac", "expand"), ("kfac", "reduce"), ("kflr", "reduce")),
                    vit=dict(dim=64, depth=2, heads=4, mlp_dim=128), resnet_widths=(8, 16), laplace_fit_n=2_000,
                    lora_rank=4, lora_steps=100, marglik_steps=100, task_train=6_000, task_test=2_000,
                    task_epochs=3),
    "paper": Scale(n_train=None, n_test=None, n_ood=None, batch=128, steps=5_000, resnet_steps=5_000,
                   eval_every=250, eval_n=10_000, adamw_lrs=(3e-4, 1e-3, 3e-3, 1e-2),
                   gn=(("kfac", "expand"), ("kfac", "reduce"), ("kflr", "expand"), ("kflr", "reduce")),
                   vit=dict(dim=128, depth=4, heads=4, mlp_dim=256), resnet_widths=(16, 32, 64), laplace_fit_n=None,
                   lora_rank=8, lora_steps=1_000, marglik_steps=200, tasks=10, task_train=None, task_test=None,
                   task_epochs=10, lams=(1.0, 10.0), checkpoint_every=250),
}
ARCHS = ("vit", "resnet")


# ---------------------------------------------------------------------------------------------- data, models
def images(train: bool, n: int | None) -> tuple[Tensor, Tensor]:
    """The first ``n`` bundled MNIST images as (n, 1, 28, 28) float32 in [0, 1], and their digits."""
    X, y = mnist(train=train)
    X = X.float().div(255).unsqueeze(1)
    return (X, y) if n is None else (X[:n], y[:n])


def ood_images(n: int | None) -> Tensor:
    """The first ``n`` bundled KMNIST test images as (n, 1, 28, 28) float32 in [0, 1]."""
    X, _ = kmnist_test()
    X = X.float().div(255).reshape(-1, 1, 28, 28)
    return X if n is None else X[:n]


def device() -> torch.device:
    """Where the experiment runs: the GPU when there is one (the paper scale is sized for it), else the CPU."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def model_fn(arch: str, sc: Scale, seed: int) -> Callable[[], nn.Module]:
    """The architecture's builder at this scale on :func:`device`, every call the same initial weights (drawn
    on the CPU from ``seed``)."""
    if arch == "vit":
        return lambda: vit(seed=seed, **sc.vit).to(device())
    if arch == "resnet":
        return lambda: resnet(widths=sc.resnet_widths, seed=seed).to(device())
    raise ValueError(f"unknown architecture {arch!r}; use one of {ARCHS}")


def metrics(f: Tensor, y: Tensor) -> dict[str, float]:
    """Summed cross-entropy and number correct of a chunk (``Task.metrics``)."""
    return {"loss": float(nn.functional.cross_entropy(f, y, reduction="sum")),
            "accuracy": float((f.argmax(-1) == y).sum())}


# ---------------------------------------------------------------------------------------------- optimisation
def gauss_newton_refusal(model: nn.Module, X: Tensor, y: Tensor, **options: Any) -> str | None:
    """None if GaussNewton (with ``options``) takes a step on ``model`` (a deep copy: the model is not changed),
    else the message of its refusal (:class:`~curvkit.structure.UnsupportedModelError`)."""
    import copy

    trial = copy.deepcopy(model)
    try:
        GaussNewton(trial.parameters(), model=trial, likelihood=CrossEntropy(), curvature="kfac",
                    weight_decay=WEIGHT_DECAY, **options).step(batch=(X, y))
    except UnsupportedModelError as err:
        return str(err)
    return None


def run_specs(sc: Scale, arch: str, gn_allowed: bool) -> list[RunSpec]:
    """The AdamW grid and (where allowed) the GaussNewton runs of one architecture."""
    steps = sc.steps if arch == "vit" else sc.resnet_steps
    common = dict(eval_every=sc.eval_every, checkpoint_every=sc.checkpoint_every)
    specs = [RunSpec(f"adamw-lr{lr:g}", "adamw", steps, lr=lr, **common) for lr in sc.adamw_lrs]  # type: ignore[arg-type]
    if gn_allowed:
        opts = tuple(sorted(FAST_ADAPTATION.items())) + (RESNET_GN_OPTIONS if arch == "resnet" else ())
        specs += [RunSpec(f"gn-{c}-{ws}", "gauss_newton", steps, curvature=c,
                          options=(("weight_sharing", ws), *opts), **common)  # type: ignore[arg-type]
                  for c, ws in sc.gn]
    return specs


def final_objective(rec: dict[str, Any]) -> float:
    """The smoothed minibatch objective after the run's last update (inf if it diverged)."""
    return math.inf if rec["diverged"] or not rec["loss"] else float(smooth(rec["loss"])[-1])


def choose_map(runs: dict[str, dict[str, Any]]) -> str:
    """The AdamW run whose final network has the lowest training loss in eval mode (its last evaluation):
    the MAP network of the Laplace section. Not the minibatch objective: with BatchNorm, a run whose
    training-mode objective is lowest can have running statistics that lag its weights (measured: the
    ResNet-BN at lr 1e-2, objective 0.19 but eval-mode loss 0.94 and 62% test accuracy)."""
    def final_loss(name: str) -> float:
        rec = runs[name]
        return math.inf if rec["diverged"] else float(rec["evals"][-1]["loss"])

    return min((k for k in runs if k.startswith("adamw")), key=final_loss)


def reach(rec: dict[str, Any], target: float) -> tuple[int | None, float | None]:
    """(updates, training seconds) after which the run's smoothed objective first is <= ``target``;
    (None, None) if it never is."""
    s = smooth(rec["loss"])
    hit = np.nonzero(s <= target)[0]
    if len(hit) == 0:
        return None, None
    return int(hit[0]) + 1, float(rec["time"][hit[0]])


def optimisation(arch: str, sc: Scale, data: dict[str, Tensor], out: Path, seed: int,
                 stop_after: int | None = None) -> dict[str, Any] | None:
    """Train every run of one architecture (or resume them); returns the runs, the default GaussNewton's
    refusal (if any), that of GaussNewton with the architecture's options (None: it runs), the best AdamW run's
    name and the per-run summary, or None when ``stop_after`` interrupted a run."""
    build = model_fn(arch, sc, seed)
    X0, y0 = data["Xtr"][:sc.batch], data["ytr"][:sc.batch]
    default_refusal = gauss_newton_refusal(build(), X0, y0)
    options = dict(RESNET_GN_OPTIONS) if arch == "resnet" else {}
    refusal = gauss_newton_refusal(build(), X0, y0, **options) if options else default_refusal
    task = Task(f"modern-{arch}", build, CrossEntropy("mean"), data["Xtr"], data["ytr"], sc.batch, WEIGHT_DECAY,
                metrics, sc.eval_n, test=(data["Xte"], data["yte"]))
    runs: dict[str, dict[str, Any]] = {}
    for spec in run_specs(sc, arch, refusal is None):
        rec = train_run(task, spec, out / "runs" / arch / spec.name, batch_seed=seed, stop_after=stop_after,
                        keep_model=spec.kind == "adamw")
        if rec is None:
            return None
        runs[spec.name] = rec
    adamw = [k for k in runs if k.startswith("adamw")]
    best = min(adamw, key=lambda k: final_objective(runs[k]))
    target = final_objective(runs[best])
    summary = {}
    for name, rec in runs.items():
        upd, sec = reach(rec, target)
        last = rec["evals"][-1]
        summary[name] = {"final_objective": final_objective(rec), "train_loss": last.get("loss"),
                         "test_accuracy": last.get("test_accuracy"), "seconds": rec["time"][-1] if rec["time"] else 0,
                         "updates": len(rec["loss"]), "updates_to_best_adamw": upd, "seconds_to_best_adamw": sec,
                         "diverged": rec["diverged"]}
    return {"runs": runs, "gauss_newton_refusal": refusal, "default_refusal": default_refusal,
            "gauss_newton_options": options, "best_adamw": best, "target": target,
            "summary": summary, "map": choose_map(runs)}


def optimisation_figure(arch: str, res: dict[str, Any], path: Path) -> None:
    """Training objective and test accuracy per update and per training wall-clock."""
    fig, ax = new_figure(2, 2, size=(5.0, 3.6))
    for name, rec in res["runs"].items():
        ls = "--" if name.startswith("adamw") else "-"
        s = smooth(rec["loss"])
        ax[0, 0].plot(np.arange(1, len(s) + 1), s, ls, label=name)
        ax[0, 1].plot(rec["time"], s, ls, label=name)
        ev = [e for e in rec["evals"] if math.isfinite(e.get("test_accuracy", math.inf))]
        ax[1, 0].plot([e["step"] for e in ev], [e["test_accuracy"] for e in ev], ls, marker=".", label=name)
        ax[1, 1].plot([e["time"] for e in ev], [e["test_accuracy"] for e in ev], ls, marker=".", label=name)
    for a, (xl, yl) in zip(ax.flat, [("update", "training objective (smoothed)"), ("training seconds", "training objective (smoothed)"),
                                     ("update", "test accuracy"), ("training seconds", "test accuracy")]):
        a.set_xlabel(xl)
        a.set_ylabel(yl)
        if "objective" in yl:
            a.set_yscale("log")
        a.legend(fontsize=7)
    fig.suptitle(f"{arch}: GaussNewton vs AdamW on MNIST")
    save_figure(fig, path)


# ---------------------------------------------------------------------------------------------- uncertainty
@dataclass(frozen=True)
class Variant:
    """One Laplace posterior: its structure, curvature source and parameter subset (``'lora'``: the
    adapters of a LoRA copy of the MAP network, fine-tuned first)."""

    name: str
    structure: str
    curvature: str
    subset: str


VARIANTS = (Variant("KF Laplace (all weights)", "kron", "kflr", "all"),
            Variant("diag Laplace (all weights)", "diag", "mc_fisher", "all"),
            Variant("KF Laplace (last layer)", "kron", "kflr", "last_layer"),
            Variant("KF Laplace (LoRA adapters)", "kron", "kflr", "lora"))


def classification_scores(probs: Tensor, y: Tensor, probs_ood: Tensor) -> dict[str, float]:
    """Accuracy, mean NLL, ECE (15 bins) on the test set; AUROC of in- vs out-of-distribution by the
    predictive entropy (:func:`curvkit.experiments.laplace_ood.auroc`)."""
    p, y = probs.detach().double().cpu(), y.cpu()
    return {"accuracy": float((p.argmax(1) == y).double().mean()),
            "nll": float(-p.gather(1, y[:, None]).clamp_min(1e-12).log().mean()),
            "ece": ece(p, y),
            "auroc_kmnist": auroc(entropy(p).numpy(), entropy(probs_ood.detach().double().cpu()).numpy())}


@torch.no_grad()
def map_probs(model: nn.Module, X: Tensor, chunk: int = 1000) -> Tensor:
    return torch.cat([model(X[i:i + chunk]).softmax(-1) for i in range(0, X.shape[0], chunk)])


def lora_model(arch: str, sc: Scale, data: dict[str, Tensor], map_state: dict[str, Tensor], out: Path,
               seed: int) -> nn.Module:
    """The MAP network with rank-``lora_rank`` adapters (the rest frozen) fine-tuned by AdamW for
    ``lora_steps`` updates (a stored run; resumable), in eval mode."""
    build = model_fn(arch, sc, seed)

    def adapted() -> nn.Module:
        base = build()
        base.load_state_dict(map_state)
        return add_lora(base, sc.lora_rank, seed=seed)

    task = Task(f"modern-{arch}-lora", adapted, CrossEntropy("mean"), data["Xtr"], data["ytr"], sc.batch,
                WEIGHT_DECAY, metrics, sc.eval_n, test=(data["Xte"], data["yte"]))
    spec = RunSpec("lora-adamw-lr1e-3", "adamw", sc.lora_steps, lr=1e-3, eval_every=sc.lora_steps,
                   checkpoint_every=sc.checkpoint_every)
    run_dir = out / "runs" / arch / "lora"
    train_run(task, spec, run_dir, batch_seed=seed + 1, keep_model=True)
    model = adapted()
    model.load_state_dict(checkpoint.load(run_dir / "model.pt"))
    return model.eval()


def fit_variant(v: Variant, model: nn.Module, sc: Scale, data: dict[str, Tensor], seed: int) -> dict[str, Any]:
    """Fit one Laplace posterior, choose its prior precision by marginal likelihood, and score its GLM
    predictive (or return ``{"not_run": message}`` where curvkit refuses the model)."""
    n = data["Xtr"].shape[0]
    m = n if sc.laplace_fit_n is None else min(n, sc.laplace_fit_n)
    batches = [(data["Xtr"][i:min(m, i + 500)], data["ytr"][i:min(m, i + 500)]) for i in range(0, m, 500)]
    t0 = time.perf_counter()
    try:
        post = Laplace(model, CrossEntropy(), v.structure, v.curvature,  # type: ignore[arg-type]
                       subset="all" if v.subset == "lora" else v.subset, seed=seed)
        post.fit(batches, num_data=n)
        lam = optimize_prior_precision(post, steps=sc.marglik_steps, init=1.0)
        probs = post.predict(data["Xte"], method="glm", batch_size=100)
        probs_ood = post.predict(data["Xood"], method="glm", batch_size=100)
    except UnsupportedModelError as err:
        return {"not_run": str(err)}
    res = classification_scores(probs, data["yte"], probs_ood)
    res.update({"prior_precision": float(lam.mean()), "log_marglik": float(post.log_marginal_likelihood()),
                "parameters": int(post.layout.dim), "curvature_images": m, "num_data": n,
                "seconds": time.perf_counter() - t0})
    return res


def uncertainty(arch: str, sc: Scale, data: dict[str, Tensor], opt: dict[str, Any], out: Path,
                seed: int) -> dict[str, Any]:
    """MAP and every Laplace variant on one architecture's MAP network, each stored in its own file."""
    best = opt["map"]
    map_state = checkpoint.load(out / "runs" / arch / best / "model.pt")
    model = model_fn(arch, sc, seed)()
    model.load_state_dict(map_state)
    model.eval()
    res: dict[str, Any] = {"MAP": classification_scores(map_probs(model, data["Xte"]), data["yte"],
                                                        map_probs(model, data["Xood"]))}
    res["MAP"]["network"] = best
    key_base = {"scale": asdict(sc), "map": best, "seed": seed, "format": 1}
    for v in VARIANTS:
        if v.subset == "lora" and arch != "vit":
            res[v.name] = {"not_run": "the ResNet's only nn.Linear is its head (add_lora adapts nn.Linear "
                                      "modules), so LoRA adapters there are a last-layer posterior"}
            continue
        path = out / "laplace" / arch / (v.name.split(" (")[0].replace(" ", "_") + "_" + v.subset + ".pt")
        path.parent.mkdir(parents=True, exist_ok=True)

        def compute(v: Variant = v) -> dict[str, Any]:
            if v.subset == "lora":
                lora = lora_model(arch, sc, data, map_state, out, seed)
                entry = fit_variant(v, lora, sc, data, seed)
                entry["lora_map"] = classification_scores(map_probs(lora, data["Xte"]), data["yte"],
                                                          map_probs(lora, data["Xood"]))
                return entry
            return fit_variant(v, model, sc, data, seed)

        res[v.name] = cached_stage(path, {**key_base, "variant": asdict(v)}, compute)
    return res


# ---------------------------------------------------------------------------------------------- continual
def continual_methods(sc: Scale) -> list[Method]:
    return ([Method("online", c, lam) for lam in sc.lams for c in ("kron", "diag")] + [Method("none")])


def continual(sc: Scale, out: Path, seed: int) -> dict[str, Any]:
    """Online KF / diagonal Laplace and fine-tuning on permuted MNIST with the ViT (flat inputs reshaped
    to images by an ``nn.Unflatten`` in front of it)."""
    Xtr, ytr = images(True, sc.task_train)
    Xte, yte = images(False, sc.task_test)
    tasks = PermutedTasks(Xtr.flatten(1), ytr, Xte.flatten(1), yte, sc.tasks, permutation_seed=seed,
                          identity_first=True)
    n = Xtr.shape[0]
    cfg = SequenceConfig(optimizer="adam", lr=sc.task_lr, lr_decay_k=0.0, batch_size=sc.batch,
                         min_epochs=sc.task_epochs, max_epochs=sc.task_epochs, patience=sc.task_epochs,
                         val_size=max(1, n // 10), curvature_batch=500)

    def build(s: int) -> nn.Module:  # the trainer moves the (CPU) task data to the model's device
        return nn.Sequential(nn.Unflatten(1, (1, 28, 28)), vit(seed=s, **sc.vit)).to(device())

    runs = {}
    for m in continual_methods(sc):
        runs[m.label] = run_method(m, build, tasks, cfg, out / "continual", seed)
    return runs


# ---------------------------------------------------------------------------------------------- report
def claims(opt: dict[str, Any], unc: dict[str, Any], cont: dict[str, Any], sc: Scale) -> dict[str, Any]:
    """The expectations of the module docstring, each True/False (None: not measurable at this run)."""
    holds: dict[str, Any] = {}
    for arch, o in opt.items():
        gn = {k: v for k, v in o["summary"].items() if k.startswith("gn")}
        ad = o["summary"][o["best_adamw"]]  # it reaches its own final value first after updates_to_best_adamw
        if gn:
            holds[f"{arch}: GN reaches the best AdamW objective in fewer updates"] = any(
                v["updates_to_best_adamw"] is not None and v["updates_to_best_adamw"] < ad["updates_to_best_adamw"]
                for v in gn.values())
            holds[f"{arch}: GN reaches the best AdamW objective in less wall-clock"] = any(
                v["seconds_to_best_adamw"] is not None and v["seconds_to_best_adamw"] < ad["seconds_to_best_adamw"]
                for v in gn.values())
    for arch, u in unc.items():
        base = u["MAP"]
        for name, r in u.items():
            if name == "MAP" or "not_run" in r:
                continue
            ref = r.get("lora_map", base)  # the LoRA posterior's mean is the fine-tuned network
            holds[f"{arch}: {name} lowers the test NLL of its MAP"] = r["nll"] < ref["nll"]
            holds[f"{arch}: {name} lowers the ECE of its MAP"] = r["ece"] < ref["ece"]
            holds[f"{arch}: {name} raises the KMNIST AUROC of its MAP"] = r["auroc_kmnist"] > ref["auroc_kmnist"]
    final = {k: v["mean_seen"][-1] for k, v in cont.items()}
    for lam in sc.lams:
        kf, dg = final[Method("online", "kron", lam).label], final[Method("online", "diag", lam).label]
        holds[f"continual: online KF (lam={lam:g}) above diagonal and fine-tuning after the last task"] = (
            kf > dg and kf > final["none"])
    return holds


def write_report(out: Path, scale: str, sc: Scale, opt: dict[str, Any], unc: dict[str, Any], cont: dict[str, Any],
                 holds: dict[str, Any], seconds: float) -> None:
    md = [f"# modern ({scale})", "",
          f"MNIST ({'all' if sc.n_train is None else sc.n_train} training images, "
          f"{'10000' if sc.n_test is None else sc.n_test} test images), KMNIST test "
          f"({'10000' if sc.n_ood is None else sc.n_ood} images) as OOD. ViT {sc.vit}, ResNet-BN widths "
          f"{sc.resnet_widths}. Minibatch {sc.batch}, weight decay {WEIGHT_DECAY:g}. AdamW: constant learning "
          f"rates {', '.join(f'{lr:g}' for lr in sc.adamw_lrs)}; GaussNewton: the current minibatch's curvature, "
          "FAST_ADAPTATION damping. Objective = minibatch loss + weight decay term before each update, smoothed "
          "over 10 updates; train loss on the first "
          f"{sc.eval_n} training images. Laplace: curvature over the first "
          f"{'all' if sc.laplace_fit_n is None else sc.laplace_fit_n} training images with N = the training-set "
          "size, prior precision by marginal likelihood (one value), GLM probit predictive.", ""]
    for arch, o in opt.items():
        md += [f"## Optimisation: {arch}", ""]
        if o["gauss_newton_refusal"]:
            md += [f"GaussNewton not run: it refuses the model in training mode: `{o['gauss_newton_refusal']}`", ""]
        elif o.get("default_refusal"):
            opts = ", ".join(f"{k}={v!r}" for k, v in o["gauss_newton_options"].items())
            md += [f"GaussNewton with its defaults refuses the model in training mode (`{o['default_refusal']}`); "
                   f"the GaussNewton runs use {opts}.", ""]
        rows = [[k, v["updates"], v["final_objective"], v["train_loss"], v["test_accuracy"], v["seconds"],
                 v["updates_to_best_adamw"], v["seconds_to_best_adamw"]] for k, v in o["summary"].items()]
        md += [markdown_table(["run", "updates", "final objective (smoothed)", "train loss", "test acc",
                               "train s", f"updates to {o['best_adamw']}'s final", "s to it"], rows),
               f"Figure: optimisation_{arch}.png", ""]
    for arch, u in unc.items():
        md += [f"## Uncertainty: {arch} (MAP = {u['MAP']['network']})", ""]
        rows, skipped = [], []
        for name, r in u.items():
            if "not_run" in r:
                skipped.append(f"- {name}: not run: {r['not_run']}")
                continue
            rows.append([name, 100 * r["accuracy"], r["nll"], r["ece"], r["auroc_kmnist"], r.get("prior_precision"),
                         r.get("parameters"), r.get("seconds")])
            if "lora_map" in r:
                lm = r["lora_map"]
                rows.append(["LoRA-fine-tuned MAP", 100 * lm["accuracy"], lm["nll"], lm["ece"], lm["auroc_kmnist"],
                             None, None, None])
        md += [markdown_table(["method", "test acc %", "test NLL", "ECE", "AUROC KMNIST", "prior precision (marglik)",
                               "parameters", "s"], rows), *skipped, ""]
    md += ["## Continual: ViT on permuted MNIST", ""]
    rows = [[k, *[round(100 * a, 2) for a in v["mean_seen"]], sum(v["seconds"])] for k, v in cont.items()]
    md += [markdown_table(["method", *[f"mean acc after task {t + 1} %" for t in range(sc.tasks)], "s"], rows),
           "Figure: continual_vit.png", "", "## Expectations", ""]
    md += [f"- {k}: {'holds' if v else 'does NOT hold'}" for k, v in holds.items()]
    md += ["", f"Wall time {seconds:.0f} s."]
    (out / "report.md").write_text("\n".join(md) + "\n")


def continual_figure(cont: dict[str, Any], path: Path) -> None:
    fig, ax = new_figure(1, 1, size=(5.5, 4.0))
    for k, r in cont.items():
        ax[0, 0].plot(range(1, len(r["mean_seen"]) + 1), r["mean_seen"], marker="o", label=k)
    ax[0, 0].set_xlabel("tasks seen")
    ax[0, 0].set_ylabel("mean test accuracy over seen tasks")
    ax[0, 0].legend(fontsize=7)
    save_figure(fig, path)


def reproduce(scale: str, out: Path, seed: int = 0, stop_after: int | None = None) -> dict[str, Any] | None:
    """The experiment (module docstring); ``stop_after`` interrupts the first unfinished optimisation run
    after that many updates (for the resume tests) and returns None. Everything runs inside
    :func:`curvkit.structure.curvature_kernels` (no fused eval-mode fast path of the transformer layers: it
    reads ``linear1.weight`` directly and so cannot run a LoRA adapter there)."""
    with curvature_kernels():
        return _reproduce(scale, out, seed, stop_after)


def _reproduce(scale: str, out: Path, seed: int, stop_after: int | None) -> dict[str, Any] | None:
    sc = SCALES[scale]
    t0 = time.perf_counter()
    Xtr, ytr = images(True, sc.n_train)
    Xte, yte = images(False, sc.n_test)
    data = {k: v.to(device()) for k, v in
            {"Xtr": Xtr, "ytr": ytr, "Xte": Xte, "yte": yte, "Xood": ood_images(sc.n_ood)}.items()}
    opt: dict[str, Any] = {}
    for arch in ARCHS:
        res = optimisation(arch, sc, data, out, seed, stop_after)
        if res is None:
            return None
        opt[arch] = res
        optimisation_figure(arch, res, out / f"optimisation_{arch}.png")
    unc = {arch: uncertainty(arch, sc, data, opt[arch], out, seed) for arch in ARCHS}
    cont = continual(sc, out, seed)
    continual_figure(cont, out / "continual_vit.png")
    holds = claims(opt, unc, cont, sc)
    seconds = time.perf_counter() - t0
    results = {"scale": scale, "seed": seed, "settings": asdict(sc),
               "optimisation": {a: {k: v for k, v in o.items() if k != "runs"} for a, o in opt.items()},
               "curves": {a: {n: {"loss": r["loss"], "time": r["time"], "evals": r["evals"]} for n, r in o["runs"].items()}
                          for a, o in opt.items()},
               "uncertainty": unc, "continual": cont, "holds": holds, "seconds": seconds, "machine": machine_info(),
               "device": str(device())}
    write_json(out / "results.json", results)
    write_report(out, scale, sc, opt, unc, cont, holds, seconds)
    return results


@register("modern", "GaussNewton vs AdamW, Laplace (KF/diag/last-layer/LoRA) and online Laplace on a ViT and a "
          "ResNet-BN on real MNIST (KMNIST OOD)", paper="issue 22 (no paper table)")
@single_threaded
def run(scale: str, out: Path, seed: int = 0) -> dict[str, Any]:
    res = reproduce(scale, out, seed)
    assert res is not None
    return res
