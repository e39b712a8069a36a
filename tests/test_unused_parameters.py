"""A trainable parameter the output does not depend on (issue 25, item 4): every exact operator, the
diagonal estimator and every Laplace fit warn once, naming the parameters; the Kronecker routes refuse an
uncalled layer with an error naming it. The curvature of such a parameter is exactly zero (checked against
the dense GGN), and a model without one gives no warning."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from curvkit.curvature import EmpiricalFisherOperator, FisherOperator, GGNOperator, HessianOperator
from curvkit.curvature._graph import UnusedParameterWarning
from curvkit.curvature.estimators import DiagonalEstimator, KroneckerEstimator
from curvkit.curvature.exact import MCFisherOperator
from curvkit.laplace import Laplace
from curvkit.likelihoods import CrossEntropy
from reference import dense_ggn

DT = torch.float64
UNUSED = r"\['unused.weight', 'unused.bias'\] are not in the graph of the model output"


class UnusedHead(nn.Module):
    """A body and a head that produce the output, and a second head that nothing calls."""

    def __init__(self):
        super().__init__()
        self.body, self.head, self.unused = nn.Linear(4, 5), nn.Linear(5, 3), nn.Linear(5, 3)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)))


class MergedLoRA(nn.Module):
    """A LoRA layer whose fused fast path (``merged=True``) bypasses the adapters."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(4, 3).requires_grad_(False)
        self.lora_A, self.lora_B = nn.Parameter(0.1 * torch.randn(2, 4)), nn.Parameter(0.1 * torch.randn(3, 2))
        self.bias = nn.Parameter(torch.zeros(3))
        self.merged = True

    def forward(self, x):
        out = self.base(x) + self.bias
        return out if self.merged else out + x @ self.lora_A.T @ self.lora_B.T


def _model(cls=UnusedHead):
    torch.manual_seed(0)
    return cls().double()


def _data(n=6):
    g = torch.Generator().manual_seed(0)
    return torch.randn(n, 4, generator=g, dtype=DT), torch.randint(0, 3, (n,), generator=g)


def _one_warning(record, match):
    hits = [w for w in record if issubclass(w.category, UnusedParameterWarning)]
    assert len(hits) == 1, [str(w.message) for w in hits]
    assert re.search(match, str(hits[0].message)), str(hits[0].message)
    assert hits[0].filename == __file__                       # points at the user's call


OPERATORS = {
    "ggn": lambda m, d: GGNOperator(m, CrossEntropy(), d),
    "hessian": lambda m, d: HessianOperator(m, CrossEntropy(), d),
    "fisher": lambda m, d: FisherOperator(m, CrossEntropy(), d),
    "mc_fisher": lambda m, d: MCFisherOperator(m, CrossEntropy(), d, seed=0),
    "empirical": lambda m, d: EmpiricalFisherOperator(m, CrossEntropy(), d),
}


@pytest.mark.parametrize("kind", list(OPERATORS))
@pytest.mark.parametrize("batches", [1, 2])  # 1: read off the kept construction graph; 2: a fresh forward pass
def test_every_exact_operator_warns_once_naming_the_unused_parameters(kind, batches):
    model, data = _model(), _data()
    first, second = (data, [data, data]) if batches == 1 else ([data, data], data)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        op = OPERATORS[kind](model, first)
        OPERATORS[kind](model, second)                        # a second operator on the same model: no repeat
    _one_warning(record, rf"{type(op).__name__}: trainable parameter\(s\) {UNUSED}")
    d = op.diagonal().tensors
    names = list(op.layout.names)
    assert not d[names.index("unused.weight")].any() and not d[names.index("unused.bias")].any()


def test_the_unused_parameters_have_exactly_zero_curvature_in_the_dense_reference():
    model, data = _model(), _data()
    with pytest.warns(UnusedParameterWarning):
        G = GGNOperator(model, CrossEntropy("sum"), data).to_dense()
    ref = dense_ggn(model, CrossEntropy("sum"), data)
    torch.testing.assert_close(G, ref)
    assert not ref[-18:].any() and not ref[:, -18:].any()     # unused.weight (15) and unused.bias (3) last


def test_the_diagonal_estimator_warns_once_over_many_batches():
    model, (X, y) = _model(), _data(12)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        DiagonalEstimator(model, CrossEntropy(), "ggn").update([(X[:4], y[:4]), (X[4:8], y[4:8]), (X[8:], y[8:])])
    _one_warning(record, rf"GGNOperator: trainable parameter\(s\) {UNUSED}")


@pytest.mark.parametrize("structure,curvature", [("diag", "ggn"), ("diag", "mc_fisher"), ("full", "ggn")])
def test_laplace_fit_warns_once_naming_the_unused_parameters(structure, curvature):
    model, (X, y) = _model(), _data(12)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        post = Laplace(model, CrossEntropy(), structure, curvature).fit([(X[:6], y[:6]), (X[6:], y[6:])])
    _one_warning(record, rf"Laplace.fit: trainable parameter\(s\) {UNUSED}")
    lam = post.prior_precision[post.layer_names.index("unused")]
    diag = dict(zip(post.layout.names, post.precision().diagonal().tensors))
    assert (diag["unused.weight"] == lam).all() and (diag["unused.bias"] == lam).all()   # the prior only


def test_an_adapter_bypassed_by_a_fused_path_is_named():
    model, data = _model(MergedLoRA), _data()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        Laplace(model, CrossEntropy(), "diag", "ggn", subset=["lora_A", "lora_B", "bias"]).fit(data)
    _one_warning(record, r"Laplace.fit: trainable parameter\(s\) \['lora_A', 'lora_B'\] are not in the graph")
    model.merged = False
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedParameterWarning)
        GGNOperator(model, CrossEntropy(), data)              # every parameter used now: silent


def test_kronecker_routes_refuse_an_uncalled_layer_by_name():
    model, data = _model(), _data()
    with pytest.raises(ValueError, match="module 'unused' was called 0 times"):
        KroneckerEstimator(model, CrossEntropy(), "kflr").update(data)
    with pytest.raises(ValueError, match="module 'unused' was called 0 times"), pytest.warns(UnusedParameterWarning):
        Laplace(model, CrossEntropy(), "kron").fit(data)


def test_no_warning_when_the_output_uses_every_trainable_parameter(make_mlp):
    model = make_mlp((4, 5, 3), "tanh")
    model[0].requires_grad_(False)                            # frozen and unused-by-gradient is not "unused"
    with warnings.catch_warnings():
        warnings.simplefilter("error", UnusedParameterWarning)
        GGNOperator(model, CrossEntropy(), _data()).diagonal()
        Laplace(model, CrossEntropy(), "kron").fit(_data())
