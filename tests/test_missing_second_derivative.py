"""Hessian products of a MobileNetV3-style model (issue 31, item 6): PyTorch has no second derivative of
``hardsigmoid`` (no double backward, no forward-over-reverse), so HessianOperator raises curvkit's error naming
the module and the alternatives; the GGN of the same model equals its dense reference (float64, atol 1e-12),
and the same functions written with ``relu6`` have a Hessian equal to the dense reference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from curvkit.curvature import GGNOperator, HessianOperator
from curvkit.likelihoods import CrossEntropy
from reference import dense_ggn_flat, dense_hessian_ror

D64 = torch.float64
ATOL = 1e-12


class HardSigmoid6(nn.Module):  # nn.Hardsigmoid written with relu6: the same function, every derivative
    def forward(self, x):
        return F.relu6(x + 3) / 6


class HardSwish6(nn.Module):
    def forward(self, x):
        return x * F.relu6(x + 3) / 6


class SqueezeExcite(nn.Module):
    def __init__(self, c: int, gate: nn.Module):
        super().__init__()
        self.fc1, self.fc2, self.gate = nn.Conv2d(c, 2, 1), nn.Conv2d(2, c, 1), gate

    def forward(self, x):
        return x * self.gate(self.fc2(torch.relu(self.fc1(x.mean((2, 3), keepdim=True)))))


class MiniMobileNetV3(nn.Module):
    def __init__(self, native: bool = True):
        super().__init__()
        self.stem = nn.Conv2d(1, 4, 3, padding=1)
        self.act = nn.Hardswish() if native else HardSwish6()
        self.se = SqueezeExcite(4, nn.Hardsigmoid() if native else HardSigmoid6())
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(self.se(self.act(self.stem(x))).mean((2, 3)))


def models_and_data():
    torch.manual_seed(0)
    native = MiniMobileNetV3().to(D64)
    rewritten = MiniMobileNetV3(native=False).to(D64)
    rewritten.load_state_dict(native.state_dict())
    g = torch.Generator().manual_seed(1)
    return native, rewritten, (torch.randn(4, 1, 6, 6, generator=g, dtype=D64), torch.randint(0, 3, (4,), generator=g))


@pytest.mark.filterwarnings("ignore:HessianOperator. double backward failed:RuntimeWarning")
def test_hessian_names_the_module_and_the_alternatives():
    native, _, data = models_and_data()
    H = HessianOperator(native, CrossEntropy(), data)
    v = torch.ones(H.layout.dim, dtype=D64)
    with pytest.raises(NotImplementedError, match=r"module 'se\.gate' \(Hardsigmoid\) runs aten::hardsigmoid.*GGNOperator"
                       r".*relu6"):
        H @ v


def test_ggn_and_the_rewritten_hessian_equal_dense_references():
    native, rewritten, data = models_and_data()
    lik = CrossEntropy()
    v = torch.randn(sum(p.numel() for p in native.parameters()), dtype=D64, generator=torch.Generator().manual_seed(2))
    G = GGNOperator(native, lik, data)
    torch.testing.assert_close(G @ v, dense_ggn_flat(native, lik, data) @ v, atol=ATOL, rtol=0)
    # (torch's hardsigmoid_backward multiplies by 1/6 rounded to float32 even in float64: 5e-9 relative)
    torch.testing.assert_close(G @ v, GGNOperator(rewritten, lik, data) @ v, atol=0, rtol=1e-7)
    H = HessianOperator(rewritten, lik, data)
    torch.testing.assert_close(H @ v, dense_hessian_ror(rewritten, lik, data) @ v, atol=ATOL, rtol=0)
