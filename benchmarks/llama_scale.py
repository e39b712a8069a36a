"""Curvature of a Llama-architecture LLM on one CPU (issue 30, section 5).

Model: ``transformers.LlamaForCausalLM`` with the TinyLlama-1.1B architecture (``LlamaConfig``: hidden 2048,
intermediate 5632, 22 layers, 32 heads, 4 key-value heads, vocabulary 32,000; 1.1 B parameters), random
weights (seed 0), float32, eval mode, wrapped by ``curvkit.hf.HuggingFace``; ``--quick``: the same
architecture shrunk (hidden 256, intermediate 704, 2 layers, 8 heads, 2 key-value heads, vocabulary 2,000).
Batch: 2 sequences of 128 random tokens (``--quick``: 2 x 32), next-token targets, ``position_ids`` with the
batch dimension. Loss: softmax cross-entropy, mean over the tokens.

Rows, all in ONE process, each timed as a ratio to a gradient pass measured in the same process just before
(median process CPU time of 3 calls, 5 for the gradient, ``time.process_time``, with
``OMP_WAIT_POLICY=PASSIVE`` unless set; beside it the median wall time of the same calls and the threads kept
busy, CPU / wall time; the ratios are of the CPU times; peak memory: the increase of the resident set during the
call):

* ``gradient``: loss + gradient of every parameter (math attention, as the curvature passes run);
* ``curvkit KFAC expand`` / ``reduce``: ``KroneckerEstimator(curvature="kfac")`` ``update`` +
  ``operator(release=True)`` on EVERY parameter (norms and the 32k head included), a fresh estimator per call
  (its first batch also runs the samples-first trace); ``a refresh (estimator kept)``: ``reset`` + ``update`` +
  ``operator(release=True)`` of one estimator kept across calls, as an optimiser refreshes its factors; a refusal
  of the engine is recorded as the row's note;
* ``curvlinops KFAC``: ``KFACLinearOperator`` (MC, expand) on the parameters it takes (``nn.Linear``; in the
  full configuration without ``lm_head``, whose dense 32,000^2 output factor is 4 GB), its coverage;
* ``LoRA gradient``: peft LoRA, rank 8 on ``q_proj`` and ``v_proj``, everything else frozen: the unit of the
  LoRA rows; ``LoRA Kronecker Laplace``: ``Laplace(structure="kron", curvature="kfac")`` fit + log marginal
  likelihood; ``LoRA GLM predictive``: its linearised predictive at every token over the whole vocabulary
  (``link="mc"``, 10 draws by forward-mode products); ``LoRA GaussNewton``: one step (KFAC, alpha*, rho);
* ``GaussNewton all parameters``: one step on every parameter (KFAC, alpha*, rho); ``--quick`` and fewer than 22
  layers only. On the whole model it was killed by the out-of-memory killer at 23.9 GB (2026-11-29): beside the
  weights and the gradient (4.4 GB each) a step holds the three candidate directions of the zeta search (4.4 GB
  each), the input factors (3.9 GB; the output factors are their 256 rows, ``estimators.ROWS_OUTPUTS``), a copy
  of them and their inverses.

``--skip-kfac``: the gradient, then the rows after the KFAC rows (GaussNewton, curvlinops, LoRA), for a second
process on the whole model; ``--no-curvlinops`` leaves curvlinops' row out.

The KFAC rows take the operator with ``operator(release=True)`` (the statistics handed to it, symmetrised in
place, as :func:`curvkit.curvature.kfac` does): one set of factors in memory, not two. The header gives the
largest resident set of the process during any row.

Run: ``flock /tmp/curvkit-bench.lock env OMP_NUM_THREADS=2 .venv/bin/python benchmarks/llama_scale.py
[--quick | --layers N] [--out table.md]`` (``--layers N``: the full width with N of the 22 decoder
layers, for a machine where the whole model does not fit beside the comparison). Prints one markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # threads waiting for a descheduled sibling do not spin

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import cpu_fields, peak_rss_delta

FULL = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22, "num_attention_heads": 32,
        "num_key_value_heads": 4, "vocab_size": 32000}
QUICK = {"hidden_size": 256, "intermediate_size": 704, "num_hidden_layers": 2, "num_attention_heads": 8,
         "num_key_value_heads": 2, "vocab_size": 2000}
LORA_RANK = 8
GLM_SAMPLES = 10


def build(quick: bool, layers: int | None = None) -> tuple[Any, dict[str, torch.Tensor], torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    from curvkit.hf import HuggingFace

    sizes = dict(QUICK if quick else FULL, **({"num_hidden_layers": layers} if layers else {}))
    cfg = LlamaConfig(**sizes, max_position_embeddings=2048, attn_implementation="eager")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    B, T = 2, 32 if quick else 128
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids[:, :-1].contiguous(), "position_ids": torch.arange(T).expand(B, T).contiguous()}
    return HuggingFace(model), batch, ids[:, 1:].contiguous()


class Ids(torch.nn.Module):
    """(B, T) token ids -> (B, T, V) logits, position ids 0..T-1 with the batch dimension: for Laplace and
    GaussNewton, which take a tensor batch."""

    def __init__(self, hf: torch.nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.hf({"input_ids": ids, "position_ids": torch.arange(ids.shape[-1]).expand(ids.shape)})
        return out


class Flat(torch.nn.Module):
    """curvlinops' view: ids in, logits (B, V, T) out (CrossEntropyLoss reads classes second)."""

    def __init__(self, hf: torch.nn.Module):
        super().__init__()
        self.net = Ids(hf)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from curvkit.structure import curvature_kernels

        with curvature_kernels():
            return self.net(ids).transpose(1, 2)


def gradient(hf: Any, batch: dict[str, torch.Tensor], y: torch.Tensor) -> Any:
    from curvkit.structure import curvature_kernels

    params = [p for p in hf.parameters() if p.requires_grad]
    with curvature_kernels():
        logits = hf(batch)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return torch.autograd.grad(loss, params)


REPEATS = {"n": 3}  # calls per row (``--repeats``); the gradient takes two more
PROCESS_PEAK = {"mib": 0.0}  # the largest resident set seen during any first call (before + its increase)


def measure(fn: Any, repeats: int | None = None) -> tuple[dict[str, Any], float | None]:
    """({``s``: median process CPU seconds of ``repeats`` calls, ``wall_s``: their median wall seconds,
    ``threads_busy``}, peak resident-set increase in MiB of the first)."""
    repeats = REPEATS["n"] if repeats is None else repeats
    times: list[float] = []
    walls: list[float] = []

    def timed() -> Any:
        c0, t0 = time.process_time(), time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t0)
        times.append(time.process_time() - c0)
        return out

    mem = peak_rss_delta(timed)
    if mem["peak_delta_mib"] is not None:
        PROCESS_PEAK["mib"] = max(PROCESS_PEAK["mib"], mem["rss_before_mib"] + mem["peak_delta_mib"])
    for _ in range(repeats - 1):
        timed()
    busy = cpu_fields(walls, times)["threads_busy"]
    return {"s": statistics.median(times), "wall_s": statistics.median(walls), "threads_busy": busy}, mem["peak_delta_mib"]


def coverage(hf: Any) -> float:
    return sum(p.numel() for p in hf.parameters() if p.requires_grad) / sum(p.numel() for p in hf.parameters())


def run(quick: bool, layers: int | None = None, kfac_only: bool = False, output_factor: str = "auto",
        skip_kfac: bool = False, no_curvlinops: bool = False) -> list[dict[str, Any]]:
    from curvkit.curvature import KroneckerEstimator
    from curvkit.likelihoods import CrossEntropy
    from curvkit.structure import UnsupportedModelError

    hf, batch, y = build(quick, layers)
    rows: list[dict[str, Any]] = Progress()
    n_all = sum(p.numel() for p in hf.parameters())

    def unit(name: str) -> tuple[float, float | None]:
        gradient(hf, batch, y)  # warm-up
        t, mib = measure(lambda: gradient(hf, batch, y), REPEATS["n"] + 2)
        rows.append({"row": name, **t, "ratio": 1.0, "mib": mib, "mib_ratio": 1.0, "coverage": coverage(hf)})
        return t["s"], mib

    def row(name: str, fn: Any, base: tuple[float, float | None], note: str = "") -> bool:
        try:
            t, mib = measure(fn)
        except UnsupportedModelError as err:
            rows.append({"row": name, "note": "refused: " + str(err).split(";")[0][:160], "coverage": coverage(hf)})
            return False
        rows.append({"row": name, **t, "ratio": t["s"] / base[0], "mib": mib, "coverage": coverage(hf), "note": note,
                     "mib_ratio": mib / base[1] if mib is not None and base[1] else None})
        return True

    def kfac(sharing: str) -> Any:
        est = KroneckerEstimator(hf, CrossEntropy("mean"), "kfac", weight_sharing=sharing, seed=0,
                                 output_factor=output_factor)  # type: ignore[arg-type]
        return est.update((batch, y)).operator(release=True)  # as curvature.kfac(): the statistics handed over

    kept: dict[str, Any] = {}

    def refresh(sharing: str) -> Any:
        """A factor refresh of an estimator kept across steps (as an optimiser keeps it): its first batch's
        one-time checks (the samples-first trace) are paid before the timed calls."""
        if sharing not in kept:
            kept[sharing] = KroneckerEstimator(hf, CrossEntropy("mean"), "kfac", weight_sharing=sharing, seed=0,
                                               output_factor=output_factor)  # type: ignore[arg-type]
            kept[sharing].update((batch, y))
        est = kept[sharing]
        est.reset()
        return est.update((batch, y)).operator(release=True)

    base = unit("gradient (every parameter)")
    if not skip_kfac:
        row("curvkit KFAC expand, every parameter", lambda: kfac("expand"), base)
        row("curvkit KFAC reduce", lambda: kfac("reduce"), base)
        for sharing in ("expand", "reduce"):
            refresh(sharing)  # the kept estimator's construction and first batch, untimed
            row(f"curvkit KFAC {sharing}, a refresh (estimator kept)", lambda s=sharing: refresh(s), base)
        kept.clear()
    if kfac_only:
        for r in rows:
            r["params"] = n_all
        return rows
    if quick or (layers is not None and layers < FULL["num_hidden_layers"]):
        gauss_newton_row(hf, batch, y, row, base)  # its optimiser (factors, inverses) freed on return
    else:
        rows.append({"row": "GaussNewton step, every parameter", "coverage": coverage(hf),
                     "note": "not run: killed by the out-of-memory killer at 23.9 GB (weights, gradient, three "
                             "candidate directions of 4.4 GB each, factors and their inverses)"})
    try:
        if no_curvlinops:
            raise ImportError("--no-curvlinops")
        import curvlinops as cl

        lin = [m for n, m in hf.named_modules() if isinstance(m, torch.nn.Linear) and (quick or "lm_head" not in n)]
        params = [p for m in lin for p in m.parameters()]
        keep = {id(p) for p in params}
        for p in hf.parameters():
            p.requires_grad_(id(p) in keep)

        def curvlinops_kfac() -> Any:
            op = cl.KFACLinearOperator(Flat(hf), torch.nn.CrossEntropyLoss(), params, [(batch["input_ids"], y)],
                                       kfac_approx="expand", check_deterministic=False,
                                       num_per_example_loss_terms=y.shape[1], num_data=y.shape[0])
            op.compute_kronecker_factors()
            return op

        base_cl = unit("gradient (curvlinops' parameters)")
        row("curvlinops KFAC expand", curvlinops_kfac, base_cl, "" if quick else "lm_head excluded")
    except ImportError as err:
        rows.append({"row": "curvlinops KFAC expand", "note": "not run (--no-curvlinops)" if no_curvlinops else
                     f"curvlinops not installed ({err})"})
    lora_rows(hf, batch, y, rows, unit, row)
    for r in rows:
        r["params"] = n_all
    return rows


def gauss_newton_row(hf: Any, batch: dict[str, torch.Tensor], y: torch.Tensor, row: Any, base: Any) -> None:
    from curvkit.likelihoods import CrossEntropy
    from curvkit.optim import GaussNewton

    gn = GaussNewton([p for p in hf.parameters() if p.requires_grad], model=Ids(hf), likelihood=CrossEntropy("mean"),
                     curvature="kfac")
    row("GaussNewton step, every parameter", lambda: gn.step(batch=(batch["input_ids"], y)), base)


class Progress(list):  # type: ignore[type-arg]
    """The rows, each also printed (to stderr) as it is measured, so that a run stopped early (out of memory on
    the whole model) still shows what it measured."""

    def append(self, row: dict[str, Any]) -> None:
        super().append(row)
        print(render([row]).splitlines()[-1], file=sys.stderr, flush=True)


def lora_rows(hf: Any, batch: dict[str, torch.Tensor], y: torch.Tensor, rows: list[dict[str, Any]], unit: Any,
              row: Any) -> None:
    from peft import LoraConfig, get_peft_model

    from curvkit.hf import HuggingFace
    from curvkit.laplace import Laplace
    from curvkit.likelihoods import CrossEntropy
    from curvkit.optim import GaussNewton

    base_model = hf.model
    for p in base_model.parameters():
        p.requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lora = get_peft_model(base_model, LoraConfig(r=LORA_RANK, target_modules=["q_proj", "v_proj"],
                                                     init_lora_weights="gaussian"))
    hf_l = HuggingFace(lora)
    net = Ids(hf_l)
    base = unit_for(hf_l, batch, y, rows)
    fitted: dict[str, Any] = {}

    def fit() -> Any:
        fitted["la"] = Laplace(net, CrossEntropy("mean"), structure="kron", curvature="kfac").fit(
            [(batch["input_ids"], y)])
        return fitted["la"].log_marginal_likelihood().detach()

    row("LoRA Kronecker Laplace (fit + log marginal likelihood)", fit, base)
    if "la" in fitted:
        row("LoRA GLM predictive over the vocabulary", lambda: fitted["la"].predict(
            batch["input_ids"], link="mc", num_samples=GLM_SAMPLES, generator=torch.Generator().manual_seed(4)),
            base, f"{GLM_SAMPLES} linearised draws")
    gn = GaussNewton([p for p in hf_l.parameters() if p.requires_grad], model=net, likelihood=CrossEntropy("mean"))
    row("LoRA GaussNewton step", lambda: gn.step(batch=(batch["input_ids"], y)), base)


def unit_for(hf: Any, batch: dict[str, torch.Tensor], y: torch.Tensor, rows: list[dict[str, Any]]) -> Any:
    gradient(hf, batch, y)
    t, mib = measure(lambda: gradient(hf, batch, y), REPEATS["n"] + 2)
    rows.append({"row": "LoRA gradient (adapters)", **t, "ratio": 1.0, "mib": mib, "mib_ratio": 1.0,
                 "coverage": sum(p.numel() for p in hf.parameters() if p.requires_grad)
                 / sum(p.numel() for p in hf.parameters())})
    return t["s"], mib


def render(rows: list[dict[str, Any]]) -> str:
    out = ["| row | trainable share | CPU s | x gradient | wall s | threads busy | peak MiB | x gradient | note |",
           "|---|---|---|---|---|---|---|---|---|"]
    def cell(r: dict[str, Any], k: str, fmt: str) -> str:
        return format(r[k], fmt) if r.get(k) is not None else "-"

    for r in rows:
        def f(k: str, fmt: str, r: dict[str, Any] = r) -> str:
            return cell(r, k, fmt)
        out.append(f"| {r['row']} | {f('coverage', '.2%')} | {f('s', '.2f')} | {f('ratio', '.2f')} | "
                   f"{f('wall_s', '.2f')} | {f('threads_busy', '.2f')} | {f('mib', '.0f')} | {f('mib_ratio', '.2f')} | "
                   f"{r.get('note', '')} |")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the shrunk configuration (minutes instead of an hour)")
    ap.add_argument("--layers", type=int, default=None,
                    help="keep the full width but build only this many of the 22 decoder layers (memory, time)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="timed calls per row (the gradient: two more)")
    ap.add_argument("--kfac-only", action="store_true", help="only the gradient and curvkit's KFAC rows")
    ap.add_argument("--output-factor", default="auto", choices=("auto", "dense", "low_rank"),
                    help="the KFAC rows' output_factor (low_rank: every output factor held as its rows)")
    ap.add_argument("--skip-kfac", action="store_true", help="the gradient and the rows after the KFAC rows")
    ap.add_argument("--no-curvlinops", action="store_true", help="leave out the curvlinops row")
    ap.add_argument("--out", type=Path, default=None, help="also write the table here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    REPEATS["n"] = args.repeats
    rows = run(args.quick, args.layers, args.kfac_only, args.output_factor, args.skip_kfac, args.no_curvlinops)
    table = render(rows)
    name = "quick" if args.quick else "TinyLlama-1.1B" + (f" width, {args.layers} layers" if args.layers else "")
    name += "" if args.output_factor == "auto" else f", output_factor={args.output_factor!r}"
    head = (f"llama_scale ({name} configuration, {rows[0]['params']:,} "
            f"parameters, {args.threads} threads; process peak resident set {PROCESS_PEAK['mib'] / 1024:.1f} GiB)")
    print(head + "\n\n" + table)
    if args.out:
        args.out.write_text(head + "\n\n" + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
