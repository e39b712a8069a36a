"""Consumers that factorise an output factor themselves refuse a low-rank one (a layer with more than
``LOW_RANK_OUTPUTS`` outputs under ``output_factor='auto'``) with curvkit's error, naming the layer and the
fixes, before anything is changed; frozen, the same layer is no obstacle."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from curvkit.continual.laplace import LaplacePenalty
from curvkit.curvature.estimators import LOW_RANK_OUTPUTS
from curvkit.laplace import Laplace
from curvkit.likelihoods import CrossEntropy
from curvkit.optim import GaussNewton
from curvkit.optim.natural_gradient import NaturalGradient
from curvkit.structure import UnsupportedModelError

WIDE = LOW_RANK_OUTPUTS + 8


def wide_model() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, WIDE))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    X = torch.randn(6, 3, generator=g)
    y = torch.randint(0, WIDE, (6,), generator=g)
    return model, X, y


def consumers(model: nn.Module, X: torch.Tensor, y: torch.Tensor) -> dict[str, object]:
    lik = CrossEntropy()
    return {
        "GaussNewton": lambda: GaussNewton(model.parameters(), model=model, likelihood=lik,
                                           curvature="kfac").step(batch=(X, y)),
        "Laplace(structure='kron')": lambda: Laplace(model, lik, structure="kron", curvature="kfac").fit([(X, y)]),
        "LaplacePenalty(curvature='kron')": lambda: LaplacePenalty(curvature="kron", method="kfac", task_size=6,
                                                                   likelihood=lik).consolidate(model, [(X, y)]),
        "NaturalGradient(fisher='kfac')": lambda: NaturalGradient(model.parameters(), model=model, likelihood=lik,
                                                                  fisher="kfac"),
    }


@pytest.mark.parametrize("name", ["GaussNewton", "Laplace(structure='kron')", "LaplacePenalty(curvature='kron')",
                                  "NaturalGradient(fisher='kfac')"])
def test_low_rank_output_factor_is_refused_naming_layer_and_fixes(name: str) -> None:
    model, X, y = wide_model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UnsupportedModelError) as err:
        consumers(model, X, y)[name]()  # type: ignore[operator]
    msg = str(err.value)
    assert name in msg and "module '2' (Linear)" in msg and f"{WIDE} outputs" in msg
    assert "requires_grad_(False)" in msg and "output_factor='dense'" in msg
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k]), k


def test_frozen_wide_layer_is_no_obstacle() -> None:
    model, X, y = wide_model()
    model[2].requires_grad_(False)
    gn = GaussNewton([p for p in model.parameters() if p.requires_grad], model=model, likelihood=CrossEntropy(),
                     curvature="kfac")
    assert torch.isfinite(torch.as_tensor(gn.step(batch=(X, y))))
    la = Laplace(model, CrossEntropy(), structure="kron", curvature="kfac").fit([(X, y)])
    assert torch.isfinite(la.log_marginal_likelihood())
