"""Kronecker factors on a ResNet, a ViT and a GPT-style model, against curvlinops (issue 20, section 4, the KFAC part).

Models (float32, CPU, train mode with dropout 0, softmax cross-entropy with mean reduction, every call - the
baseline included - under the math attention backend, the one curvature passes use):

* ``vit``: ``curvkit.architectures.vit`` on real MNIST (bundled), 28x28 images in 4x4 patches (49 patches
  and a class token = 50 tokens), width 256, 2 pre-norm blocks of 4 heads, MLP width 512: 1,074,698
  parameters; batch 128; (B, 10) outputs.
* ``gpt``: ``curvkit.architectures.causal_lm`` as a byte-level next-token model (vocabulary 256, 64
  positions, width 128, 2 blocks of 4 heads, MLP width 512, untied head): 470,528 parameters; batch 16
  sequences of 64 bytes of this repository's documentation (1,024 target tokens); (B, 64, 256) outputs.

* ``resnet``: ``curvkit.architectures.resnet(widths=(32, 64, 128))`` in eval mode (BatchNorm with running
  statistics) on the ViT's 128 MNIST images: 308,074 parameters; (B, 10) outputs.

Quantities (each timed from the model and the batch to the factors; wall and CPU time):

* ``grad``: one loss + gradient pass (plain PyTorch; the baseline every ratio refers to);
* ``kfac_expand`` / ``kfac_reduce``: KFAC-MC factors (one sampled label per position) with KFAC-expand and
  KFAC-reduce (Eschenhagen et al. 2023); weight and bias in one block;
* ``kflr``: exact-GGN (type-2) factors with expand: one backward pass per class (10 for the ViT, 256 for
  the GPT), curvlinops' ``fisher_type='type-2'``.

Libraries: ``curvkit`` on every trainable parameter (each one has a block: the weight-shared Linear layers,
the packed attention projections, Embedding, LayerNorm, the ViT's raw class token and position table), a
fresh ``KroneckerEstimator`` per call (construction, planning and the factors; the samples-first trace, a
forward and a backward pass of two samples, runs once per model and layout, in the untimed warm-up call: later
estimators of the same model skip it, ``curvkit.curvature.estimators._TRACED``);
``curvkit-reused`` the same with one estimator kept for every call (``reset()`` + ``update``: what an
optimiser or a posterior that keeps its estimator pays per refresh);
``curvkit-subset`` and ``curvlinops`` on the parameters curvlinops 3.0.1 supports (the nn.Linear layers it
sees called: patch embedding, MLPs, head; it has no Embedding, LayerNorm or packed-attention blocks, and the
rest must be left out of its ``params``). ``coverage`` is the fraction of the model's parameters with a block.

Memory: each (model, library, quantity) runs in its own fresh process (``benchmarks/_common.py``): one
warm-up call, then the peak RSS increase of one call. Time: one process per model holds every callable
(each with its own copy of the model), warms each up, then runs ``--repeats`` rounds with one call of each
per round in rotating order; the median over rounds is reported (interleaving makes the ratios fair on a
shared machine whose load changes). One torch thread by default.

Run: ``.venv/bin/python benchmarks/modern_kfac.py`` (``--quick``: 2 repeats; ``--out FILE.md`` also writes
the tables).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fmt_busy, fmt_mib, fmt_ratio, fmt_seconds, peak_rss_delta, run_worker, time_rounds

ROOT = Path(__file__).resolve().parent.parent
MODELS = {"vit": {"batch": 128, "outputs": "(B, 10)"}, "gpt": {"batch": 16, "outputs": "(B, 64, 256)"},
          "resnet": {"batch": 128, "outputs": "(B, 10)"}}
QUANTITIES = ("grad", "kfac_expand", "kfac_reduce", "kflr")
QUANTITY_NAMES = {"grad": "loss + gradient pass", "kfac_expand": "KFAC-MC factors, expand",
                  "kfac_reduce": "KFAC-MC factors, reduce", "kflr": "exact-GGN (KFLR / type-2) factors, expand"}
OFFERS = {"torch": {"grad"}, "curvkit": set(QUANTITIES[1:]), "curvkit-reused": set(QUANTITIES[1:]),
          "curvkit-subset": set(QUANTITIES[1:]), "curvlinops": set(QUANTITIES[1:])}
LIBRARIES = tuple(OFFERS)


# ============================================================================ worker side
def build_model(name: str) -> Any:
    import torch

    from curvkit.architectures import causal_lm, resnet, vit

    if name == "resnet":  # eval mode: BatchNorm with running statistics (per-sample curvature)
        return resnet(widths=(32, 64, 128), seed=0, dtype=torch.float32).eval()
    if name == "vit":
        return vit(image_size=28, patch_size=4, dim=256, depth=2, heads=4, mlp_dim=512, num_classes=10, seed=0,
                   dtype=torch.float32)
    return causal_lm(vocab_size=256, max_len=64, dim=128, depth=2, heads=4, mlp_dim=512, seed=0, dtype=torch.float32)


def curvlinops_params(model: Any) -> list[Any]:
    """The parameters curvlinops 3.0.1 can take: those of nn.Linear and nn.Conv2d modules that are called as
    modules (not the out_proj of nn.MultiheadAttention, whose forward reads its weight directly)."""
    from torch import nn

    inside = {id(m.out_proj) for m in model.modules() if isinstance(m, nn.MultiheadAttention)}
    return [p for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)) and id(m) not in inside
            for p in m.parameters() if p.requires_grad]


class ClassesSecond:
    """curvlinops reads CrossEntropyLoss logits as (batch, classes, positions): a wrapper module."""

    def __new__(cls, net: Any) -> Any:
        from torch import nn

        class Wrap(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.net = net

            def forward(self, x: Any) -> Any:
                out = self.net(x)
                return out.movedim(-1, 1) if out.dim() > 2 else out

        return Wrap()


def make_call(lib: str, quantity: str, model: Any, X: Any, y: Any) -> Any:
    """The callable of one (library, quantity), run under the math attention backend (every library and the
    baseline alike: curvkit's curvature passes always use it, :func:`curvkit.structure.curvature_kernels`)."""
    from curvkit.structure import curvature_kernels

    call = _make_call(lib, quantity, model, X, y)

    def under_math_attention() -> Any:
        with curvature_kernels():
            return call()

    return under_math_attention


def _make_call(lib: str, quantity: str, model: Any, X: Any, y: Any) -> Any:
    import torch
    from torch import nn

    from curvkit.curvature.estimators import KroneckerEstimator
    from curvkit.likelihoods import CrossEntropy

    if lib == "torch":
        params = [p for p in model.parameters() if p.requires_grad]

        def grad() -> Any:
            out = model(X)
            loss = nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))
            return torch.autograd.grad(loss, params)

        return grad
    mode = "reduce" if quantity == "kfac_reduce" else "expand"
    if lib in ("curvkit", "curvkit-reused", "curvkit-subset"):
        if lib == "curvkit-subset":
            keep = {id(p) for p in curvlinops_params(model)}
            for p in model.parameters():
                p.requires_grad_(id(p) in keep)
        method = "kflr" if quantity == "kflr" else "kfac"
        if lib == "curvkit-reused":  # one estimator for every call, as an optimiser or a posterior keeps it
            kept = KroneckerEstimator(model, CrossEntropy(), method, weight_sharing=mode, seed=0)

            def reused() -> Any:
                kept.reset()
                return kept.update((X, y)).operator()

            return reused

        def ck() -> Any:
            est = KroneckerEstimator(model, CrossEntropy(), method, weight_sharing=mode, seed=0)
            return est.update((X, y)).operator()

        return ck
    from curvlinops import KFACLinearOperator

    params = curvlinops_params(model)
    wrapped = ClassesSecond(model)

    def cl() -> Any:
        op = KFACLinearOperator(wrapped, nn.CrossEntropyLoss(), params, [(X, y)],
                                fisher_type="type-2" if quantity == "kflr" else "mc", kfac_approx=mode,
                                separate_weight_and_bias=False, check_deterministic=False,
                                num_per_example_loss_terms=y[0].numel(), num_data=X.shape[0])
        op.compute_kronecker_factors()
        return op

    return cl


def coverage(lib: str, model: Any) -> float:
    total = sum(p.numel() for p in model.parameters())
    if lib in ("curvkit-subset", "curvlinops"):
        return sum(p.numel() for p in curvlinops_params(model)) / total
    if lib in ("curvkit", "curvkit-reused"):
        from curvkit.curvature.estimators import KroneckerEstimator
        from curvkit.likelihoods import CrossEntropy

        est = KroneckerEstimator(model, CrossEntropy())
        covered = {n for _, spec in est.blocks for n in spec.names}
        return sum(p.numel() for n, p in model.named_parameters() if n in covered) / total
    return 1.0


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """``kind='memory'``: one (library, quantity) in this fresh process: warm-up, then the peak RSS increase of
    one call. ``kind='timing'``: every (library, quantity) of one model, interleaved rounds."""
    import copy

    import torch

    torch.set_num_threads(spec["threads"])
    base = build_model(spec["model"])
    X, y = torch.load(spec["data"])
    d = sum(p.numel() for p in base.parameters())
    if spec["kind"] == "memory":
        cov = coverage(spec["lib"], copy.deepcopy(base))
        call = make_call(spec["lib"], spec["quantity"], base, X, y)
        call()
        holder: dict[str, Any] = {}
        mem = peak_rss_delta(lambda: holder.setdefault("out", call()))
        return {**mem, "num_params": d, "coverage": cov}
    calls = {f"{lib}/{q}": make_call(lib, q, copy.deepcopy(base), X, y) for lib, q in spec["jobs"]}
    for c in calls.values():
        c()
    return time_rounds(calls, spec["repeats"])


# ============================================================================ driver
def prepare_data(tmp: Path, seed: int = 0) -> dict[str, str]:
    import torch

    from curvkit.data import mnist
    from curvkit.data.transforms import to_unit

    X, y = mnist(train=True)
    idx = torch.randperm(X.shape[0], generator=torch.Generator().manual_seed(seed))[: MODELS["vit"]["batch"]]
    paths = {"vit": str(tmp / "vit.pt"), "gpt": str(tmp / "gpt.pt"), "resnet": str(tmp / "resnet.pt")}
    torch.save((to_unit(X[idx]).float()[:, None].contiguous(), y[idx].clone()), paths["vit"])
    torch.save((to_unit(X[idx]).float()[:, None].contiguous(), y[idx].clone()), paths["resnet"])
    text = b"".join(p.read_bytes() for p in sorted((ROOT / "docs").glob("*.md")))
    data = torch.tensor(list(text), dtype=torch.long)
    B, T = MODELS["gpt"]["batch"], 64
    starts = torch.randperm(data.numel() - T - 1, generator=torch.Generator().manual_seed(seed))[:B]
    seqs = torch.stack([data[s:s + T + 1] for s in starts.tolist()])
    torch.save((seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()), paths["gpt"])
    return paths


def render(results: dict[str, dict[str, dict[str, dict[str, Any]]]], args: argparse.Namespace,
           load: tuple[float, float]) -> str:
    lines = []
    for model, per_q in results.items():
        d = next((r["num_params"] for q in per_q.values() for r in q.values() if "num_params" in r), None)
        grad = per_q.get("grad", {}).get("torch", {}).get("median_s")
        grad_mem = per_q.get("grad", {}).get("torch", {}).get("peak_delta_mib")
        lines.append(f"### {model} (batch {MODELS[model]['batch']}, outputs {MODELS[model]['outputs']}"
                     + (f", {d:,} parameters)\n" if d is not None else ")\n"))  # None under --no-memory
        lines.append("| quantity | library | coverage | median wall time | / gradient pass | curvkit / curvlinops | "
                     "CPU time | threads busy | peak memory (MiB) | / gradient pass | curvkit / curvlinops |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for q in QUANTITIES:
            rows = per_q.get(q, {})
            ref = rows.get("curvlinops", {}).get("median_s")
            ref_mem = rows.get("curvlinops", {}).get("peak_delta_mib")
            for lib, r in rows.items():
                if "error" in r:
                    lines.append(f"| {QUANTITY_NAMES[q]} | {lib} | | failed: {r['error'][:150]} | | | | | | | |")
                    continue
                t = r.get("median_s")
                vs = fmt_ratio(t / ref) if ref and t and lib.startswith("curvkit") else "-"
                mem = r.get("peak_delta_mib")
                vs_mem = fmt_ratio(mem / ref_mem) if ref_mem and mem is not None and lib.startswith("curvkit") else "-"
                cov = f"{100 * r['coverage']:.0f} %" if "coverage" in r else "-"
                lines.append(f"| {QUANTITY_NAMES[q]} | {lib} | {cov} | {fmt_seconds(t)} | "
                             f"{fmt_ratio(t / grad) if grad and t else '-'} | {vs} | {fmt_seconds(r.get('cpu_s'))} | "
                             f"{fmt_busy(r.get('threads_busy'))} | {fmt_mib(mem)} | "
                             f"{fmt_ratio(mem / grad_mem) if mem is not None and grad_mem else '-'} | {vs_mem} |")
        lines.append("")
    lines.append(f"Settings: {args.repeats} timed rounds (median) after one warm-up call each; torch threads "
                 f"{args.threads}; float32; CPU; load average {load[0]:.2f} before and {load[1]:.2f} after the run "
                 f"on {os.cpu_count()} logical cores.\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="2 repeats (development)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--libs", default=",".join(LIBRARIES))
    parser.add_argument("--quantities", default=",".join(QUANTITIES))
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory processes")
    parser.add_argument("--out", default=None, help="also write the markdown tables to this file")
    parser.add_argument("--json", default=None, help="also write raw results to this JSON file")
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if args.quick:
        args.repeats = 2

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
    load0 = os.getloadavg()[0]
    results: dict[str, dict[str, dict[str, dict[str, Any]]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        paths = prepare_data(Path(tmp))
        for m in models:
            jobs = [(lib, q) for q in quantities for lib in (["torch"] if q == "grad" else libs) if q in OFFERS[lib]]
            common = {"model": m, "data": paths[m], "threads": args.threads}
            results[m] = {q: {} for q in quantities}
            for lib, q in jobs:
                r: dict[str, Any] = {}
                if not args.no_memory:
                    r = run_worker(__file__, {**common, "kind": "memory", "lib": lib, "quantity": q})
                    print(f"[{m}] memory {q:12s} {lib:15s} {r.get('error') or fmt_mib(r['peak_delta_mib'])}",
                          file=sys.stderr, flush=True)
                results[m][q][lib] = r
            ok = [(lib, q) for lib, q in jobs if "error" not in results[m][q][lib]]
            timing = run_worker(__file__, {**common, "kind": "timing", "jobs": ok, "repeats": args.repeats},
                                timeout=7200)
            for lib, q in ok:
                t = timing.get(f"{lib}/{q}")
                results[m][q][lib].update(t if t is not None else {"error": timing.get("error", "no timing")})
                print(f"[{m}] time   {q:12s} {lib:15s} {fmt_seconds(results[m][q][lib].get('median_s'))}",
                      file=sys.stderr, flush=True)
            if args.json:
                Path(args.json).write_text(json.dumps({"results": results, "args": vars(args)}, indent=1))
    info = {**machine_info(), "torch_threads": args.threads}
    text = render(results, args, (load0, os.getloadavg()[0]))
    text += "\nMachine: " + ", ".join(f"{k} {v}" for k, v in info.items()) + "\n"
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "machine": info, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
