"""``online-laplace-permuted``: thesis Figs. 5.7-5.8 - Online / EWC / Non-Online Laplace (KF and diagonal),
SI and joint training on permuted MNIST, 784-100-100-10 ReLU, one shared head.

Protocol (Sec. 5.4.1; digest choices where silent): 50,000/10,000/10,000 train/validation/test split of
MNIST, one fixed pixel permutation per task; momentum SGD (lr 1e-2, momentum 0.95, batch 250), at least
``min_epochs`` epochs and early stopping after ``patience`` epochs without validation improvement, initial
lr decayed per task as lr0 / (1 + k t); SI with Adam lr 1e-3 (best for SI in the thesis); prior precision
1e-2 on the summed loss; KFLR factors / exact GGN diagonal per task. Claims checked: KF Online Laplace
above 90% mean accuracy after all tasks; KF beats diagonal at every lambda; lambda = 3 best for KF; lambda
= 1 forgets the first task; lambda = 100 keeps the first task above the latest (plasticity lost).

Scales: smoke - 3 tasks on a 3,000-example MNIST subset, 2 epochs; medium - 10 tasks, full MNIST, 2-3 epochs
(patience 1), k = 0.1, lambda in {1, 3, 10, 30, 100} for Online KF and D, EWC and Non-Online at lambda 3,
summed-factor KF at lambda 3, SI c = 0.1, joint; paper - 50 tasks, 10-20 epochs (patience 5), the same grids plus SI c in {0.01, ..., 1}.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from curvkit.continual.streams import PermutedTasks
from curvkit.continual.task_sequence import SequenceConfig
from curvkit.data import mnist
from curvkit.experiments._laplace_continual import Method, run_method
from curvkit.experiments._report import (
    machine_info,
    markdown_table,
    new_figure,
    save_figure,
    single_threaded,
    write_json,
)
from curvkit.experiments.registry import register
from curvkit.models import mlp

LAMS = (1.0, 3.0, 10.0, 30.0, 100.0)


def _settings(scale: str) -> dict[str, Any]:
    if scale == "smoke":
        return dict(tasks=3, n_train=1200, n_test=500, val=240, min_epochs=3, max_epochs=3, patience=1, k=0.0,
                    batch=50, lr=0.05,
                    methods=[Method("online", "kron", 3.0), Method("online", "diag", 3.0), Method("si", hyper=0.1),
                             Method("none"), Method("joint")])
    fixed = [Method(f, c, 3.0) for f in ("ewc", "non_online") for c in ("kron", "diag")]
    if scale == "medium":
        sweep = [Method("online", c, lam) for c in ("kron", "diag") for lam in LAMS]
        return dict(tasks=10, n_train=None, n_test=None, val=10000, min_epochs=2, max_epochs=3, patience=1, k=0.1,
                    batch=250, lr=1e-2,
                    methods=[*sweep, *fixed, Method("online", "kron", 3.0, "summed"), Method("si", hyper=0.1),
                             Method("joint")])
    methods = [Method("online", c, lam) for c in ("kron", "diag") for lam in LAMS] + fixed
    return dict(tasks=50, n_train=None, n_test=None, val=10000, min_epochs=10, max_epochs=20, patience=5, k=0.1,
                batch=250, lr=1e-2,
                methods=[*methods, Method("online", "kron", 3.0, "summed"),
                         *[Method("si", hyper=c) for c in (0.01, 0.03, 0.1, 0.3, 1.0)], Method("joint")])


def _tasks(st: dict[str, Any], seed: int) -> PermutedTasks:
    Xtr, ytr = mnist(train=True)
    Xte, yte = mnist(train=False)
    Xtr, Xte = Xtr.reshape(-1, 784).float() / 255, Xte.reshape(-1, 784).float() / 255
    if st["n_train"] is not None:
        Xtr, ytr, Xte, yte = Xtr[:st["n_train"]], ytr[:st["n_train"]], Xte[:st["n_test"]], yte[:st["n_test"]]
    return PermutedTasks(Xtr, ytr, Xte, yte, st["tasks"], permutation_seed=seed)


@register("online-laplace-permuted", "Online / EWC / Non-Online Laplace (KF, diag), SI, joint on permuted MNIST",
          paper="002 Botev thesis, Figs. 5.7-5.8")
@single_threaded
def run(scale: str, out: Path, seed: int = 0) -> dict[str, Any]:
    st = _settings(scale)
    t0 = time.perf_counter()
    tasks = _tasks(st, seed)
    cfg = SequenceConfig(optimizer="momentum", lr=st["lr"], momentum=0.95, lr_decay_k=st["k"], batch_size=st["batch"],
                         min_epochs=st["min_epochs"], max_epochs=st["max_epochs"], patience=st["patience"],
                         val_size=st["val"], curvature_batch=1000)
    runs = {}
    for m in st["methods"]:
        runs[m.label] = run_method(m, lambda s: mlp([784, 100, 100, 10], "relu", seed=s), tasks, cfg, out, seed,
                                   progress=scale != "smoke")
    T = st["tasks"]
    rows = [[k, r["mean_seen"][-1], r["first"][-1], r["latest"][-1], min(r["acc"][-1][:T]), sum(r["seconds"])]
            for k, r in runs.items()]
    final = {k: r["mean_seen"][-1] for k, r in runs.items()}
    holds: dict[str, Any] = {}
    kf = {lam: final[Method("online", "kron", lam).label] for lam in LAMS if Method("online", "kron", lam).label in final}
    dg = {lam: final[Method("online", "diag", lam).label] for lam in LAMS if Method("online", "diag", lam).label in final}
    pairs = [(kf[lam], dg[lam]) for lam in LAMS if lam in kf and lam in dg]
    if scale == "smoke":
        holds["kf_beats_diag"] = final["online KF lam=3"] > final["online D lam=3"]
        holds["kf_keeps_first_task_better_than_finetuning"] = (runs["online KF lam=3"]["first"][-1]
                                                                > runs["none"]["first"][-1])
    else:
        holds["kf_online_above_90pct"] = kf.get(3.0, 0.0) > 0.9
        holds["kf_beats_diag_at_every_lambda"] = bool(pairs) and all(a > b for a, b in pairs)
        # the thesis selects by the final validation error over all tasks; runs made before the trainer recorded
        # validation accuracy on every task fall back to the final mean test accuracy (stated in the report)
        recorded = all(runs[Method("online", "kron", lam).label].get("val_acc") for lam in kf)
        score = {lam: (float(np.mean(runs[Method("online", "kron", lam).label]["val_acc"][-1])) if recorded
                       else kf[lam]) for lam in kf}
        key = "lambda_3_best_for_kf_by_validation" if recorded else "lambda_3_best_for_kf_by_final_test_accuracy"
        holds[key] = max(score, key=score.get) == 3.0  # type: ignore[arg-type]
        r1, r100 = runs[Method("online", "kron", 1.0).label], runs[Method("online", "kron", 100.0).label]
        holds["lambda_1_forgets_first_task"] = r1["first"][-1] < r1["latest"][-1]
        holds["lambda_100_freezes"] = r100["first"][-1] > r100["latest"][-1]
    fig, axes = new_figure(1, 2, size=(5.5, 4.0))
    for k, r in runs.items():
        if "lam=" in k and not k.endswith("lam=3") and "summed" not in k:
            continue
        axes[0, 0].plot(range(1, T + 1), r["mean_seen"], label=k, ls=":" if k == "joint" else "-")
    axes[0, 0].set_xlabel("tasks seen")
    axes[0, 0].set_ylabel("mean test accuracy over seen tasks")
    axes[0, 0].legend(fontsize=7)
    for tag, ls in (("KF", "-"), ("D", "--")):
        for lam in (1.0, 3.0, 100.0):
            key = f"online {tag} lam={lam:g}"
            if key in runs:
                axes[0, 1].plot(range(1, T + 1), runs[key]["first"], ls=ls, label=f"{tag} lam={lam:g} first")
    axes[0, 1].set_xlabel("tasks seen")
    axes[0, 1].set_ylabel("accuracy on the first task")
    axes[0, 1].legend(fontsize=7)
    save_figure(fig, out / "fig5_7_5_8_permuted.png")
    results = {"scale": scale, "seed": seed, "settings": {k: v for k, v in st.items() if k != "methods"},
               "runs": runs, "final_mean": final, "holds": holds, "seconds": time.perf_counter() - t0,
               "machine": machine_info()}
    write_json(out / "results.json", results)
    md = [f"# online-laplace-permuted ({scale})", "",
          f"{T} permuted-MNIST tasks, 784-100-100-10 ReLU, momentum SGD lr {st['lr']:g} (0.95), batch {st['batch']}, "
          f"{st['min_epochs']}-{st['max_epochs']} epochs per task (patience {st['patience']}), lr decay k = "
          f"{st['k']:g}; SI with Adam 1e-3. Thesis: 50 tasks, KF Online Laplace > 90% (Fig. 5.7).", "",
          markdown_table(["method", "mean acc (seen)", "first task", "latest task", "worst task", "seconds"], rows),
          "", "Claims:", ""]
    md += [f"- {k.replace('_', ' ')}: {'holds' if v else 'does NOT hold'}" for k, v in holds.items()]
    md += ["", "Figure: fig5_7_5_8_permuted.png"]
    (out / "report.md").write_text("\n".join(md) + "\n")
    return results
