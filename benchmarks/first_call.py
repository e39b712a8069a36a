"""The first curvature call of a fresh process, and the GLM predictive of a sequence model (issue 35).

* ``first``: in a fresh interpreter (``--worker``), the byte-level GPT of ``benchmarks/modern_kfac.py``
  (470,528 parameters, 16 x 64 tokens), one gradient pass, then four fresh ``GGNOperator`` products in a row
  (construction + one product each), in gradient passes of the same process; ``--src`` names the curvkit
  source to import (e.g. another checkout, for a before/after in one run).
* ``predictive``: a Kronecker Laplace on all its weights, then the probit GLM predictive of the 16 x 64
  tokens: ``auto`` (forward-mode draws above ``JVP_OUTPUTS`` outputs per sample, 100 draws) against the exact
  variances (``sampler='covariance'``, on one sequence, times 16), wall and CPU time.

Run: ``flock /tmp/curvkit-bench.lock .venv/bin/python benchmarks/first_call.py [--src DIR ...]``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _gpt() -> tuple:
    import torch

    from curvkit.architectures import causal_lm

    torch.set_num_threads(1)
    m = causal_lm(vocab_size=256, max_len=64, dim=128, depth=2, heads=4, mlp_dim=512, seed=0, dtype=torch.float32)
    text = b"".join(p.read_bytes() for p in sorted((ROOT / "docs").glob("*.md")))
    data = torch.tensor(list(text), dtype=torch.long)
    starts = torch.randperm(data.numel() - 65, generator=torch.Generator().manual_seed(0))[:16]
    seqs = torch.stack([data[s:s + 65] for s in starts.tolist()])
    X, y = seqs[:, :-1].contiguous(), seqs[:, 1:].contiguous()
    params = list(m.parameters())

    def grad() -> None:
        out = m(X)
        torch.autograd.grad(torch.nn.functional.cross_entropy(out.reshape(-1, 256), y.reshape(-1)), params)

    grad()
    t = time.perf_counter()
    grad()
    return m, X, y, time.perf_counter() - t


def first() -> None:
    import torch

    from curvkit.curvature.exact import GGNOperator
    from curvkit.likelihoods import CrossEntropy

    m, X, y, tg = _gpt()
    v = torch.randn(sum(p.numel() for p in m.parameters()), generator=torch.Generator().manual_seed(1))
    cells = []
    for _ in range(4):
        t = time.perf_counter()
        GGNOperator(m, CrossEntropy(), (X, y)) @ v
        cells.append(f"{time.perf_counter() - t:.2f} s ({(time.perf_counter() - t) / tg:.1f})")
    print(" | ".join(cells) + f" | {'yes' if 'torch._dynamo' in sys.modules else 'no'} |")


def predictive() -> None:
    import torch

    from curvkit.laplace import Laplace
    from curvkit.likelihoods import CrossEntropy

    m, X, y, tg = _gpt()
    post = Laplace(m.eval(), CrossEntropy(), structure="kron").fit([(X, y)])

    def timed(label: str, fn, scale: int = 1):  # type: ignore[no-untyped-def]
        c, t = time.process_time(), time.perf_counter()
        r = fn()
        w, cc = (time.perf_counter() - t) * scale, (time.process_time() - c) * scale
        print(f"| {label} | {w:.2f} s | {w / tg:.0f} | {cc:.2f} s |")
        return r

    print(f"gradient pass {tg * 1e3:.0f} ms; load average {os.getloadavg()[0]:.1f}\n")
    print("| probit GLM predictive, 16 x 64 tokens, 256 classes | wall | / gradient pass | CPU |\n|---|---|---|---|")
    a = timed("auto: forward-mode draws (100)", lambda: post.predict(X, generator=torch.Generator().manual_seed(0)))
    b = timed("exact variances (sampler='covariance'; 1 of 16 sequences, x 16)",
              lambda: post.predict(X[:1], sampler="covariance"), 16)
    print(f"\nlargest |auto - exact| probability on sequence 0: {float((a[:1] - b).abs().max()):.4f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", choices=["first", "predictive"])
    parser.add_argument("--src", action="append", default=None, help="curvkit source directories to compare")
    parser.add_argument("--runs", type=int, default=2, help="fresh processes per source for 'first'")
    args = parser.parse_args()
    if args.worker:
        (first if args.worker == "first" else predictive)()
        return 0
    print(f"load average {os.getloadavg()[0]:.2f}\n\n| curvkit source | product 1 (gradient passes) | 2 | 3 | 4 | "
          "torch._dynamo imported |\n|---|---|---|---|---|---|", flush=True)
    for src in args.src or [str(ROOT / "src")]:
        for _ in range(args.runs):
            env = {**os.environ, "PYTHONPATH": src}
            out = subprocess.run([sys.executable, __file__, "--worker", "first"], env=env, capture_output=True,
                                 text=True, timeout=600)
            print(f"| {src} | " + (out.stdout.strip() or out.stderr.strip().splitlines()[-1]), flush=True)
    print()
    env = {**os.environ, "PYTHONPATH": (args.src or [str(ROOT / "src")])[-1]}
    subprocess.run([sys.executable, __file__, "--worker", "predictive"], env=env, timeout=900)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
