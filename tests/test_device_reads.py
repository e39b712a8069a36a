"""Issue 35, "what it would be on a GPU": a Gauss-Newton step reads values back from the device (``.item()``,
``bool(t)``, ``float(t)``: each stalls a GPU's queue until it is empty) a number of times that does not grow with
the number of layers. Checks that used to read per parameter or per block (the objective's weight decay, the
gradient's and the update's finiteness, the factored-damping split, the zero blocks, the Cholesky factors, the
replayed primals of the quadratic model, the quadratic model's dot products) read once; their errors still name
the parameter or factor at fault."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from curvkit.likelihoods import CrossEntropy
from curvkit.linalg.kron import KroneckerBlock, KroneckerOperator
from curvkit.linalg.krylov import NotPositiveDefiniteError
from curvkit.linalg.layout import ParamLayout
from curvkit.optim import GaussNewton
from curvkit.optim.second_order.direction import FactoredInverse
from curvkit.optim.second_order.gauss_newton import FAST_ADAPTATION
from curvkit.validation import first_nonfinite


class Reads(TorchDispatchMode):
    """Counts the reads of values from the device (``aten._local_scalar_dense``)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket.__name__ == "_local_scalar_dense":
            self.count += 1
        return func(*args, **(kwargs or {}))


def _reads_per_5_steps(hidden: int) -> int:
    torch.manual_seed(0)
    layers: list[nn.Module] = [nn.Linear(6, 8), nn.Tanh()]
    for _ in range(hidden):
        layers += [nn.Linear(8, 8), nn.LayerNorm(8), nn.Tanh()]
    model = nn.Sequential(*layers, nn.Linear(8, 3)).double()
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(16, 6, generator=g, dtype=torch.float64), torch.randint(0, 3, (16,), generator=g)
    opt = GaussNewton(model.parameters(), model=model, likelihood=CrossEntropy(), curvature="kfac",
                      weight_decay=1e-4, **FAST_ADAPTATION)
    for _ in range(5):
        opt.step(batch=(X, y))
    reads = Reads()
    with reads:
        for _ in range(5):  # one period of every interval (zeta's search on the 5th step)
            opt.step(batch=(X, y))
    return reads.count


def test_a_step_reads_the_device_as_often_for_two_layers_as_for_eight():
    """Five steps (tau every step, zeta's three-candidate search on one): the same number of reads for an MLP
    with 1 and with 7 hidden Linear + LayerNorm layers (before: about 8 reads per parameter and block per
    step, 290 per step on the ViT of ``reproduce modern``, 22 now: benchmarks/step_costs.py)."""
    shallow, deep = _reads_per_5_steps(1), _reads_per_5_steps(7)
    assert deep == shallow, (shallow, deep)
    assert shallow <= 5 * 40


def test_first_nonfinite_names_the_first_tensor_at_fault():
    ok = [torch.ones(3), torch.zeros(2, 2)]
    assert first_nonfinite(ok) is None and first_nonfinite([]) is None
    assert first_nonfinite([*ok, torch.tensor([1.0, float("nan")]), torch.tensor([float("inf")])]) == 2


def test_a_nan_gradient_is_refused_by_name_and_nothing_changes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3)).double()
    X, y = torch.randn(8, 4, dtype=torch.float64), torch.randint(0, 3, (8,))
    opt = GaussNewton(model.parameters(), model=model, likelihood=CrossEntropy(), curvature="kfac")
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model[2].bias.register_hook(lambda g: g * float("nan"))
    with pytest.raises(FloatingPointError, match=r"the gradient of 2\.bias contains NaN or inf; nothing was changed"):
        opt.step(batch=(X, y))
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_factor_that_damping_cannot_make_positive_definite_is_named():
    """All blocks' Cholesky factorisations are checked in one read; the error names the first failed factor."""
    layout = ParamLayout(("a", "b"), (torch.Size([2, 3]), torch.Size([2, 2])))
    eye = lambda n: torch.eye(n, dtype=torch.float64)  # noqa: E731
    good = KroneckerBlock(eye(2), eye(3), "a")
    bad = KroneckerBlock(-100 * eye(2), eye(2), "b")  # G = -100 I: no damping of 1 makes it positive
    op = KroneckerOperator(layout, [good, bad])
    with pytest.raises(NotPositiveDefiniteError, match=r"factor 'b' G is not positive definite after damping"):
        FactoredInverse(op, 1.0, [1.0, 1.0])
    FactoredInverse(KroneckerOperator(layout, [good, KroneckerBlock(eye(2), eye(2), "b")]), 1.0, [1.0, 1.0])
