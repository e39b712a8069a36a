"""GaussNewton on an FSDP2-sharded ViT against the data-parallel optimiser (issue 33, item 4): bytes communicated,
time per step and memory per rank, 2 processes (gloo, CPU). Prints a markdown table.

Model and data: the ViT of ``benchmarks/gauss_newton_vit.py`` (``curvkit.architectures.vit``, 28x28 MNIST in 4x4
patches, width 256, 2 pre-norm blocks of 4 heads, MLP width 672: 1,238,858 parameters, float32, softmax
cross-entropy with mean reduction), a global minibatch of ``--batch`` (64, half the ViT benchmark's: two
processes share the 2 cores) real MNIST images split into the ranks' contiguous halves, cycling over 4 minibatches.
``GaussNewton(curvature='kfac', weight_decay=1e-5)`` with the thesis's settings (factors and inverses every step,
``tau_every=5``) and the reducer's default placement (comm-opt: every layer's inverse on one owner rank,
broadcast).

Arms (each a fresh pair of processes, one torch thread each):

* ``data-parallel``: every rank holds the whole model (``distributed=Reducer()``);
* ``FSDP2``: ``fully_shard`` on every transformer block, then on the model (the patch embedding, tokens, final
  norm and head in the root's group): each rank holds half of every parameter; GaussNewton gathers the whole
  parameters into a replica at each step (:class:`curvkit.distributed.sharded.ShardedReplica`) and frees them
  after it (``docs/usage.md``, "Sharded models (FSDP2)").

Measured per arm: the median step time on rank 0 over ``--steps`` timed steps after ``--warmup`` (each step ends
with a barrier), the median over ``--rounds`` runs of each arm in rotating order; beside it the CPU time per step
of both processes together (each rank's ``time.process_time``, every thread, over the same steps, summed over the
ranks per step; the median over the steps, then over the runs) and the threads kept busy in both processes (that
sum / rank 0's wall time; at most 2 here); the bytes per step counted by
the :class:`~curvkit.distributed.Reducer` (``Reducer.stats``: the payload rank 0 hands to ``all_reduce`` and ``all_gather``, and the payload of every ``broadcast`` summed over
the ranks that send it, averaged over the timed steps); memory per rank, from the rank's tensors: the parameters
it holds between steps (DTensor local shards under FSDP2), gradients left in ``p.grad`` (none: a step computes
its gradient itself), the optimiser state (every tensor of ``GaussNewton.state_dict()``: the factor statistics,
whole on every rank in both arms, and the label generator's state), the replica's whole parameters held during
a step (FSDP2 only); parameters + gradient + optimiser state between steps and within a step (where the step's
whole gradient, |theta| values, is held in both arms); and the process's peak resident memory during the timed
steps above its resident memory before them (``_common.peak_rss_delta``: activations, per-sample statistics,
candidate directions and the replica included).

Run: ``.venv/bin/python benchmarks/sharded.py`` (``--quick``: 1 warm-up and 3 timed steps; ``--out FILE.md``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import fmt_busy, peak_rss_delta, summed_cpu_fields
from gauss_newton_vit import VIT, _batches

ARMS = ("data-parallel", "FSDP2")


def _tensor_bytes(obj: Any) -> int:
    """Bytes of every tensor in a nested dict/list (a state_dict)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, dict):
        return sum(_tensor_bytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(_tensor_bytes(v) for v in obj)
    return 0


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def _worker(rank: int, world: int, spec: dict[str, Any], out: str) -> None:
    from curvkit.architectures import vit
    from curvkit.distributed import Reducer
    from curvkit.likelihoods import CrossEntropy
    from curvkit.optim import GaussNewton

    red = Reducer(timeout=1200)
    model = vit(**VIT, seed=0)  # type: ignore[arg-type]
    if spec["arm"] == "FSDP2":
        from torch.distributed.fsdp import fully_shard

        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    gn = GaussNewton(model.parameters(), model=model, likelihood=CrossEntropy("mean"), curvature="kfac",
                     weight_decay=1e-5, distributed=red)
    rows = red.shard(int(spec["batch"]))
    batches = [(X[rows], y[rows]) for X, y in _batches(int(spec["batch"]), 4)]
    for k in range(int(spec["warmup"])):
        gn.step(batch=batches[k % 4])
    red.barrier()
    red.stats.reset()
    times: list[float] = []
    cpu: list[float] = []

    def timed() -> None:
        for k in range(int(spec["steps"])):
            c0, t0 = time.process_time(), time.perf_counter()
            gn.step(batch=batches[(int(spec["warmup"]) + k) % 4])
            red.barrier()  # every rank done with the step (no payload: not counted)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)

    mem = peak_rss_delta(timed)
    replica = getattr(gn, "_replica", None)
    memory = {
        "params": sum(_tensor_bytes(_local(p)) for p in model.parameters()),
        "grads": sum(_tensor_bytes(_local(p.grad)) for p in model.parameters() if p.grad is not None),
        "state": _tensor_bytes(gn.state_dict()),
        "factors": _tensor_bytes(gn.state_dict()["gauss_newton"]["estimator"]),
        "replica": 0 if replica is None else sum(e.whole.numel() * e.whole.element_size() for e in replica._sharded),
        "peak_delta_mib": mem["peak_delta_mib"], "rss_before_mib": mem["rss_before_mib"],
    }
    stats = red.stats.snapshot()
    every = red.all_gather_object({"stats": stats, "memory": memory, "cpu": cpu})
    if rank == 0:
        steps = int(spec["steps"])
        mine = every[0]["stats"]["bytes"]
        Path(out).write_text(json.dumps({
            "time_s": statistics.median(times), **summed_cpu_fields(times, [e["cpu"] for e in every]),
            "params": sum(p.numel() for p in model.parameters()),
            "all_reduce": mine.get("all_reduce", 0) / steps, "all_gather": mine.get("all_gather", 0) / steps,
            "broadcast": sum(e["stats"]["bytes"].get("broadcast", 0) for e in every) / steps,
            "calls": every[0]["stats"]["calls"], "memory": [e["memory"] for e in every]}))


def _run(arm: str, spec: dict[str, Any]) -> dict[str, Any]:
    from curvkit.distributed import spawn

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "r.json")
        spawn(_worker, 2, ({**spec, "arm": arm}, out), timeout=3600, collective_timeout=1200, threads=1)
        return dict(json.loads(Path(out).read_text()))


def _mib(b: float) -> str:
    return f"{b / 2**20:.2f}"


def table(rows: dict[str, dict[str, Any]], args: argparse.Namespace, load: tuple[float, float]) -> str:
    dp = rows["data-parallel"]
    lines = [f"### GaussNewton (KFAC) on an FSDP2-sharded ViT vs data-parallel, 2 processes ({datetime.date.today()})",
             "", f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} logical cores, torch "
             f"{torch.__version__}, gloo, 1 torch thread per process; load average (1 min) {load[0]:.2f} at the "
             f"start, {load[1]:.2f} at the end (shared machine). ViT {dp['params']:,} parameters, float32, global "
             f"batch {args.batch} (each rank {args.batch // 2}); {args.warmup} warm-up and {args.steps} timed steps "
             f"per run, {args.rounds} run(s) per arm in rotating order, step time: the median over runs of rank 0's "
             "median; CPU time: of both processes together, per step summed over the ranks, the median over runs "
             "of the median over steps (threads busy: that sum / rank 0's wall time). Bytes: the Reducer's counts per step (rank 0's all-reduce and "
             "all-gather payloads, broadcasts summed over their senders). Memory per rank: parameters held and "
             "optimiser state (`state_dict()` tensors) between steps, the replica's whole parameters during a step, "
             "their sum with the gradients (none in `p.grad` between steps; the step's whole gradient within it), "
             "peak RSS during the timed steps over the RSS before them.", "",
             "| arm | time / step (s) | vs data-parallel | CPU time / step, both processes (s) | threads busy, both "
             "processes | all-reduce MiB | all-gather MiB | broadcast MiB | "
             "total MiB / step | params held (MiB) | optimiser state (MiB) | replica in a step (MiB) | params + "
             "grads + state, between / in a step (MiB) | peak RSS delta (MiB) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm in ARMS:
        r = rows[arm]
        m = r["memory"][0]
        total = r["all_reduce"] + r["all_gather"] + r["broadcast"]
        peak = "n/a" if m["peak_delta_mib"] is None else f"{m['peak_delta_mib']:.0f}"
        held = m["params"] + m["grads"] + m["state"]
        step = held + m["replica"] + 4 * r["params"]  # + the step's whole float32 gradient
        lines.append(f"| {arm} | {r['time_s']:.2f} | {r['time_s'] / dp['time_s']:.2f}x | {r['cpu_s']:.2f} | "
                     f"{fmt_busy(r['threads_busy'])} | {_mib(r['all_reduce'])} | "
                     f"{_mib(r['all_gather'])} | {_mib(r['broadcast'])} | {_mib(total)} | {_mib(m['params'])} | "
                     f"{_mib(m['state'])} ({_mib(m['factors'])} factors) | {_mib(m['replica'])} | {_mib(held)} / "
                     f"{_mib(step)} | {peak} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each arm, in rotating order (median time)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.steps, args.warmup, args.rounds = 3, 1, 1
    load0 = os.getloadavg()[0]
    spec = dict(batch=args.batch, steps=args.steps, warmup=args.warmup)
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    for k in range(args.rounds):  # rotating order: machine load affects both arms alike
        for arm in ARMS[k % 2:] + ARMS[:k % 2]:
            runs[arm].append(_run(arm, spec))
    rows = {arm: {**got[-1], **{k: statistics.median(g[k] for g in got) for k in ("time_s", "cpu_s", "threads_busy")}}
            for arm, got in runs.items()}
    text = table(rows, args, (load0, os.getloadavg()[0]))
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
