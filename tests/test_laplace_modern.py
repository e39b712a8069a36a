"""Laplace posteriors on transformers, ViTs, ResNets, sequence taggers and LoRA adapters (issue 21, section 2),
against dense float64 references written with torch.func on tiny models (tests/reference.py):

* ``full``/``diag`` + ``ggn``: the precision is the dense GGN of the summed loss restricted to the subset plus the
  prior (``N`` = the number of samples seen, so ``N * (GGN / n) = GGN``);
* ``kron``: the precision is ``N`` times the Kronecker engine's per-datum blocks plus the prior (``exact`` form),
  every non-standard block (embedding, attention row slices, normalisation layers, raw parameters) read through
  its index; where a block is exact (one datum's head, a per-sample-gradient block of a normalisation layer) it
  equals the dense GGN block;
* the GLM predictive: ``J Sigma J^T`` with the dense Jacobian of the covered parameters and the dense covariance,
  per position for sequence outputs (padding included), and the probit predictive from its diagonal.
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.reference import dense_ggn_flat, flat_model
from tests.tiny_models import tiny_case
from torch import nn
from torch.func import jacrev

from curvkit import architectures as arch
from curvkit.curvature.estimators import KroneckerEstimator
from curvkit.laplace import Laplace, optimize_prior_precision
from curvkit.likelihoods import CrossEntropy

DT = torch.float64


def _vit(seed=0):
    return arch.vit(image_size=8, patch_size=4, dim=8, depth=1, heads=2, mlp_dim=8, num_classes=3, seed=seed,
                    dtype=DT).eval()


def _case(name: str):
    """(model, likelihood, X, y) of a tiny float64 model in eval mode."""
    g = torch.Generator().manual_seed(3)
    if name == "vit":
        return _vit(), CrossEntropy(), torch.randn(5, 1, 8, 8, generator=g, dtype=DT), torch.randint(0, 3, (5,), generator=g)
    if name == "resnet":
        m = arch.resnet(widths=(3,), num_classes=3, dtype=DT)
        with torch.no_grad():  # non-trivial running statistics and affine parameters
            for mod in m.modules():
                if isinstance(mod, nn.BatchNorm2d):
                    mod.running_mean.uniform_(-0.5, 0.5, generator=g)
                    mod.running_var.uniform_(0.5, 2.0, generator=g)
                    mod.weight.uniform_(0.5, 1.5, generator=g)
                    mod.bias.uniform_(-0.3, 0.3, generator=g)
        return m.eval(), CrossEntropy(), torch.randn(4, 1, 5, 5, generator=g, dtype=DT), torch.randint(0, 3, (4,), generator=g)
    if name == "lm":  # per-token classification with padding
        m = arch.causal_lm(vocab_size=5, max_len=4, dim=8, depth=1, heads=2, mlp_dim=8, dtype=DT).eval()
        X = torch.randint(0, 5, (3, 4), generator=g)
        y = torch.randint(0, 5, (3, 4), generator=g)
        y[0, 2:] = -100
        y[2, 3] = -100
        return m, CrossEntropy(ignore_index=-100), X, y
    if name == "tagger":
        m = arch.conv1d_tagger(channels=2, hidden=4, num_classes=3, dtype=DT).eval()
        return m, CrossEntropy(), torch.randn(3, 2, 5, generator=g, dtype=DT), torch.randint(0, 3, (3, 5), generator=g)
    if name == "lora":
        m = arch.add_lora(_vit(), rank=2, init_b="normal").eval()
        return m, CrossEntropy(), torch.randn(5, 1, 8, 8, generator=g, dtype=DT), torch.randint(0, 3, (5,), generator=g)
    if name == "recognised":  # RMSNorm as written, GRU, layer scale, arange(T) positions: the per-sample fallback
        m, lik, (X, y) = tiny_case("recognised")
        return m, lik, X, y
    raise KeyError(name)


MODELS = ["vit", "resnet", "lm", "tagger", "lora", "recognised"]


def _positions(post: Laplace, model: nn.Module) -> torch.Tensor:
    """Indices of the posterior's parameters (flat, its layout) in the reference's flat trainable vector."""
    starts, o = {}, 0
    for n, p in model.named_parameters():
        if p.requires_grad:
            starts[n] = (o, p.numel())
            o += p.numel()
    return torch.cat([torch.arange(starts[n][0], starts[n][0] + starts[n][1]) for n in post.names])


def _state(model: nn.Module):
    return ({n: p.detach().clone() for n, p in model.named_parameters()},
            {n: b.detach().clone() for n, b in model.named_buffers()},
            [m.training for m in model.modules()], [p.requires_grad for p in model.parameters()])


def _assert_unchanged(model: nn.Module, before) -> None:
    params, buffers, modes, flags = _state(model)
    for n in params:
        assert torch.equal(params[n], before[0][n]), n
    for n in buffers:
        assert torch.equal(buffers[n], before[1][n]), n
    assert modes == before[2] and flags == before[3]


# ---------------------------------------------------------------------------------------------- precision
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("structure,subset", [("full", "all"), ("diag", "all"), ("full", "last_layer")])
def test_full_and_diag_ggn_precision_is_the_dense_ggn_of_the_subset_plus_the_prior(name, structure, subset):
    model, lik, X, y = _case(name)
    before = _state(model)
    lam = 0.7
    post = Laplace(model, lik, structure, "ggn", subset=subset, prior_precision=lam).fit([(X[:2], y[:2]), (X[2:], y[2:])])
    G = dense_ggn_flat(model, CrossEntropy("sum", ignore_index=lik.ignore_index), (X, y))
    idx = _positions(post, model)
    ref = G[idx][:, idx] + lam * torch.eye(idx.numel(), dtype=DT)
    P = post.precision().to_dense()
    if structure == "diag":
        torch.testing.assert_close(P, torch.diag(ref.diagonal()))
    else:
        torch.testing.assert_close(P, ref)
    _assert_unchanged(model, before)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("curvature,sharing", [("kflr", "expand"), ("kfac", "reduce"), ("empirical", "expand")])
def test_kron_precision_is_n_times_the_engines_per_datum_blocks_plus_the_prior(name, curvature, sharing):
    """Every block of every layer kind, read through its index: the exact form ``N K + lam I`` with K the
    Kronecker engine's operator of the summed loss divided by the samples; the covariance is its inverse."""
    model, lik, X, y = _case(name)
    before = _state(model)
    lam, N = 0.4, 11.0
    kw = dict(mc_samples=2, seed=5, weight_sharing=sharing, norm_structure="full", parameter_structure="full")
    post = Laplace(model, lik, "kron", curvature, prior_precision=lam, prior_form="exact", **kw).fit((X, y), num_data=N)
    est = KroneckerEstimator(model, CrossEntropy("sum", ignore_index=lik.ignore_index), curvature, mc_samples=2, seed=5,
                             weight_sharing=sharing, norm_structure="full", parameter_structure="full").update((X, y))
    K = est.operator().to_dense()
    assert set(est.operator().layout.names) == set(post.names)
    ref = N / X.shape[0] * K + lam * torch.eye(K.shape[0], dtype=DT)
    P = post.precision().to_dense()
    torch.testing.assert_close(P, ref)
    torch.testing.assert_close(post.covariance().to_dense(), torch.linalg.inv(ref))
    torch.testing.assert_close(post.log_det_precision(), torch.linalg.slogdet(ref)[1])
    _assert_unchanged(model, before)


def test_kron_blocks_that_are_exact_equal_the_dense_ggn_blocks_on_a_vit():
    """One datum: the head's KFLR block ``G (x) A`` and the per-sample-gradient blocks of the LayerNorms and raw
    parameters (``norm_structure``/``parameter_structure='full'``) are the exact GGN blocks."""
    model, lik, X, y = _case("vit")
    X, y = X[:1], y[:1]
    post = Laplace(model, lik, "kron", "kflr", prior_precision=0.3, prior_form="exact", norm_structure="full",
                   parameter_structure="full").fit((X, y))
    G = dense_ggn_flat(model, CrossEntropy("sum"), (X, y))
    P = post.precision().to_dense()
    sl = post.layout.slices()
    exact = [n for n in post.names if n.startswith(("head.", "norm.", "cls_token", "pos_embed"))
             or ".norm" in n]
    assert any(n.startswith("head.") for n in exact) and any("norm" in n for n in exact)
    named = [n for n, p in model.named_parameters() if p.requires_grad]
    starts = dict(zip(named, torch.tensor([0] + [p.numel() for p in model.parameters()]).cumsum(0).tolist()))
    for n in exact:
        # the blocks of one module (weight and bias together) are exact; compare each parameter's own block
        i = torch.arange(sl[n].start, sl[n].stop)
        j = torch.arange(starts[n], starts[n] + i.numel())
        torch.testing.assert_close(P[i][:, i], G[j][:, j] + 0.3 * torch.eye(i.numel(), dtype=DT), msg=n)


# ---------------------------------------------------------------------------------------------- GLM predictive
def _dense_jsjt(post: Laplace, model: nn.Module, X: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(f, J Sigma J^T) per position: J the dense Jacobian of the outputs in the covered parameters."""
    f, theta = flat_model(model)
    idx = _positions(post, model)

    def g(sub):
        full = theta.clone()
        full[idx] = sub
        return f(full, X)

    out = g(theta[idx])
    J = jacrev(g)(theta[idx])  # (B, *P, C, d)
    S = post.covariance().to_dense()
    return out, torch.einsum("...ci,ij,...dj->...cd", J, S, J)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("structure,curvature,form,subset", [
    ("kron", "kflr", "factored", "all"), ("kron", "kfac", "exact", "all"), ("diag", "ggn", "factored", "all"),
    ("full", "ggn", "factored", "all"), ("kron", "kflr", "factored", "last_layer"),
    ("diag", "mc_fisher", "factored", "last_layer")])
def test_glm_variance_equals_j_sigma_jt_from_the_dense_jacobian(name, structure, curvature, form, subset):
    model, lik, X, y = _case(name)
    before = _state(model)
    post = Laplace(model, lik, structure, curvature, subset=subset, prior_precision=0.5, prior_form=form).fit((X, y))
    f_ref, V_ref = _dense_jsjt(post, model, X)
    f, V = post.functional_variance(X, batch_size=2)
    torch.testing.assert_close(f, f_ref)
    torch.testing.assert_close(V, V_ref)
    f, Vd = post.functional_variance(X, batch_size=3, diagonal=True)
    torch.testing.assert_close(Vd, V_ref.diagonal(dim1=-2, dim2=-1))
    probs = post.predict(X, "glm", batch_size=2)
    ref = (f_ref / torch.sqrt(1 + math.pi / 8 * V_ref.diagonal(dim1=-2, dim2=-1))).softmax(-1)
    torch.testing.assert_close(probs, ref)
    _assert_unchanged(model, before)


@pytest.mark.parametrize("name", ["vit", "lm"])
def test_mc_predictive_marginal_likelihood_and_prior_optimisation_on_modern_models(name):
    model, lik, X, y = _case(name)
    post = Laplace(model, lik, "kron", "kflr", prior_precision=1.0).fit((X, y))
    S = post.sample(4, generator=torch.Generator().manual_seed(0))
    f, _ = flat_model(model)
    idx = _positions(post, model)
    theta = torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])
    ref = 0
    for s in S:
        t = theta.clone()
        t[idx] = s
        ref = ref + f(t, X).softmax(-1) / len(S)
    torch.testing.assert_close(post.predict(X, "mc", samples=S, batch_size=2), ref)
    torch.testing.assert_close(post.log_det_precision(), torch.linalg.slogdet(post.precision().to_dense())[1])
    before = float(post.log_marginal_likelihood())
    optimize_prior_precision(post, steps=30)
    assert float(post.log_marginal_likelihood()) > before


# ---------------------------------------------------------------------------------------------- LoRA
@pytest.mark.parametrize("structure", ["kron", "diag", "full"])
def test_lora_posterior_covers_exactly_the_trainable_adapters(structure):
    model, lik, X, y = _case("lora")
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    assert len(trainable) < len(list(model.parameters()))
    before = _state(model)
    post = Laplace(model, lik, structure, "ggn" if structure != "kron" else "kflr", prior_precision=0.5).fit((X, y))
    assert post.names == trainable
    assert post.layout.dim == sum(p.numel() for p in model.parameters() if p.requires_grad)
    _assert_unchanged(model, before)
    if structure != "kron":
        G = dense_ggn_flat(model, CrossEntropy("sum"), (X, y))  # over the trainable parameters only
        ref = G + 0.5 * torch.eye(G.shape[0], dtype=DT)
        P = post.precision().to_dense()
        torch.testing.assert_close(P, ref if structure == "full" else torch.diag(ref.diagonal()))
    S = post.sample(3, generator=torch.Generator().manual_seed(1))
    frozen = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    for s in S:  # a draw moves the adapters only
        params = post.sample_params(s)
        assert all(torch.equal(params[n], p) for n, p in frozen.items())


# ---------------------------------------------------------------------------------------------- BatchNorm
def test_batchnorm_in_training_mode_is_refused_naming_the_layer_and_eval():
    model, lik, X, y = _case("resnet")
    model.train()
    before = _state(model)
    for structure in ("kron", "diag", "full"):
        with pytest.raises(Exception, match=r"(?i)batchnorm.*|.*eval\(\)"):
            Laplace(model, lik, structure).fit((X, y))
    _assert_unchanged(model, before)


# ---------------------------------------------------------------------------------------------- bad input
class _GRUClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.rnn = nn.GRU(3, 4, batch_first=True)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.rnn(x)[0][:, -1])


def test_kron_takes_a_recurrent_layer_and_leaves_the_model_alone():
    """A GRU (no registered kind) gets the per-sample fallback (curvkit.layerkinds.generic): its exact block
    (KFLR, (B, C) outputs, norm_structure='full', under the dense size limit) plus the prior."""
    model = _GRUClassifier().double()
    X, y = torch.randn(4, 5, 3, dtype=DT), torch.randint(0, 2, (4,))
    before = _state(model)
    post = Laplace(model, CrossEntropy(), "kron", "kflr", prior_precision=0.3, prior_form="exact",
                   norm_structure="full").fit((X, y))
    G = dense_ggn_flat(model, CrossEntropy("sum"), (X, y))
    sl, i0 = post.layout.slices(), 0
    for n, p in model.named_parameters():  # each GRU parameter is its own block (four parameters)
        if n.startswith("rnn."):
            i = torch.arange(sl[n].start, sl[n].stop)
            j = torch.arange(i0, i0 + p.numel())
            torch.testing.assert_close(post.precision().to_dense()[i][:, i],
                                       G[j][:, j] + 0.3 * torch.eye(p.numel(), dtype=DT), msg=n)
        i0 += p.numel()
    _assert_unchanged(model, before)
    # the last layer alone is a Linear: Kronecker Laplace on it works
    post = Laplace(model, CrossEntropy(), "kron", subset=["head"]).fit((X, y))
    assert post.names == ["head.weight", "head.bias"]
    _assert_unchanged(model, before)


class _Squeeze(nn.Module):
    def __init__(self, net, softmax=False):
        super().__init__()
        self.net, self.softmax = net, softmax

    def forward(self, x):
        out = self.net(x)
        return out.softmax(-1) if self.softmax else out[:, 0]


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_outputs_that_are_not_logits_for_the_likelihood_are_named(structure):
    model, lik, X, y = _case("vit")
    before = _state(model)
    with pytest.raises(TypeError, match=r"must return one tensor of shape \(batch, outputs\).*got \(batch,\)"):
        Laplace(_Squeeze(model), lik, structure).fit((X, y))
    with pytest.raises(ValueError, match="output is probabilities"):
        Laplace(_Squeeze(model, softmax=True), lik, structure).fit((X, y))
    with pytest.raises(ValueError, match=r"targets must be integer class indices of shape \(5,\)"):
        Laplace(model, lik, structure).fit((X, torch.randn(5, 3, dtype=DT)))
    _assert_unchanged(model, before)


def test_a_tied_weight_is_taken_by_kron_diag_and_full():
    model = arch.causal_lm(vocab_size=5, max_len=4, dim=8, depth=1, heads=2, mlp_dim=8, tie_weights=True,
                           dtype=DT).eval()
    g = torch.Generator().manual_seed(0)
    X, y = torch.randint(0, 5, (3, 4), generator=g), torch.randint(0, 5, (3, 4), generator=g)
    before = _state(model)
    post = Laplace(model, CrossEntropy(), "kron", prior_precision=0.5).fit((X, y))  # the sum of both uses' terms
    _, V_ref = _dense_jsjt(post, model, X)
    torch.testing.assert_close(post.functional_variance(X, batch_size=2)[1], V_ref)
    _assert_unchanged(model, before)
    G = dense_ggn_flat(model, CrossEntropy("sum"), (X, y))
    for structure in ("diag", "full"):  # the tied parameter once, with the curvature of both uses
        post = Laplace(model, CrossEntropy(), structure, "ggn", prior_precision=0.5).fit((X, y))
        ref = G + 0.5 * torch.eye(G.shape[0], dtype=DT)
        torch.testing.assert_close(post.precision().to_dense(), ref if structure == "full" else torch.diag(ref.diagonal()))
        _, V_ref = _dense_jsjt(post, model, X)
        torch.testing.assert_close(post.functional_variance(X, batch_size=2)[1], V_ref)
    _assert_unchanged(model, before)


@pytest.mark.parametrize("structure", ["kron", "diag", "full"])
def test_padding_without_ignore_index_and_nan_batches_are_named(structure):
    model, _, X, y = _case("lm")
    before = _state(model)
    with pytest.raises(ValueError, match=r"padding is not enabled: for padded positions pass "
                                         r"CrossEntropy\(ignore_index=\.\.\.\)\), got values in \[-100, 4\]"):
        Laplace(model, CrossEntropy(), structure).fit((X, y))
    vmodel, lik, Xi, yi = _case("vit")
    bad = Xi.clone()
    bad[1, 0, 2, 2] = float("nan")
    with pytest.raises(ValueError, match=r"batch 1 of the data: the inputs X contain NaN or inf \(1 of"):
        Laplace(vmodel, lik, structure).fit([(Xi, yi), (bad, yi)])
    _assert_unchanged(model, before)


@pytest.mark.parametrize("name", ["lm", "lora", "resnet"])
def test_jvp_linearised_samples_equal_the_dense_jacobian(name):
    """``linearised_samples``: f* + J delta for posterior offsets delta, J the dense Jacobian of the outputs in
    the posterior's parameters (per position for the LM; only the adapters for LoRA)."""
    from curvkit.laplace.predictive import linearised_samples

    model, lik, X, y = _case(name)
    post = Laplace(model, lik, structure="kron", prior_precision=2.0).fit([(X, y)])
    deltas = post.sample(3, torch.Generator().manual_seed(0)) - post.mean
    f0, fs = linearised_samples(post, X, deltas)
    f, theta = flat_model(model)
    pos = _positions(post, model)
    J = jacrev(f)(theta, X)  # (B, *P, C, D)
    full = torch.zeros(deltas.shape[0], theta.numel(), dtype=DT)
    full[:, pos] = deltas
    expected = f(theta, X)[None] + torch.einsum("...d,kd->k...", J, full)
    torch.testing.assert_close(f0, f(theta, X), atol=1e-12, rtol=0)
    torch.testing.assert_close(fs, expected, atol=1e-10, rtol=0)


def test_glm_mc_predictive_by_jvp_matches_the_covariance_sampler_in_expectation():
    """link='mc' with sampler='jvp' draws from the same Gaussian N(f*, J Sigma J^T) as sampler='covariance':
    with 4,000 draws each (fixed seeds) the predictive probabilities agree to 0.03, about 6 standard errors of
    the difference at these variances (about 0.005; the largest of the 60 differences is 0.016); 'auto' picks
    the covariance route at 5 classes; the same generator gives the same jvp predictive. (The exactness of
    the jvp route itself is the dense-Jacobian test above.)"""
    model, lik, X, y = _case("lm")
    post = Laplace(model, lik, structure="kron", prior_precision=0.5).fit([(X, y)])
    by_jvp = post.predict(X, link="mc", sampler="jvp", num_samples=4000, generator=torch.Generator().manual_seed(1))
    by_cov = post.predict(X, link="mc", sampler="covariance", num_samples=4000,
                          generator=torch.Generator().manual_seed(2))
    auto = post.predict(X, link="mc", num_samples=4000, generator=torch.Generator().manual_seed(2))
    assert by_jvp.shape == by_cov.shape == (3, 4, 5)
    torch.testing.assert_close(by_jvp.sum(-1), torch.ones(3, 4, dtype=DT))
    assert (by_jvp - by_cov).abs().max() < 0.03
    torch.testing.assert_close(auto, by_cov)
    again = post.predict(X, link="mc", sampler="jvp", num_samples=4000, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(again, by_jvp)
    with pytest.raises(ValueError, match="sampler must be"):
        post.predict(X, link="mc", sampler="dense")


def test_glm_probit_predictive_by_jvp_estimates_the_exact_variances(monkeypatch):
    """link='probit' with sampler='jvp' (issue 35): the variances diag(J Sigma J^T) are the mean squares of
    the draws J delta, so with 4,000 draws (relative error of a variance about sqrt(2/4000) = 2 %) the
    probabilities agree with the exact probit to 0.01; 'auto' takes this route only above JVP_OUTPUTS outputs
    per sample (forced here by lowering it to the LM's 4 x 5 = 20)."""
    import curvkit.laplace.predictive as predictive

    model, lik, X, y = _case("lm")
    post = Laplace(model, lik, structure="kron", prior_precision=0.5).fit([(X, y)])
    exact = post.predict(X)
    by_jvp = post.predict(X, sampler="jvp", num_samples=4000, generator=torch.Generator().manual_seed(1))
    assert by_jvp.shape == exact.shape == (3, 4, 5)
    assert (by_jvp - exact).abs().max() < 0.01
    torch.testing.assert_close(post.predict(X, sampler="auto"), exact)  # 20 outputs: the exact route
    monkeypatch.setattr(predictive, "JVP_OUTPUTS", 19)
    auto = post.predict(X, num_samples=4000, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(auto, by_jvp)
