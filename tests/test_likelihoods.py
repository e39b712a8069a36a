"""Likelihood heads: per-sample NLL, output gradient, output Hessian and its square root against autograd;
model-label samplers in expectation; validation errors."""

import math

import pytest
import torch
from torch.func import grad, hessian, vmap

from curvkit.likelihoods import BernoulliBCE, CrossEntropy, Gaussian, get_likelihood

pytestmark = pytest.mark.usefixtures("float64_default")

B, C = 6, 4


def _data(lik, seed=0):
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(B, C, generator=g)
    if isinstance(lik, CrossEntropy):
        y = torch.randint(0, C, (B,), generator=g)
    elif isinstance(lik, BernoulliBCE):
        y = torch.rand(B, C, generator=g).round()
    else:
        y = torch.randn(B, C, generator=g)
    return f, y


LIKS = [CrossEntropy(), BernoulliBCE(), Gaussian(sigma=0.7), Gaussian(reduction="sum")]


@pytest.mark.parametrize("lik", LIKS, ids=repr)
def test_grad_hessian_sqrt_against_autograd(lik):
    f, y = _data(lik)

    def per(fi, yi):
        return lik.nll_per_sample(fi[None], yi[None])[0]

    g_ref = vmap(grad(per))(f, y)
    H_ref = vmap(hessian(per))(f, y)
    torch.testing.assert_close(lik.output_grad(f, y), g_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(lik.output_hessian(f), H_ref, atol=1e-12, rtol=0)
    S = lik.output_hessian_sqrt(f)
    torch.testing.assert_close(S @ S.transpose(1, 2), H_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(lik.output_hessian_diagonal(f), H_ref.diagonal(dim1=1, dim2=2), atol=1e-12,
                               rtol=0)


@pytest.mark.parametrize("lik", LIKS, ids=repr)
def test_reduction(lik):
    f, y = _data(lik)
    per = lik.nll_per_sample(f, y)
    expected = per.sum() if lik.reduction == "sum" else per.mean()
    torch.testing.assert_close(lik.nll(f, y), expected)


def test_cross_entropy_matches_torch():
    f, y = _data(CrossEntropy())
    torch.testing.assert_close(CrossEntropy().nll(f, y), torch.nn.functional.cross_entropy(f, y))


def test_softmax_hessian_rank_is_k_minus_one():
    f, _ = _data(CrossEntropy())
    ranks = torch.linalg.matrix_rank(CrossEntropy().output_hessian(f))
    assert (ranks == C - 1).all()


@pytest.mark.parametrize("lik", [CrossEntropy(), BernoulliBCE(), Gaussian(sigma=0.5)], ids=repr)
def test_output_fisher_from_samples_matches_hessian(lik):
    """E_{y ~ model}[g g^T] = H_L (thesis Eqs. 3.36-3.38); Monte Carlo with 40k samples, fixed seed.

    Each entry of the MC average has standard deviation below ~ max|g|^2 / sqrt(n) <= 4 / 200 for these
    heads at unit-scale logits; a tolerance of 0.03 (absolute, relative to entries of size <= 4) holds.
    """
    f, _ = _data(lik, seed=1)
    n = 40_000
    gen = torch.Generator().manual_seed(0)
    fr = f.repeat(n, 1)
    ys = lik.sample(fr, generator=gen)
    g = lik.output_grad(fr, ys).reshape(n, B, C)
    F_mc = torch.einsum("nbi,nbj->bij", g, g) / n
    tol = 0.03 * (1 / lik.sigma**2 if isinstance(lik, Gaussian) else 1)
    torch.testing.assert_close(F_mc, lik.output_hessian(f), atol=tol, rtol=0)


def test_gaussian_normaliser():
    lik = Gaussian(sigma=2.0, include_normaliser=True)
    f, y = torch.zeros(1, 3), torch.zeros(1, 3)
    assert math.isclose(float(lik.nll_per_sample(f, y)[0]), 1.5 * math.log(2 * math.pi * 4))


def test_validation_errors():
    ce = CrossEntropy()
    f = torch.randn(3, 4)
    with pytest.raises(ValueError, match="NaN or inf"):
        ce.nll(torch.tensor([[0.0, float("nan")]]), torch.tensor([0]))
    with pytest.raises(ValueError, match="integer class indices"):
        ce.nll(f, torch.zeros(3))
    with pytest.raises(ValueError, match=r"lie in \[0, 3\]"):
        ce.nll(f, torch.tensor([0, 1, 4]))
    with pytest.raises(ValueError, match="shape"):
        ce.nll(torch.randn(3), torch.tensor([0, 1, 2]))
    with pytest.raises(ValueError, match="output's shape"):
        BernoulliBCE().nll(f, torch.zeros(3, 3))
    with pytest.raises(ValueError, match="sigma"):
        Gaussian(sigma=0.0)
    with pytest.raises(ValueError, match="reduction"):
        CrossEntropy(reduction="avg")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown likelihood"):
        get_likelihood("poisson")


# ------------------------------------------------------------------ positions (sequence outputs) and padding
T = 5


def _seq_data(lik, seed=0):
    g = torch.Generator().manual_seed(seed)
    f = torch.randn(B, T, C, generator=g)
    if isinstance(lik, CrossEntropy):
        y = torch.randint(0, C, (B, T), generator=g)
    elif isinstance(lik, BernoulliBCE):
        y = torch.rand(B, T, C, generator=g).round()
    else:
        y = torch.randn(B, T, C, generator=g)
    return f, y


SEQ_LIKS = [CrossEntropy(), CrossEntropy("sum"), BernoulliBCE(), Gaussian(sigma=0.7), Gaussian(reduction="sum")]


@pytest.mark.parametrize("lik", SEQ_LIKS, ids=repr)
def test_sequence_outputs_equal_the_token_flattened_loss(lik):
    """(B, T, C) logits with (B, T) targets: every per-position quantity equals the (B*T, C) one, the loss is
    the flattened loss (mean over all B*T terms), and nll_per_sample sums each sequence's tokens."""
    f, y = _seq_data(lik)
    ff, yf = f.reshape(B * T, C), y.reshape(B * T, *y.shape[2:])
    torch.testing.assert_close(lik.nll(f, y), lik.nll(ff, yf))
    torch.testing.assert_close(lik.nll_per_sample(f, y), lik.nll_per_sample(ff, yf).reshape(B, T).sum(1))
    assert lik.num_terms(f, y) == B * T
    for name in ("output_hessian", "output_hessian_sqrt", "output_hessian_diagonal"):
        torch.testing.assert_close(getattr(lik, name)(f), getattr(lik, name)(ff).reshape(B, T, *getattr(lik, name)(ff).shape[1:]))
    torch.testing.assert_close(lik.output_grad(f, y), lik.output_grad(ff, yf).reshape(B, T, C))
    if isinstance(lik, CrossEntropy):
        torch.testing.assert_close(CrossEntropy(lik.reduction).nll(f, y),
                                   torch.nn.functional.cross_entropy(ff, yf, reduction=lik.reduction))


@pytest.mark.parametrize("lik", SEQ_LIKS, ids=repr)
def test_structured_hessian_products_and_sqrt_columns_match_the_dense_hessian(lik):
    f, _ = _seq_data(lik)
    H = lik.output_hessian(f)  # (B, T, C, C)
    V = torch.randn(3, B, T, C, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(lik.output_hessian_matvec(f, V), torch.einsum("btij,kbtj->kbti", H, V))
    S = lik.output_hessian_sqrt(f)
    torch.testing.assert_close(S @ S.transpose(-1, -2), H)
    assert lik.sqrt_rank(f) == S.shape[-1]
    torch.testing.assert_close(torch.cat([lik.output_hessian_sqrt_columns(f, slice(0, 1)),
                                          lik.output_hessian_sqrt_columns(f, slice(1, None))], -1), S)


def test_cross_entropy_padding_drops_the_terms_everywhere():
    """ignore_index: the loss equals torch's with the same ignore_index, padded positions have zero gradient,
    zero Hessian (every form), and samples copy the padding; the mean is over the counted tokens."""
    lik = CrossEntropy(ignore_index=-100)
    f, y = _seq_data(lik)
    y[0, 3:] = -100
    y[2, 1] = -100
    keep = y != -100
    torch.testing.assert_close(lik.nll(f, y), torch.nn.functional.cross_entropy(f.reshape(-1, C), y.reshape(-1)))
    assert lik.num_terms(f, y) == int(keep.sum())
    per_sequence = torch.stack([lik.nll_per_sample(f[b][keep[b]], y[b][keep[b]]).sum() for b in range(B)])
    torch.testing.assert_close(lik.nll_per_sample(f, y), per_sequence)
    assert (lik.output_grad(f, y)[~keep] == 0).all()
    assert (lik.output_hessian(f, y)[~keep] == 0).all()
    assert (lik.output_hessian_sqrt(f, y)[~keep] == 0).all()
    assert (lik.output_hessian_diagonal(f, y)[~keep] == 0).all()
    V = torch.randn(2, B, T, C)
    assert (lik.output_hessian_matvec(f, V, y)[:, ~keep] == 0).all()
    torch.testing.assert_close(lik.output_hessian(f, y)[keep], lik.output_hessian(f)[keep])
    ys = lik.sample(f, torch.Generator().manual_seed(0), y)
    assert (ys[~keep] == -100).all() and (ys[keep] >= 0).all()
    assert (lik.output_grad(f, ys)[~keep] == 0).all()


def test_gaussian_padding_by_value():
    lik = Gaussian(reduction="sum", ignore_value=-7.0)
    f, y = _seq_data(lik)
    y[1, 2:] = -7.0
    keep = torch.ones(B, T, dtype=torch.bool)
    keep[1, 2:] = False
    torch.testing.assert_close(lik.nll(f, y), Gaussian(reduction="sum").nll(f[keep], y[keep]))
    assert lik.num_terms(f, y) == B * T - 3
    assert (lik.output_hessian_diagonal(f, y)[~keep] == 0).all()
    with pytest.raises(ValueError, match="ignore_value must be a finite"):
        Gaussian(ignore_value=float("nan"))


def test_sequence_target_errors_never_reread_the_shape():
    ce = CrossEntropy()
    f = torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match=r"shape \(2, 3\).*LAST dimension"):
        ce.nll(f.movedim(-1, 1), torch.randint(0, 4, (2, 3)))  # torch's (B, C, T) layout
    with pytest.raises(ValueError, match=r"shape \(2, 3\)"):
        ce.nll(f, torch.randint(0, 4, (2, 3, 1)))
    with pytest.raises(ValueError, match=r"padding is not enabled.*ignore_index"):
        ce.nll(f, torch.full((2, 3), -100))
    with pytest.raises(ValueError, match="targets must have the output"):
        Gaussian().nll(f, torch.randn(2, 3))


@pytest.mark.parametrize("lik", [CrossEntropy(), BernoulliBCE(), Gaussian()], ids=repr)
def test_empty_batch_and_all_padding_are_clear_errors(lik):
    f = torch.randn(0, C)
    y = torch.zeros(0, dtype=torch.long) if isinstance(lik, CrossEntropy) else torch.zeros(0, C)
    with pytest.raises(ValueError, match="batch is empty"):
        lik.nll(f, y)
    with pytest.raises(ValueError, match="mean over 0 loss terms"):
        CrossEntropy(ignore_index=-1).nll(torch.randn(2, C), torch.full((2,), -1))


def test_cross_entropy_samples_a_large_softmax_by_its_inverse_cdf():
    """Above INVERSE_CDF_ENTRIES probabilities the labels come from the inverse CDF: their frequencies match the
    softmax (200,000 draws, fixed seed) and a class of probability 0 is never drawn."""
    from curvkit import likelihoods

    C = 12
    logits = torch.full((C,), -30.0)
    logits[:5] = torch.tensor([0.0, 0.7, 1.1, -0.3, 0.4])
    logits[7] = -float("inf")  # probability exactly 0
    f = logits.expand(200_000, C)
    draws = likelihoods.CrossEntropy()._sample(f, torch.Generator().manual_seed(0))
    p = logits.softmax(-1)
    counts = torch.bincount(draws, minlength=C).double()
    assert counts[7] == 0
    top = counts[:5] / draws.numel()
    torch.testing.assert_close(top, p[:5].double(), atol=4e-3, rtol=0)  # 5 sigma at n = 200,000: about 5e-3
    by_multinomial = torch.multinomial(f.softmax(-1), 1, generator=torch.Generator().manual_seed(0))[:, 0]
    assert not torch.equal(draws, by_multinomial)  # the other route
    small = f[: likelihoods.INVERSE_CDF_ENTRIES // C]  # up to the threshold: curvlinops' draws, torch.multinomial's
    expected = torch.multinomial(small.softmax(-1), 1, generator=torch.Generator().manual_seed(0))[:, 0]
    assert torch.equal(likelihoods.CrossEntropy()._sample(small, torch.Generator().manual_seed(0)), expected)


def test_output_checks_decide_by_one_reduction_and_keep_their_meaning():
    """``check`` sums the outputs once (a finite sum: no NaN or inf) and looks at the entries only when the sum is
    not finite, so large finite logits whose sum overflows pass and a NaN or inf entry is named; ``check_logits``
    decides "probabilities" by the minimum first (logits with a negative entry, or a NaN, are logits) and sums the
    rows of non-negative outputs in float64, so a bf16 softmax is still recognised."""
    lik = CrossEntropy()
    big = torch.full((2, 3), 3e38)  # finite entries, their float32 sum is inf
    lik.check(big)
    for bad in (float("nan"), float("inf")):
        f = torch.zeros(2, 3)
        f[1, 2] = bad
        with pytest.raises(ValueError, match=r"NaN or inf \(1 entries\)"):
            lik.check(f)
    logits = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
    lik.check_logits(logits, "test")
    nan_rows = logits.softmax(-1)
    nan_rows[0, 0] = float("nan")
    lik.check_logits(nan_rows, "test")  # not every row sums to 1: not refused as probabilities
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(ValueError, match="look like probabilities"):
            lik.check_logits(logits.softmax(-1).to(dtype).detach(), "test")
