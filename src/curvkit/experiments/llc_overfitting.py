"""``llc-overfitting``: paper App. A.3 (Figs. 7-8) - λ̂, Tr(H) and WBIC rise as the model overfits.

The paper used Fashion-MNIST 2HL-128, lr 1e-2, α = 0.1 for 40 epochs. Fashion-MNIST is not bundled:
``medium``/``paper`` use it when ``CURVKIT_FASHION_MNIST_DIR`` points at its files and fall back to the
bundled MNIST otherwise (said in the report). ``smoke``: synthetic blobs on a small training set
(300 points) so that a 2HL-64 net overfits within 20 epochs. Checkpoints after every epoch.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from curvkit.checkpoint import write_text
from curvkit.experiments._report import machine_info, markdown_table, write_json
from curvkit.experiments.ngd_common import (
    SMOKE_NOTE,
    Data,
    Measure,
    RunSpec,
    load_data,
    plot_series,
    train_run,
)
from curvkit.experiments.registry import register

PAPER = {"ngd": {"val": (0.307, 0.583), "trace": (190, 452), "llc": (22.5, 41.9), "wbic": (76853, 96864)},
         "sgd": {"val": (0.326, 0.418), "trace": (211, 370), "llc": (19.5, 23.3), "wbic": (56022, 62909)}}


def _settings(scale: str) -> dict[str, Any]:
    if scale == "smoke":
        return dict(hidden=64, epochs=20, batch=32,
                    measure=Measure(llc_chains=2, llc_draws=100, llc_epochs=(2, 10, 20), trace_probes=10,
                                    trace_points=300, trace_epochs=(2, 10, 20)))
    every = None
    return dict(hidden=128, epochs=40 if scale == "paper" else 20, batch=128,
                measure=Measure(llc_chains=2, llc_draws=1000, llc_epochs=every, trace_probes=100 if scale == "medium"
                                else 250, trace_epochs=every))


@register("llc-overfitting", "LLC, Hessian trace and WBIC rise when the model overfits",
          paper="003 Saghir et al. 2024, App. A (Figs. 7-8)")
def run(scale: str, out: Path, seed: int = 0) -> dict[str, Any]:
    st = _settings(scale)
    if scale == "smoke":
        d = load_data("smoke", seed=seed)
        data = Data(d.X[:300], d.y[:300], d.Xte, d.yte, d.name + " (300 train points)")
    else:
        dataset = "fashion_mnist" if os.environ.get("CURVKIT_FASHION_MNIST_DIR") else "mnist"
        data = load_data(scale, dataset, seed=seed)
    ck, h = out / "checkpoints", st["hidden"]
    runs = {opt: train_run(RunSpec(f"a-{opt}-{h}", h, 2, opt, lr=1e-2, alpha=0.1, epsilon=1e-10, epochs=st["epochs"],
                                   seed=1, batch_size=st["batch"]), data, st["measure"], ck) for opt in ("sgd", "ngd")}
    for key, label in (("llc", "λ̂"), ("trace_h", "Tr(H)"), ("wbic", "WBIC"), ("val_loss", "validation loss")):
        plot_series(out / f"fig7_{key}.png", {o: [(r["epoch"], r[key]) for r in v if key in r] for o, v in runs.items()},
                    label, f"{label} per epoch ({data.name})")
    rows, holds = [], {}
    for opt, recs in runs.items():
        val = [r["val_loss"] for r in recs]
        best = min(range(len(val)), key=lambda i: val[i])
        meas = [r for r in recs if "llc" in r]
        after = [r for r in meas if r["epoch"] >= recs[best]["epoch"]]
        first, last = (after[0], after[-1]) if len(after) >= 2 else (meas[0], meas[-1])
        overfits = val[-1] > val[best]
        holds[opt] = {"overfits": overfits, **{k: last[k] > first[k] for k in ("llc", "trace_h", "wbic")}}
        rows.append([opt, f"{val[best]:.3f} (ep {recs[best]['epoch']}) -> {val[-1]:.3f}",
                     f"{first['llc']:.2f} -> {last['llc']:.2f}", f"{first['trace_h']:.1f} -> {last['trace_h']:.1f}",
                     f"{first['wbic']:.0f} -> {last['wbic']:.0f}",
                     "val {} -> {}; Tr {} -> {}; λ̂ {} -> {}".format(*PAPER[opt]["val"], *PAPER[opt]["trace"],
                                                                  *PAPER[opt]["llc"])])
    results = {"scale": scale, "data": data.name, "runs": runs, "holds": holds, "machine": machine_info()}
    write_json(out / "results.json", results)
    md = [f"# llc-overfitting ({scale})", "", f"Data: {data.name}; 2HL-{h}, lr 1e-2, α = 0.1, {st['epochs']} epochs.",
          "Values from the epoch of minimum validation loss (or the first measured epoch after it) to the end.", "",
          markdown_table(["opt", "val loss min -> end", "λ̂", "Tr(H)", "WBIC", "paper (Fashion-MNIST 2HL-128)"], rows), ""]
    for opt, hv in holds.items():
        md.append(f"- {opt}: overfits (val loss rises): {hv['overfits']}; λ̂ rises: {hv['llc']}; Tr(H) rises: "
                  f"{hv['trace_h']}; WBIC rises: {hv['wbic']}.")
    if scale == "smoke":
        md.append("\nSmoke scale: synthetic data and a tiny network; only the direction of the changes is "
                  "comparable with the paper.")
    elif "fashion" not in data.name:
        md.append("\nFashion-MNIST files were not supplied (CURVKIT_FASHION_MNIST_DIR); this run used "
                  f"{data.name} instead, so the paper's numbers are not directly comparable.")
    md.append("\nFigures: fig7_llc.png, fig7_trace_h.png, fig7_wbic.png, fig7_val_loss.png.")
    if scale == "smoke":
        md[1:1] = [SMOKE_NOTE, ""]
    write_text(out / "report.md", "\n".join(md) + "\n")
    return results
