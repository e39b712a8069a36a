"""``benchmarks/step_costs.py`` (issue 35, "what it would be on a GPU") counts what it says: the kernels and the
device reads of a step. Checked on operations whose counts are known, then on one AdamW step of the small ViT
(one period of 1 step)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import step_costs


def test_counting_separates_kernels_views_reads_and_host_reads():
    a, b = torch.randn(4, 3), torch.randn(3, 5)
    host = torch.tensor(2.0)
    with step_costs.Counting({id(host)}) as c:
        m = a @ b  # one kernel
        v = m.t().reshape(-1)  # views: none (reshape of a transpose copies: one)
        float(v.sum())  # one kernel, one read of the device
        float(host)  # a host tensor's read: not a device read
        torch.linalg.cholesky(torch.eye(3) * 2)  # a factorisation of size 3 (eye, mul, cholesky)
    assert c.syncs == 1 and c.ops["host read"] == 1
    assert c.ops["mm"] == 1 and c.ops["sum"] == 1
    assert c.linalg and max(c.largest.values()) == 3
    assert c.kernels == sum(n for k, n in c.ops.items() if k not in step_costs.METADATA) - 2


def test_an_adamw_step_of_the_small_vit_is_counted():
    r = step_costs.count("modern", "AdamW", steps=1)
    assert 60 < r["kernels"] < 400 and r["syncs"] <= 5 and r["gflop"] > 0.5
