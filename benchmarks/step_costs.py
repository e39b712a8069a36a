"""What a training step is made of, counted, and what that would cost on a GPU (issue 35, "what it would be on a
GPU"): AdamW against GaussNewton KFAC on the two ViTs of the wall-clock studies.

No GPU was lent to this project, so this does not time one. It COUNTS, exactly, on the CPU, for one step of each
arm, per step: the mean over 5 steps after 5 warm-up steps, on one minibatch (5 steps are one period of every
interval here: the factor refresh, the quadratic model, ``FAST_ADAPTATION``'s zeta search every 5th step):

* ``kernels``: the ATen operations that compute (every operator dispatched below autograd, without the
  metadata-only ones: views, reshapes, transposes, ``detach``, ``expand``...). In eager PyTorch each is one
  kernel launch on a GPU (a few are two), issued by the Python thread one after the other;
* ``syncs``: the host-device synchronisations (``aten._local_scalar_dense``: ``.item()``, ``bool(t)``,
  ``float(t)``), each of which drains the GPU's queue before Python goes on (not counted: AdamW's reads of its
  step counters, which torch keeps on the host);
* ``linalg``: the dense factorisations (Cholesky, eigh, solves, inverses), which are single operations whose GPU
  time depends on their size (cuSOLVER), listed with their largest factor's size;
* ``GFLOP``: the floating-point operations of the matrix products, convolutions and attention
  (``torch.utils.flop_counter.FlopCounterMode``), i.e. the part of the work that a GPU's tensor cores do;
* CPU time of the step here (one thread), for reference.

The projection ``t_GPU = kernels x t_launch + syncs x t_sync + GFLOP / R`` has three assumed constants, printed
with the table (``--launch-us``, ``--sync-us``, ``--tflops``): the eager dispatch cost per operation (Python,
autograd and the launch: about 10 us on a fast host), the cost of a synchronisation beyond it, and the rate the
products reach (far below the peak at these sizes). The factorisations are left out of t_GPU and listed instead.
Read the projection as the ORDER of the ratio GaussNewton / AdamW on a GPU, not as a measurement.

Models: ``modern`` is the ViT of ``curvkit reproduce modern --scale medium`` (72,074 parameters, 7x7 patches);
``vit`` the one of ``benchmarks/gauss_newton_vit.py`` (1.24 M parameters, 4x4 patches). MNIST minibatch 128.
Arms: AdamW (weight decay 1e-4, as ``modern``; ``foreach=True``, its default on a GPU: a few multi-tensor
kernels for all parameters, where the CPU default is a loop of kernels per parameter); GaussNewton ``curvature='kfac'`` with ``modern``'s damping
(``FAST_ADAPTATION``) and weight decay 1e-4, factors, inverses and the alpha* quadratic model every step
(the thesis's step); with ``curvature_every=5`` (the AMORTISED preset); with ``quadratic_every=5`` and
``tau_every=5`` as well.

Run: ``.venv/bin/python benchmarks/step_costs.py [--models modern,vit]``.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))

from curvkit.experiments.modern import SCALES
from gauss_newton_vit import VIT

# the ViT of `reproduce modern --scale medium` (vit()'s defaults otherwise: 28x28 MNIST in 7x7 patches) and the
# one of gauss_newton_vit.py
MODELS = {"modern": dict(SCALES["medium"].vit), "vit": VIT}
ARMS = ("AdamW", "GaussNewton KFAC, thesis (every step)", "GaussNewton KFAC, factors every 5 (AMORTISED)",
        "GaussNewton KFAC, factors and alpha* every 5")
METADATA = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "as_strided", "select",
            "slice", "unsqueeze", "squeeze", "detach", "alias", "unflatten", "flatten", "split", "split_with_sizes",
            "chunk", "unbind", "narrow", "diagonal", "view_as", "expand_as", "movedim", "lift_fresh", "_reshape_alias",
            "numpy_T", "mT", "matrix_H", "real", "conj", "_conj", "_neg_view", "resolve_conj", "resolve_neg",
            "is_same_size", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "dim", "size", "stride",
            "is_nonzero", "result_type", "_has_compatible_shallow_copy_type", "set_", "_to_copy_if_needed",
            "clone_if_needed", "_has_same_storage_numel", "_make_dual", "_unpack_dual", "_fw_primal",
            "empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "lift_fresh_copy",
            "_record_function_enter_new", "_record_function_exit"}
LINALG = ("linalg_cholesky", "cholesky", "linalg_eigh", "_linalg_eigh", "linalg_solve", "cholesky_solve",
          "linalg_inv", "triangular_solve", "linalg_solve_triangular", "cholesky_inverse", "_linalg_solve_ex",
          "linalg_cholesky_ex", "linalg_inv_ex", "_cholesky_solve_helper")


class Counting(TorchDispatchMode):
    """Counts the ATen operations dispatched (module docstring): kernels, syncs, factorisations by size."""

    def __init__(self, host: set[int] = frozenset()) -> None:  # type: ignore[assignment]
        super().__init__()
        self.host = host  # ids of tensors that stay on the host on a GPU too (AdamW's step counters)
        self.ops: Counter[str] = Counter()
        self.linalg: Counter[str] = Counter()
        self.largest: dict[str, int] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense" and id(args[0]) in self.host:
            name = "host read"
        self.ops[name] += 1
        if name in LINALG:
            factor = args[1] if name.startswith("cholesky_solve") else args[0]  # the factor, not the right side
            n = int(factor.shape[-1]) if isinstance(factor, torch.Tensor) and factor.dim() else 0
            self.linalg[name] += 1
            self.largest[name] = max(self.largest.get(name, 0), n)
        return func(*args, **(kwargs or {}))

    @property
    def kernels(self) -> int:
        return sum(c for k, c in self.ops.items() if k not in METADATA and k not in ("_local_scalar_dense", "host read"))

    @property
    def syncs(self) -> int:
        return self.ops["_local_scalar_dense"]


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    from curvkit.experiments._second_order import load_mnist

    X, y = load_mnist(128)
    return X.reshape(-1, 1, 28, 28), y


def _arm(arm: str, model_name: str) -> tuple[Any, Any]:
    """(step(X, y) of one arm (module docstring) on a fresh model, a callable giving the ids of the tensors it
    reads that a GPU run keeps on the host: AdamW's step counters)."""
    from curvkit.architectures import vit
    from curvkit.likelihoods import CrossEntropy
    from curvkit.optim import GaussNewton
    from curvkit.optim.second_order.gauss_newton import FAST_ADAPTATION

    model = vit(**MODELS[model_name], seed=0)  # type: ignore[arg-type]
    lik = CrossEntropy("mean")
    if arm == "AdamW":
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=1e-4, foreach=True)  # CUDA's default

        def step(X: torch.Tensor, y: torch.Tensor) -> None:
            adamw.zero_grad()
            lik(model(X), y).backward()
            adamw.step()

        return step, lambda: {id(st["step"]) for st in adamw.state.values()}
    every = 1 if "thesis" in arm else 5
    quadratic = 5 if "alpha*" in arm else 1
    options = {**FAST_ADAPTATION, "curvature_every": every, "quadratic_every": quadratic}
    if quadratic > 1:
        options["tau_every"] = quadratic
    gn = GaussNewton(model.parameters(), model=model, likelihood=lik, curvature="kfac", weight_decay=1e-4, **options)

    def gn_step(X: torch.Tensor, y: torch.Tensor) -> None:
        gn.step(batch=(X, y))

    return gn_step, set


def count(model_name: str, arm: str, steps: int = 5) -> dict[str, Any]:
    """Per step, the mean over ``steps`` consecutive steps after ``steps`` warm-up steps: with 5, one whole period
    of every interval here (the factor refresh, the quadratic model, zeta's search every 5th step)."""
    from torch.utils.flop_counter import FlopCounterMode

    torch.manual_seed(0)
    X, y = _batch()
    step, host = _arm(arm, model_name)
    for _ in range(steps):
        step(X, y)
    counter = Counting(host())
    flops = FlopCounterMode(display=False)
    c0 = time.process_time()
    with flops, counter:
        for _ in range(steps):
            step(X, y)
    counted = time.process_time() - c0
    c0 = time.process_time()
    for _ in range(steps):
        step(X, y)
    plain = time.process_time() - c0
    return {"kernels": counter.kernels / steps, "syncs": counter.syncs / steps,
            "gflop": flops.get_total_flops() / 1e9 / steps, "linalg": {k: v / steps for k, v in counter.linalg.items()},
            "largest": counter.largest, "cpu_counted_s": counted / steps, "cpu_s": plain / steps,
            "top": [(k, v / steps) for k, v in counter.ops.most_common(10)]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="modern,vit")
    parser.add_argument("--launch-us", type=float, default=10.0)
    parser.add_argument("--sync-us", type=float, default=20.0)
    parser.add_argument("--tflops", type=float, default=50.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    print(f"torch {torch.__version__}, 1 thread; projection t_GPU = kernels x {args.launch_us:g} us + syncs x "
          f"{args.sync_us:g} us + GFLOP / {args.tflops:g} TFLOP/s (assumed constants, module docstring)\n")
    for model_name in args.models.split(","):
        rows = {arm: count(model_name, arm) for arm in ARMS}
        base = rows["AdamW"]

        def t_gpu(r: dict[str, Any]) -> float:
            return (r["kernels"] * args.launch_us + r["syncs"] * args.sync_us) * 1e-6 + r["gflop"] / (args.tflops * 1e3)

        print(f"#### {model_name}\n")
        print("| arm | kernels / step | syncs / step | GFLOP / step | factorisations / step (largest n) | CPU s / step here "
              "| projected GPU ms / step | / AdamW |")
        print("|---|---|---|---|---|---|---|---|")
        for arm, r in rows.items():
            fact = ", ".join(f"{k} {v:g} ({r['largest'][k]})" for k, v in r["linalg"].items()) or "-"
            print(f"| {arm} | {r['kernels']:,.0f} | {r['syncs']:,.0f} | {r['gflop']:.2f} | {fact} | {r['cpu_s']:.3f} | "
                  f"{1e3 * t_gpu(r):.2f} | {t_gpu(r) / t_gpu(base):.1f}x |")
        print()
        for arm, r in rows.items():
            print(f"- {arm}: most frequent operations per step {', '.join(f'{k} {v:g}' for k, v in r['top'])}")
        print()


if __name__ == "__main__":
    main()
