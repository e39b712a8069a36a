"""What users pass to Laplace (issue 25): ``subset='last_layer'`` is the layer that produces the output,
found from the forward pass, or an error listing the candidates (item 3); bad ``num_data``, prior
precisions (also as tensors that require grad) and prediction inputs raise curvkit errors naming the
argument, its value and what is expected, and leave the fitted posterior unchanged (item 5).

Dense references: the full-GGN Laplace precision of the chosen parameters is the matching block of the
dense GGN (``tests/reference.py``) plus the prior.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from adapters import headed_raw_lora, module_lora, raw_lora
from curvkit.laplace import Laplace
from curvkit.likelihoods import CrossEntropy
from reference import dense_ggn

DT = torch.float64


def _data(n=12, d=6, classes=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=DT), torch.randint(0, classes, (n,), generator=g)


def _block(model, names):
    """Indices of the parameters ``names`` in the flat trainable layout of ``model``."""
    idx, o = [], 0
    for n, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if n in names:
            idx.extend(range(o, o + p.numel()))
        o += p.numel()
    return torch.tensor(idx)


def _check_full_laplace(model, post, X, y, lam):
    i = _block(model, post.names)
    ref = dense_ggn(model, CrossEntropy("sum"), (X, y))[i][:, i]
    torch.testing.assert_close(post.precision().to_dense(), ref + lam * torch.eye(len(i), dtype=DT))


# ------------------------------------------------------------------------------------------ item 3
def test_last_layer_is_the_head_that_produces_the_output_not_the_last_registered_parameters():
    model, (X, y) = headed_raw_lora(), _data()
    post = Laplace(model, CrossEntropy(), "full", "ggn", subset="last_layer", prior_precision=0.5).fit((X, y))
    assert post.names == ["head.weight", "head.bias"]          # registration order: ['body.lora_B.0', ...]
    _check_full_laplace(model, post, X, y, 0.5)


def test_last_layer_of_a_lora_model_is_the_adapted_output_layer_with_both_adapters():
    model, (X, y) = module_lora(), _data()
    post = Laplace(model, CrossEntropy(), "full", "ggn", subset="last_layer", prior_precision=0.5).fit((X, y))
    assert post.names == ["2.lora_A.weight", "2.lora_B.weight"]  # registration order: ['2.lora_B.weight']
    _check_full_laplace(model, post, X, y, 0.5)
    kron = Laplace(model, CrossEntropy(), "kron", "kflr", subset="last_layer").fit((X, y))
    assert kron.layer_names == ["2.lora_A", "2.lora_B"]


def test_last_layer_of_raw_adapters_stops_with_the_candidates():
    model, (X, y) = raw_lora(), _data()
    post = Laplace(model, CrossEntropy(), "diag", subset="last_layer")
    with pytest.raises(ValueError, match=r"subset='last_layer': no module of RawLoRA short of the whole model "
                                         r"produces its output.*lora_A \(lora_A.0, lora_A.1\); lora_B \(lora_B.0, "
                                         r"lora_B.1\)\. Pass subset=\[\.\.\.\]"):
        post.fit((X, y))
    assert not post.blocks
    named = Laplace(model, CrossEntropy(), "diag", subset=["lora_A.1", "lora_B.1"]).fit((X, y))
    assert named.names == ["lora_A.1", "lora_B.1"]


def test_last_layer_names_are_known_after_fit_and_survive_a_state_dict_round_trip():
    model, (X, y) = headed_raw_lora(), _data()
    post = Laplace(model, CrossEntropy(), "kron", subset="last_layer", prior_precision=2.0)
    with pytest.raises(ValueError, match="known once fit"):
        _ = post.names
    assert "subset='last_layer'" in repr(post)
    post.fit((X, y))
    assert post.names == ["head.weight", "head.bias"] and post.layout.dim == 18
    torch.testing.assert_close(post.prior_precision, torch.tensor([2.0], dtype=DT))
    fresh = Laplace(model, CrossEntropy(), "kron", subset="last_layer")
    fresh.load_state_dict(copy.deepcopy(post.state_dict()))
    assert fresh.names == post.names
    torch.testing.assert_close(fresh.precision().to_dense(), post.precision().to_dense())


def test_last_layer_of_a_plain_mlp_is_its_last_linear(make_mlp):
    model, (X, y) = make_mlp((6, 5, 4, 3), "tanh"), _data()
    post = Laplace(model, CrossEntropy(), "full", "ggn", subset="last_layer", prior_precision=1.0).fit((X, y))
    assert post.names == ["4.weight", "4.bias"]
    _check_full_laplace(model, post, X, y, 1.0)
    with pytest.raises(ValueError, match="has no trainable parameters"):
        Laplace(nn.Linear(2, 2).requires_grad_(False), CrossEntropy(), subset="last_layer")


# ------------------------------------------------------------------------------------------ item 5
STRUCTURES = [("diag", "ggn"), ("kron", "kflr"), ("full", "ggn")]


def _fitted(structure, curvature, make_mlp):
    model, (X, y) = make_mlp((6, 5, 3), "tanh"), _data()
    return Laplace(model, CrossEntropy(), structure, curvature, prior_precision=0.3).fit((X, y)), X


def _snapshot(post):
    return copy.deepcopy(post.state_dict())


def _assert_unchanged(post, before):
    after = post.state_dict()
    torch.testing.assert_close(after["prior_precision"], before["prior_precision"], rtol=0, atol=0)
    assert after["num_data"] == before["num_data"]
    for a, b in zip(after["stats"], before["stats"]):
        for k in a:
            if isinstance(a[k], torch.Tensor):
                torch.testing.assert_close(a[k], b[k], rtol=0, atol=0)


@pytest.mark.parametrize("structure,curvature", STRUCTURES)
def test_log_marginal_likelihood_refuses_a_bad_num_data_or_prior(structure, curvature, make_mlp):
    post, _ = _fitted(structure, curvature, make_mlp)
    before, value = _snapshot(post), post.log_marginal_likelihood()
    with pytest.raises(ValueError, match=r"num_data must be a finite number > 0, got -3"):
        post.log_marginal_likelihood(num_data=-3)
    with pytest.raises(ValueError, match=r"num_data must be a finite number > 0, got -3.0"):
        post.log_marginal_likelihood(num_data=torch.tensor(-3.0, dtype=DT, requires_grad=True))
    with pytest.raises(ValueError, match=r"prior_precision must be a finite number > 0, got -1.0"):
        post.log_marginal_likelihood(prior_precision=torch.tensor(-1.0, dtype=DT, requires_grad=True))
    lam = torch.tensor([0.5, -2.0], dtype=DT, requires_grad=True)
    with pytest.raises(ValueError, match=r"prior_precision must be a finite number > 0, got \[0.5, -2.0\] "
                                         r"\(entry 1 of 2\)"):
        post.log_marginal_likelihood(prior_precision=lam)
    with pytest.raises(ValueError, match=r"one value per layer \(2: 0, 2\), got a tensor of shape \(3,\)"):
        post.log_marginal_likelihood(prior_precision=torch.ones(3, dtype=DT, requires_grad=True))
    with pytest.raises(ValueError, match=r"prior_precision must be a finite number > 0, got nan"):
        post.log_marginal_likelihood(prior_precision=torch.tensor(float("nan"), dtype=DT, requires_grad=True))
    _assert_unchanged(post, before)
    torch.testing.assert_close(post.log_marginal_likelihood(), value, rtol=0, atol=0)
    good = torch.tensor(0.3, dtype=DT, requires_grad=True)     # a valid tensor stays differentiable
    post.log_marginal_likelihood(prior_precision=good, num_data=12.0).backward()
    assert good.grad is not None and torch.isfinite(good.grad)


@pytest.mark.parametrize("method", ["glm", "mc"])
@pytest.mark.parametrize("structure,curvature", STRUCTURES)
def test_predict_refuses_inputs_unlike_the_fitted_ones(structure, curvature, method, make_mlp):
    post, X = _fitted(structure, curvature, make_mlp)
    before = _snapshot(post)

    def predict():
        kw = {"generator": torch.Generator().manual_seed(0)} if method == "mc" else {}
        return post.predict(X[:3], method=method, **kw)

    ok = predict()
    assert ok.shape == (3, 3)
    with pytest.raises(ValueError, match=r"X of shape \(4, 7\) does not fit the model: the posterior was fitted "
                                         r"on inputs \(B, 6\) of dtype torch.float64"):
        post.predict(torch.randn(4, 7, dtype=DT), method=method)
    with pytest.raises(ValueError, match=r"X has dtype torch.float32, but the posterior was fitted on inputs "
                                         r"\(B, 6\) of dtype torch.float64; convert it with X.to\(torch.float64\)"):
        post.predict(X.float(), method=method)
    with pytest.raises(ValueError, match=r"X has shape \(6,\), but the posterior was fitted on inputs \(B, 6\)"):
        post.predict(X[0], method=method)
    with pytest.raises(TypeError, match=r"X must be a torch\.Tensor"):
        post.predict(X.tolist(), method=method)
    _assert_unchanged(post, before)
    torch.testing.assert_close(predict(), ok, rtol=0, atol=0)


def test_predict_accepts_token_ids_of_any_integer_dtype():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(7, 3), nn.Flatten(), nn.Linear(12, 3)).double()
    g = torch.Generator().manual_seed(1)
    ids, y = torch.randint(0, 7, (10, 4), generator=g), torch.randint(0, 3, (10,), generator=g)
    post = Laplace(model, CrossEntropy(), "diag", "ggn").fit((ids, y))
    torch.testing.assert_close(post.predict(ids.int()), post.predict(ids))
    with pytest.raises(ValueError, match=r"X has dtype torch.float64, but the posterior was fitted on inputs "
                                         r"\(B, 4\) of dtype torch.int64"):
        post.predict(ids.double())


def test_fit_refuses_inputs_of_another_dtype_in_curvkits_words():
    """float32 inputs for a float64 model: curvkit's error naming both dtypes and the fix, not torch's
    "mat1 and mat2 must have the same dtype"; for every structure and for mapping batches."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 4), nn.Tanh(), nn.Linear(4, 3)).to(DT)
    X, y = torch.randn(8, 5), torch.randint(0, 3, (8,))
    for structure in ("kron", "diag", "full"):
        post = Laplace(model, CrossEntropy(), structure)
        with pytest.raises(ValueError, match=r"inputs X have dtype torch.float32, but the model's parameters are "
                                             r"torch.float64.*X.to\(torch.float64\)"):
            post.fit((X, y))
        assert not post.blocks
        post.fit((X.to(DT), y))  # the converted inputs fit

    class Keyed(nn.Module):
        def __init__(self):
            super().__init__()
            self.net = model

        def forward(self, batch):
            return self.net(batch["x"])

    with pytest.raises(ValueError, match=r"inputs X\['x'\] have dtype torch.float32"):
        Laplace(Keyed(), CrossEntropy(), "diag").fit(({"x": X}, y))
