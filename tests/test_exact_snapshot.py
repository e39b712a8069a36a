"""The exact operators' parameter snapshot is one flat buffer in layout order (issue 22, section 3): a
forward-mode tangent taken from a flat column is used by ``make_dual`` as it is (no parameter-sized copy per
product, which at GPT-2 scale was 650 MB per product), and products over several batches are unchanged."""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD

from curvkit.architectures import causal_lm
from curvkit.curvature import GGNOperator
from curvkit.curvature._functional import cols_to_params
from curvkit.likelihoods import CrossEntropy


def _op(batches: int = 1) -> GGNOperator:
    model = causal_lm(vocab_size=30, max_len=6, dim=8, depth=1, heads=2, mlp_dim=16, seed=0, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    data = [(torch.randint(0, 30, (2, 6), generator=g), torch.randint(0, 30, (2, 6), generator=g))
            for _ in range(batches)]
    return GGNOperator(model, CrossEntropy("sum"), data[0] if batches == 1 else data)


def test_forward_mode_tangents_from_a_flat_column_are_not_copied() -> None:
    op = _op()
    M = torch.randn(op.layout.dim, 1, dtype=torch.float64)
    V = cols_to_params(op.layout, M)
    base = op.params[0].untyped_storage().data_ptr()
    assert all(p.untyped_storage().data_ptr() == base for p in op.params)  # one buffer
    with fwAD.dual_level():
        for p, v in zip(op.params, V):
            assert fwAD.unpack_dual(fwAD.make_dual(p, v[0])).tangent.data_ptr() == v[0].data_ptr()


def test_products_over_several_batches_equal_the_sum_of_single_batch_operators() -> None:
    op = _op(batches=3)
    v = torch.randn(op.layout.dim, 2, dtype=torch.float64)
    model = op.fmodel.module
    ref = sum(GGNOperator(model, CrossEntropy("sum"), b) @ v for b in op.batches)
    torch.testing.assert_close(op @ v, ref)
    torch.testing.assert_close(op @ v[:, 0], ref[:, 0])
