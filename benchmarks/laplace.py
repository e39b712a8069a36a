"""Laplace posteriors: curvkit vs laplace-torch (issue 13, section 5), measured side by side in one run.

Setting: a 784-H-H-10 ReLU MLP (default H = 100, the thesis's permuted-MNIST net) trained for one epoch on the bundled MNIST (Adam), float32,
CPU. Fit: the curvature over ``--fit`` training images (batches of 500). Predictives on ``--test`` test images:
the linearised (GLM) predictive with the probit link and the MC predictive (thesis Eq. 5.9, ``--samples``
posterior samples); the GLM predictive on ``--glm-test`` points only (default 1,000: laplace-torch's took about
30 s for 500 points of a 26k-parameter MLP on this machine). Equal curvature type on both sides: Kronecker factors of the exact GGN (curvkit KFLR;
laplace-torch's default CurvlinopsGGN KFAC with the type-2 Fisher) with the exact prior term
(``prior_form='exact'``, laplace-torch's form), and the exact GGN diagonal (curvkit ``diag`` + ``ggn``;
laplace-torch's ``diag``). Prior precision 1, N = the number of fitted images on both sides.

Every measurement runs in a fresh process (:func:`_common.run_worker`): a warm-up call, the peak RSS increase
during one call, then the median wall time over ``--repeats`` calls and the median CPU time of the process over the
same calls (``time.process_time``, every thread; threads busy = CPU / wall time); an arm whose warm-up takes over
30 s is measured by that call alone, time and peak memory (laplace-torch's diagonal fit and GLM predictive here).
The ratio curvkit / laplace-torch is of the wall times. The table
is rewritten after every row, so an interrupted run keeps what it finished. Agreement: mean absolute difference of the
two libraries' GLM probabilities, and of their MC probabilities compared with the Monte Carlo standard error
of a difference of two independent K-sample averages.

Targets (issue 13): fit at most half laplace-torch's time, predictives no slower, memory no higher.
Run: ``.venv/bin/python benchmarks/laplace.py`` (needs ``laplace-torch``; ``--quick`` for a small check).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_busy, fmt_mib, fmt_ratio, fmt_seconds, require_library, run_worker, time_and_peak


def _model(hidden: int) -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(784, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, hidden),
                               torch.nn.ReLU(), torch.nn.Linear(hidden, 10))


def _data(n_fit: int, n_test: int) -> tuple[torch.Tensor, ...]:
    from curvkit.data import mnist

    Xtr, ytr = mnist(train=True)
    Xte, _ = mnist(train=False)
    return (Xtr[:n_fit].reshape(-1, 784).float() / 255, ytr[:n_fit], Xte[:n_test].reshape(-1, 784).float() / 255)


def _prepare(hidden: int, path: Path) -> None:
    torch.manual_seed(0)
    model = _model(hidden)
    X, y, _ = _data(60000, 1)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for i in range(0, 60000, 128):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(X[i:i + 128]), y[i:i + 128]).backward()
        opt.step()
    torch.save(model.state_dict(), path)


def _laplace_torch() -> Any:
    """laplace-torch's ``Laplace`` (this script is also called laplace.py: drop its directory from the path)."""
    here = Path(__file__).resolve().parent
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != here]
    mod = sys.modules.pop("laplace", None)
    try:
        import laplace

        return laplace.Laplace
    finally:
        sys.path[:] = saved
        if mod is not None and "laplace" not in sys.modules:
            sys.modules["laplace"] = mod


# ---------------------------------------------------------------------------------------------- worker
def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    torch.set_num_threads(spec["threads"])
    model = _model(spec["hidden"])
    model.load_state_dict(torch.load(spec["weights"]))
    model.eval()
    X, y, Xte = _data(spec["fit"], spec["test"])
    batches = [(X[i:i + 500], y[i:i + 500]) for i in range(0, X.shape[0], 500)]
    lib, structure, op = spec["lib"], spec["structure"], spec["op"]
    if lib == "curvkit":
        from curvkit.laplace import Laplace
        from curvkit.likelihoods import CrossEntropy

        def fit() -> Any:
            kw = dict(prior_form="exact") if structure == "kron" else {}
            return Laplace(model, CrossEntropy(), structure, "kflr" if structure == "kron" else "ggn",
                           prior_precision=1.0, **kw).fit(batches)  # type: ignore[arg-type]

        def glm(post: Any) -> torch.Tensor:
            return post.predict(Xte, "glm", batch_size=500)  # type: ignore[no-any-return]

        def mc(post: Any) -> torch.Tensor:
            return post.predict(Xte, "mc", num_samples=spec["samples"], generator=torch.Generator().manual_seed(1),
                                batch_size=2000)  # type: ignore[no-any-return]
    else:
        LT = _laplace_torch()

        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=500)

        def fit() -> Any:
            la = LT(model, "classification", subset_of_weights="all", hessian_structure=structure,
                    prior_precision=1.0)
            la.fit(loader)
            return la

        def glm(la: Any) -> torch.Tensor:
            return torch.cat([la(Xte[i:i + 500], pred_type="glm", link_approx="probit")
                              for i in range(0, Xte.shape[0], 500)])

        def mc(la: Any) -> torch.Tensor:
            torch.manual_seed(1)
            return la(Xte, pred_type="nn", link_approx="mc", n_samples=spec["samples"])  # type: ignore[no-any-return]

    base = {"fit": fit, "glm": lambda: glm(post), "mc": lambda: mc(post)}[op]
    post = None if op == "fit" else fit()
    last: dict[str, Any] = {}

    def fn() -> Any:
        last["out"] = base()
        return last["out"]

    t = time_and_peak(fn, repeats=spec["repeats"])
    out: dict[str, Any] = {"median_s": t["median_s"], "cpu_s": t["cpu_s"], "threads_busy": t["threads_busy"],
                           "runs": t["runs"], "peak_mib": t["peak_delta_mib"]}
    if op != "fit":  # the probabilities of the last timed call (MC: the same seed every call)
        torch.save(last["out"].detach().double(), spec["probs"])
    return out


# ---------------------------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--hidden", type=int, default=100)
    ap.add_argument("--fit", type=int, default=10000)
    ap.add_argument("--test", type=int, default=10000)
    ap.add_argument("--glm-test", type=int, default=1000, help="test points of the GLM predictive (laplace-torch's "
                    "GLM predictive took ~30 s for 500 points of a 26k-parameter MLP here)")
    ap.add_argument("--samples", type=int, default=100)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return
    if args.quick:
        args.hidden, args.fit, args.test, args.glm_test, args.samples, args.repeats = 32, 1000, 1000, 200, 10, 1
    require_library("laplace-torch", "laplace", "benchmarks/laplace.py")  # before anything is measured
    tmp = Path(tempfile.mkdtemp(prefix="curvkit-laplace-bench-"))
    weights = tmp / "model.pt"
    _prepare(args.hidden, weights)
    rows, results = [], {}
    for structure in ("kron", "diag"):
        for op in ("fit", "glm", "mc"):
            res = {}
            for lib in ("laplace-torch", "curvkit"):
                n_test = args.glm_test if op == "glm" else args.test
                spec = dict(lib=lib, structure=structure, op=op, hidden=args.hidden, fit=args.fit, test=n_test,
                            samples=args.samples, repeats=args.repeats, threads=args.threads, weights=str(weights),
                            probs=str(tmp / f"{lib}_{structure}_{op}.pt"))
                res[lib] = run_worker(__file__, spec)
            results[f"{structure}/{op}"] = res
            base, ours = res["laplace-torch"], res["curvkit"]
            agree = "-"
            if op != "fit" and "error" not in base and "error" not in ours:
                pa = torch.load(tmp / f"laplace-torch_{structure}_{op}.pt")
                pb = torch.load(tmp / f"curvkit_{structure}_{op}.pt")
                diff = float((pa - pb).abs().mean())
                if op == "mc":
                    # standard error of a K-sample average, per entry, from the spread of the probabilities
                    se = float((2 * pb * (1 - pb) / args.samples).sqrt().mean())
                    agree = f"{diff:.2e} (MC s.e. {se:.1e})"
                else:
                    agree = f"{diff:.2e}"
                res["mean_abs_diff"] = diff
            err = base.get("error") or ours.get("error")
            if err:
                rows.append([structure, op, base.get("error", "ok")[:60], ours.get("error", "ok")[:60], *[""] * 8])
            else:
                rows.append([structure, op, _time(base), _time(ours), fmt_ratio(ours["median_s"] / base["median_s"]),
                             fmt_seconds(base["cpu_s"]), fmt_busy(base["threads_busy"]), fmt_seconds(ours["cpu_s"]),
                             fmt_busy(ours["threads_busy"]), fmt_mib(base["peak_mib"]), fmt_mib(ours["peak_mib"]), agree])
            _write(args, rows, results, final=False)  # an interrupted run keeps its finished rows
    _write(args, rows, results, final=True)


def _time(res: dict[str, Any]) -> str:
    """Median time, with the number of timed calls when a slow arm was timed once."""
    runs = res.get("runs")
    return fmt_seconds(res["median_s"]) + (f" ({runs} run)" if runs == 1 else "")


def _write(args: Any, rows: list[list[Any]], results: dict[str, Any], final: bool) -> None:
    header = ["structure", "operation", "laplace-torch", "curvkit", "curvkit / laplace-torch", "laplace-torch CPU",
              "laplace-torch threads busy", "curvkit CPU", "curvkit threads busy", "laplace-torch peak MiB",
              "curvkit peak MiB", "mean |p diff|"]
    lines = [f"Laplace benchmark ({datetime.date.today()}): 784-{args.hidden}-{args.hidden}-10 MLP, fit on "
             f"{args.fit} MNIST images, MC predictive on {args.test} and GLM predictive on {args.glm_test} test images, "
             f"{args.samples} MC samples, "
             f"{args.threads} torch threads, median wall and CPU time of {args.repeats} after a warm-up call and a "
             "peak-memory call "
             f"(an arm whose warm-up takes over 30 s: that one call); load average {os.getloadavg()[0]:.1f}"
             + ("." if final else " (partial: the run is not finished)."), "",
             "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    text = "\n".join(lines) + "\n"
    if final:
        print(text)
    if args.out:
        Path(args.out).write_text(text)
        Path(args.out).with_suffix(".json").write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
