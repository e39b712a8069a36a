"""GaussNewton's amortisation options (issue 35): the damped inverses (``inverse_every``) and the quadratic
model of alpha* (``quadratic_every``) at their own intervals, in float64 on tiny models.

* A step between evaluations of the quadratic model runs no Jacobian-vector product and takes the geometric
  mean of the past alpha*s along its own direction: its update is (that alpha) / alpha*_ref times the reference
  step's update (the same direction: same parameters, minibatch and factors), to 1e-12.
* Steps that adapt tau or zeta evaluate the model (they need it).
* ``inverse_every`` holds the factors of the last rebuild; a stopped and resumed run equals the
  uninterrupted one bitwise with both options on.
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from curvkit.likelihoods import CrossEntropy
from curvkit.models import mlp
from curvkit.optim import GaussNewton
from curvkit.optim.second_order import AMORTISED

pytestmark = pytest.mark.usefixtures("float64_default")


def _batches(n: int, seed: int = 7) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(10, 4, generator=g), torch.randint(0, 3, (10,), generator=g)) for _ in range(n)]


def _make(seed: int = 0, **kw):
    net = mlp([4, 5, 3], "tanh", dtype=torch.float64, seed=seed)
    cfg = dict(curvature="kfac", weight_decay=1e-3, seed=11, tau_every=0, zeta_every=0)
    cfg.update(kw)
    return net, GaussNewton(net.parameters(), model=net, likelihood=CrossEntropy(), **cfg)


class _Counting:
    def __init__(self, lin):
        self.lin, self.calls = lin, 0

    def __getattr__(self, name):
        return getattr(self.lin, name)

    def __call__(self, directions):
        self.calls += 1
        return self.lin(directions)


def _params(net) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in net.parameters()])


@pytest.mark.parametrize("curvature", ["kfac", "kflr", "kfra"])
def test_steps_between_quadratic_models_reuse_alpha(curvature):
    batches = _batches(5)
    _, opt = _make(curvature=curvature, quadratic_every=3)
    count = _Counting(opt._linearisation)
    opt._linearisation = count
    calls = []
    for b in batches:
        before = count.calls
        opt.step(batch=b)
        calls.append(count.calls - before)
    assert calls == [1, 0, 1, 0, 0]
    h = opt.history
    assert [r["quadratic"] for r in h] == [True, False, True, False, False]  # step 1, then k divisible by 3
    # the steps in between take the geometric mean of the past alpha*s (moving average of log |alpha*|, 0.9)
    a0, a2 = h[0]["alpha"], h[2]["alpha"]
    assert a0 < 0 and a2 < 0 and a0 != a2
    assert h[1]["alpha"] == pytest.approx(a0, rel=1e-12)
    mean = -math.exp((0.9 * 0.1 * math.log(-a0) + 0.1 * math.log(-a2)) / (0.9 * 0.1 + 0.1))
    assert h[3]["alpha"] == pytest.approx(mean, rel=1e-12) and h[4]["alpha"] == h[3]["alpha"]
    assert h[1]["predicted_change"] is None and h[1]["rho"] is None
    # step 2 against the reference (quadratic model on every step) from the same state: the same direction
    ref_net, ref = _make(curvature=curvature)
    ref.step(batch=batches[0])
    net2, opt2 = _make(curvature=curvature, quadratic_every=3)
    opt2.step(batch=batches[0])
    assert torch.equal(_params(ref_net), _params(net2))
    p0 = _params(net2)
    ref.step(batch=batches[1])
    opt2.step(batch=batches[1])
    ratio = opt2.history[1]["alpha"] / ref.history[1]["alpha"]
    torch.testing.assert_close(_params(net2) - p0, ratio * (_params(ref_net) - p0), rtol=1e-12, atol=1e-14)


def test_damping_adaptation_steps_evaluate_the_quadratic_model():
    _, opt = _make(quadratic_every=4, tau_every=2, zeta_every=3)
    for b in _batches(6):
        opt.step(batch=b)
    # step 1 (first), 2, 4, 6 (tau), 3, 6 (zeta), 4 (quadratic_every); not 5
    assert [r["quadratic"] for r in opt.history] == [True, True, True, True, False, True]
    _, opt = _make(quadratic_every=4, tau_every=4, zeta_every=8)
    for b in _batches(6):
        opt.step(batch=b)
    assert [r["quadratic"] for r in opt.history] == [True, False, False, True, False, False]
    assert opt.history[3]["rho"] is not None


def test_inverse_every_holds_the_factors_of_the_last_rebuild():
    _, opt = _make(ema=0.9, curvature_every=1, inverse_every=3)
    held = []
    for b in _batches(5):
        opt.step(batch=b)
        held.append(opt.curvature().to_dense())
    assert opt.estimator.num_updates == 5
    assert torch.equal(held[0], held[1]) and torch.equal(held[1], held[2]) and not torch.equal(held[2], held[3])
    assert [r["refreshed"] for r in opt.history] == [True, False, False, True, False]


def test_amortised_run_resumes_exactly():
    cfg = dict(ema=0.9, curvature_every=2, inverse_every=4, quadratic_every=3, momentum=True, tau_every=3,
               zeta_every=6)
    batches = _batches(9)
    net_a, opt_a = _make(**cfg)
    for b in batches:
        opt_a.step(batch=b)
    net_b, opt_b = _make(**cfg)
    for b in batches[:5]:
        opt_b.step(batch=b)
    buf = io.BytesIO()
    torch.save({"model": net_b.state_dict(), "opt": opt_b.state_dict()}, buf)
    buf.seek(0)
    ck = torch.load(buf, weights_only=True)
    net_c, opt_c = _make(seed=99, **cfg)
    net_c.load_state_dict(ck["model"])
    opt_c.load_state_dict(ck["opt"])
    for b in batches[5:]:
        opt_c.step(batch=b)
    assert torch.equal(_params(net_a), _params(net_c))
    assert [r["alpha"] for r in opt_a.history[5:]] == [r["alpha"] for r in opt_c.history]


def test_amortisation_options_are_checked():
    with pytest.raises(ValueError, match=r"inverse_every \(3\) must be a multiple of curvature_every \(2\)"):
        _make(curvature_every=2, inverse_every=3)
    with pytest.raises(ValueError, match="quadratic_every"):
        _make(quadratic_every=0)
    _, opt = _make(**AMORTISED)  # the preset is accepted as it is
    opt.step(batch=_batches(1)[0])
