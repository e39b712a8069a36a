"""Data-parallel step time and communication volume (issue 14): the Kronecker optimiser (GaussNewton, KFAC
curvature, factored damping) and MESU at 1 and 2 processes (gloo, CPU), against kfac-pytorch's
distributed KFAC preconditioner at the same factors and refresh period. Prints a markdown table.

Problem: an MLP 784-256-128-10 (ReLU, float32, 235,146 parameters), softmax cross-entropy, a global
minibatch of ``--batch`` (256) random inputs and labels (the numbers do not depend on the data's content),
split into contiguous shards. Every process runs one intra-op thread (the machine has 2 cores: 2 processes
use both, 1 process one). Each arm: ``--warmup`` steps, then ``--steps`` timed steps; per-step time is the
median wall time over the timed steps on rank 0 (every step ends with the same collectives on every rank). CPU
time: every rank measures its process's CPU time (``time.process_time``, every thread) over the same steps; the
table gives, per step, the SUM over the ranks (median over the timed steps), and the threads kept busy in all the
processes together (that sum / rank 0's wall time, median over the steps; at most 2 here, one thread per process).

Bytes per step are counted by curvkit's :class:`~curvkit.distributed.Reducer` itself (every collective
curvkit issues goes through it): the payload each rank hands to ``all_reduce`` (the same on every rank)
plus the payload of every ``broadcast`` summed over the owner ranks that send them, averaged over the timed
steps. kfac-pytorch (``pip install kfac-pytorch``) is measured when it is installed (its collectives are
counted by wrapping ``torch.distributed``'s functions); when it is not, its volume is computed from its
communication schedule (kfac-pytorch 0.4, ``KFACPreconditioner`` defaults: COMM-OPT, eigen inverses with the
eigenvalue outer product, float32 inverses, no symmetry-aware packing; ``BaseKFACPreconditioner.step`` and
``layers/eigen.py``): per factor update an all-reduce of every A (n_A^2) and G (n_G^2), per inverse update a
broadcast of QA (n_A^2), QG (n_G^2) and dGdA (n_G n_A), plus DistributedDataParallel's gradient all-reduce
(every parameter, every step). Such rows are marked "model".

Extrapolation to P workers (ring all-reduce: each worker sends and receives 2 (P-1)/P S for S payload bytes;
broadcast of S bytes: every receiver gets S): per-worker received bytes per step
    2 (P-1)/P * S_allreduce + (P-1)/P * S_broadcast
with S_allreduce, S_broadcast the payloads above, which do not depend on P for comm-opt placements.

Run: ``.venv/bin/python benchmarks/distributed.py`` (``--quick``: fewer steps; ``--json PATH``).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import statistics
import tempfile
import time
from typing import Any

import torch

from _common import require_library, summed_cpu_fields

LAYERS = [784, 256, 128, 10]


def _model() -> torch.nn.Module:
    from curvkit.models import mlp

    return mlp(LAYERS, "relu", dtype=torch.float32, seed=0)


def _data(batch: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.rand(batch, LAYERS[0], generator=g), torch.randint(0, LAYERS[-1], (batch,), generator=g)


def _worker(rank: int, world: int, spec: dict[str, Any], out: str) -> None:
    from curvkit.distributed import Reducer, shard_range
    from curvkit.likelihoods import CrossEntropy
    from curvkit.optim import MESU, GaussNewton

    red = Reducer(timeout=120) if world > 1 else None
    net = _model()
    arm = spec["arm"]
    if arm == "gauss_newton":
        opt: Any = GaussNewton(net.parameters(), model=net, likelihood=CrossEntropy("mean"), curvature="kfac",
                               inversion="factored", curvature_every=spec["refresh"], tau_every=5, zeta_every=20,
                               distributed=red)
    else:
        opt = MESU(net.parameters(), model=net, mc_samples=4, sigma_prior=0.01, sigma_res=10.0, distributed=red)
    times, cpu = [], []
    n = spec["warmup"] + spec["steps"]
    for t in range(n):
        X, y = _data(spec["batch"], t)
        a, b = shard_range(spec["batch"], rank, world)
        if t == spec["warmup"] and red is not None:
            red.stats.reset()
        c0, t0 = time.process_time(), time.perf_counter()
        opt.step(batch=(X[a:b], y[a:b]))
        if red is not None:
            red.barrier()  # every rank done with the step (not counted in the bytes: no payload)
        if t >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    stats = red.stats.snapshot() if red is not None else {"bytes": {}, "calls": {}}
    gathered = red.all_gather_object((stats, cpu)) if red is not None else [(stats, cpu)]
    allstats = [g[0] for g in gathered]
    if rank == 0:
        ar = allstats[0]["bytes"].get("all_reduce", 0) / spec["steps"]
        bc = sum(s["bytes"].get("broadcast", 0) for s in allstats) / spec["steps"]
        with open(out, "w") as fh:
            json.dump({"time_s": statistics.median(times), **summed_cpu_fields(times, [g[1] for g in gathered]),
                       "allreduce_bytes": ar, "broadcast_bytes": bc, "calls": allstats[0]["calls"]}, fh)


def _kfac_pytorch_worker(rank: int, world: int, spec: dict[str, Any], out: str) -> None:  # pragma: no cover
    import torch.distributed as dist
    from kfac.preconditioner import KFACPreconditioner

    counted = {"all_reduce": 0, "broadcast": 0}
    orig_ar, orig_bc = dist.all_reduce, dist.broadcast

    def ar(t: torch.Tensor, *a: Any, **k: Any) -> Any:
        counted["all_reduce"] += t.numel() * t.element_size()
        return orig_ar(t, *a, **k)

    def bc(t: torch.Tensor, *a: Any, **k: Any) -> Any:
        src = k.get("src", a[0] if a else 0)
        if dist.get_rank() == src:
            counted["broadcast"] += t.numel() * t.element_size()
        return orig_bc(t, *a, **k)

    dist.all_reduce, dist.broadcast = ar, bc  # type: ignore[assignment]
    net = torch.nn.parallel.DistributedDataParallel(_model())
    pre = KFACPreconditioner(net, factor_update_steps=spec["refresh"], inv_update_steps=spec["refresh"],
                             damping=1e-3, lr=0.1)
    sgd = torch.optim.SGD(net.parameters(), lr=0.1)
    lik = torch.nn.CrossEntropyLoss()
    times, cpu = [], []
    for t in range(spec["warmup"] + spec["steps"]):
        X, y = _data(spec["batch"], t)
        a = rank * spec["batch"] // world
        b = (rank + 1) * spec["batch"] // world
        if t == spec["warmup"]:
            counted.update(all_reduce=0, broadcast=0)
        c0, t0 = time.process_time(), time.perf_counter()
        sgd.zero_grad()
        lik(net(X[a:b]), y[a:b]).backward()
        pre.step()
        sgd.step()
        dist.barrier()
        if t >= spec["warmup"]:
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, (counted, cpu))
    if rank == 0:
        with open(out, "w") as fh:
            json.dump({"time_s": statistics.median(times), **summed_cpu_fields(times, [g[1] for g in gathered]),
                       "allreduce_bytes": gathered[0][0]["all_reduce"] / spec["steps"],
                       "broadcast_bytes": sum(g[0]["broadcast"] for g in gathered) / spec["steps"]}, fh)


def kfac_pytorch_model(refresh: int) -> dict[str, float]:
    """kfac-pytorch's bytes per step from its schedule (module docstring), float32."""
    ar = bc = 0.0
    grads = 0
    for n_in, n_out in itertools.pairwise(LAYERS):
        nA, nG = n_in + 1, n_out
        ar += 4 * (nA * nA + nG * nG) / refresh
        bc += 4 * (nA * nA + nG * nG + nG * nA) / refresh
        grads += n_out * (n_in + 1)
    return {"allreduce_bytes": ar + 4 * grads, "broadcast_bytes": bc}


def extrapolate(allreduce: float, broadcast: float, P: int) -> float:
    return 2 * (P - 1) / P * allreduce + (P - 1) / P * broadcast


def _run(fn: Any, world: int, spec: dict[str, Any]) -> dict[str, Any]:
    from curvkit.distributed import spawn

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        spawn(fn, world, (spec, out), timeout=1800, collective_timeout=600, threads=1)
        with open(out) as fh:
            return dict(json.load(fh))


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--refresh", type=int, default=1, help="factor and inverse refresh period (both libraries)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup = 5, 1
    rows: list[dict[str, Any]] = []
    for arm in ("gauss_newton", "mesu"):
        for world in (1, 2):
            spec = dict(arm=arm, batch=args.batch, steps=args.steps, warmup=args.warmup, refresh=args.refresh)
            r = _run(_worker, world, spec)
            rows.append(dict(arm=arm, world=world, source="measured", **r))
    have = require_library("kfac-pytorch", "kfac", "benchmarks/distributed.py", optional=True)
    for world in (1, 2):
        spec = dict(batch=args.batch, steps=args.steps, warmup=args.warmup, refresh=args.refresh)
        if have:
            r = _run(_kfac_pytorch_worker, world, spec)
            rows.append(dict(arm="kfac-pytorch", world=world, source="measured", **r))
        else:
            m = kfac_pytorch_model(args.refresh) if world > 1 else {"allreduce_bytes": 0.0, "broadcast_bytes": 0.0}
            rows.append(dict(arm="kfac-pytorch", world=world, source="model (not installed)", time_s=None, **m))
    machine = (f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
               f"gloo, 1 thread per process")
    print(f"machine: {machine}; MLP {'-'.join(map(str, LAYERS))}, batch {args.batch}, refresh every "
          f"{args.refresh} step(s), {args.steps} timed steps (median wall time on rank 0, median CPU time summed over "
          "the processes)\n")
    print("| optimiser | processes | step time (ms) | vs 1 process | CPU time / step, all processes (ms) | "
          "threads busy, all processes | all-reduce MiB/step | broadcast MiB/step | total MiB/step | source |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    base = {r["arm"]: r["time_s"] for r in rows if r["world"] == 1}
    for r in rows:
        t = r["time_s"]
        ratio = f"{t / base[r['arm']]:.2f}x" if t is not None and base.get(r["arm"]) else "n/a"
        tot = r["allreduce_bytes"] + r["broadcast_bytes"]
        cpu, busy = r.get("cpu_s"), r.get("threads_busy")
        print(f"| {r['arm']} | {r['world']} | {'n/a' if t is None else f'{1000 * t:.1f}'} | {ratio} | "
              f"{'n/a' if cpu is None else f'{1000 * cpu:.1f}'} | {'n/a' if busy is None else f'{busy:.2f}'} | "
              f"{_mib(r['allreduce_bytes'])} | {_mib(r['broadcast_bytes'])} | {_mib(tot)} | {r['source']} |")
    gn = next(r for r in rows if r["arm"] == "gauss_newton" and r["world"] == 2)
    kp = next(r for r in rows if r["arm"] == "kfac-pytorch" and r["world"] == 2)
    me = next(r for r in rows if r["arm"] == "mesu" and r["world"] == 2)
    print(f"\nGaussNewton / kfac-pytorch bytes per step at 2 processes: "
          f"{(gn['allreduce_bytes'] + gn['broadcast_bytes']) / (kp['allreduce_bytes'] + kp['broadcast_bytes']):.2f}")
    print("\nExtrapolated per-worker received MiB per step (comm-opt, ring all-reduce):\n")
    print("| workers | GaussNewton (KFAC) | kfac-pytorch | MESU |")
    print("|---|---|---|---|")
    for P in (8, 16, 32, 64, 128):
        print(f"| {P} | {_mib(extrapolate(gn['allreduce_bytes'], gn['broadcast_bytes'], P))} | "
              f"{_mib(extrapolate(kp['allreduce_bytes'], kp['broadcast_bytes'], P))} | "
              f"{_mib(extrapolate(me['allreduce_bytes'], me['broadcast_bytes'], P))} |")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"machine": machine, "args": vars(args), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
