"""Kronecker Laplace decomposes an input factor shared by several blocks once: layers fed by one input (q and k
projections; LoRA's ``lora_A`` on q and v of every LLM layer, 2,048 wide on TinyLlama) have equal input factors,
and one eigendecomposition serves all of them. The log marginal likelihood and the GLM variances equal those of
the same posterior with nothing reused, to 1e-12."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from curvkit.laplace import Laplace, _blocks
from curvkit.likelihoods import CrossEntropy

DT = torch.float64


class TwoReaders(nn.Module):
    """q and k read the same input x; the head reads their combination."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.out = nn.Linear(5, 4), nn.Linear(5, 4), nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.q(x) * self.k(x)))


@pytest.mark.parametrize("prior_form", ["factored", "exact"])
def test_a_shared_input_factor_is_decomposed_once(monkeypatch: pytest.MonkeyPatch, prior_form: str) -> None:
    torch.manual_seed(0)
    model = TwoReaders().to(DT)
    X, y = torch.randn(9, 5, dtype=DT), torch.randint(0, 3, (9,))
    la = Laplace(model, CrossEntropy("mean"), structure="kron", curvature="kflr", prior_form=prior_form).fit([(X, y)])
    calls: list[tuple[int, ...]] = []
    real = _blocks.psd_eigh

    def counting(M: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        calls.append(tuple(M.shape))
        return real(M, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(_blocks, "psd_eigh", counting)
    separate = copy.deepcopy(la)
    mll = la.log_marginal_likelihood()
    assert calls.count((6, 6)) == 1  # q's and k's input factor (5 inputs and the bias), once
    assert calls.count((5, 5)) == 1  # the head's
    for blk in separate.blocks:  # each block on its own: nothing reused
        blk._inputs = []
    calls.clear()
    torch.testing.assert_close(separate.log_marginal_likelihood(), mll, rtol=1e-12, atol=1e-12)
    assert calls.count((6, 6)) == 2
    Xt = torch.randn(4, 5, dtype=DT)
    torch.testing.assert_close(separate.functional_variance(Xt)[1], la.functional_variance(Xt)[1], rtol=1e-12,
                               atol=1e-12)

