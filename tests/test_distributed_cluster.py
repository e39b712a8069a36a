"""curvkit.distributed on a real cluster (issue 23): clean deterministic exits, collectives only on the
backend's communication device through one entry point, timeouts that hold for every collective and on
non-blocking backends (NCCL), housekeeping (rank reports, orphan checkpoint files).

What cannot run here (no GPU): NCCL itself. What stands in for it: a reducer that declares a non-CPU
communication device ('meta') and a transport that records what reaches it (item 3), Work objects that
behave as NCCL's do without TORCH_NCCL_BLOCKING_WAIT (item 4), and an ``atexit`` handler that aborts the
process, as a gloo thread does when it takes the GIL in the interpreter's teardown (item 1): an exit path
that still runs the teardown fails these tests every time, not once in a dozen launches. The stress test
(real launches under CPU load) has a short default version and a long one behind ``-m slow``.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

from curvkit import checkpoint
from curvkit.distributed import (
    CollectiveError,
    CollectiveTimeout,
    CommunicationDeviceError,
    Reducer,
    ReplicaMismatch,
    communication_device,
    communication_devices,
    spawn,
)

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "curvkit"


# ============================================================================ item 1: clean exits
def _abort_in_teardown() -> None:
    """Stand-in for the crash of issue 23: a background thread that aborts the process when the interpreter
    tears down (gloo's threads do it when they need the GIL then). A clean exit never runs the teardown."""
    atexit.register(os.abort)


def _light_run(rank: int, world: int) -> None:
    """A short but realistic data-parallel run: a few optimiser steps, object collectives, a checkpoint."""
    from curvkit.likelihoods import CrossEntropy
    from curvkit.models import mlp
    from curvkit.optim import GaussNewton

    red = Reducer(timeout=60)
    net = mlp([5, 4, 3], "tanh", dtype=torch.float64, seed=0)
    opt = GaussNewton(net.parameters(), model=net, likelihood=CrossEntropy("mean"), curvature="kflr",
                      tau_every=1, distributed=red)
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(16, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (16,), generator=g)
    rows = red.shard(16)
    for _ in range(3):
        opt.step(batch=(X[rows], y[rows]))
    red.check_identical(net.parameters())
    red.check_same(len(opt.history), "number of steps")
    a = torch.zeros(4, dtype=torch.float64)  # check_identical sees a one-ulp difference on one rank
    if rank == 1:
        a[2] = 2.0 ** -60
    with pytest.raises(ReplicaMismatch, match=r"rank\(s\) \[1\] differ"):
        red.check_identical([a], "a")


def teardown_crash_worker(rank: int, world: int) -> None:
    _abort_in_teardown()
    _light_run(rank, world)


def test_spawn_reports_a_worker_that_dies_after_its_work():
    # the exit code of every process counts: a process killed by a signal after correct work is a failure
    with pytest.raises(ProcessExitedException, match="SIGABRT"):
        spawn(_abort_after_work, 2, timeout=60)


def _abort_after_work(rank: int, world: int) -> None:
    Reducer(timeout=30).barrier()
    if rank == 1:
        os.abort()


def _training_script() -> str:
    """The training script of docs/usage.md (its ``train.py`` code block)."""
    text = (ROOT / "docs" / "usage.md").read_text()
    m = re.search(r"\*\*A training script\*\* \(`train.py`\):\s*```python\n(.*?)```", text, re.S)
    assert m, "docs/usage.md lost its train.py example"
    return m.group(1)


def _torchrun(script: Path, env: dict[str, str], timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           str(script)], cwd=script.parent, env=env, capture_output=True, text=True, timeout=timeout)


def _env(extra_path: Path | None = None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    paths = [str(ROOT / "src")] + ([str(extra_path)] if extra_path else [])
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    return env


def test_documented_training_script_exits_cleanly_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_training_script())
    inject = tmp_path / "inject"
    inject.mkdir()
    (inject / "sitecustomize.py").write_text(  # only in the workers (torchrun's agent has no LOCAL_RANK)
        "import atexit, os\nif 'LOCAL_RANK' in os.environ:\n    atexit.register(os.abort)\n")
    proc = _torchrun(script, _env(inject))
    assert proc.returncode == 0, f"torchrun failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    assert (tmp_path / "gn.pt").exists()


# ----------------------------------------------------------------------------- the CLI under torchrun
def cli_worker(rank: int, world: int, out: str) -> None:
    from curvkit import cli
    from curvkit.experiments import registry

    @registry.register("issue23-tiny", "a tiny data-parallel experiment (test only)", scales=("smoke",))
    def run(scale: str, out: Path, seed: int = 0) -> None:
        from curvkit.experiments._report import cached_stage, new_figure, save_figure, write_json
        from curvkit.likelihoods import CrossEntropy
        from curvkit.models import mlp
        from curvkit.optim import MESU

        net = mlp([5, 4, 3], "tanh", dtype=torch.float64, seed=seed)
        g = torch.Generator().manual_seed(seed)
        X, y = torch.randn(12, 5, generator=g, dtype=torch.float64), torch.randint(0, 3, (12,), generator=g)

        def train() -> dict:
            opt = MESU(net.parameters(), model=net, loss_fn=CrossEntropy("sum"), seed=seed)  # distributed: current()
            for _ in range(2):
                opt.step(batch=(X, y))  # every rank keeps its own rows (shard_batches)
            return net.state_dict()

        net.load_state_dict(cached_stage(out / "train.pt", "v1", train))
        fig, ax = new_figure()
        ax[0, 0].plot([0, 1])
        save_figure(fig, out / "curve.png")
        write_json(out / "results.json", {"ok": True})
        checkpoint.write_text(out / "summary.json", "{}\n")
        (out / "report.md").write_text("# report\n")

    _abort_in_teardown()
    cli.main(["reproduce", "issue23-tiny", "--out", out, "--distributed"])
    raise AssertionError("curvkit reproduce under torchrun returned instead of ending the process")


def test_cli_under_torchrun_exits_cleanly_and_only_rank0_writes_the_report(tmp_path):
    out = tmp_path / "run"
    spawn(cli_worker, 2, (str(out),), timeout=180)
    assert {p.name for p in out.iterdir() if p.is_file()} == {"report.md", "results.json", "summary.json",
                                                             "curve.png", "train.pt"}
    assert sorted(p.name for p in (out / ".rank1").iterdir()) == ["train.pt"]  # its checkpoint only


# ----------------------------------------------------------------------------- stress: launches under load
@contextlib.contextmanager
def _cpu_load(n: int):
    """``n`` busy processes for the duration (each ends by itself after 10 minutes at most)."""
    procs = [subprocess.Popen([sys.executable, "-c", "import time\nt = time.time()\nwhile time.time() - t < 600: pass"])
             for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


def stress_launches(spawns: int, torchruns: int, tmp: Path, load: int = 2, worker=None) -> dict:
    """Repeat launches of a finished-and-exiting 2-process run (``spawn`` of ``worker``, by default a short
    GaussNewton run, and torchrun of the documented train.py) under ``load`` busy processes; every failure
    (an exception, a non-zero exit code, a signal) is recorded."""
    failures: list[str] = []
    script = tmp / "train.py"
    script.write_text(_training_script())
    t0 = time.monotonic()
    with _cpu_load(load):
        load = os.getloadavg()[0]
        for i in range(spawns):
            try:
                spawn(worker or teardown_free_worker, 2, timeout=180)
            except Exception as err:
                failures.append(f"spawn {i}: {type(err).__name__}: {str(err)[-300:]}")
        for i in range(torchruns):
            proc = _torchrun(script, _env())
            if proc.returncode != 0:
                failures.append(f"torchrun {i}: exit code {proc.returncode}: {proc.stderr[-300:]}")
        load = max(load, os.getloadavg()[0])
    return {"spawns": spawns, "torchruns": torchruns, "failures": failures, "load": load,
            "seconds": time.monotonic() - t0}


def teardown_free_worker(rank: int, world: int) -> None:
    _light_run(rank, world)


def test_a_finished_worker_exits_cleanly_under_load(tmp_path):
    # the short version: one launch under load whose workers would abort in the interpreter's teardown
    # (before: always SIGABRT, and torch's spawn reported a failure after correct work)
    res = stress_launches(1, 0, tmp_path, load=1, worker=teardown_crash_worker)
    assert not res["failures"], res


@pytest.mark.slow
def test_stress_many_launches_under_load(tmp_path):
    res = stress_launches(40, 10, tmp_path)
    print(json.dumps(res))
    assert not res["failures"], res


# ============================================================================ item 3: communication device
@contextlib.contextmanager
def _transport(fake):
    """Replace the torch.distributed collectives the reducer issues by ``fake`` (restored afterwards, so the
    process still ends through a real barrier)."""
    import torch.distributed as dist

    saved = {name: getattr(dist, name) for name in ("all_reduce", "broadcast", "all_gather")}
    try:
        for name in saved:
            setattr(dist, name, fake)
        yield
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


class _Reached(Exception):
    """The stub transport was reached: every tensor passed the entry point's device check."""


def meta_device_worker(rank: int, world: int) -> None:
    seen: list[torch.device] = []

    def stub(*args, **kwargs):
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        tensors += [t for a in args if isinstance(a, list) for t in a if isinstance(t, torch.Tensor)]
        seen.extend(t.device for t in tensors)
        raise _Reached

    with _transport(stub):
        _meta_device_checks(seen)


def _meta_device_checks(seen: list[torch.device]) -> None:
    red = Reducer(timeout=10, device="meta")  # declare a communication device other than the CPU
    meta = torch.empty(3, 3, device="meta")
    built_by_the_reducer = {
        "sum_int": lambda: red.sum_int(3), "sum_scalars": lambda: red.sum_scalars(1.0, 2.0),
        "barrier": red.barrier, "all_gather_object": lambda: red.all_gather_object({"a": 1}),
        "broadcast_object": lambda: red.broadcast_object(5), "check_same": lambda: red.check_same(1, "x"),
        "shared_generator": lambda: red.shared_generator("cpu"),
        "sync_generator": lambda: red.sync_generator(torch.Generator()),
        "check_identical": lambda: red.check_identical([torch.ones(2)]),
        "all_gather_rows": lambda: red.all_gather_rows(meta), "weighted_mean": lambda: red.weighted_mean([meta], 3),
        "mean_of_sums": lambda: red.mean_of_sums([meta], 3),
        "all_reduce_": lambda: red.all_reduce_([meta]), "sum": lambda: red.sum([meta, meta[0]]),
        "sum_symmetric": lambda: red.sum_symmetric([meta, meta[0]], [True, False]),
        "broadcast_": lambda: red.broadcast_([meta], 0), "share": lambda: red.share([meta, meta[0]], 0),
        "share_symmetric": lambda: red.share_symmetric([meta], 0, lower=True),
    }
    for name, call in built_by_the_reducer.items():
        seen.clear()
        with pytest.raises(_Reached):
            call()
        assert seen and all(d.type == "meta" for d in seen), f"{name} sent tensors on {seen}"
    # a tensor built elsewhere is refused before anything is sent, naming both devices
    cpu = torch.ones(3)
    for call in {"all_reduce_": lambda: red.all_reduce_([cpu]), "broadcast_": lambda: red.broadcast_([cpu], 0),
                 "share": lambda: red.share([cpu], 0), "all_gather_rows": lambda: red.all_gather_rows(cpu),
                 "weighted_mean": lambda: red.weighted_mean([cpu], 2),
                 "mean_of_sums": lambda: red.mean_of_sums([cpu], 2),
                 "sum_symmetric": lambda: red.sum_symmetric([cpu[:1].reshape(1, 1)], [True])}.values():
        with pytest.raises(CommunicationDeviceError, match=r"on cpu.*communicates meta tensors"):
            call()


def test_every_collective_sends_tensors_on_the_declared_communication_device():
    spawn(meta_device_worker, 2, timeout=60)


def test_communication_device_of_a_backend(monkeypatch):
    assert communication_device("gloo") == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)  # as after torch.cuda.set_device(1)
    assert communication_device("nccl") == torch.device("cuda", 1)
    assert communication_devices("cpu:gloo,cuda:nccl") == (torch.device("cuda", 1), torch.device("cpu"))
    assert communication_device("nccl", "cuda:1") == torch.device("cuda", 1)
    assert communication_device("mpi", "cpu") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"Reducer\(device=\.\.\.\)"):
        communication_device("mpi")


COLLECTIVES = {"all_reduce", "broadcast", "all_gather", "all_gather_object", "broadcast_object_list", "barrier",
               "monitored_barrier", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_gather_into_tensor",
               "all_to_all", "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list",
               "send", "recv", "isend", "irecv", "batch_isend_irecv"}
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "eye", "randn", "rand", "randint", "as_tensor",
             "linspace"}
DISTRIBUTED_LAYER = [*sorted((SRC / "distributed").glob("*.py")), *sorted(SRC.glob("*/*/_distributed.py")),
                     *sorted(SRC.glob("*/_distributed.py"))]


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _is_dist(node: ast.AST) -> bool:
    return (isinstance(node, ast.Name) and node.id == "dist") or ast.unparse(node) == "torch.distributed"


def test_collectives_go_only_through_the_entry_point():
    """No module calls a torch.distributed collective except as the ``issue`` callable of
    ``Reducer._collective``, which checks the device and applies the timeout."""
    offenders = []
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text())
        parent = _parents(tree)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
                bad = [a.name for a in node.names if a.name in COLLECTIVES]
                if bad:
                    offenders.append(f"{path.relative_to(SRC)}:{node.lineno} imports {bad}")
            if not (isinstance(node, ast.Attribute) and node.attr in COLLECTIVES and _is_dist(node.value)):
                continue
            up, ok = parent.get(node), False
            while up is not None:
                if isinstance(up, ast.Lambda):
                    call = parent.get(up)
                    ok = (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                          and call.func.attr == "_collective")
                    break
                up = parent.get(up)
            if not ok:
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno} dist.{node.attr} outside Reducer._collective")
    assert not offenders, "\n".join(offenders)


def test_the_distributed_layer_builds_no_tensor_off_the_communication_device():
    """In the modules that talk to the reducer, every tensor factory names its device (the reducer's or the
    data's) unless its value is read back at once, and no code names the CPU except the gloo -> CPU entry
    of ``communication_devices`` and ``load_checkpoint``'s default ``map_location`` (checkpoints load onto
    the CPU, as torch's ``load_state_dict`` expects; nothing loaded travels)."""
    assert len(DISTRIBUTED_LAYER) >= 10
    offenders = []
    for path in DISTRIBUTED_LAYER:
        tree = ast.parse(path.read_text())
        parent = _parents(tree)
        allowed = {n for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name in ("communication_devices", "load_checkpoint")
                   for n in ast.walk(f)}
        for node in ast.walk(tree):
            where = f"{path.relative_to(SRC)}:{getattr(node, 'lineno', '?')}"
            if isinstance(node, ast.Constant) and node.value == "cpu" and node not in allowed:
                offenders.append(f"{where} names the CPU")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in FACTORIES
                    and ast.unparse(node.func.value) == "torch"
                    and not any(k.arg == "device" for k in node.keywords)):
                up = parent.get(node)
                read_back = isinstance(up, ast.Call) and ast.unparse(up.func) in ("int", "float", "bool")
                if not read_back:
                    offenders.append(f"{where} torch.{node.func.attr}(...) without device=")
    assert not offenders, "\n".join(offenders)


# ============================================================================ item 4: timeouts and messages
class _NcclLikeWork:
    """A collective that never completes, with NCCL's non-blocking ``wait`` (no TORCH_NCCL_BLOCKING_WAIT):
    ``wait(timeout)`` returns True at once, only ``is_completed()`` tells the truth."""

    def is_completed(self) -> bool:
        return False

    def wait(self, timeout=None) -> bool:
        return True

    def get_future(self):  # pragma: no cover - not used by the waiting path
        raise NotImplementedError


def nccl_like_worker(rank: int, world: int) -> None:
    with _transport(lambda *a, **k: _NcclLikeWork()):
        _nccl_like_checks()


def _nccl_like_checks() -> None:
    red = Reducer(timeout=0.5, blocking_wait=False)
    t = torch.ones(3)
    for name, call in {"all_reduce_": lambda: red.all_reduce_([t]), "broadcast_": lambda: red.broadcast_([t], 0),
                       "all_gather_object": lambda: red.all_gather_object(1), "barrier": red.barrier,
                       "broadcast_object": lambda: red.broadcast_object(1), "share": lambda: red.share([t], 0)}.items():
        t0 = time.monotonic()
        with pytest.raises(CollectiveTimeout, match=r"did not complete within 0\.5 s"):
            call()
        assert 0.5 <= time.monotonic() - t0 < 5, name


def test_the_timeout_holds_when_wait_does_not_block_the_host():
    spawn(nccl_like_worker, 2, timeout=60)


def stalled_peer_worker(rank: int, world: int, result: str) -> None:
    """Rank 0 runs the object collectives, a barrier and a subgroup creation while ranks 1 and 2 never
    arrive (they wait for rank 0's result file); each must give up after the reducer's 1 s, not after the
    process group's 60 s."""
    done = Path(result)
    if rank != 0:
        while not done.exists():
            time.sleep(0.05)
        os._exit(0)
    red = Reducer(timeout=1.0)
    times = {}
    for name, call in {"all_gather_object": lambda: red.all_gather_object({"a": 1}),
                       "broadcast_object": lambda: red.broadcast_object(3),
                       "check_same": lambda: red.check_same(1, "x"), "barrier": red.barrier,
                       "subgroup": lambda: red.subgroup((0, 1))}.items():
        t0 = time.monotonic()
        try:
            call()
            times[name] = "completed"
        except CollectiveTimeout as err:
            times[name] = [time.monotonic() - t0, str(err)]
        except Exception as err:
            times[name] = [time.monotonic() - t0, f"{type(err).__name__}: {err}"]
    done.write_text(json.dumps(times))
    os._exit(0)


def test_object_collectives_and_subgroups_keep_the_reducer_timeout(tmp_path):
    result = tmp_path / "times.json"
    spawn(stalled_peer_worker, 3, (str(result),), timeout=300, collective_timeout=60)
    times = json.loads(result.read_text())
    for name, got in times.items():
        assert isinstance(got, list) and 0.95 <= got[0] < 8 and "within 1 s" in got[1], (name, got)


def closed_peer_worker(rank: int, world: int, result: str) -> None:
    red = Reducer(timeout=30)
    red.barrier()
    if rank == 1:
        os._exit(0)  # closes its connections without taking part in the next collective
    t0 = time.monotonic()
    try:
        red.all_reduce_([torch.ones(3)])
        got = ["completed", 0.0]
    except CollectiveError as err:
        got = [f"{type(err).__name__}: {err}", time.monotonic() - t0]
    Path(result).write_text(json.dumps(got))
    os._exit(0)


def test_a_closed_peer_is_reported_as_a_failure_not_a_timeout(tmp_path):
    result = tmp_path / "got.json"
    spawn(closed_peer_worker, 2, (str(result),), timeout=120, collective_timeout=60)
    msg, elapsed = json.loads(result.read_text())
    assert msg.startswith("CollectiveError: rank 0: all_reduce failed after"), msg
    assert "timed out" not in msg and "within" not in msg and elapsed < 20, (msg, elapsed)


# ============================================================================ item 5: orphan checkpoint files
def test_an_interrupted_checkpoint_write_leaves_no_orphan(tmp_path):
    target = tmp_path / "ckpt.pt"
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys, time\nfrom curvkit import checkpoint\n"
        "checkpoint._atomic_write(__import__('pathlib').Path(sys.argv[1]), "
        "lambda fh: (fh.write(b'partial'), fh.flush(), time.sleep(600)))\n"), str(target)], env=_env())
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".ckpt.pt.*.tmp")):
            assert time.monotonic() < deadline and writer.poll() is None, "the writer did not start"
            time.sleep(0.05)
        live = list(tmp_path.glob(".ckpt.pt.*.tmp"))
        checkpoint.save({"a": 1}, tmp_path / "other.pt")
        checkpoint.remove_orphans(target)
        assert list(tmp_path.glob(".ckpt.pt.*.tmp")) == live  # a live writer's file is left alone
    finally:
        writer.send_signal(signal.SIGKILL)  # interrupted beyond any cleanup
        writer.wait()
    assert len(list(tmp_path.glob(".ckpt.pt.*.tmp"))) == 1  # the orphan
    checkpoint.save({"step": 2}, target)  # the next save of the same target removes it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt", "other.pt"]
    assert checkpoint.load(target) == {"step": 2}
    # an orphan of another host (or of the old naming) goes once it is a day old; load cleans as well
    stale = tmp_path / ".ckpt.pt.abc123.tmp"
    stale.write_bytes(b"x")
    checkpoint.load(target)
    assert stale.exists()
    old = time.time() - 2 * checkpoint.STALE_AFTER_S
    os.utime(stale, (old, old))
    checkpoint.load(target)
    assert not stale.exists()


def test_spawn_raises_every_failing_rank_first_failure_first():
    with pytest.raises(ProcessRaisedException, match=r"(?s)boom on rank 1.*rank 0"):
        spawn(_fail_then_peer_fails, 2, timeout=90, collective_timeout=60)


def _fail_then_peer_fails(rank: int, world: int) -> None:
    red = Reducer(timeout=20)
    red.barrier()
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    red.all_reduce_([torch.ones(2)])


# ============================================================================ the byte counter (benchmarks)
def comm_stats_worker(rank: int, world: int) -> None:
    """Reducer.stats counts the payload this rank hands to each kind of collective: an all-reduce's coalesced
    buffer, a broadcast by its sender only, an all-gather's own tensor (in a subgroup too), the barrier none."""
    red = Reducer(timeout=30)
    red.stats.reset()
    red.all_reduce_([torch.ones(3, dtype=torch.float64), torch.ones(2, 2, dtype=torch.float64)])  # one message
    red.broadcast_([torch.ones(5, dtype=torch.float32)], src=1)
    pair = red.subgroup((0, 1))  # every rank creates it; only its members gather in it
    if rank < 2:
        assert len(red.all_gather(torch.ones(4, dtype=torch.float32), group=pair)) == 2
    red.barrier()
    snap = red.stats.snapshot()
    want = {"all_reduce": 7 * 8, "broadcast": 5 * 4 if rank == 1 else 0, "all_gather": 16 if rank < 2 else 0}
    assert {k: v for k, v in snap["bytes"].items() if v} == {k: v for k, v in want.items() if v}, snap
    assert snap["calls"]["all_reduce"] == 1 and snap["total_bytes"] == sum(want.values())
    red.stats.reset()
    assert red.stats.total() == 0 and red.stats.snapshot()["calls"] == {}


def test_the_reducer_counts_the_bytes_of_every_collective():
    spawn(comm_stats_worker, 3, timeout=120, collective_timeout=60)
