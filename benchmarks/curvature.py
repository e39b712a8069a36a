"""Benchmark of the curvature engine against curvlinops, BackPACK and PyHessian (issue 2, section 7).

Models (float32, CPU, softmax cross-entropy with mean reduction, real MNIST images scaled to [0, 1]):

* ``mlp``: 784-512-512-10 ReLU MLP, batch 512 (669,706 parameters);
* ``cnn``: LeNet-style CNN (``curvkit.models.lenet``: conv5-pool-conv5-pool-120-84-10, ReLU), batch 128.

Quantities (each timed from the model and the batch to the result, i.e. operator construction included):

* ``grad``: one loss + gradient pass (plain PyTorch; the baseline every ratio refers to);
* ``ggnvp``: one GGN-vector product; ``hvp``: one Hessian-vector product;
* ``diag_ggn``: the exact GGN diagonal;
* ``kfac``: KFAC Kronecker factors (one MC label per point; weight and bias in one block);
* ``trace_hessian`` / ``trace_ggn``: Hutchinson trace with ``--probes`` (default 100) Rademacher probes;
* ``trace_hessian`` for curvkit is its default ``HessianOperator.trace("hutchinson")``. Both models are
  ReLU networks (verified structurally, ``piecewise_linear="auto"``), for which tr(H) = tr(GGN) exactly
  (thesis Lemma 3.23), so curvkit takes the probes through the GGN's quadratic forms z^T G z (Jacobian-vector
  products only): same estimand and probe count as the other libraries' ``trace_hessian``, different
  per-probe variance. ``trace_hessian_hvp`` (curvkit only, compared with the other libraries'
  ``trace_hessian``) forces their algorithm, Hessian-vector products (``piecewise_linear=False``).

Memory: each (model, library, quantity) runs in its own fresh process (``benchmarks/_common.py``):
``--warmup`` untimed calls, then one call whose peak RSS increase is recorded. Time: one process per model
holds every (library, quantity) callable (each with its own copy of the model), warms each up, then runs
``--repeats`` rounds with one call of each per round in rotating order; the median over rounds is
reported, wall time and the process's CPU time (``time.process_time``, every thread) of the same calls.
Interleaving makes the ratios fair on a shared machine whose load changes over time.
Default: one torch thread (``--threads``), the most stable setting on a shared CPU. The table gives wall time,
its ratio to the gradient pass, the ratio of curvkit to the fastest OTHER library for that quantity (both
wall-time ratios), CPU time, threads busy (CPU / wall time) and peak memory.

Run: ``.venv/bin/python benchmarks/curvature.py`` (full) or ``--quick`` (fewer repeats and probes, for
development). ``--out FILE.md`` also writes the tables to a file.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import (
    fmt_busy,
    fmt_mib,
    fmt_ratio,
    fmt_seconds,
    peak_rss_delta,
    require_library,
    run_worker,
    time_rounds,
)

MODELS = {"mlp": {"batch": 512}, "cnn": {"batch": 128}}
QUANTITIES = ("grad", "ggnvp", "hvp", "diag_ggn", "kfac", "trace_hessian", "trace_hessian_hvp", "trace_ggn")
QUANTITY_NAMES = {
    "grad": "loss + gradient pass",
    "ggnvp": "GGN-vector product",
    "hvp": "Hessian-vector product",
    "diag_ggn": "exact GGN diagonal",
    "kfac": "KFAC factors",
    "trace_hessian": "Hutchinson trace of the Hessian",
    "trace_hessian_hvp": "Hutchinson trace of the Hessian, forced Hessian-vector products",
    "trace_ggn": "Hutchinson trace of the GGN",
}
# which library offers which quantity ("torch" = plain PyTorch, used for the gradient pass only)
OFFERS = {
    "torch": {"grad"},
    "curvkit": {"ggnvp", "hvp", "diag_ggn", "kfac", "trace_hessian", "trace_hessian_hvp", "trace_ggn"},
    "curvlinops": {"ggnvp", "hvp", "kfac", "trace_hessian", "trace_ggn"},
    "backpack": {"ggnvp", "hvp", "diag_ggn", "kfac"},
    "pyhessian": {"hvp", "trace_hessian"},
}
LIBRARIES = tuple(OFFERS)
# curvkit-only variants are compared with the other libraries' rows of this quantity
COMPARE_WITH = {"trace_hessian_hvp": "trace_hessian"}


# ============================================================================ worker side
def build_model(name: str) -> Any:
    import torch

    from curvkit.models import lenet, mlp

    torch.manual_seed(0)
    if name == "mlp":
        return mlp([784, 512, 512, 10], "relu", seed=0)
    if name == "cnn":
        return lenet(in_channels=1, num_classes=10, image_size=28)
    raise ValueError(f"unknown model {name!r}")


def make_call(lib: str, quantity: str, model: Any, X: Any, y: Any, probes: int) -> Any:
    """A zero-argument callable computing ``quantity`` with ``lib`` from scratch (model and batch fixed)."""
    import torch
    from torch import nn

    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(1)
    v_list = [torch.randn(p.shape, generator=gen) for p in params]
    v_flat = torch.cat([v.reshape(-1) for v in v_list])
    ce = nn.CrossEntropyLoss(reduction="mean")

    if lib == "torch" and quantity == "grad":
        def grad() -> Any:
            return torch.autograd.grad(ce(model(X), y), params)
        return grad

    if lib == "curvkit":
        from curvkit.curvature import GGNOperator, HessianOperator
        from curvkit.likelihoods import CrossEntropy

        lik = CrossEntropy(reduction="mean")
        data = (X, y)
        if quantity == "ggnvp":
            return lambda: GGNOperator(model, lik, data) @ v_flat
        if quantity == "hvp":
            return lambda: HessianOperator(model, lik, data) @ v_flat
        if quantity == "diag_ggn":
            return lambda: GGNOperator(model, lik, data).diagonal()
        if quantity == "kfac":
            from curvkit.curvature.kronecker import kfac
            return lambda: kfac(model, lik, data, mc_samples=1, seed=0)
        if quantity in ("trace_hessian", "trace_ggn"):
            Op = HessianOperator if quantity == "trace_hessian" else GGNOperator
            return lambda: Op(model, lik, data).trace("hutchinson", num_probes=probes,
                                                        generator=torch.Generator().manual_seed(2))
        if quantity == "trace_hessian_hvp":  # the default takes tr(H) = tr(GGN) for ReLU nets (Lemma 3.23)
            return lambda: HessianOperator(model, lik, data).trace(
                "hutchinson", num_probes=probes, generator=torch.Generator().manual_seed(2),
                piecewise_linear=False)

    if lib == "curvlinops":
        import curvlinops as cl

        data_cl = [(X, y)]
        kw = {"check_deterministic": False, "num_data": X.shape[0]}
        if quantity == "ggnvp":
            return lambda: cl.GGNLinearOperator(model, ce, params, data_cl, **kw) @ v_list
        if quantity == "hvp":
            return lambda: cl.HessianLinearOperator(model, ce, params, data_cl, **kw) @ v_list
        if quantity == "kfac":
            def kfac_cl() -> Any:
                op = cl.KFACLinearOperator(model, ce, params, data_cl, mc_samples=1,
                                           separate_weight_and_bias=False, num_per_example_loss_terms=1,
                                           **kw)
                op.compute_kronecker_factors()
                return op
            return kfac_cl
        if quantity in ("trace_hessian", "trace_ggn"):
            Op = cl.HessianLinearOperator if quantity == "trace_hessian" else cl.GGNLinearOperator
            return lambda: cl.hutchinson_trace(Op(model, ce, params, data_cl, **kw), probes)

    if lib == "backpack":
        from backpack import backpack, extend
        from backpack.extensions import KFAC, DiagGGNExact
        from backpack.hessianfree.ggnvp import ggn_vector_product_from_plist
        from backpack.hessianfree.hvp import hessian_vector_product

        if quantity == "ggnvp":
            def ggnvp_bp() -> Any:
                out = model(X)
                return ggn_vector_product_from_plist(ce(out, y), out, params, v_list)
            return ggnvp_bp
        if quantity == "hvp":
            return lambda: hessian_vector_product(ce(model(X), y), params, v_list)
        if quantity in ("diag_ggn", "kfac"):
            bmodel, bce = extend(model), extend(nn.CrossEntropyLoss(reduction="mean"))
            ext = DiagGGNExact() if quantity == "diag_ggn" else KFAC(mc_samples=1)
            attr = "diag_ggn_exact" if quantity == "diag_ggn" else "kfac"

            def ext_bp() -> Any:
                bmodel.zero_grad()
                with backpack(ext):
                    bce(bmodel(X), y).backward()
                return [getattr(p, attr) for p in params]
            return ext_bp

    if lib == "pyhessian":
        from pyhessian import hessian
        from pyhessian.utils import hessian_vector_product as phvp

        if quantity == "hvp":
            def hvp_ph() -> Any:
                h = hessian(model, ce, data=(X, y), cuda=False)
                out = phvp(h.gradsH, h.params, v_list)
                model.zero_grad(set_to_none=True)
                return out
            return hvp_ph
        if quantity == "trace_hessian":
            def trace_ph() -> Any:
                h = hessian(model, ce, data=(X, y), cuda=False)
                vals = h.trace(maxIter=probes, tol=float("-inf"))  # -inf: never stop early
                model.zero_grad(set_to_none=True)
                assert len(vals) == probes
                return sum(vals) / len(vals)
            return trace_ph

    raise ValueError(f"{lib} does not offer {quantity}")


def summary_value(out: Any) -> float | None:
    """A scalar fingerprint of a result (norm or trace value) to check that the libraries agree."""
    import torch

    if isinstance(out, torch.Tensor):
        return float(out.norm()) if out.dim() else float(out)
    if isinstance(out, (int, float)):
        return float(out)
    if isinstance(out, (list, tuple)) and out and all(isinstance(t, torch.Tensor) for t in out):
        return float(torch.cat([t.reshape(-1) for t in out]).norm())
    flat = getattr(out, "flat", None)  # curvkit DiagonalOperator
    if isinstance(flat, torch.Tensor):
        return float(flat.norm())
    return None


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """``kind='memory'``: one (library, quantity) in this fresh process: warm-up, then the peak RSS
    increase of one call and a fingerprint of its result. ``kind='timing'``: every (library, quantity) of
    one model, each with its own copy of the model, timed in interleaved rounds (one call of each per
    round, rotating the order) so that load changes on a shared machine hit all libraries alike."""
    import copy

    import torch

    torch.set_num_threads(spec["threads"])
    base = build_model(spec["model"])
    X, y = torch.load(spec["data"])
    d = sum(p.numel() for p in base.parameters())
    if spec["kind"] == "memory":
        call = make_call(spec["lib"], spec["quantity"], base, X, y, spec["probes"])
        for _ in range(spec["warmup"]):
            call()
        holder: dict[str, Any] = {}
        mem = peak_rss_delta(lambda: holder.setdefault("out", call()))
        return {**mem, "value": summary_value(holder["out"]), "num_params": d}
    calls = {f"{lib}/{q}": make_call(lib, q, copy.deepcopy(base), X, y, spec["probes"]) for lib, q in spec["jobs"]}
    for c in calls.values():
        for _ in range(spec["warmup"]):
            c()
    return {k: {**t, "num_params": d} for k, t in time_rounds(calls, spec["repeats"]).items()}


# ============================================================================ driver
def prepare_data(tmp: Path, seed: int = 0) -> dict[str, str]:
    import torch

    from curvkit.data import mnist
    from curvkit.data.transforms import flatten, to_unit

    X, y = mnist(train=True)
    idx = torch.randperm(X.shape[0], generator=torch.Generator().manual_seed(seed))
    paths = {}
    for name, meta in MODELS.items():
        sel = idx[: meta["batch"]]
        Xs = to_unit(X[sel]).float()
        Xs = flatten(Xs) if name == "mlp" else Xs[:, None]
        p = tmp / f"{name}.pt"
        torch.save((Xs.contiguous(), y[sel].clone()), p)
        paths[name] = str(p)
    return paths


def render(results: dict[str, dict[str, dict[str, dict[str, Any]]]], args: argparse.Namespace) -> str:
    lines = []
    for model, per_q in results.items():
        d = next((r["num_params"] for q in per_q.values() for r in q.values() if "num_params" in r), None)
        grad = per_q.get("grad", {}).get("torch", {}).get("median_s")
        lines.append(f"### {model} (batch {MODELS[model]['batch']}, {d} parameters)\n")
        lines.append("| quantity | library | median wall time | / gradient pass | curvkit / best other | CPU time | "
                     "threads busy | peak memory (MiB) | value |")
        lines.append("|---|---|---|---|---|---|---|---|---|")
        for q in QUANTITIES:
            rows = per_q.get(q, {})
            ref_rows = per_q.get(COMPARE_WITH.get(q, q), {})
            others = [r["median_s"] for lib, r in ref_rows.items() if lib != "curvkit" and "median_s" in r]
            best_other = min(others) if others else None
            for lib, r in rows.items():
                if "error" in r:
                    lines.append(f"| {QUANTITY_NAMES[q]} | {lib} | failed: {r['error'][:120]} | | | | | | |")
                    continue
                t = r["median_s"]
                ratio_best = (t / best_other) if lib == "curvkit" and best_other else None
                val = "-" if r.get("value") is None else f"{r['value']:.5g}"
                lines.append(f"| {QUANTITY_NAMES[q]} | {lib} | {fmt_seconds(t)} | "
                             f"{fmt_ratio(t / grad) if grad else '-'} | {fmt_ratio(ratio_best)} | "
                             f"{fmt_seconds(r.get('cpu_s'))} | {fmt_busy(r.get('threads_busy'))} | "
                             f"{fmt_mib(r.get('peak_delta_mib'))} | {val} |")
        lines.append("")
    lines.append(f"Settings: {args.repeats} timed repeats (median wall and CPU time) after {args.warmup} warm-up "
                 "call(s); "
                 f"{args.probes} Hutchinson probes; torch threads {args.threads}; float32; CPU. "
                 "`value` = norm of the result (trace value for traces): equal values across libraries "
                 "confirm that they compute the same quantity (KFAC: MC-sampled, differs).\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="2 repeats, 10 probes (development)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--probes", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--libs", default=",".join(LIBRARIES))
    parser.add_argument("--quantities", default=",".join(QUANTITIES))
    parser.add_argument("--out", default=None, help="also write the markdown tables to this file")
    parser.add_argument("--json", default=None, help="also write raw results to this JSON file")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if args.quick:
        args.repeats, args.probes = 2, 10

    from curvkit.experiments._report import machine_info

    models = [m for m in args.models.split(",") if m]
    libs = [x for x in args.libs.split(",") if x]
    quantities = [q for q in args.quantities.split(",") if q]
    bad = [m for m in models if m not in MODELS] + [x for x in libs if x not in OFFERS] + \
          [q for q in quantities if q not in QUANTITIES]
    if bad:
        parser.error(f"unknown names {bad}; models {list(MODELS)}, libs {list(OFFERS)}, quantities {QUANTITIES}")
    if "grad" not in quantities:
        quantities = ["grad", *quantities]
    for lib in libs:  # a compared library that does not import stops the run before anything is measured
        if lib not in ("torch", "curvkit"):
            require_library(lib, lib, "benchmarks/curvature.py")
    results: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = prepare_data(Path(tmp))
        for m in models:
            jobs = [(lib, q) for q in quantities for lib in dict.fromkeys(["torch", *libs] if q == "grad" else libs)
                    if q in OFFERS[lib]]
            common = {"model": m, "data": paths[m], "probes": args.probes, "warmup": args.warmup,
                      "threads": args.threads}
            results[m] = {q: {} for q in quantities}
            for lib, q in jobs:
                r = run_worker(__file__, {**common, "kind": "memory", "lib": lib, "quantity": q})
                results[m][q][lib] = r
                msg = r.get("error") or f"peak {fmt_mib(r['peak_delta_mib'])} MiB, value {r['value']}"
                print(f"[{m}] memory {q:14s} {lib:10s} {msg}", file=sys.stderr, flush=True)
            ok = [(lib, q) for lib, q in jobs if "error" not in results[m][q][lib]]
            timing = run_worker(__file__, {**common, "kind": "timing", "jobs": ok, "repeats": args.repeats})
            for lib, q in ok:
                t = timing.get(f"{lib}/{q}")
                results[m][q][lib].update(t if t is not None else {"error": timing.get("error", "no timing")})
                print(f"[{m}] time   {q:14s} {lib:10s} {fmt_seconds(results[m][q][lib].get('median_s'))}",
                      file=sys.stderr, flush=True)
            if args.json:  # partial results survive an interrupted run
                Path(args.json).write_text(json.dumps({"results": results, "args": vars(args)}, indent=1))
    info = {**machine_info(), "torch_threads": args.threads}
    text = render(results, args)
    text += "\nMachine: " + ", ".join(f"{k} {v}" for k, v in info.items()) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "machine": info, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
