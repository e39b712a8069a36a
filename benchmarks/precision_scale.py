"""bf16 model with float32 curvature statistics against the float32 model (issue 31, item 3).

Model: the ``benchmarks/gpt2_scale.py`` GPT-2 (width 768, 12 heads, the full 50,257-token vocabulary, untied
``lm_head``, eager attention, eval mode, seed 0) with ``--layers`` blocks (default 2, to keep the run short on a
shared CPU; ``--layers 12`` is GPT-2-small), batch ``--batch`` x ``--tokens`` random ids (seed 1). Arms, each
for the float32 model and for the model cast to bfloat16 (curvkit's default precision policy: passes in bf16,
statistics, factors, inverses and the posterior in float32):

* ``KFAC``: ``KroneckerEstimator(curvature="kfac")`` on every layer, ``update`` + ``operator()``;
* ``LoRA Laplace``: rank-8 ``peft`` LoRA adapters (float32 in both arms: peft keeps them float32 on a bf16
  base, the Laplace-LoRA setting) on every ``attn.c_attn``, everything else frozen (bf16 base in the bf16 arm);
  ``Laplace(structure="kron", curvature="kfac").fit`` then the log marginal likelihood.

Time: CPU seconds of the process (``time.process_time``, every thread), best of ``--repeats``; beside it the wall
seconds of the same calls, best of ``--repeats``, and the threads kept busy (CPU / wall time, median over the
calls); peak memory: the increase of the resident set during the call (``_common.peak_rss_delta``). Ratios: bf16 /
float32 of the same arm in the same run (CPU time). Run: ``OMP_NUM_THREADS=2 .venv/bin/python benchmarks/precision_scale.py``.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import cpu_fields, fmt_busy, fmt_mib, peak_rss_delta


def build(layers: int, batch: int, tokens: int, lora: bool, dtype: torch.dtype) -> tuple[Any, dict, torch.Tensor]:
    from transformers import GPT2Config, GPT2LMHeadModel

    from curvkit.hf import HuggingFace

    cfg = GPT2Config(n_layer=layers, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).eval().to(dtype)
    if lora:  # peft keeps the adapters in float32 on a bf16 base (autocast_adapter_dtype); injected into model
        import warnings

        from peft import LoraConfig, get_peft_model

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # GPT-2's Conv1D: fan_in_fan_out set to True
            get_peft_model(model, LoraConfig(r=8, target_modules=["c_attn"], lora_dropout=0.0))
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (batch, tokens + 1), generator=g)
    X = {"input_ids": ids[:, :-1].contiguous(), "position_ids": torch.arange(tokens).expand(batch, tokens).contiguous()}
    return HuggingFace(model), X, ids[:, 1:].contiguous()


def arm(name: str, hf: Any, X: dict, y: torch.Tensor) -> Any:
    from curvkit.curvature.estimators import KroneckerEstimator
    from curvkit.laplace import Laplace
    from curvkit.likelihoods import CrossEntropy

    if name == "KFAC":
        return lambda: KroneckerEstimator(hf, CrossEntropy("mean"), "kfac").update((X, y)).operator()
    return lambda: Laplace(hf, CrossEntropy("mean"), "kron", "kfac").fit((X, y)).log_marginal_likelihood()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    rows = []
    for name in ("KFAC", "LoRA Laplace"):
        res = {}
        for dtype in (torch.float32, torch.bfloat16):
            hf, X, y = build(args.layers, args.batch, args.tokens, name.startswith("LoRA"), dtype)
            fn = arm(name, hf, X, y)
            print(f"{name} {dtype}: built", file=sys.stderr, flush=True)
            times, walls = [], []
            for _ in range(args.repeats):
                c0, t0 = time.process_time(), time.perf_counter()
                fn()
                walls.append(time.perf_counter() - t0)
                times.append(time.process_time() - c0)
            mem = peak_rss_delta(fn)["peak_delta_mib"]
            weights = sum(p.numel() * p.element_size() for p in hf.parameters()) / 2**20
            res[dtype] = (min(times), mem, weights, min(walls), cpu_fields(walls, times)["threads_busy"])
            del hf
        (t32, m32, w32, wall32, b32), (t16, m16, w16, wall16, b16) = res[torch.float32], res[torch.bfloat16]
        rows.append(f"| {name} | {t32:.2f} | {t16:.2f} | {t16 / t32:.2f} | {wall32:.2f} | {wall16:.2f} | "
                    f"{fmt_busy(b32)} | {fmt_busy(b16)} | {fmt_mib(m32)} | {fmt_mib(m16)} | "
                    f"{m16 / m32 if m16 and m32 else float('nan'):.2f} | {w32:.0f} | {w16:.0f} |")
    print(f"GPT-2 width 768, {args.layers} layers, vocabulary 50,257, batch {args.batch} x {args.tokens} tokens, "
          f"torch threads {torch.get_num_threads()}; best of {args.repeats} call(s)\n")
    print("| arm | fp32 CPU s | bf16 CPU s | bf16/fp32 | fp32 wall s | bf16 wall s | fp32 threads busy | "
          "bf16 threads busy | fp32 peak MiB | bf16 peak MiB | bf16/fp32 | fp32 weights MiB | bf16 weights MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
