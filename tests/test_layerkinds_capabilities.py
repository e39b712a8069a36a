"""The optional capabilities of the layer-kind handlers, which the routes outside the Kronecker estimators query
instead of module types or kind names (docs/architecture.md, "Capabilities"), each against plain autograd in float64:

* ``bilinear`` + ``tangent``: the handler's forward-mode rule equals ``torch.func.jvp`` of the module in its
  input and parameters, for k directions at once, with and without an input tangent and with frozen parameters;
* ``squares`` + ``squared_gradients``: the sum of the squared per-sample gradients of R back-propagated vectors,
  against one autograd gradient per sample and vector; the inputs and modules the rule refuses;
* ``paired_rows``: the Kronecker filters take exactly the layers whose handler says so, a newly registered kind
  included (and its numbers are those of the built-in kind it computes like).
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jvp
from torch.nn import functional as F

from curvkit import layerkinds
from curvkit.layerkinds import LinearHandler, handler_for
from curvkit.optim.filters import KFNatGrad, KFWhiten

pytestmark = pytest.mark.usefixtures("float64_default")

GEN = torch.Generator().manual_seed(0)


def _randn(*shape: int) -> Tensor:
    return torch.randn(*shape, generator=GEN)


BILINEAR = {
    "linear": (lambda: nn.Linear(4, 3), (5, 4)),
    "linear-positions": (lambda: nn.Linear(4, 3, bias=False), (5, 2, 6, 4)),
    "conv1d-same-reflect": (lambda: nn.Conv1d(2, 4, 3, padding="same", padding_mode="reflect"), (5, 2, 7)),
    "conv2d-groups": (lambda: nn.Conv2d(4, 6, 3, stride=2, padding=1, dilation=1, groups=2), (3, 4, 7, 7)),
    "conv3d-circular": (lambda: nn.Conv3d(2, 3, 2, padding=1, padding_mode="circular"), (3, 2, 3, 4, 3)),
}


@pytest.mark.parametrize("name", list(BILINEAR))
@pytest.mark.parametrize("terms", ["all", "no-input-tangent", "frozen-weight", "input-only"])
def test_tangent_rule_equals_jvp(name, terms):
    make, shape = BILINEAR[name]
    torch.manual_seed(0)
    mod = make()
    handler, _ = handler_for(mod)
    assert handler is not None and handler.bilinear(mod)
    k = 3
    x = _randn(*shape)
    params = dict(mod.named_parameters())
    t = None if terms in ("no-input-tangent",) else _randn(k, *shape)
    tangents = {} if terms == "input-only" else {a: _randn(k, *p.shape) for a, p in params.items()}
    if terms == "frozen-weight":
        del tangents["weight"]
    values = {a: p.detach() for a, p in params.items()}
    got = handler.tangent(mod, x, t, values, tangents)
    assert got is not None

    def f(inp: Tensor, ps: dict[str, Tensor]) -> Tensor:
        return functional_call(mod, ps, (inp,))

    for j in range(k):
        dx = t[j] if t is not None else torch.zeros_like(x)
        dp = {a: tangents[a][j] if a in tangents else torch.zeros_like(v) for a, v in values.items()}
        ref = jvp(f, (x, values), (dx, dp))[1]
        torch.testing.assert_close(got[j], ref, atol=1e-12, rtol=0)


def test_tangent_rule_without_any_direction_is_none():
    mod = nn.Linear(3, 2)
    handler, _ = handler_for(mod)
    assert handler.tangent(mod, _randn(4, 3), None, {"weight": mod.weight.detach()}, {}) is None


SQUARES = {
    "linear": (lambda: nn.Linear(4, 3), (5, 4)),
    "linear-no-bias": (lambda: nn.Linear(4, 3, bias=False), (5, 4)),
    "conv2d": (lambda: nn.Conv2d(2, 3, 3, stride=2, padding=1, padding_mode="replicate"), (4, 2, 6, 6)),
    "conv1d": (lambda: nn.Conv1d(2, 3, 3, padding="same", dilation=2), (4, 2, 7)),
    "conv3d": (lambda: nn.Conv3d(2, 3, 2, stride=(1, 2, 1), padding=1, bias=False), (3, 2, 3, 4, 3)),
}


@pytest.mark.parametrize("name", list(SQUARES))
def test_squared_gradients_equal_per_sample_autograd(name):
    make, shape = SQUARES[name]
    torch.manual_seed(0)
    mod = make()
    handler, _ = handler_for(mod)
    x = _randn(*shape)
    assert handler.squares(mod) and handler.squares(mod, x)
    out = mod(x)
    R = 2
    deltas = _randn(R, *out.shape)
    got = handler.squared_gradients(mod, x, deltas)
    params = dict(mod.named_parameters())
    assert set(got) == set(params)
    ref = {a: torch.zeros_like(p) for a, p in params.items()}
    for r in range(R):
        for n in range(shape[0]):
            grads = torch.autograd.grad((mod(x[n:n + 1])[0] * deltas[r, n]).sum(), list(params.values()))
            for a, g in zip(params, grads):
                ref[a] += g**2
    for a in params:
        torch.testing.assert_close(got[a], ref[a], atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("mod, x, expect", [
    (nn.Linear(4, 3), _randn(2, 5, 4), False),  # positions: a sample's gradient sums them
    (nn.Conv2d(4, 4, 3, groups=2), None, False),  # grouped: one block per group
    (nn.Conv1d(2, 3, 3), None, True),
    (nn.LayerNorm(3), None, False),  # no rule
    (nn.Embedding(5, 3), None, False),
])
def test_squared_gradient_rule_is_declined_where_it_does_not_apply(mod, x, expect):
    handler, _ = handler_for(mod)
    assert handler.squares(mod, x) is expect


@pytest.mark.parametrize("name", ["conv1d", "conv3d"])
def test_exact_diagonal_of_convolutions_takes_the_squared_gradient_route(name):
    """A model whose every parameter is in a layer with the rule: the batched-backward diagonal, equal to the
    dense float64 GGN's diagonal."""
    from curvkit.curvature import GGNOperator
    from curvkit.likelihoods import CrossEntropy
    from reference import dense_ggn

    torch.manual_seed(0)
    if name == "conv1d":
        model = nn.Sequential(nn.Conv1d(2, 3, 3, padding=1, padding_mode="circular"), nn.Tanh(),
                              nn.Conv1d(3, 2, 2, stride=2), nn.Flatten(), nn.Linear(6, 3))
        X = _randn(5, 2, 7)
    else:
        model = nn.Sequential(nn.Conv3d(2, 2, 2, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(2 * 4 * 3 * 4, 3))
        X = _randn(5, 2, 3, 2, 3)
    data = (X, torch.randint(0, 3, (5,), generator=GEN))
    lik = CrossEntropy("sum")
    op = GGNOperator(model, lik, data)
    torch.testing.assert_close(op.diagonal().flat, dense_ggn(model, lik, data).diagonal(), atol=1e-12, rtol=0)
    assert op._layer_specs  # the route ran


def test_kinds_that_take_sharded_weights_say_so():
    """Only kinds whose statistics never read the layer's parameters take FSDP2 shards (the estimators ask
    ``takes_shards``, never a kind's name)."""
    taking = {h.kind for h in layerkinds.registered().values() if h.takes_shards}
    assert taking == {"linear", "conv", "embedding", "norm"}
    assert not layerkinds.AttentionHandler.takes_shards and not layerkinds.TransposedLinearHandler.takes_shards
    assert not layerkinds.ParameterHandler.takes_shards and not layerkinds.ModuleHandler.takes_shards


def test_capabilities_default_to_none_for_kinds_without_rules():
    for mod in (nn.LayerNorm(3), nn.Embedding(5, 3), nn.MultiheadAttention(4, 2), nn.GroupNorm(1, 2)):
        handler, _ = handler_for(mod)
        assert not handler.bilinear(mod) and not handler.squares(mod) and handler.paired_rows(mod) is None
    assert handler_for(nn.Linear(2, 2))[0].paired_rows(nn.Linear(2, 2)) == "samples"
    assert handler_for(nn.Conv2d(2, 2, 1))[0].paired_rows(nn.Conv2d(2, 2, 1)) == "positions"
    assert handler_for(nn.Conv1d(2, 2, 1))[0].paired_rows(nn.Conv1d(2, 2, 1)) == "positions"
    assert handler_for(nn.Conv2d(2, 2, 1, groups=2))[0].paired_rows(nn.Conv2d(2, 2, 1, groups=2)) is None


class OwnLinear(nn.Linear):
    """A Linear layer with a forward of its own (so it does not inherit nn.Linear's handler)."""

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class NoRows(LinearHandler):
    """A Linear handler that declares no paired rows."""

    def paired_rows(self, module: nn.Module):
        return None


@pytest.fixture
def registered_own_linear():
    """Registers a handler for :class:`OwnLinear` for one test and removes it afterwards (no global change)."""
    def register(handler):
        layerkinds.register(OwnLinear, handler)

    yield register
    layerkinds._REGISTRY.pop(OwnLinear, None)


def _two_layers(cls: type[nn.Linear]) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(cls(4, 5), nn.Tanh(), nn.Linear(5, 3))


@pytest.mark.parametrize("opt_cls", [KFWhiten, KFNatGrad])
def test_filters_take_the_layers_whose_handler_has_paired_rows(opt_cls, registered_own_linear):
    """A kind registered with paired rows is a Kronecker layer of the filters, with the numbers of nn.Linear;
    registered without them, it gets the diagonal form."""
    X, y = _randn(6, 4), torch.randint(0, 3, (6,), generator=GEN)
    runs = {}
    for label, cls, handler in (("builtin", nn.Linear, None), ("own", OwnLinear, LinearHandler()),
                                ("own-no-rows", OwnLinear, NoRows())):
        if handler is not None:
            registered_own_linear(handler)
        model = _two_layers(cls)
        opt = opt_cls(model.parameters(), model=model)
        for _ in range(2):
            opt.zero_grad()
            F.cross_entropy(model(X), y).backward()
            opt.step()
        runs[label] = ([r.name for r in opt.layers], [d.name for d in opt.diagonal],
                       [p.detach().clone() for p in model.parameters()])
        opt.close()
    assert runs["builtin"][:2] == runs["own"][:2] == (["0", "2"], [])
    assert all(torch.equal(a, b) for a, b in zip(runs["builtin"][2], runs["own"][2]))
    assert runs["own-no-rows"][:2] == (["2"], ["0.weight", "0.bias"])
