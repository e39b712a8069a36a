"""Kronecker factors: KFAC (MC), KFLR, KFRA, empirical KFAC; Conv2d (KFC); scale; errors."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from curvkit.curvature.kronecker import empirical_kfac, kfac, kflr, kfra
from curvkit.likelihoods import BernoulliBCE, CrossEntropy, Gaussian
from curvkit.linalg.kron import KroneckerOperator
from curvkit.models import mlp

pytestmark = pytest.mark.usefixtures("float64_default")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def data_for(lik, n, seed=0, d_in=4, c=3):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(n, d_in, generator=g)
    if isinstance(lik, CrossEntropy):
        return X, torch.randint(0, c, (n,), generator=g)
    if isinstance(lik, BernoulliBCE):
        return X, torch.rand(n, c, generator=g)
    return X, torch.randn(n, c, generator=g)


def test_input_factor_and_shapes():
    """A = mean of a_hat a_hat^T (bias entry 1 last), identical for every estimator; G shapes."""
    model = mlp([4, 5, 3], "tanh", seed=0, dtype=torch.float64)
    lik = CrossEntropy("mean")
    X, y = data_for(lik, 6)
    ops = [kflr(model, lik, (X, y)), kfac(model, lik, (X, y)), kfra(model, lik, (X, y)),
           empirical_kfac(model, lik, (X, y))]
    ah0 = torch.cat([X, torch.ones(6, 1)], 1)
    a1 = torch.tanh(model[0](X)).detach()
    ah1 = torch.cat([a1, torch.ones(6, 1)], 1)
    for op in ops:
        assert isinstance(op, KroneckerOperator)
        assert [(b.weight_name, b.bias_name) for b in op.blocks] == [("0.weight", "0.bias"), ("2.weight", "2.bias")]
        assert [tuple(b.G.shape) for b in op.blocks] == [(5, 5), (3, 3)]
        assert torch.allclose(op.blocks[0].A, ah0.T @ ah0 / 6)
        assert torch.allclose(op.blocks[1].A, ah1.T @ ah1 / 6)


def test_empirical_kfac_last_layer():
    """Empirical KFAC's last-layer G is the mean outer product of output gradients at the data labels."""
    model = mlp([4, 5, 3], "relu", seed=1, dtype=torch.float64)
    lik = CrossEntropy("mean")
    X, y = data_for(lik, 7, seed=1)
    g = lik.output_grad(model(X).detach(), y)
    assert torch.allclose(empirical_kfac(model, lik, (X, y)).blocks[1].G, g.T @ g / 7)


@pytest.mark.parametrize("lik", [CrossEntropy("mean"), BernoulliBCE("mean"), Gaussian("mean", sigma=0.7)])
def test_kfac_converges_to_kflr(lik):
    """MC Fisher is unbiased for the exact (KFLR) G: with 2000 samples x 8 data the relative Frobenius error
    of every G is < 6% (observed 0.25-1.9% for seed 0, vs 9-82% with one sample)."""
    model = mlp([4, 5, 3, 3], "tanh", seed=2, dtype=torch.float64)
    data = data_for(lik, 8, seed=3)
    ref = kflr(model, lik, data)
    few = kfac(model, lik, data, mc_samples=1, seed=0)
    many = kfac(model, lik, data, mc_samples=2000, seed=0)
    for f, m, r in zip(few.blocks, many.blocks, ref.blocks):
        assert torch.equal(m.A, r.A)
        assert rel(m.G, r.G) < 0.06
        assert rel(f.G, r.G) > rel(m.G, r.G)  # one sample is much noisier


@pytest.mark.parametrize("S", [1, 2, 7])
def test_kfac_single_layer_equals_sampled_output_fisher(S):
    """Single Linear layer: g = c, so G = (1/(N S)) sum_n sum_s c_ns c_ns^T with the labels drawn from
    torch.Generator().manual_seed(seed) for f repeated S times (S <= C: one pass per draw; S > C: square-root route)."""
    model = torch.nn.Linear(4, 3).double()
    lik = CrossEntropy("mean")
    X, y = data_for(lik, 6, seed=5)
    f = model(X).detach()
    f_rep = f.repeat(S, 1)  # the S draws come from one call on f repeated S times
    c = lik.output_grad(f_rep, lik.sample(f_rep, torch.Generator().manual_seed(11)))
    G = c.T @ c
    op = kfac(model, lik, (X, y), mc_samples=S, seed=11)
    assert torch.allclose(op.blocks[0].G, G / (6 * S), atol=1e-12)


def test_kfac_seeding():
    model = mlp([4, 5, 3], "tanh", seed=3, dtype=torch.float64)
    lik = CrossEntropy("mean")
    data = data_for(lik, 5)
    torch.manual_seed(0)
    a = kfac(model, lik, data, seed=7)
    torch.manual_seed(1)  # the global RNG is not used
    b = kfac(model, lik, data, seed=7)
    c = kfac(model, lik, data, seed=8)
    assert all(torch.equal(x.G, y.G) for x, y in zip(a.blocks, b.blocks))
    assert not torch.equal(a.blocks[0].G, c.blocks[0].G)
    with pytest.raises(ValueError, match="mc_samples"):
        kfac(model, lik, data, mc_samples=0)


def test_reduction_scale_and_batches():
    """'sum' = N x 'mean' (N on G); KFLR over a list of batches == over the concatenated data."""
    model = mlp([4, 5, 3], "tanh", seed=4, dtype=torch.float64)
    X, y = data_for(CrossEntropy(), 6)
    batches = [(X[:4], y[:4]), (X[4:], y[4:])]
    for fn in (kflr, kfra):
        mean = fn(model, CrossEntropy("mean"), (X, y))
        total = fn(model, CrossEntropy("sum"), (X, y))
        assert torch.allclose(total.to_dense(), 6 * mean.to_dense())
    split = kflr(model, CrossEntropy("mean"), batches)
    assert torch.allclose(split.to_dense(), kflr(model, CrossEntropy("mean"), (X, y)).to_dense())
    # KFRA is computed per batch (nested expectation), then averaged with weights B/N
    k1 = kfra(model, CrossEntropy("mean"), [batches[0]])
    k2 = kfra(model, CrossEntropy("mean"), [batches[1]])
    ks = kfra(model, CrossEntropy("mean"), batches)
    assert torch.allclose(ks.blocks[0].G, (4 * k1.blocks[0].G + 2 * k2.blocks[0].G) / 6)


def test_kfra_with_bias_free_layers_and_flatten():
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 3, bias=False), nn.ReLU(), nn.Linear(3, 2)).double()
    lik = Gaussian("mean")
    X, y = torch.randn(1, 2, 2), torch.randn(1, 2)
    a, b = kfra(model, lik, (X, y)), kflr(model, lik, (X.flatten(1), y))
    assert a.blocks[0].A.shape == (4, 4)
    assert torch.allclose(a.to_dense(), b.to_dense())


@pytest.mark.parametrize("lik", [CrossEntropy("mean", ignore_index=-100), Gaussian("sum", ignore_value=0.0)])
def test_kfra_padded_samples_have_no_output_curvature(lik):
    """Padding removes a sample from every curvature: KFRA's G_L (the mean output Hessian, Eq. 4.7) is zero
    at padded samples, so its output-layer block is KFLR's (the two coincide at the output layer) and the
    padded samples change G only through the count of the mean (scale N / M)."""
    model = mlp([4, 5, 3], "tanh", seed=4, dtype=torch.float64)
    X, y = data_for(lik, 7)
    if isinstance(lik, CrossEntropy):
        y[[1, 4]] = -100
    else:
        y[[1, 4]] = 0.0
    a, b = kfra(model, lik, (X, y)), kflr(model, lik, (X, y))
    torch.testing.assert_close(a.blocks[-1].G, b.blocks[-1].G, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(a.blocks[-1].A, b.blocks[-1].A, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------- Conv2d
def tiny_cnn(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Conv2d(2, 3, 3, padding=1, stride=2), nn.ReLU(), nn.Flatten(),
                         nn.Linear(3 * 3 * 3, 4)).double()


def test_conv_factor_shapes_and_reference():
    """KFC factors of a tiny CNN (5x5 input, k=3, padding 1, stride 2 -> 3x3 output, T = 9) against an
    explicit loop over output locations: A sums patches over locations, G averages over locations."""
    model = tiny_cnn()
    lik = CrossEntropy("mean")
    g = torch.Generator().manual_seed(1)
    X, y = torch.randn(3, 2, 5, 5, generator=g), torch.randint(0, 4, (3,), generator=g)
    op = kflr(model, lik, (X, y))
    conv = op.blocks[0]
    assert (conv.weight_name, conv.bias_name) == ("0.weight", "0.bias")
    assert conv.G.shape == (3, 3) and conv.A.shape == (2 * 9 + 1, 2 * 9 + 1)
    assert op.blocks[1].A.shape == (28, 28)
    # reference A by slicing the zero-padded input (weight order (C, kh, kw), bias last)
    Xp = F.pad(X, (1, 1, 1, 1))
    A = torch.zeros(19, 19)
    for i in range(3):
        for j in range(3):
            p = Xp[:, :, 2 * i:2 * i + 3, 2 * j:2 * j + 3].reshape(3, -1)
            ph = torch.cat([p, torch.ones(3, 1)], 1)
            A += ph.T @ ph
    assert torch.allclose(conv.A, A / 3)
    # reference G: per-location gradients of the conv output for each column of the output-Hessian root
    h = model[0](X).detach().requires_grad_(True)
    f = model[3](model[2](model[1](h)))
    S = lik.output_hessian_sqrt(f.detach())
    G = torch.zeros(3, 3)
    for r in range(S.shape[2]):
        (gh,) = torch.autograd.grad(f, h, S[:, :, r], retain_graph=True)  # (3, 3, 3, 3)
        gt = gh.permute(0, 2, 3, 1).reshape(-1, 3)
        G += gt.T @ gt / 9
    assert torch.allclose(conv.G, G / 3)
    # KFAC on the CNN: same A, G shapes
    kop = kfac(model, lik, (X, y), seed=0)
    assert torch.allclose(kop.blocks[0].A, conv.A) and kop.blocks[0].G.shape == (3, 3)


@pytest.mark.parametrize("kwargs", [dict(padding="same", dilation=2), dict(stride=(1, 2), padding=(2, 1)),
                                    dict(padding=1, padding_mode="reflect", bias=False)])
def test_conv_patches_reproduce_conv_output(kwargs):
    """The unfolded patches (weight order (C, kh, kw)) satisfy h[n, :, t] = W.reshape(out, -1) p[n, t] + b
    for string/tuple padding, dilation, stride and non-zero padding modes."""
    from curvkit.layerkinds.conv import conv_patches

    torch.manual_seed(3)
    conv = nn.Conv2d(2, 3, 3, **kwargs).double()
    X = torch.randn(2, 2, 6, 7)
    P = conv_patches(conv, X)  # (B, T, C*9)
    h = P @ conv.weight.reshape(3, -1).T + (conv.bias if conv.bias is not None else 0)
    ref = conv(X).detach()
    assert torch.allclose(h.transpose(1, 2).reshape(ref.shape), ref)


class TwoTower(nn.Module):
    """A non-Sequential module tree with nested names and parameter-free modules."""

    def __init__(self):
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(4, 5), nn.Tanh())
        self.head = nn.ModuleDict({"out": nn.Linear(5, 3, bias=False)})
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        return self.head["out"](self.drop(self.enc(x)))


def test_arbitrary_module_tree_kflr_exact_for_one_datum():
    from reference import block_mask, dense_ggn

    torch.manual_seed(4)
    model = TwoTower().double()
    lik = Gaussian("sum")
    data = (torch.randn(1, 4), torch.randn(1, 3))
    op = kflr(model, lik, data)
    assert [(b.weight_name, b.bias_name) for b in op.blocks] == [("enc.0.weight", "enc.0.bias"),
                                                                  ("head.out.weight", None)]
    assert torch.allclose(op.to_dense(), dense_ggn(model, lik, data) * block_mask(model), atol=1e-12)


@pytest.mark.parametrize("bias", [True, False])
def test_one_by_one_conv_matches_linear(bias):
    """A Conv2d whose output is 1x1 is a Linear layer on the flattened input: identical factors."""
    torch.manual_seed(2)
    conv_net = nn.Sequential(nn.Conv2d(2, 3, 3, bias=bias), nn.Tanh(), nn.Flatten(), nn.Linear(3, 4)).double()
    lin_net = nn.Sequential(nn.Flatten(), nn.Linear(18, 3, bias=bias), nn.Tanh(), nn.Linear(3, 4)).double()
    assert kflr(conv_net, CrossEntropy(), (torch.randn(1, 2, 3, 3), torch.zeros(1, dtype=torch.long))
                ).blocks[0].A.shape == ((19, 19) if bias else (18, 18))
    with torch.no_grad():
        lin_net[1].weight.copy_(conv_net[0].weight.reshape(3, 18))
        if bias:
            lin_net[1].bias.copy_(conv_net[0].bias)
        lin_net[3].weight.copy_(conv_net[3].weight)
        lin_net[3].bias.copy_(conv_net[3].bias)
    lik = CrossEntropy("sum")
    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(5, 2, 3, 3, generator=g), torch.randint(0, 4, (5,), generator=g)
    for fn in (kflr, lambda m, lk, d: kfac(m, lk, d, mc_samples=3, seed=4)):
        a, b = fn(conv_net, lik, (X, y)), fn(lin_net, lik, (X, y))
        for ba, bb in zip(a.blocks, b.blocks):
            assert torch.allclose(ba.G, bb.G) and torch.allclose(ba.A, bb.A)
        assert torch.allclose(a.to_dense(), b.to_dense())  # same flat order: conv weight (3,2,3,3) row-major


# ---------------------------------------------------------------------------------------------- errors
class _CallsTwice(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3).double()

    def forward(self, x):
        return self.lin(torch.tanh(self.lin(x)))


@pytest.mark.parametrize("fn", [kfac, kflr, kfra, empirical_kfac])
def test_unsupported_layers_raise_naming_module(fn):
    lik = CrossEntropy()
    X, y = torch.randn(4, 4), torch.randint(0, 3, (4,))
    bn = nn.Sequential(nn.Linear(4, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3)).double()
    with pytest.raises(ValueError, match=r"module '1' \(BatchNorm1d\)"):
        fn(bn, lik, (X, y))
    prelu = nn.Sequential(nn.Linear(4, 5), nn.PReLU(), nn.Linear(5, 3)).double()
    if fn is kfra:  # KFRA's recursion is defined on MLP chains only
        with pytest.raises(ValueError, match=r"module '1' \(PReLU\) is not supported in an MLP chain"):
            fn(prelu, lik, (X, y))
    else:
        fn(prelu, lik, (X, y))  # an unregistered class: the per-sample fallback (curvkit.layerkinds.generic)


def test_other_errors():
    lik = CrossEntropy()
    X, y = torch.randn(4, 2, 5, 5), torch.randint(0, 4, (4,))
    with pytest.raises(ValueError, match=r"module '0' \(Conv2d\)"):
        kfra(tiny_cnn(), lik, (X, y))
    inplace = nn.Sequential(nn.Linear(4, 5), nn.ReLU(inplace=True), nn.Linear(5, 3)).double()
    with pytest.raises(ValueError, match=r"module '0'.*modified in place"):
        kflr(inplace, lik, (torch.randn(4, 4), torch.randint(0, 3, (4,))))
    shared = nn.Linear(3, 3).double()
    twice = nn.Sequential(shared, nn.Tanh(), shared)
    with pytest.raises(ValueError, match=r"module '0' \(Linear\) is registered under 2 names"):
        kfac(twice, lik, (torch.randn(4, 3), torch.randint(0, 3, (4,))))
    with pytest.raises(ValueError, match=r"module 'lin' was called 2 times"):  # reused inside forward()
        kfac(_CallsTwice(), lik, (torch.randn(4, 3), torch.randint(0, 3, (4,))))
    model = mlp([4, 3], seed=0, dtype=torch.float64)
    with pytest.raises(ValueError, match="NaN"):
        kflr(model, lik, (torch.full((2, 4), float("nan")), torch.zeros(2, dtype=torch.long)))
