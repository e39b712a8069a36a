"""Exact curvature products on modern models and with many classes, against curvlinops (issue 20, section 4).

Models (float32, CPU, softmax cross-entropy with mean reduction over the counted positions):

* ``vit``: ``curvkit.architectures.vit`` on real MNIST images (28x28, 16 patches of 7x7 plus a class
  token), width 256, 3 pre-norm blocks of 8 heads, MLP 512, batch 128 (about 1.6 M parameters);
* ``gpt``: ``curvkit.architectures.causal_lm``, byte-level (vocabulary 256) on the repository's own docs
  (``docs/*.md``), 16 sequences of 64 tokens (next-token targets), width 256, 2 blocks of 8 heads, MLP 1024
  (about 1.7 M parameters; logits (16, 64, 256));
* ``mlp-C``: the many-classes sweep, a 32-64-C tanh MLP, batch 64, random inputs and labels, C = 1,000,
  4,000 and 50,000 (``--classes``).

Arms, each timed as a SESSION on a fresh operator: construction, the first product, the second product
(the one that used to build a ``torch.func.linearize`` cache), then ``--steady`` more products (the
steady state: their median):

* ``curvkit GGN``: ``GGNOperator`` with its defaults (the construction pass's graph is cached; tangents
  of the transformers by one forward-mode pass without a graph, of the MLPs from the recorded activations;
  then one backward pass per product);
* ``curvkit GGN reverse``: ``GGNOperator(..., reverse_tangents=True)`` (the transformers' tangents by
  reverse-over-reverse through the cached forward graph);
* ``curvkit Hessian``: ``HessianOperator`` (reverse-over-reverse on the cached gradient graph);
* ``curvlinops GGN`` / ``curvlinops Hessian``: ``GGNLinearOperator`` / ``HessianLinearOperator``
  (``check_deterministic=False``; the model runs with the math attention backend and without the
  multi-head-attention fast path, as curvkit's does, since the fused kernels have no forward-mode derivative;
  the transformer's logits are handed over in torch's (B, C, T) layout);
* ``gradient``: one loss + gradient pass in plain PyTorch, the baseline of every ratio, with the same
  kernels as the products (math attention; the issue's protocol).

Time: one process per model holds every arm (each with its own copy of the model); after a warm-up session
of each (so every process is "already warmed"), ``--repeats`` rounds run one session of each arm in
rotating order, and the median over rounds is reported. Times are CPU seconds of the process (one torch
thread), which other jobs time-slicing a shared machine's cores do not inflate (wall-clock times were
seen to swing by +-30 % between rounds on the loaded development machine); every ratio is of CPU times. Beside
them, the wall-clock times (``time.perf_counter``) of the same calls for construction + first product and for the
steady product, in parentheses / the gradient pass's wall time, and the threads kept busy over a whole session
(its CPU time / its wall time, median over rounds). Memory: a fresh process per arm: a warm-up
session, then the peak resident-set increase (``_common.peak_rss_delta``) of construction + first product
(everything the operator builds and holds included), and of one steady-state product on a warm operator.
The ``value`` column (norm of the first product) shows that the libraries compute the same matrix.

Every worker imports ``torch._dynamo`` first: the state of a process that has stepped a ``torch.optim`` optimiser
or called ``torch.func`` (curvlinops' arms import it in the timing process anyway). Without it, curvkit's GGN
products take the double-backward route (docs/architecture.md, "The first call in a fresh process"), whose
time and memory differ from forward mode's; ``benchmarks/first_call.py`` measures that state. Before
2026-11-29 the memory workers did not import it, so their curvkit GGN column was that route while the times
were forward mode's.

Run: ``.venv/bin/python benchmarks/modern_products.py --out bench.md --json bench.json`` (``--quick`` for
development). ``--baseline-src DIR`` adds the default curvkit GGN and Hessian arms from another source tree
(e.g. an older commit unpacked with ``git archive``), in their own processes with their own gradient
baseline.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import cpu_fields, fmt_busy, fmt_mib, fmt_ratio, fmt_seconds, peak_rss_delta, run_worker

ROOT = Path(__file__).resolve().parent.parent
ARMS = ("gradient", "curvkit GGN", "curvkit GGN reverse", "curvkit Hessian", "curvlinops GGN", "curvlinops Hessian")
BASELINE_ARMS = ("curvkit GGN", "curvkit Hessian")  # the arms an older curvkit offers too


# ============================================================================ worker side
def build_model(name: str) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    """(model, X, y) for a model name (module doc), float32, seeded."""
    from curvkit.architectures import causal_lm, vit
    from curvkit.models import mlp

    g = torch.Generator().manual_seed(0)
    if name == "vit":
        from curvkit.data import mnist
        from curvkit.data.transforms import to_unit

        X, y = mnist(train=True)
        idx = torch.randperm(X.shape[0], generator=g)[:128]
        model: torch.nn.Module = vit(image_size=28, patch_size=7, dim=256, depth=3, heads=8, mlp_dim=512, num_classes=10, seed=0)
        return model, to_unit(X[idx]).float()[:, None].contiguous(), y[idx].clone()
    if name == "gpt":
        text = b"".join(p.read_bytes() for p in sorted((ROOT / "docs").glob("*.md")))
        data = torch.tensor(list(text), dtype=torch.int64)
        starts = torch.randint(0, data.numel() - 65, (16,), generator=g)
        seqs = torch.stack([data[s:s + 65] for s in starts.tolist()])
        model = causal_lm(vocab_size=256, max_len=64, dim=256, depth=2, heads=8, mlp_dim=1024, seed=0)
        return model, seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()
    if name.startswith("mlp-"):
        C = int(name.split("-", 1)[1])
        torch.manual_seed(0)
        model = mlp([32, 64, C], "tanh", seed=0)
        return model, torch.randn(64, 32, generator=g), torch.randint(0, C, (64,), generator=g)
    raise ValueError(f"unknown model {name!r}")


class ClassesSecond(torch.nn.Module):
    """Runs the model with math attention and no fast path (``curvature_kernels``) and hands (B, T, C) logits to
    curvlinops in torch's (B, C, T) layout (nn.CrossEntropyLoss's convention)."""

    def __init__(self, net: torch.nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from curvkit.structure import curvature_kernels

        with curvature_kernels():
            out = self.net(x)
        return out.movedim(-1, 1) if out.dim() > 2 else out


def make_arm(arm: str, model: torch.nn.Module, X: torch.Tensor, y: torch.Tensor) -> tuple[Any, Any]:
    """(build, product) for one arm: ``build()`` makes a fresh operator, ``product(op)`` multiplies it with a
    fixed random vector (the gradient arm: no operator, one loss + gradient pass)."""
    params = [p for p in model.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(1)
    v_list = [torch.randn(p.shape, generator=gen) for p in params]
    v_flat = torch.cat([v.reshape(-1) for v in v_list])
    ce = torch.nn.CrossEntropyLoss(reduction="mean")
    if arm == "gradient":
        from curvkit.structure import curvature_kernels

        def grad(_op: Any) -> Any:
            with curvature_kernels():  # the kernels both libraries' products run (math attention)
                logits = model(X)
            return torch.autograd.grad(ce(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)), params)
        return (lambda: None), grad
    if arm.startswith("curvkit"):
        from curvkit.curvature import GGNOperator, HessianOperator
        from curvkit.likelihoods import CrossEntropy

        lik = CrossEntropy("mean")
        cls = HessianOperator if arm == "curvkit Hessian" else GGNOperator
        kw = {"reverse_tangents": True} if arm == "curvkit GGN reverse" else {}
        return (lambda: cls(model, lik, (X, y), **kw)), (lambda op: op @ v_flat)
    if arm.startswith("curvlinops"):
        import curvlinops as cl

        wrapped = ClassesSecond(model)
        Op = cl.GGNLinearOperator if arm == "curvlinops GGN" else cl.HessianLinearOperator
        cl_kw: dict[str, Any] = {"check_deterministic": False, "num_data": X.shape[0]}
        return (lambda: Op(wrapped, ce, params, [(X, y)], **cl_kw)), (lambda op: op @ v_list)
    raise ValueError(f"unknown arm {arm!r}")


def session(build: Any, product: Any, products: int) -> tuple[list[float], list[float], Any]:
    """[construction, product 1, product 2, ...] CPU seconds of this process on a fresh operator (one torch
    thread: CPU time is what the computation costs, and other jobs time-slicing the cores do not inflate
    it), the wall seconds of the same calls, and the first product."""
    c0, t0 = time.process_time(), time.perf_counter()
    op = build()
    times, walls = [time.process_time() - c0], [time.perf_counter() - t0]
    first = None
    for _ in range(products):
        c0, t0 = time.process_time(), time.perf_counter()
        out = product(op)
        walls.append(time.perf_counter() - t0)
        times.append(time.process_time() - c0)
        first = out if first is None else first
    return times, walls, first


def norm(out: Any) -> float | None:
    if isinstance(out, torch.Tensor):
        return float(out.norm())
    if isinstance(out, (list, tuple)) and out and all(isinstance(t, torch.Tensor) for t in out):
        return float(torch.cat([t.reshape(-1) for t in out]).norm())
    return None


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """``kind='memory'``: one arm in this fresh process (warm-up session, then the peak RSS increase of
    construction + first product and of one steady-state product). ``kind='timing'``: every arm of one model
    in interleaved rounds of sessions (module doc)."""
    import torch._dynamo  # the products' route depends on it (module docstring)

    torch.set_num_threads(spec["threads"])
    base, X, y = build_model(spec["model"])
    d = sum(p.numel() for p in base.parameters() if p.requires_grad)
    n = 2 + spec["steady"]
    if spec["kind"] == "memory":
        build, product = make_arm(spec["arm"], base, X, y)
        session(build, product, 2)  # warm-up: lazy initialisation, allocator
        holder: dict[str, Any] = {}

        def first() -> Any:
            holder["op"] = build()
            return product(holder["op"])

        mem_first = peak_rss_delta(first)
        product(holder["op"])  # the second product
        mem_steady = peak_rss_delta(lambda: product(holder["op"]))
        return {"first": mem_first, "steady": mem_steady, "num_params": d}
    arms = list(spec["arms"])
    calls = {a: make_arm(a, copy.deepcopy(base), X, y) for a in arms}
    values = {a: norm(session(*calls[a], 2)[2]) for a in arms}  # warm-up
    rounds: dict[str, list[list[float]]] = {a: [] for a in arms}
    walls: dict[str, list[list[float]]] = {a: [] for a in arms}
    for r in range(spec["repeats"]):
        for a in arms[r % len(arms):] + arms[: r % len(arms)]:
            cpu, wall, _ = session(*calls[a], n)
            rounds[a].append(cpu)
            walls[a].append(wall)
    out: dict[str, Any] = {}
    for a, rs in rounds.items():
        ws = walls[a]
        if a == "gradient":
            out[a] = {"grad_s": statistics.median(t for r in rs for t in r[1:]),
                      "grad_wall_s": statistics.median(t for w in ws for t in w[1:])}
        else:
            out[a] = {"construct_s": statistics.median(r[0] for r in rs),
                      "first_s": statistics.median(r[1] for r in rs),
                      "fresh_s": statistics.median(r[0] + r[1] for r in rs),
                      "second_s": statistics.median(r[2] for r in rs),
                      "steady_s": statistics.median(t for r in rs for t in r[3:]),
                      "fresh_wall_s": statistics.median(w[0] + w[1] for w in ws),
                      "steady_wall_s": statistics.median(t for w in ws for t in w[3:]),
                      "value": values[a]}
        out[a]["threads_busy"] = cpu_fields([sum(w) for w in ws], [sum(r) for r in rs])["threads_busy"]
        out[a]["num_params"] = d
    return out


# ============================================================================ driver
def render(results: dict[str, dict[str, dict[str, Any]]], args: argparse.Namespace) -> str:
    lines = []
    for model, per_arm in results.items():
        d = next((r.get("num_params") for r in per_arm.values() if r.get("num_params")), None)
        lines.append(f"#### {model} ({d:,} parameters)\n" if d else f"#### {model}\n")
        lines.append("| arm | construction + 1st product (CPU) | 1st product (CPU) | 2nd product (CPU) | steady product "
                     "(CPU) | construction + 1st product, wall | steady product, wall | threads busy | "
                     "peak MiB (construction + 1st) | peak MiB (steady) | value |")
        lines.append("|---|---|---|---|---|---|---|---|---|---|---|")
        for arm, r in per_arm.items():
            grad = r.get("grad_ref_s")
            grad_wall = r.get("grad_ref_wall_s")
            busy = fmt_busy(r.get("threads_busy"))
            if "error" in r:
                lines.append(f"| {arm} | failed: {r['error'][:140]} | | | | | | | | | |")
                continue
            mem_f = r.get("first_mem", {}).get("peak_delta_mib")
            mem_s = r.get("steady_mem", {}).get("peak_delta_mib")
            gmem = r.get("grad_mem_mib")
            if arm.split(" (")[0] == "gradient":
                lines.append(f"| {arm} | {fmt_seconds(r.get('grad_s'))} = 1x | | | | "
                             f"{fmt_seconds(r.get('grad_wall_s'))} = 1x | | {busy} | {fmt_mib(mem_f)} = 1x | | |")
                continue

            def cell(key: str, grad: float | None = grad, r: dict[str, Any] = r) -> str:
                t = r.get(key)
                return f"{fmt_seconds(t)} ({fmt_ratio(t / grad) if grad and t is not None else '-'})"

            def mcell(m: float | None, gmem: float | None = gmem) -> str:
                return f"{fmt_mib(m)} ({fmt_ratio(m / gmem) if m is not None and gmem else '-'})"

            val = "-" if r.get("value") is None else f"{r['value']:.5g}"
            lines.append(f"| {arm} | {cell('fresh_s')} | {cell('first_s')} | {cell('second_s')} | "
                         f"{cell('steady_s')} | {cell('fresh_wall_s', grad_wall)} | {cell('steady_wall_s', grad_wall)} | "
                         f"{busy} | {mcell(mem_f)} | {mcell(mem_s)} | {val} |")
        lines.append("")
    lines.append(f"Times: median over {args.repeats} interleaved rounds of one session per arm (construction, "
                 f"two products, {args.steady} steady products), CPU seconds of the process and, for construction + "
                 f"1st and the steady product, wall seconds of the same calls; in parentheses: / one loss + gradient "
                 f"pass of the same process (CPU / CPU, wall / wall); threads busy: a session's CPU / wall time. "
                 f"Peak memory: increase of the resident set during the call, in parentheses / "
                 f"the gradient pass's. torch threads {args.threads}; float32; CPU.\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="2 rounds, 2 steady products (development)")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--steady", type=int, default=4, help="steady-state products per session")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", default="vit,gpt")
    parser.add_argument("--classes", default="1000,4000,50000", help="C of the many-classes sweep ('' = none)")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--baseline-src", default=None, help="also run curvkit from this source tree")
    parser.add_argument("--out", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if args.quick:
        args.repeats, args.steady = 2, 2
    from curvkit.experiments._report import machine_info

    models = [m for m in args.models.split(",") if m] + [f"mlp-{c}" for c in args.classes.split(",") if c]
    arms = [a for a in args.arms.split(",") if a]
    if "gradient" not in arms:
        arms = ["gradient", *arms]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        parser.error(f"unknown arms {bad}; choose from {ARMS}")
    groups: list[tuple[str, list[str], str | None]] = [("", arms, None)]
    if args.baseline_src:
        groups.append((" (baseline)", ["gradient", *[a for a in arms if a in BASELINE_ARMS]], args.baseline_src))
    results: dict[str, dict[str, dict[str, Any]]] = {}
    start = time.time()
    for m in models:
        results[m] = {}
        for suffix, group, src in groups:
            env_before = os.environ.get("PYTHONPATH")
            if src is not None:
                os.environ["PYTHONPATH"] = str(Path(src).resolve())
            try:
                common = {"model": m, "threads": args.threads, "steady": args.steady}
                mems = {a: run_worker(__file__, {**common, "kind": "memory", "arm": a}) for a in group}
                timing = run_worker(__file__, {**common, "kind": "timing", "arms": [a for a in group
                                                                                     if "error" not in mems[a]],
                                               "repeats": args.repeats}, timeout=3600)
            finally:
                if src is not None:
                    if env_before is None:
                        os.environ.pop("PYTHONPATH", None)
                    else:
                        os.environ["PYTHONPATH"] = env_before
            grad_s = timing.get("gradient", {}).get("grad_s")
            grad_wall_s = timing.get("gradient", {}).get("grad_wall_s")
            grad_mem = mems["gradient"].get("first", {}).get("peak_delta_mib")
            for a in group:
                r = dict(timing.get(a, {"error": mems[a].get("error") or timing.get("error", "no timing")}))
                if "error" in mems[a]:
                    r = {"error": mems[a]["error"]}
                r.update({"first_mem": mems[a].get("first", {}), "steady_mem": mems[a].get("steady", {}),
                          "grad_ref_s": grad_s, "grad_ref_wall_s": grad_wall_s, "grad_mem_mib": grad_mem})
                results[m][a + suffix] = r
                print(f"[{m}] {a + suffix}: {json.dumps({k: v for k, v in r.items() if k.endswith('_s')})}",
                      file=sys.stderr, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"results": results, "args": vars(args)}, indent=1))
    info = {**machine_info(), "torch_threads": args.threads}
    try:
        load = os.getloadavg()
    except OSError:
        load = None
    text = render(results, args)
    text += ("\nMachine: " + ", ".join(f"{k} {v}" for k, v in info.items())
             + (f"; load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min)"
                if load else "") + f"; wall time {(time.time() - start) / 60:.1f} min\n")
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "machine": info, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
