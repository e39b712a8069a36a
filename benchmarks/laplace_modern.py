"""Laplace with many classes and on a ViT: curvkit vs laplace-torch (issue 21, sections 2 and 4), side by side
in one run, every measurement in a fresh process (:func:`_common.run_worker`), 1 torch thread by default.

1. Many classes: a 32-64-C tanh MLP (float32, random weights and data: the cost does not depend on them) at
   C = 100 and 1,000; fit on 512 training points (batches of 128), GLM predictive (probit) on 128 test points.
   Same curvature type on both sides: Kronecker factors of the exact GGN (curvkit ``kron`` + ``kflr`` with
   ``prior_form='exact'``; laplace-torch's ``KronLaplace``, its default Curvlinops GGN backend) and the exact
   GGN diagonal (curvkit ``diag`` + ``ggn``; laplace-torch's ``DiagLaplace``).
2. ViT: :func:`curvkit.architectures.vit` with width 144, 5 blocks of 4 heads, MLP 576 (1,265,050 parameters) on
   1,024 bundled MNIST images (batches of 128), GLM predictive on 128 test images. All-weight Kronecker Laplace
   where each library takes it, and last-layer Kronecker Laplace; times also as a ratio to one gradient pass
   (forward and backward of the mean cross-entropy) over the same 1,024 images.

Each worker runs under an address-space cap (``--cap-gib``, default 10): an arm that asks for more fails with
an out-of-memory error, which the table reports. Time: the median wall time of ``--repeats`` calls after a warm-up
call and a peak-memory call (an arm whose warm-up takes over 30 s: that one call), and the median CPU time of the
process over the same calls (``time.process_time``, every thread; threads busy = CPU / wall time); the ratios are
of the wall times. Peak: the RSS increase during one
call. Agreement: the mean absolute difference of the two libraries' GLM probabilities.

Targets (issue 21): fit at most half laplace-torch's time, predictives no slower, memory no higher.
Run: ``bash scripts/bench.sh benchmarks/laplace_modern.py [--quick] [--out docs/bench/laplace_modern.md]``.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_busy, fmt_mib, fmt_ratio, fmt_seconds, require_library, run_worker, time_and_peak

VIT = dict(dim=144, depth=5, heads=4, mlp_dim=576)


def _laplace_torch() -> Any:
    """laplace-torch's ``Laplace`` (through benchmarks/laplace.py's loader: that script's name shadows it)."""
    spec = importlib.util.spec_from_file_location("_bench_laplace", Path(__file__).resolve().parent / "laplace.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod._laplace_torch()


def _setting(spec: dict[str, Any]) -> tuple[torch.nn.Module, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """(model in eval mode, training batches, test inputs) of a worker's setting."""
    if spec["part"] == "mlp":
        g = torch.Generator().manual_seed(0)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, spec["classes"]))
        X, y = torch.randn(spec["fit"], 32, generator=g), torch.randint(0, spec["classes"], (spec["fit"],), generator=g)
        Xte = torch.randn(spec["test"], 32, generator=g)
    else:
        from curvkit.architectures import vit
        from curvkit.data import mnist

        model = vit(**VIT, seed=0)
        Xtr, ytr = mnist(train=True)
        Xt, _ = mnist(train=False)
        X, y = Xtr[:spec["fit"]].float()[:, None] / 255, ytr[:spec["fit"]].long()
        Xte = Xt[:spec["test"]].float()[:, None] / 255
    return model.eval(), [(X[i:i + 128], y[i:i + 128]) for i in range(0, X.shape[0], 128)], Xte


def _worker(spec: dict[str, Any]) -> dict[str, Any]:
    cap = int(spec["cap_gib"] * 2**30)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    torch.set_num_threads(spec["threads"])
    model, batches, Xte = _setting(spec)
    lib, structure, op, subset = spec["lib"], spec["structure"], spec["op"], spec["subset"]
    if op == "grad":
        def base() -> Any:
            for X, y in batches:
                model.zero_grad()
                torch.nn.functional.cross_entropy(model(X), y).backward()
            return None
        fit: Any = None
    elif lib == "curvkit":
        from curvkit.laplace import Laplace
        from curvkit.likelihoods import CrossEntropy

        def fit() -> Any:
            kw = dict(prior_form="exact") if structure == "kron" else {}
            return Laplace(model, CrossEntropy(), structure, "kflr" if structure == "kron" else "ggn", subset=subset,
                           prior_precision=1.0, **kw).fit(batches)  # type: ignore[arg-type]

        def glm(post: Any) -> torch.Tensor:
            return post.predict(Xte, "glm", batch_size=128)  # type: ignore[no-any-return]
    else:
        LT = _laplace_torch()
        X = torch.cat([b[0] for b in batches])
        y = torch.cat([b[1] for b in batches])
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(X, y), batch_size=128)

        def fit() -> Any:
            la = LT(model, "classification", subset_of_weights=subset, hessian_structure=structure,
                    prior_precision=1.0)
            la.fit(loader)
            return la

        def glm(la: Any) -> torch.Tensor:
            return la(Xte, pred_type="glm", link_approx="probit")  # type: ignore[no-any-return]

    if op == "fit":
        base = fit
    elif op == "glm":
        post = fit()

        def base() -> Any:
            return glm(post)
    last: dict[str, Any] = {}

    def fn() -> Any:
        last["out"] = base()
        return last["out"]

    t = time_and_peak(fn, repeats=spec["repeats"])
    if op == "glm":
        torch.save(last["out"].detach().double(), spec["probs"])
    return {"median_s": t["median_s"], "cpu_s": t["cpu_s"], "threads_busy": t["threads_busy"], "runs": t["runs"],
            "peak_mib": t["peak_delta_mib"]}


# ---------------------------------------------------------------------------------------------- main
def _rows(args: Any) -> list[dict[str, Any]]:
    """The comparisons: (part, classes, structure, subset, op)."""
    out = []
    for C in args.classes:
        for structure in ("kron", "diag"):
            for op in ("fit", "glm"):
                out.append(dict(part="mlp", classes=C, structure=structure, subset="all", op=op, fit=args.mlp_fit,
                                test=args.mlp_test))
    for subset in args.vit_subsets:
        for op in ("fit", "glm"):
            out.append(dict(part="vit", classes=10, structure="kron", subset=subset, op=op, fit=args.vit_fit,
                            test=args.vit_test))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker")
    ap.add_argument("--classes", type=int, nargs="*", default=[100, 1000], help="MLP class counts (none: no MLP rows)")
    ap.add_argument("--vit-subsets", nargs="*", default=["all", "last_layer"], choices=["all", "last_layer"])
    ap.add_argument("--mlp-fit", type=int, default=512)
    ap.add_argument("--mlp-test", type=int, default=128)
    ap.add_argument("--vit-fit", type=int, default=1024)
    ap.add_argument("--vit-test", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cap-gib", type=float, default=10.0)
    ap.add_argument("--skip-vit", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(_worker(json.loads(args.worker))))
        return
    if args.quick:
        args.classes, args.mlp_fit, args.mlp_test, args.vit_fit, args.vit_test, args.repeats = [100], 256, 64, 256, 32, 1
    require_library("laplace-torch", "laplace", "benchmarks/laplace_modern.py")
    tmp = Path(tempfile.mkdtemp(prefix="curvkit-laplace-modern-"))
    common = dict(repeats=args.repeats, threads=args.threads, cap_gib=args.cap_gib)
    grad = None
    if not args.skip_vit:
        grad = run_worker(__file__, dict(part="vit", classes=10, structure="-", subset="all", op="grad", lib="torch",
                                         fit=args.vit_fit, test=args.vit_test, probs="", **common))
    rows: list[list[Any]] = []
    results: dict[str, Any] = {"gradient_pass": grad}
    started = time.time()
    for row in _rows(args):
        if row["part"] == "vit" and args.skip_vit:
            continue
        res = {}
        for lib in ("laplace-torch", "curvkit"):
            probs = tmp / f"{lib}_{len(rows)}.pt"
            res[lib] = run_worker(__file__, {**row, **common, "lib": lib, "probs": str(probs)})
        lt, ck = res["laplace-torch"], res["curvkit"]
        agree = "-"
        if row["op"] == "glm" and "error" not in lt and "error" not in ck:
            agree = f"{float((torch.load(tmp / f'laplace-torch_{len(rows)}.pt') - torch.load(tmp / f'curvkit_{len(rows)}.pt')).abs().mean()):.1e}"
        per_grad = "-"
        if row["part"] == "vit" and grad is not None and "error" not in grad and "error" not in ck:
            lt_grad = "" if "error" in lt else f" / {lt['median_s'] / grad['median_s']:.1f}x"
            per_grad = f"{ck['median_s'] / grad['median_s']:.1f}x{lt_grad}"
        setting = (f"MLP 32-64-{row['classes']}" if row["part"] == "mlp" else "ViT 1.27M") + f", {row['subset']}"
        ratio = "-" if "error" in lt or "error" in ck else fmt_ratio(ck["median_s"] / lt["median_s"])
        rows.append([setting, row["structure"], row["op"], _cell(lt), _cell(ck), ratio, *_cpu_cells(lt),
                     *_cpu_cells(ck), "-" if "error" in lt else fmt_mib(lt["peak_mib"]),
                     "-" if "error" in ck else fmt_mib(ck["peak_mib"]), per_grad, agree])
        results[f"{setting}/{row['structure']}/{row['op']}"] = res
        _write(args, rows, results, grad, final=False)
    _write(args, rows, results, grad, final=True)
    print(f"total {time.time() - started:.0f} s")


def _cell(res: dict[str, Any]) -> str:
    if "error" in res:
        err = str(res["error"])
        return "out of memory (cap)" if "memory" in err.lower() else err[:90].replace("|", "/")
    return fmt_seconds(res["median_s"]) + (" (1 run)" if res.get("runs") == 1 else "")


def _cpu_cells(res: dict[str, Any]) -> list[str]:
    """CPU time and threads busy of an arm (``-`` for a failed one)."""
    if "error" in res:
        return ["-", "-"]
    return [fmt_seconds(res["cpu_s"]), fmt_busy(res["threads_busy"])]


def _write(args: Any, rows: list[list[Any]], results: dict[str, Any], grad: Any, final: bool) -> None:
    header = ["setting", "structure", "op", "laplace-torch", "curvkit", "curvkit / laplace-torch", "laplace-torch CPU",
              "laplace-torch threads busy", "curvkit CPU", "curvkit threads busy", "laplace-torch peak MiB",
              "curvkit peak MiB", "curvkit / laplace-torch in gradient passes", "mean |p diff|"]
    gtext = "-" if not grad or "error" in grad else (f"{fmt_seconds(grad['median_s'])} wall, "
                                                      f"{fmt_seconds(grad.get('cpu_s'))} CPU")
    lines = [f"Laplace, many classes and ViT ({datetime.date.today()}): MLP fit on {args.mlp_fit} points, GLM on "
             f"{args.mlp_test}; ViT fit on {args.vit_fit} MNIST images, GLM on {args.vit_test}; gradient pass over the "
             f"ViT's fit images {gtext}; {args.threads} torch thread(s), {args.cap_gib:g} GiB address-space cap per "
             f"worker, median wall and CPU time of {args.repeats}; load average {os.getloadavg()[0]:.1f}"
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
