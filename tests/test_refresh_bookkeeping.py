"""The per-refresh bookkeeping of the Kronecker estimators (issue 35, lean factors): the block index maps kept for
the next operator of the same blocks, and one finiteness check of a batch's statistics."""

import pytest
import torch
from torch import nn

from curvkit.curvature.estimators import KroneckerEstimator
from curvkit.likelihoods import CrossEntropy
from curvkit.linalg import block_index
from curvkit.linalg.kron import KroneckerBlock, KroneckerOperator
from curvkit.linalg.layout import ParamLayout


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3)).double()


def test_operators_of_the_same_blocks_reuse_the_checked_index_maps():
    """A refresh builds the same blocks again: the second operator takes the first one's index maps (the same
    objects) and gives the same products; another estimator's blocks of another model do not."""
    net = _net()
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (6,), generator=g)
    est = KroneckerEstimator(net, CrossEntropy(), "kflr").update((X, y))
    first, second = est.operator(), est.operator()
    assert all(a is b for a, b in zip(first._index, second._index))
    v = torch.randn(first.layout.dim, dtype=torch.float64, generator=g)
    torch.testing.assert_close(first @ v, second @ v, rtol=0, atol=0)
    torch.testing.assert_close(second.to_dense(), first.to_dense(), rtol=0, atol=0)
    other = KroneckerEstimator(_net(), CrossEntropy(), "kflr").update((X, y)).operator()
    assert all(a is b for a, b in zip(first._index, other._index))  # equal blocks: a fresh estimator finds them
    torch.testing.assert_close(other @ v, first @ v, rtol=0, atol=0)
    wider = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3)).double()
    third = KroneckerEstimator(wider, CrossEntropy(), "kflr").update((X, y)).operator()
    assert not any(a is b for a, b in zip(first._index, third._index))  # another layout: built and checked


def test_equal_strided_indices_share_the_maps_and_a_shared_row_index_is_not_an_inference_tensor():
    """Two estimators of two copies of an attention model name equal q/k/v slices (StridedIndex, compared by
    value) and the same (1, P) row index of their LayerNorm (one tensor per P, made outside inference mode even
    when the plan is made inside it): the second operator takes the first one's maps and gives the same
    products as the operator of a block set built from scratch."""
    from curvkit.layerkinds._base import row_index

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True, dtype=torch.float64)
            self.norm = nn.LayerNorm(4, dtype=torch.float64)
            self.head = nn.Linear(4, 3, dtype=torch.float64)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.norm(self.attn(x, x, x, need_weights=False)[0]).mean(1))

    g = torch.Generator().manual_seed(2)
    X, y = torch.randn(5, 3, 4, generator=g, dtype=torch.float64), torch.randint(0, 3, (5,), generator=g)
    first = KroneckerEstimator(Attn(), CrossEntropy(), "kflr").update((X, y)).operator()
    with torch.inference_mode():
        assert not row_index(777).is_inference()
    assert row_index(8) is row_index(8)
    block_index._INDEX_MEMO.clear()
    fresh = KroneckerEstimator(Attn(), CrossEntropy(), "kflr").update((X, y)).operator()  # maps built again
    second = KroneckerEstimator(Attn(), CrossEntropy(), "kflr").update((X, y)).operator()
    assert any(type(b.index).__name__ == "StridedIndex" for b in second.blocks)
    assert all(a is b for a, b in zip(fresh._index, second._index))
    v = torch.randn(first.layout.dim, dtype=torch.float64, generator=g)
    torch.testing.assert_close(second @ v, first @ v, rtol=0, atol=0)


def test_an_explicit_index_changed_in_place_is_checked_again():
    """The kept maps are keyed by each explicit index's identity AND version: an index overwritten in place
    after an operator was built is validated again (here it now covers an entry twice)."""
    layout = ParamLayout(("w",), (torch.Size([2, 3]),))
    index = torch.arange(6).reshape(2, 3)
    block = KroneckerBlock(torch.eye(2, dtype=torch.float64), torch.eye(3, dtype=torch.float64), "w", index=index)
    KroneckerOperator(layout, [block])
    index[1, 2] = 0  # entry 0 twice, entry 5 never
    with pytest.raises(ValueError, match=r"covered by 2 Kronecker blocks|not covered|exactly one block"):
        KroneckerOperator(layout, [block])
    assert len(block_index._INDEX_MEMO) <= block_index._INDEX_MEMO_SIZE


def test_a_statistic_that_overflows_is_refused_by_name():
    """Finite outputs but an input factor that overflows float32 (an input of 1e20: x x^T = 1e40): the
    update raises and names the statistic, after one check of all of them."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    X = torch.randn(5, 4)
    X[0, 0] = 1e20
    est = KroneckerEstimator(net, CrossEntropy(), "kfac", seed=0)
    with pytest.raises(ValueError, match=r"the statistic A of block '0' of this batch contains NaN or inf"):
        est.update((X, torch.zeros(5, dtype=torch.long)))
