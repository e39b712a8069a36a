"""KFNatGrad / KFBayes keep the Kronecker posterior on layers whose per-example gradient has rank > 1: a Linear
layer shared over positions (inputs (B, T, in)) and a groups=1 convolution (its output locations). One step equals
a reference written from the equations with E_n, the per-example gradient of the layer's [W | b] computed by
torch.func per-sample gradients (not from the filter's captured rows): the drift (Eq. 28), the data step of
kron_math.project_first_order_rows written out from E_n, the rebalancing and W += Sd' G Sx'. Float64."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.func import functional_call, grad, vmap
from torch.nn import functional as F

from curvkit.optim.filters import KFBayes, KFNatGrad
from reference import kron_filter_step

pytestmark = pytest.mark.usefixtures("float64_default")


class Tokens(nn.Module):
    """(B, T, 3) -> Linear -> tanh -> Linear -> (B, T, 2) per-position logits (a transformer's projections)."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(3, 4), nn.Linear(4, 2, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.tanh(self.up(x)))


class Conv(nn.Module):
    """(B, 2, 4, 4) -> Conv2d (3 x 3, padding 1) -> tanh -> mean over locations -> Linear: (B, 2)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.head = nn.Conv2d(2, 3, 3, padding=1), nn.Linear(3, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.conv(x)).mean((2, 3)))


def _data(name: str, B: int = 5):
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    if name == "tokens":
        return Tokens().double(), torch.randn(B, 6, 3, generator=g), torch.randint(0, 2, (B, 6), generator=g)
    return Conv().double(), torch.randn(B, 2, 4, 4, generator=g), torch.randint(0, 2, (B,), generator=g)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The summed negative log-likelihood of the batch (per position for the token model)."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1), reduction="sum")


def _per_example_matrices(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per layer the per-example gradients E_n = d(-loss_n)/d[W | b] (B, M, N), by torch.func."""
    params = {n: p.detach() for n, p in model.named_parameters()}

    def one(p, x, t):
        return -_loss(functional_call(model, p, (x[None],)), t[None])

    gs = vmap(grad(one), in_dims=(None, 0, 0))(params, X, y)
    out = {}
    for name, m in model.named_children():
        E = gs[f"{name}.weight"].reshape(X.shape[0], m.weight.shape[0], -1)
        if m.bias is not None:
            E = torch.cat([E, gs[f"{name}.bias"][:, :, None]], 2)
        out[name] = E
    return out


@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("sequential", [True, False])
@pytest.mark.parametrize("cls", [KFNatGrad, KFBayes])
@pytest.mark.parametrize("name", ["tokens", "conv"])
def test_one_step_equals_the_per_example_gradient_reference(name, cls, sequential, exact):
    model, X, y = _data(name)
    B = X.shape[0]
    k = 3  # fisher_samples: the first 3 examples, their E_n scaled by sqrt(B / 3)
    kw = {"s0": 0.3, "fisher_samples": k, "sample_update": "sequential" if sequential else "batched",
          "projection": "exact" if exact else "first_order"}
    eta, sigma2 = 0.0, math.inf
    if cls is KFBayes:
        eta, sigma2 = 0.2, 4.0
        kw.update(lr=eta, sigma2=sigma2)
    Es = _per_example_matrices(model, X, y)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = cls(model.parameters(), model=model, reduction="mean", **kw)
    assert not opt.diagonal and sorted(r.name for r in opt.layers) == sorted(Es)  # no diagonal form left
    (_loss(model(X), y) / B).backward()
    opt.step()
    assert not opt.diagonal
    decay = 1.0 - eta**2 / (2 * sigma2)
    factors = opt.factors()
    for name_, m in model.named_children():
        E = Es[name_]
        G = E.sum(0)  # the ascent gradient of the summed log-likelihood
        N = E.shape[2]
        S0 = torch.eye(N) * math.sqrt(0.3), torch.eye(E.shape[1]) * math.sqrt(0.3)
        Sx, Sd, inc = kron_filter_step(*S0, E[:k] * math.sqrt(B / k), G, eta, sigma2, sequential, exact)
        torch.testing.assert_close(factors[name_][0], Sx, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(factors[name_][1], Sd, rtol=1e-10, atol=1e-12)
        W = before[f"{name_}.weight"].reshape(m.weight.shape[0], -1)
        if m.bias is not None:
            W = torch.cat([W, before[f"{name_}.bias"][:, None]], 1)
        want = decay * (W + inc)
        got = m.weight.detach().reshape(m.weight.shape[0], -1)
        if m.bias is not None:
            got = torch.cat([got, m.bias.detach()[:, None]], 1)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    opt.close()


def test_one_row_per_example_keeps_the_rank_one_route():
    """A Linear layer on (B, in) inputs has T = 1 and takes the rank-one route (its own tests); a Linear on (B, 1, in)
    inputs has T = 1 too: the two give the same step."""
    torch.manual_seed(1)
    a = nn.Linear(3, 2).double()
    b = nn.Linear(3, 2).double()
    b.load_state_dict(a.state_dict())
    X, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    for m, x in ((a, X), (b, X[:, None])):
        opt = KFNatGrad(m.parameters(), model=m, s0=0.2)
        F.cross_entropy(m(x).reshape(4, 2), y).backward()
        opt.step()
        opt.close()
    torch.testing.assert_close(a.weight, b.weight, rtol=0, atol=1e-15)
