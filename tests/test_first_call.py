"""The first curvature product in a fresh process imports nothing heavy (issue 35, "The first call").

torch imports its compiler stack (``torch._dynamo``) on the first forward-mode rule of an elementwise
product, and sympy with its symbolic-shape helpers on the first ``torch.autograd.grad`` given explicit
``grad_outputs``: seconds of a notebook's first call. In a fresh interpreter, after a training step with a
hand-written update (a torch optimizer imports ``torch._dynamo`` itself), a GGN product on a small
transformer and Kronecker factors must leave both unimported, with the same numbers as the forward-mode route.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from curvkit.curvature._vjp import vector_grad

SCRIPT = r"""
import json, sys, torch
from curvkit.architectures import causal_lm
from curvkit.curvature.estimators import KroneckerEstimator
from curvkit.curvature.exact import GGNOperator
from curvkit.likelihoods import CrossEntropy
m = causal_lm(vocab_size=16, max_len=8, dim=8, depth=1, heads=2, mlp_dim=16, seed=0, dtype=torch.float64)
g = torch.Generator().manual_seed(0)
X = torch.randint(0, 16, (3, 8), generator=g); y = torch.randint(0, 16, (3, 8), generator=g)
loss = torch.nn.functional.cross_entropy(m(X).reshape(-1, 16), y.reshape(-1)); loss.backward()
with torch.no_grad():
    for p in m.parameters():
        p.sub_(0.01 * p.grad)
v = torch.randn(sum(p.numel() for p in m.parameters()), generator=g, dtype=torch.float64)
first = GGNOperator(m, CrossEntropy(), (X, y)) @ v
KroneckerEstimator(m, CrossEntropy()).update((X, y)).operator()
clean = {k: k not in sys.modules for k in ("torch._dynamo", "sympy", "torch.fx.experimental.symbolic_shapes")}
import torch._dynamo  # now forward mode is used
later = GGNOperator(m, CrossEntropy(), (X, y)) @ v
print(json.dumps({**clean, "err": float((first - later).abs().max() / later.abs().max())}))
"""


def test_first_product_imports_no_compiler_stack() -> None:
    src = str(Path(__file__).resolve().parent.parent / "src")
    env = {**os.environ, "PYTHONPATH": src + os.pathsep + os.environ.get("PYTHONPATH", "")}
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res.pop("err") < 1e-12
    assert all(res.values()), res


def test_vector_grad_equals_autograd_grad() -> None:
    g = torch.Generator().manual_seed(0)
    W = torch.randn(4, 3, dtype=torch.float64, generator=g, requires_grad=True)
    x = torch.randn(5, 4, dtype=torch.float64, generator=g)
    f = (x @ W).tanh()
    h = f.sin()
    V = torch.randn(5, 3, dtype=torch.float64, generator=g)
    U = torch.randn(5, 3, dtype=torch.float64, generator=g)
    ref = torch.autograd.grad([f, h], W, [V, U], retain_graph=True)[0]
    with torch.no_grad():  # the caller's grad mode does not matter
        got = vector_grad([f, h], W, [V, U], retain_graph=True)[0]
    assert torch.equal(got, ref)
    u = torch.zeros_like(f, requires_grad=True)  # double backward through the vector
    JTu = vector_grad(f, W, u, create_graph=True, retain_graph=True)[0]
    Jv = vector_grad(JTu, u, V[:4, :3].new_ones(4, 3))[0]
    ref_Jv = torch.autograd.grad(torch.autograd.grad(f, W, u, create_graph=True)[0], u, torch.ones(4, 3,
                                 dtype=torch.float64))[0]
    assert torch.allclose(Jv, ref_Jv, rtol=0, atol=1e-14)
