"""``mesu-permuted``: MESU vs BGD (and boundary-based / fine-tuning baselines) on continuously blended
permuted MNIST without task boundaries (MESU paper Fig. 3a-d, Appendix D "Benchmark between MESU and
BGD").

Protocol (paper Appendix D; the choices it leaves open are marked as ours): MNIST zero-padded to 32x32, scaled
to [0, 1], flattened to 1024 inputs; one fixed pixel permutation per task; a 1024-200-200-10 ReLU MLP with
Kaiming-uniform weights (the paper does not say which variant; ours: ``torch.nn.init.kaiming_uniform_``
defaults, biases U(+-1/sqrt(fan_in))); batch 128; Zeno et al.'s continuous schedule (ours: the paper's Fig. 3a
shows a continuous blend without its formula; beta = 4, virtual epochs of 469 iterations, as in Zeno et al.'s
code); MESU sigma_0 = sigma_prior = 0.04, sigma_res = 10; BGD sigma_0 = 0.04, eta = 1 (eta is ours);
sum-reduced loss (ours); K = 10 training samples at every scale (ours; with K = 2-3 we saw MESU diverge within
a few dozen steps on MNIST: the sigma-gradient estimate is too noisy and sigma * g_sigma overshoots, which the
paper's rule does not guard against); evaluation on every task's test set after every evaluation period.

Baselines (not in the paper, which compares MESU with BGD only; our settings): SGD (lr 0.05) and Adam
(lr 1e-4) fine-tuning; EWC (empirical Fisher, lambda 5000), EWC with the true Fisher, online EWC
(lambda 5000, gamma 1) and SI (c 0.1, xi 1e-3), all on Adam lr 1e-4 with a mean-reduced loss. EWC/SI receive
the task boundaries (the 50/50 points of the cross-fade) through the harness's explicit hook; MESU, BGD and
the fine-tuning baselines never see them.

Scales: ``smoke`` (256 training images, 3 tasks x 2 epochs, K = 10 training / 3 test samples, one seed;
plumbing only), ``medium`` (full MNIST, 100 tasks x 1 epoch, K = 10 training / 5 test samples, 500 test
images per task, evaluation every 2 tasks, one seed; estimated 1-2 hours on 2 idle cores, not measured),
``paper`` (100 tasks x 20 epochs,
K = 10 / 10, full test sets, evaluation every epoch, 3 seeds; GPU-sized). Every (method, seed) run
checkpoints under ``out/runs/<method>/seed<k>`` and a re-invocation resumes it.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from curvkit.checkpoint import write_text
from curvkit.continual import (
    EWC,
    ContinualRunner,
    ContinuousSchedule,
    Learner,
    MeanFieldLearner,
    PermutedTasks,
    RunnerConfig,
    RunResult,
    SynapticIntelligence,
    TaskStream,
    TorchLearner,
    iters_per_epoch,
)
from curvkit.experiments._mesu_common import kaiming_uniform_mlp
from curvkit.experiments._report import machine_info, markdown_table, new_figure, save_figure, write_json
from curvkit.experiments.registry import register

BAYESIAN = ("mesu", "bgd")


@dataclass(frozen=True)
class Protocol:
    num_tasks: int
    epochs_per_task: int
    n_train: int | None  # None: all 60000
    n_test: int | None  # test images per task at evaluation (None: all 10000)
    train_mc: int
    test_mc: int
    evals_per_task: float  # evaluations per task duration (1/2 = every 2 tasks)
    seeds: int
    methods: tuple[str, ...]
    fisher_samples: int = 1000
    mix_stride: int = 1
    batch_size: int = 128


PROTOCOLS = {
    "smoke": Protocol(3, 2, 256, 200, 10, 3, 2, 1,
                      ("mesu", "bgd", "sgd", "adam", "ewc", "ewc-true", "online-ewc", "si"), fisher_samples=100),
    "medium": Protocol(100, 1, None, 500, 10, 5, 0.5, 1,
                       ("mesu", "bgd", "sgd", "adam", "online-ewc", "si"), fisher_samples=500, mix_stride=5),
    "paper": Protocol(100, 20, None, None, 10, 10, 20, 3,
                      ("mesu", "bgd", "sgd", "adam", "ewc", "ewc-true", "online-ewc", "si"), mix_stride=10),
}


def load_permuted_mnist(n_train: int | None) -> tuple[torch.Tensor, ...]:
    """Padded (32x32), [0,1]-scaled, flattened MNIST: X_train (N, 1024), y_train, X_test (10000, 1024), y_test."""
    from curvkit.data import mnist_vectors

    return (*mnist_vectors(train=True, n=n_train, padding=2), *mnist_vectors(train=False, padding=2))


def build_model(seed: int) -> nn.Sequential:
    """1024-200-200-10 ReLU MLP, Kaiming-uniform weights (default gain), biases U(+-1/sqrt(fan_in))."""
    return kaiming_uniform_mlp([1024, 200, 200, 10], seed)


def build_learner(method: str, seed: int, proto: Protocol, device: torch.device) -> Learner:
    from curvkit.optim import BGD, MESU

    model = build_model(seed).to(device)
    if method == "mesu":
        return MeanFieldLearner(model, MESU(model.parameters(), model=model, sigma_prior=0.04, sigma_res=10.0, sigma_init=0.04,
                                            mc_samples=proto.train_mc, seed=seed + 1000))
    if method == "bgd":
        return MeanFieldLearner(model, BGD(model.parameters(), model=model, eta=1.0, sigma_init=0.04, mc_samples=proto.train_mc, seed=seed + 1000))
    if method == "sgd":
        return TorchLearner(model, torch.optim.SGD(model.parameters(), lr=0.05))
    adam = torch.optim.Adam(model.parameters(), lr=1e-4)
    if method == "adam":
        return TorchLearner(model, adam)
    if method == "ewc":
        return TorchLearner(model, adam, EWC(lam=5000.0, curvature="empirical"))
    if method == "ewc-true":
        return TorchLearner(model, adam, EWC(lam=5000.0, curvature="true"))
    if method == "online-ewc":
        return TorchLearner(model, adam, EWC(lam=5000.0, curvature="empirical", online=True, gamma=1.0))
    if method == "si":
        return TorchLearner(model, adam, SynapticIntelligence(c=0.1, xi=1e-3))
    raise ValueError(f"unknown method {method!r}")


def _phase_accuracy(res: RunResult, D: int, after_tasks: int, tasks: range) -> float:
    """Mean MC accuracy over ``tasks`` at the evaluation done after ``after_tasks`` task durations."""
    it = after_tasks * D
    if it not in res.eval_iters:
        raise ValueError(f"no evaluation at iteration {it}; choose an evaluation period dividing the task length")
    row = res.accuracy("mc")[res.eval_iters.index(it)]
    return float(np.mean(row[list(tasks)]))


def summarize_run(res: RunResult, D: int) -> dict[str, Any]:
    M = res.num_tasks
    k = min(10, M)
    acc = res.accuracy("mc")
    just = []  # accuracy of task m at the end of its duration ("just learned"; H8)
    for m in range(M):
        it = (m + 1) * D
        just.append(float(acc[res.eval_iters.index(it), m]) if it in res.eval_iters else float("nan"))
    out = {
        "first_k_after_k": _phase_accuracy(res, D, k, range(k)),
        "last_k_after_all": _phase_accuracy(res, D, M, range(M - k, M)),
        "first_k_after_all": _phase_accuracy(res, D, M, range(k)),
        "final_mean_all": float(acc[-1].mean()),
        "final_mean_map_all": float(res.accuracy("map")[-1].mean()),
        "just_learned": just,
        "uses_task_boundaries": res.uses_task_boundaries,
        "diagnostics": res.diagnostics,
    }
    if res.sigma:
        out["mean_sigma"] = [s["all"]["mean"] for s in res.sigma]
    return out


def _mean_std(xs: list[float]) -> tuple[float, float]:
    a = np.asarray(xs, dtype=float)
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else 0.0


def _plots(out: Path, runs: dict[str, list[RunResult]], summary: dict[str, Any], D: int, ipe: int) -> list[str]:
    files = []
    # Fig. 3a: task mix per batch (top) and MESU per-task accuracy (bottom), seed 0
    ref = runs.get("mesu", next(iter(runs.values())))[0]
    fig, ax = new_figure(2, 1, size=(9, 3.2))
    mix = np.asarray(ref.mix)
    M = ref.num_tasks
    iters = np.unique(mix[:, 0])
    grid = np.zeros((M, iters.size))
    pos = {int(t): i for i, t in enumerate(iters)}
    for t, m, c in mix:
        grid[m, pos[int(t)]] = c
    for m in range(M):
        ax[0, 0].plot(iters, grid[m], lw=0.8)
    ax[0, 0].set_ylabel("inputs per batch")
    ax[0, 0].set_title("task mix per training batch (each colour a task)")
    acc = ref.accuracy("mc")
    for m in range(M):
        ax[1, 0].plot(ref.eval_iters, acc[:, m], lw=0.8)
    ax[1, 0].set_xlabel("iteration")
    ax[1, 0].set_ylabel("test accuracy")
    ax[1, 0].set_title(f"{ref.name}: per-task test accuracy")
    files.append(save_figure(fig, out / "fig3a_task_mix_accuracy.png").name)
    # Fig. 3b: mean sigma per evaluation (x in virtual epochs)
    fig, ax = new_figure()
    for method in BAYESIAN:
        for res in runs.get(method, []):
            if res.sigma:
                ax[0, 0].plot(np.asarray(res.eval_iters) / ipe, [s["all"]["mean"] for s in res.sigma], label=res.name)
    ax[0, 0].set_xlabel("virtual epoch")
    ax[0, 0].set_ylabel("mean sigma")
    ax[0, 0].legend()
    files.append(save_figure(fig, out / "fig3b_mean_sigma.png").name)
    # Fig. 3c/d: accuracy on the first k tasks after k tasks and on the last k after all tasks
    k = min(10, M)
    fig, ax = new_figure(1, 2, size=(6, 3.6))
    for j, (first, last) in enumerate([(range(k), k), (range(M - k, M), M)]):
        methods = list(runs)
        for i, method in enumerate(methods):
            per_seed = np.array([[res.accuracy("mc")[res.eval_iters.index(last * D), m] for m in first]
                                 for res in runs[method]])
            ax[0, j].bar(np.arange(k) + i / (len(methods) + 1), per_seed.mean(0), width=1 / (len(methods) + 1),
                         yerr=per_seed.std(0, ddof=1) if len(per_seed) > 1 else None, label=method)
        ax[0, j].set_xticks(np.arange(k) + 0.4, [str(m + 1) for m in first])
        ax[0, j].set_xlabel("task")
        ax[0, j].set_ylabel("test accuracy")
        ax[0, j].set_title(f"after {last} tasks")
    ax[0, 1].legend(fontsize=7)
    files.append(save_figure(fig, out / "fig3cd_last_ten_tasks.png").name)
    # H8: just-learned accuracy per task
    fig, ax = new_figure()
    for method, s in summary["methods"].items():
        ax[0, 0].plot(np.arange(1, M + 1), s["just_learned_mean"], label=method, lw=0.9)
    ax[0, 0].set_xlabel("task")
    ax[0, 0].set_ylabel("accuracy at the end of the task")
    ax[0, 0].legend(fontsize=7)
    files.append(save_figure(fig, out / "just_learned_accuracy.png").name)
    return files


def _claims(summary: dict[str, Any], M: int) -> list[list[Any]]:
    s = summary["methods"]
    rows: list[list[Any]] = []
    mesu, bgd = s.get("mesu"), s.get("bgd")
    if mesu is None or bgd is None:
        return rows
    ms, bs = mesu["mean_sigma"], bgd["mean_sigma"]
    mesu_change = (ms[-1] - ms[0]) / ms[0]
    bgd_mono = bool(np.all(np.diff(bs) <= 1e-12))
    rows.append(["H5 Fig. 3b", "MESU mean sigma ~ flat; BGD decreasing",
                 f"MESU {ms[0]:.4f} -> {ms[-1]:.4f} ({100 * mesu_change:+.1f}%); BGD {bs[0]:.4f} -> {bs[-1]:.4f}"
                 f" (monotone: {bgd_mono})",
                 "holds" if abs(mesu_change) < 0.2 and bs[-1] < bs[0] and bgd_mono else "does not hold"])
    k = min(10, M)
    m1, b1 = mesu["first_k_after_k"][0], bgd["first_k_after_k"][0]
    rows.append(["H6 Fig. 3c", f"after {k} tasks, BGD >= MESU on tasks 1-{k} (small margin)",
                 f"BGD {b1:.4f}, MESU {m1:.4f}", "holds" if b1 >= m1 else "does not hold"])
    m2, b2 = mesu["last_k_after_all"][0], bgd["last_k_after_all"][0]
    drop_b, drop_m = b1 - b2, m1 - m2
    rows.append(["H7 Fig. 3d", "after 100 tasks BGD ~6 pts below on the last ten; MESU drop ~0-1 pt",
                 f"BGD drop {100 * drop_b:+.2f} pts (vs MESU last-ten {100 * (m2 - b2):+.2f}); MESU drop {100 * drop_m:+.2f} pts",
                 "holds" if drop_b >= 0.04 and drop_m <= 0.02 and m2 > b2 else "does not hold"])
    jm, jb = np.asarray(mesu["just_learned_mean"]), np.asarray(bgd["just_learned_mean"])
    h = max(2, M // 10)

    def nm(a: np.ndarray) -> float:
        return float(np.nanmean(a)) if np.isfinite(a).any() else float("nan")

    rows.append(["H8", "MESU just-learned accuracy flat over tasks; BGD declines",
                 f"MESU first/last {h}: {nm(jm[:h]):.4f}/{nm(jm[-h:]):.4f}; BGD {nm(jb[:h]):.4f}/{nm(jb[-h:]):.4f}",
                 "holds" if nm(jm[-h:]) >= nm(jm[:h]) - 0.02 and nm(jb[-h:]) < nm(jb[:h]) - 0.02
                 else "does not hold"])
    return rows


@register("mesu-permuted", "MESU vs BGD and baselines on 100 continuously blended permuted-MNIST tasks (Fig. 3)",
          paper="MESU (Bonnet et al. 2023) Fig. 3a-d")
def run(scale: str, out: Path, seed: int = 0, progress: bool = True) -> dict[str, Any]:
    proto = PROTOCOLS[scale]
    out = Path(out)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    Xa, ya, Xb, yb = load_permuted_mnist(proto.n_train)
    tasks = PermutedTasks(Xa, ya, Xb, yb, proto.num_tasks, permutation_seed=0)
    ipe = iters_per_epoch(Xa.shape[0], proto.batch_size)
    D = proto.epochs_per_task * ipe
    eval_every = round(D / proto.evals_per_task)
    if (D % eval_every) and (eval_every % D):
        raise ValueError(f"evaluation period {eval_every} must divide the task length {D} or be a multiple of it")
    schedule = ContinuousSchedule(proto.num_tasks, D, beta=4.0)
    runs: dict[str, list[RunResult]] = {}
    for method in proto.methods:
        for k in range(proto.seeds):
            s = seed + k
            stream = TaskStream(tasks, schedule, proto.batch_size, seed=s)
            learner = build_learner(method, s, proto, device)
            cfg = RunnerConfig(eval_every=eval_every, eval_mc_samples=proto.test_mc, eval_max_test=proto.n_test,
                               mix_stride=proto.mix_stride, boundary_samples=proto.fisher_samples, seed=s,
                               progress=progress, name=f"{method}/seed{s}")
            res = ContinualRunner(learner, stream, cfg, out / "runs" / method / f"seed{s}").run()
            runs.setdefault(method, []).append(res)

    summary: dict[str, Any] = {"scale": scale, "protocol": asdict(proto), "iters_per_task": D,
                               "iters_per_epoch": ipe, "eval_every": eval_every, "machine": machine_info(),
                               "methods": {}}
    for method, rs in runs.items():
        per = [summarize_run(r, D) for r in rs]
        entry: dict[str, Any] = {key: _mean_std([p[key] for p in per])
                                 for key in ("first_k_after_k", "last_k_after_all", "first_k_after_all",
                                             "final_mean_all", "final_mean_map_all")}
        entry["just_learned_mean"] = np.nanmean([p["just_learned"] for p in per], axis=0).tolist()
        entry["uses_task_boundaries"] = per[0]["uses_task_boundaries"]
        if "mean_sigma" in per[0]:
            entry["mean_sigma"] = np.mean([p["mean_sigma"] for p in per], axis=0).tolist()
            entry["diagnostics"] = [p["diagnostics"] for p in per]
        summary["methods"][method] = entry
    figures = _plots(out, runs, summary, D, ipe)
    claims = _claims(summary, proto.num_tasks)
    summary["claims"] = [dict(zip(["id", "paper", "measured", "verdict"], r)) for r in claims]
    summary["figures"] = figures
    write_json(out / "summary.json", summary)

    k = min(10, proto.num_tasks)
    rows = [[m, "yes" if e["uses_task_boundaries"] else "no",
             f"{e['first_k_after_k'][0]:.4f} ± {e['first_k_after_k'][1]:.4f}",
             f"{e['last_k_after_all'][0]:.4f} ± {e['last_k_after_all'][1]:.4f}",
             f"{e['first_k_after_all'][0]:.4f}", f"{e['final_mean_all'][0]:.4f}", f"{e['final_mean_map_all'][0]:.4f}"]
            for m, e in summary["methods"].items()]
    text = [f"# mesu-permuted ({scale})\n",
            f"{proto.num_tasks} tasks x {proto.epochs_per_task} virtual epochs ({D} iterations per task, batch "
            f"{proto.batch_size}), continuous schedule beta = 4, K_train = {proto.train_mc}, K_test = {proto.test_mc}, "
            f"{proto.n_test or 10000} test images per task, evaluation every {eval_every} iterations, "
            f"{proto.seeds} seed(s). Accuracies: MC-averaged softmax (MAP for deterministic learners); mean ± std "
            "over seeds.\n",
            markdown_table(["method", "task boundaries used", f"tasks 1-{k} after {k}",
                            f"last {k} after {proto.num_tasks}", f"tasks 1-{k} after {proto.num_tasks}",
                            "mean all tasks (final)", "MAP mean all (final)"], rows),
            "\n## Paper claims (MESU paper Fig. 3)\n",
            markdown_table(["claim", "paper", "measured", "verdict"], claims) if claims else "(MESU/BGD not run)\n",
            "\n" + (f"Smoke scale checks the plumbing only ({proto.num_tasks} tasks of {D} iterations on "
                    f"{proto.n_train} images); its numbers say nothing about the claims.\n" if scale == "smoke" else ""),
            "\nFigures: " + ", ".join(figures) + "\n"]
    write_text(out / "report.md", "\n".join(text))
    return summary
