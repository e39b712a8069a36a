"""The exact operators' parameter snapshot (issue 22, section 3).

* The snapshot is one flat buffer in layout order: a forward-mode tangent taken from a flat column is used by
  ``make_dual`` as it is (no parameter-sized copy per product, which at GPT-2 scale was 650 MB per product),
  and products over several batches are unchanged.
* ``snapshot=False`` holds the model's own tensors (no copy of parameters, frozen parameters or buffers) and
  gives the snapshot's numbers, and every evaluation after an in-place change of any of them raises.
"""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from torch import nn

from curvkit.architectures import causal_lm
from curvkit.curvature import GGNOperator, HessianOperator, MCFisherOperator
from curvkit.curvature._functional import cols_to_params
from curvkit.likelihoods import CrossEntropy


def _lm() -> nn.Module:
    return causal_lm(vocab_size=30, max_len=6, dim=8, depth=1, heads=2, mlp_dim=16, seed=0, dtype=torch.float64)


def _data(batches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, 30, (2, 6), generator=g), torch.randint(0, 30, (2, 6), generator=g))
            for _ in range(batches)]


def _op(batches: int = 1, **kwargs: object) -> GGNOperator:
    data = _data(batches)
    return GGNOperator(_lm(), CrossEntropy("sum"), data[0] if batches == 1 else data, **kwargs)  # type: ignore[arg-type]


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


OPERATORS = {"ggn": GGNOperator, "hessian": HessianOperator, "mc_fisher": MCFisherOperator}


@pytest.mark.parametrize("kind", sorted(OPERATORS))
@pytest.mark.parametrize("batches", [1, 2])
def test_live_operator_equals_the_snapshot_and_holds_no_copy(kind: str, batches: int) -> None:
    model, data = _lm(), _data(batches)
    cls, lik = OPERATORS[kind], CrossEntropy("sum")
    ref, live = (cls(model, lik, data[0] if batches == 1 else data, snapshot=s) for s in (True, False))
    V = torch.randn(ref.layout.dim, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(live @ V, ref @ V)
    torch.testing.assert_close(live @ V[:, 0], ref @ V[:, 0])
    torch.testing.assert_close(live.quadratic_form(V), ref.quadratic_form(V))
    torch.testing.assert_close(live.diagonal().flat, ref.diagonal().flat)
    held = {t.data_ptr() for t in live.params} | {t.data_ptr() for t in live.fmodel.buffers.values()}
    assert held == {p.data_ptr() for p in model.parameters()} | {b.data_ptr() for b in model.buffers()}
    assert not {t.data_ptr() for t in ref.params} & {p.data_ptr() for p in model.parameters()}


def _step(model: nn.Module) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(_data(1)[0][0]).sum().backward()
    opt.step()


def test_live_operator_refuses_every_evaluation_after_an_optimiser_step() -> None:
    live, snap = _op(snapshot=False), _op()
    v = torch.randn(live.layout.dim, dtype=torch.float64)
    before = live @ v
    _step(live.fmodel.module)
    _step(snap.fmodel.module)
    for evaluate in (lambda: live @ v, lambda: live.quadratic_form(v), lambda: live.diagonal(),
                     lambda: live.trace("hutchinson", num_probes=2), lambda: live.to_dense()):
        with pytest.raises(RuntimeError, match=r"changed in place after the GGNOperator was built with "
                                               r"snapshot=False.*snapshot=True"):
            evaluate()
    torch.testing.assert_close(snap @ v, before)  # the snapshot keeps the construction point


def test_live_operator_sees_in_place_changes_of_frozen_parameters_and_buffers() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Tanh(), nn.Linear(4, 2)).double().eval()
    model[0].weight.requires_grad_(False)
    data = (torch.randn(5, 3, dtype=torch.float64), torch.randint(0, 2, (5,)))
    v = torch.randn(sum(p.numel() for p in model.parameters() if p.requires_grad), dtype=torch.float64)
    for change in (lambda: model[0].weight.mul_(2.0), lambda: model.train()(data[0])):
        with torch.no_grad():
            op = GGNOperator(model, CrossEntropy("sum"), data, snapshot=False)
            torch.testing.assert_close(op @ v, GGNOperator(model, CrossEntropy("sum"), data) @ v)
            change()
        model.eval()
        with pytest.raises(RuntimeError, match=r"'(0\.weight|1\.\w+)' of the model was changed in place"):
            op @ v


def test_snapshot_argument_is_validated() -> None:
    with pytest.raises(ValueError, match=r"snapshot must be True .* or False .*got 'no'"):
        _op(snapshot="no")
