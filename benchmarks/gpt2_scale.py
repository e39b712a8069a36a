"""Curvature at GPT-2-small scale on one CPU (issue 22, section 3).

Model: ``transformers.GPT2LMHeadModel`` from the default ``GPT2Config`` (12 layers, width 768, 12 heads,
``n_positions`` 1024, the full 50,257-token vocabulary; about 124 M parameters, 163 M with the untied output
layer), random weights (seed 0), eager attention, eval mode (no dropout), float32, wrapped by
``curvkit.hf.HuggingFace``. ``tie_word_embeddings=False`` (all but the ``tied`` arms): the output layer ``lm_head`` is a
separate (50,257 x 768) weight, as in the first runs of this benchmark (when tied weights were refused); the
exact products are measured on the same untied model. Batch: 2 sequences of 128
random token ids (seed 1), next-token targets random too, ``position_ids`` with the batch dimension (the
position embedding's Kronecker block needs per-sample inputs: ``curvkit.hf``). Loss: softmax cross-entropy,
mean over the 256 tokens. The ``tied`` arms use GPT-2 as it ships, ``tie_word_embeddings=True`` (124 M
parameters): the tied ``wte``/``lm_head`` weight is one Kronecker block that is the sum of two terms
(``KroneckerBlock.second``, docs/architecture.md "Shared and tied weights").

Arms (each in its own fresh process, run one after the other; ``--threads`` torch threads, 2 by default):

* ``gradient``: one loss + gradient pass (math attention, as every curvature arm runs): the unit of time
  and memory;
* ``curvkit GGN``: ``GGNOperator`` (forward-mode tangents), construction + first product, then steady
  products with fixed random vectors; ``curvkit GGN uncached``: ``cache_linearisation=False`` (no forward
  graph held between products: each product repeats the forward pass); ``curvkit GGN reverse``:
  ``reverse_tangents=True``; ``curvkit GGN live`` (and ``live uncached``): ``snapshot=False``, the operator
  holds the model's own parameters instead of a copy (as curvlinops' operators do);
* ``curvlinops GGN`` / ``curvlinops Hessian``: ``GGNLinearOperator`` / ``HessianLinearOperator`` on the
  same model with the logits flattened to (tokens, vocabulary) and the targets to (tokens,);
* ``curvkit KFAC expand`` / ``curvkit KFAC reduce``: ``KroneckerEstimator(curvature="kfac")`` (one Monte
  Carlo label per token) on EVERY layer (GPT-2's ``Conv1D`` as transposed Linear blocks, LayerNorm exact
  2 x 2 blocks, both embeddings with diagonal input factors, ``lm_head``), ``update`` + ``operator()``
  (the factors, incl. the thin eigendecomposition of ``lm_head``'s low-rank output factor: no
  50,257 x 50,257 matrix is formed, ``docs/architecture.md`` "Low-rank output factors"), then products
  ``op @ v``; with ``--inverse`` also once a damped inverse product ``op.inverse(1e-3) @ v`` (with every
  factor's eigendecomposition: about 60 dense eigendecompositions of up to 3,073 x 3,073, minutes on this
  CPU).

* ``tied gradient`` / ``tied KFAC expand`` / ``tied GaussNewton`` / ``tied Kronecker Laplace``: the tied model,
  every parameter trainable: its gradient pass (the unit of these rows), the KFAC operator (expand) and a
  product, one ``GaussNewton`` step (``curvature='auto'``: KFAC) and a Kronecker Laplace fit then its log
  marginal likelihood (the pair's log-determinant through the generalised eigendecompositions);
* ``LoRA gradient`` / ``LoRA Kronecker Laplace`` / ``LoRA GaussNewton``: the model with rank-8 LoRA adapters
  (``curvkit.architectures.add_lora``) on every ``attn.c_attn`` (GPT-2's fused query/key/value ``Conv1D``) and
  every other parameter frozen (294,912 trainable parameters): a gradient pass over the adapters (the unit of
  these rows), ``Laplace(structure="kron", curvature="kfac")`` fitted on the batch (then the log marginal
  likelihood), the same fit then its linearised (GLM) predictive at every token of the batch over the whole
  vocabulary (``predict(link="mc")``: 10 posterior draws pushed through the network by forward-mode
  products, ``sampler="jvp"``, no Jacobian and no V x V matrix), one ``GaussNewton`` step (``curvature="auto"``: KFAC for per-token outputs; alpha* and rho
  from exact products through the whole model, 50,257-way softmax included).

Every worker first runs three gradient passes (warm-up, then two timed): each arm's ratio is to the gradient
pass of its own process. Times are CPU seconds of the process (``time.process_time``, all its threads): the
cost of the computation, which other jobs time-slicing the shared cores do not inflate (wall-clock seconds
are recorded in the JSON too); the workers run with ``OMP_WAIT_POLICY=PASSIVE`` (unless set), so threads
waiting for a descheduled sibling do not spin. Peak memory: the increase of the resident set during the call
(``_common.peak_rss_delta``; the model, batch and vectors are held before), in MiB and as a ratio to the
gradient pass's from the ``gradient`` worker; the absolute peak is that plus the resident set before.

Run: ``OMP_NUM_THREADS=2 nice -n 10 .venv/bin/python benchmarks/gpt2_scale.py --out scale.md --json
scale.json``. ``--tiny`` (a 2-layer, width-32, vocabulary-300 GPT-2; workers in-process) is the smoke mode
the test suite runs (``tests/test_benchmarks_scale.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import fmt_mib, fmt_ratio, fmt_seconds, peak_rss_delta, run_worker

ARMS = ("gradient", "curvkit GGN", "curvkit GGN uncached", "curvkit GGN reverse", "curvkit GGN live",
        "curvkit GGN live uncached", "curvlinops GGN", "curvlinops Hessian",
        "curvkit KFAC expand", "curvkit KFAC reduce", "LoRA gradient", "LoRA Kronecker Laplace", "LoRA GLM predictive",
        "LoRA GaussNewton", "tied gradient", "tied KFAC expand", "tied GaussNewton", "tied Kronecker Laplace")
GLM_SAMPLES = 10
LORA_RANK = 8
TINY = {"n_layer": 2, "n_embd": 32, "n_head": 2, "vocab_size": 300, "n_positions": 64}


# ============================================================================ worker side
def build(spec: dict[str, Any]) -> tuple[Any, dict[str, torch.Tensor], torch.Tensor]:
    """(curvkit-wrapped model, batch mapping, targets) as the module docstring; for the ``LoRA`` arms the model
    is a copy with rank-``LORA_RANK`` adapters on every ``attn.c_attn`` and everything else frozen."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from curvkit.hf import HuggingFace

    tied = spec["arm"].startswith("tied")
    cfg = GPT2Config(**(TINY if spec["tiny"] else {}), tie_word_embeddings=tied, attn_implementation="eager")
    torch.manual_seed(0)  # transformers initialises with the global RNG; the worker is its own process
    model = GPT2LMHeadModel(cfg).eval()
    B, T = spec["batch"], spec["tokens"]
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (B, T + 1), generator=g)
    batch = {"input_ids": ids[:, :-1].contiguous(), "position_ids": torch.arange(T).expand(B, T).contiguous()}
    if spec["arm"].startswith("LoRA"):
        from curvkit.architectures import add_lora

        model = add_lora(model, LORA_RANK, targets=lambda n, m: n.endswith("attn.c_attn"), seed=0)
    return HuggingFace(model), batch, ids[:, 1:].contiguous()


class Ids(torch.nn.Module):
    """The model as a function of the token ids alone ((B, T) -> (B, T, V) logits; position ids 0..T-1 with
    the batch dimension): for ``Laplace.fit``/``predict`` and ``GaussNewton.step``, which take a tensor."""

    def __init__(self, hf: torch.nn.Module):
        super().__init__()
        self.hf = hf

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[-1], device=ids.device).expand(ids.shape)
        out: torch.Tensor = self.hf({"input_ids": ids, "position_ids": positions})
        return out


class Flat(torch.nn.Module):
    """curvlinops' view of the model: input ids in, logits flattened to (tokens, vocabulary) out, run with the
    kernels curvkit's products use (math attention)."""

    def __init__(self, hf: torch.nn.Module, position_ids: torch.Tensor):
        super().__init__()
        self.hf = hf
        self.position_ids = position_ids

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        from curvkit.structure import curvature_kernels

        with curvature_kernels():
            out = self.hf({"input_ids": ids, "position_ids": self.position_ids})
        return out.reshape(-1, out.shape[-1])


def gradient_pass(hf: Any, batch: dict[str, torch.Tensor], y: torch.Tensor) -> Any:
    from curvkit.structure import curvature_kernels

    params = [p for p in hf.parameters() if p.requires_grad]
    with curvature_kernels():
        logits = hf(batch)
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return torch.autograd.grad(loss, params)


def make_arm(arm: str, hf: Any, batch: dict[str, torch.Tensor], y: torch.Tensor,
             spec: dict[str, Any]) -> tuple[Any, Any]:
    """(construct, product) of one arm: ``construct()`` builds a fresh operator (or estimator + operator),
    ``product(op)`` is one steady-state call."""
    params = [p for p in hf.parameters() if p.requires_grad]
    gen = torch.Generator().manual_seed(2)
    v_list = [torch.randn(p.shape, generator=gen) for p in params]
    v_flat = torch.cat([v.reshape(-1) for v in v_list])
    if arm.startswith("curvkit GGN"):
        from curvkit.curvature import GGNOperator
        from curvkit.likelihoods import CrossEntropy

        words = arm.split()[2:]
        kw: dict[str, Any] = {"reverse_tangents": "reverse" in words, "snapshot": "live" not in words}
        if "uncached" in words:
            kw["cache_linearisation"] = False
        return (lambda: GGNOperator(hf, CrossEntropy("mean"), (batch, y), **kw)), (lambda op: op @ v_flat)
    if arm.startswith("curvlinops"):
        import curvlinops as cl

        flat = Flat(hf, batch["position_ids"])
        Op = cl.GGNLinearOperator if arm == "curvlinops GGN" else cl.HessianLinearOperator
        ce = torch.nn.CrossEntropyLoss(reduction="mean")
        data = [(batch["input_ids"], y.reshape(-1))]
        return ((lambda: Op(flat, ce, params, data, check_deterministic=False, num_data=y.shape[0])),
                (lambda op: op @ v_list))
    if arm == "tied Kronecker Laplace":  # every parameter, the tied wte/lm_head as one two-term block
        from curvkit.laplace import Laplace
        from curvkit.likelihoods import CrossEntropy

        net = Ids(hf)
        return ((lambda: Laplace(net, CrossEntropy("mean"), structure="kron", curvature="kfac")
                 .fit([(batch["input_ids"], y)])), (lambda la: la.log_marginal_likelihood().detach()))
    if arm == "tied GaussNewton":  # every parameter; construction: the optimiser, 'product': one step
        from curvkit.likelihoods import CrossEntropy
        from curvkit.optim import GaussNewton

        net = Ids(hf)
        return ((lambda: GaussNewton(params, model=net, likelihood=CrossEntropy("mean"))),
                (lambda gn: torch.as_tensor(float(gn.step(batch=(batch["input_ids"], y))))))
    if arm.startswith("curvkit KFAC") or arm == "tied KFAC expand":
        from curvkit.curvature import KroneckerEstimator
        from curvkit.likelihoods import CrossEntropy

        sharing = arm.rsplit(" ", 1)[1]  # 'tied KFAC expand': the tied head and embedding as one pair block

        def construct() -> Any:
            est = KroneckerEstimator(hf, CrossEntropy("mean"), "kfac", weight_sharing=sharing,
                                     output_factor=spec["output_factor"], seed=0)
            return est.update((batch, y)).operator()
        return construct, (lambda op: op @ v_flat)
    if arm == "LoRA Kronecker Laplace":  # fit on the batch; 'product': the log marginal likelihood
        from curvkit.laplace import Laplace
        from curvkit.likelihoods import CrossEntropy

        net = Ids(hf)
        return ((lambda: Laplace(net, CrossEntropy("mean"), structure="kron", curvature="kfac")
                 .fit([(batch["input_ids"], y)])), (lambda la: la.log_marginal_likelihood().detach()))
    if arm == "LoRA GLM predictive":  # fit; 'product': the linearised predictive over the whole vocabulary
        from curvkit.laplace import Laplace
        from curvkit.likelihoods import CrossEntropy

        net = Ids(hf)
        return ((lambda: Laplace(net, CrossEntropy("mean"), structure="kron", curvature="kfac")
                 .fit([(batch["input_ids"], y)])),
                (lambda la: la.predict(batch["input_ids"], link="mc", num_samples=GLM_SAMPLES,
                                       generator=torch.Generator().manual_seed(4))))
    if arm == "LoRA GaussNewton":  # construction: the optimiser; 'product': one step (KFAC, alpha*, rho)
        from curvkit.likelihoods import CrossEntropy
        from curvkit.optim import GaussNewton

        net = Ids(hf)
        return ((lambda: GaussNewton(params, model=net, likelihood=CrossEntropy("mean"))),
                (lambda gn: torch.as_tensor(float(gn.step(batch=(batch["input_ids"], y))))))
    raise ValueError(f"unknown arm {arm!r}")


def worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One arm: the gradient pass of this process (warm-up + 2 timed), then construction + first product
    (time and peak memory) and ``steady`` products (median time, peak of the last)."""
    torch.set_num_threads(spec["threads"])
    hf, batch, y = build(spec)
    d = sum(p.numel() for p in hf.parameters() if p.requires_grad)
    gradient_pass(hf, batch, y)
    grads, walls = [], []
    for _ in range(2):
        t0, w0 = time.process_time(), time.perf_counter()
        gradient_pass(hf, batch, y)
        grads.append(time.process_time() - t0)
        walls.append(time.perf_counter() - w0)
    out: dict[str, Any] = {"num_params": d, "grad_s": statistics.median(grads), "grad_wall_s": statistics.median(walls)}
    if spec["arm"] in ("gradient", "LoRA gradient", "tied gradient"):
        out["first"] = peak_rss_delta(lambda: gradient_pass(hf, batch, y))
        return out
    construct, product = make_arm(spec["arm"], hf, batch, y, spec)
    holder: dict[str, Any] = {}

    def first() -> Any:
        t0, w0 = time.process_time(), time.perf_counter()
        holder["op"] = construct()
        holder["construct_s"], holder["construct_wall_s"] = time.process_time() - t0, time.perf_counter() - w0
        t0, w0 = time.process_time(), time.perf_counter()
        value = product(holder["op"])
        holder["first_s"], holder["first_wall_s"] = time.process_time() - t0, time.perf_counter() - w0
        return value

    out["first"] = peak_rss_delta(first)
    out.update({k: v for k, v in holder.items() if k.endswith("_s")})
    steady, walls = [], []
    for _ in range(spec["steady"]):
        t0, w0 = time.process_time(), time.perf_counter()
        value = product(holder["op"])
        steady.append(time.process_time() - t0)
        walls.append(time.perf_counter() - w0)
    out["steady_s"] = statistics.median(steady) if steady else None
    out["steady_wall_s"] = statistics.median(walls) if walls else None
    out["steady"] = peak_rss_delta(lambda: product(holder["op"])) if steady else {}
    if spec["arm"].startswith("curvkit KFAC") and spec["inverse"]:  # a damped inverse product, with every eigh
        v = torch.randn(holder["op"].layout.dim, generator=torch.Generator().manual_seed(3))
        timer: dict[str, float] = {}

        def inverse() -> Any:
            t0 = time.process_time()
            result = holder["op"].inverse(1e-3) @ v
            timer["inverse_s"] = time.process_time() - t0
            return result

        out["inverse"] = peak_rss_delta(inverse)
        out["inverse_s"] = timer["inverse_s"]
    flat = value if isinstance(value, torch.Tensor) else torch.cat([t.reshape(-1) for t in value])
    out["value"] = float(flat.norm())
    return out


# ============================================================================ driver
def render(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> str:
    d = next((r["num_params"] for r in results.values() if "num_params" in r), None)
    gmem = results.get("gradient", {}).get("first", {}).get("peak_delta_mib")
    lines = [f"{'tiny GPT-2' if args.tiny else 'GPT-2-small'} ({d:,} parameters), batch {args.batch} x "
             f"{args.tokens} tokens\n" if d else "",
             "| arm | gradient pass (same process) | construction (KFAC: update + operator) | construction + 1st "
             "product | steady product | peak MiB (construction + 1st) | peak MiB (steady) | absolute peak MiB | "
             "KFAC: inverse(1e-3) @ v (eigh), peak MiB | value |", "|---|---|---|---|---|---|---|---|---|---|"]
    for arm, r in results.items():
        if "error" in r:
            lines.append(f"| {arm} | failed: {r['error'][:160]} | | | | | | | | |")
            continue
        g = r["grad_s"]
        mem_f = r.get("first", {}).get("peak_delta_mib")
        before = r.get("first", {}).get("rss_before_mib")
        absolute = "-" if mem_f is None or before is None else fmt_mib(mem_f + before)
        if arm in ("gradient", "LoRA gradient", "tied gradient"):
            lines.append(f"| {arm} | {fmt_seconds(g)} = 1x | | | | {fmt_mib(mem_f)} = 1x | | {absolute} | | |")
            continue

        def cell(t: float | None, g: float = g) -> str:
            return "-" if t is None else f"{fmt_seconds(t)} ({fmt_ratio(t / g)})"

        family = arm.split()[0] if arm.startswith(("LoRA", "tied")) else None
        unit = (results.get(f"{family} gradient", {}).get("first", {}).get("peak_delta_mib") if family
                else gmem)  # a LoRA arm's unit: the gradient pass over the adapters; a tied arm's: the tied model's

        def mcell(m: float | None, unit: float | None = unit) -> str:
            return f"{fmt_mib(m)} ({fmt_ratio(m / unit) if m is not None and unit else '-'})"

        first = r["construct_s"] + r["first_s"]
        steady_mem = r.get("steady", {})
        peaks = [m + b for m, b in ((mem_f, before), (steady_mem.get("peak_delta_mib"), steady_mem.get("rss_before_mib")))
                 if m is not None and b is not None]
        absolute = fmt_mib(max(peaks)) if peaks else "-"
        inv = (f"{cell(r['inverse_s'])}, {fmt_mib(r.get('inverse', {}).get('peak_delta_mib'))}"
               if "inverse_s" in r else "")
        lines.append(f"| {arm} | {fmt_seconds(g)} | {cell(r['construct_s'])} | {cell(first)} | "
                     f"{cell(r.get('steady_s'))} | {mcell(mem_f)} | "
                     f"{mcell(steady_mem.get('peak_delta_mib'))} | {absolute} | {inv} | {r['value']:.5g} |")
    lines.append("")
    lines.append("Times: CPU seconds of the process (all threads); in parentheses / the gradient pass of the same "
                 "process (LoRA arms: over the adapters, every other parameter frozen). 'construction + 1st product' = a fresh operator's cost (KFAC: update + operator() + "
                 "one product op @ v; LoRA Kronecker Laplace: the fit, then the log marginal likelihood; LoRA GLM "
                 "predictive: the fit, then the predictive; LoRA "
                 "GaussNewton: the optimiser, then one step); steady = median of "
                 f"{args.steady}. Peak memory: increase of the resident set during the call, in parentheses / the "
                 f"gradient pass's. torch threads {args.threads}; float32; CPU. KFAC output factor: "
                 f"{args.output_factor!r}.\n")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--tiny", action="store_true", help="a tiny GPT-2, workers in-process (smoke test)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--steady", type=int, default=2, help="steady-state products per arm")
    parser.add_argument("--arms", default=",".join(ARMS))
    parser.add_argument("--inverse", action="store_true",
                        help="KFAC arms: also time op.inverse(1e-3) @ v (every factor's eigendecomposition; on by "
                             "default with --tiny)")
    parser.add_argument("--output-factor", default="auto", choices=("auto", "dense", "low_rank"),
                        help="KroneckerEstimator's output_factor for the KFAC arms")
    parser.add_argument("--out", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    if args.tiny:
        args.tokens = min(args.tokens, 16)
    arms = [a for a in args.arms.split(",") if a]
    if "gradient" not in arms:
        arms = ["gradient", *arms]
    bad = [a for a in arms if a not in ARMS]
    if bad:
        parser.error(f"unknown arms {bad}; choose from {ARMS}")
    from _common import require_library

    if not args.tiny:  # (the smoke test checks its imports itself: no fresh interpreters)
        require_library("Hugging Face model", "transformers", "gpt2_scale.py")
    import importlib.util

    if any(a.startswith("curvlinops") for a in arms) and (
            importlib.util.find_spec("curvlinops") is None if args.tiny
            else not require_library("curvlinops", "curvlinops", "gpt2_scale.py", optional=True)):
        print("curvlinops is not installed: its arms are left out", file=sys.stderr)
        arms = [a for a in arms if not a.startswith("curvlinops")]
    from curvkit.experiments._report import machine_info

    # OpenMP threads wait passively: on a shared machine spinning threads inflate the CPU time measured
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    common = {"inverse": args.inverse or args.tiny, "tiny": args.tiny, "threads": args.threads, "batch": args.batch, "tokens": args.tokens,
              "steady": args.steady, "output_factor": args.output_factor}
    start = time.time()
    results: dict[str, dict[str, Any]] = {}
    for a in arms:
        spec = {**common, "arm": a}
        if args.tiny:
            results[a] = worker(spec)
        else:
            results[a] = run_worker(__file__, spec, timeout=1800)
        print(f"{a}: {json.dumps({k: v for k, v in results[a].items() if k.endswith('_s') or k == 'error'})}",
              file=sys.stderr, flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps({"results": results, "args": vars(args)}, indent=1))
    info = {**machine_info(), "torch_threads": args.threads}
    load = os.getloadavg()
    text = render(results, args)
    text += ("\nMachine: " + ", ".join(f"{k} {v}" for k, v in info.items())
             + f"; load average at the end {load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min)"
             + f"; wall time {(time.time() - start) / 60:.1f} min\n")
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"results": results, "machine": info, "args": vars(args)}, indent=1))
    failed = [a for a, r in results.items() if "error" in r]
    return 1 if args.tiny and failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
