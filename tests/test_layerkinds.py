"""Kronecker blocks for every layer kind (curvkit.layerkinds): weight sharing (expand / reduce) against
curvlinops and the exact GGN, convolutions with groups, embeddings, normalisation layers, attention,
mixed models and the operator interface, misuse errors.

Dense references: ``dense_ggn_positions`` (the exact GGN of a (B, *P, C)-output model, per-position output
Hessians, torch.func Jacobians) and curvlinops 3.x's ``KFACLinearOperator`` (optional)."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor, nn
from torch.func import functional_call, jacrev

from curvkit.curvature.estimators import KroneckerEstimator
from curvkit.likelihoods import CrossEntropy, Gaussian, Likelihood
from curvkit.linalg.layout import ParamLayout

pytestmark = pytest.mark.usefixtures("float64_default")


# ---------------------------------------------------------------------------------------------- references
def dense_ggn_positions(model: nn.Module, lik: Likelihood, X: Tensor, y: Tensor | None = None) -> Tensor:
    """Exact GGN sum_n J_n^T H_n J_n of the reduced loss, H_n block-diagonal over the positions of sample n
    (padded positions zero through y), over the trainable parameters in named_parameters() order."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    def f(ps: dict[str, Tensor]) -> Tensor:
        return functional_call(model, ps, (X,))

    out = f(params).detach()
    J = jacrev(f)(params)  # name -> (B, *P, C, *shape)
    Jf = torch.cat([J[n].reshape(*out.shape, -1) for n in names], dim=-1)  # (B, *P, C, d)
    H = lik.output_hessian(out, y)  # (B, *P, C, C)
    G = torch.einsum("...ci,...cd,...dj->ij", Jf, H, Jf)
    return G * lik.scale(lik.num_terms(out, y))


class ClassesSecond(nn.Module):
    """curvlinops reads CrossEntropyLoss logits as (batch, classes, positions...): move the classes."""

    def __init__(self, net: nn.Module):
        super().__init__()
        self.net = net

    def forward(self, x: Tensor) -> Tensor:
        out = self.net(x)
        return out.movedim(-1, 1) if out.dim() > 2 else out


def curvlinops_kfac(model: nn.Module, loss: nn.Module, batches, fisher: str, approx: str, seed: int = 3,
                    mc_samples: int = 1) -> Tensor:
    cl = pytest.importorskip("curvlinops")
    net = ClassesSecond(model) if isinstance(loss, nn.CrossEntropyLoss) else model
    params = [p for p in net.parameters() if p.requires_grad]
    op = cl.KFACLinearOperator(net, loss, params, batches, fisher_type=fisher, kfac_approx=approx,
                               separate_weight_and_bias=False, seed=seed, mc_samples=mc_samples,
                               check_deterministic=False)
    return op @ torch.eye(sum(p.numel() for p in params))


def block(M: Tensor, model: nn.Module, names: list[str]) -> Tensor:
    """Rows and columns of the named parameters (flat layout order) of a dense matrix."""
    lay = ParamLayout.from_module(model)
    sl = lay.slices()
    idx = torch.cat([torch.arange(sl[n].start, sl[n].stop) for n in names])
    return M[idx[:, None], idx[None, :]]


def rel(a: Tensor, b: Tensor) -> float:
    return float((a - b).norm() / b.norm())


def seq_mlp(seed: int = 0, d: int = 5, h: int = 6, c: int = 3) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d, h), nn.Tanh(), nn.Linear(h, c)).double()


def seq_data(B=3, T=4, d=5, c=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, d, generator=g), torch.randint(0, c, (B, T), generator=g)


# ---------------------------------------------------------------------------------------------- weight sharing
METHODS = [("type-2", "kflr"), ("mc", "kfac"), ("empirical", "empirical")]


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("fisher,method", METHODS)
def test_linear_on_sequences_equals_curvlinops(fisher, method, approx):
    """Linear layers on (B, T, d) inputs with per-token cross-entropy (two batches of unequal size):
    expand and reduce, type-2 / MC (the same sampled labels: same seed, same sampling order) / empirical,
    equal curvlinops' KFACLinearOperator (joint [W | b] blocks) at float64 rounding."""
    model = seq_mlp()
    batches = [seq_data(3, 4, seed=0), seq_data(2, 4, seed=1)]
    ref = curvlinops_kfac(model, nn.CrossEntropyLoss(), batches, fisher, approx)
    est = KroneckerEstimator(model, CrossEntropy(), method, weight_sharing=approx, seed=3).update(batches)
    assert torch.allclose(est.operator().to_dense(), ref, atol=1e-13, rtol=1e-11)


@pytest.mark.parametrize("fisher,method", METHODS)
def test_gaussian_sum_on_sequences_equals_curvlinops(fisher, method):
    """MSELoss(reduction='sum') = Gaussian(sigma^2 = 1/2) summed over positions, (B, T, C) outputs."""
    model = seq_mlp(1)
    X, _ = seq_data()
    y = torch.randn(3, 4, 3, generator=torch.Generator().manual_seed(5))
    ref = curvlinops_kfac(model, nn.MSELoss(reduction="sum"), [(X, y)], fisher, "expand")
    est = KroneckerEstimator(model, Gaussian("sum", sigma=0.5**0.5), method, seed=3).update((X, y))
    assert torch.allclose(est.operator().to_dense(), ref, atol=1e-12, rtol=1e-11)


def test_mc_with_several_samples_equals_curvlinops():
    model = seq_mlp(2)
    X, y = seq_data(seed=2)
    ref = curvlinops_kfac(model, nn.CrossEntropyLoss(), [(X, y)], "mc", "expand", mc_samples=3)
    est = KroneckerEstimator(model, CrossEntropy(), "kfac", mc_samples=3, seed=3).update((X, y))
    assert torch.allclose(est.operator().to_dense(), ref, atol=1e-13, rtol=1e-11)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
@pytest.mark.parametrize("fisher,method", METHODS[:2])
def test_conv2d_equals_curvlinops(fisher, method, approx):
    """Conv2d (padding, stride) + Linear head with (B, C) outputs: expand and reduce equal curvlinops."""
    torch.manual_seed(0)
    cnn = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.Tanh(), nn.Conv2d(3, 2, 2, stride=2), nn.Flatten(),
                        nn.Linear(8, 3)).double()
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(4, 2, 4, 4, generator=g), torch.randint(0, 3, (4,), generator=g)
    ref = curvlinops_kfac(cnn, nn.CrossEntropyLoss(), [(X, y)], fisher, approx)
    est = KroneckerEstimator(cnn, CrossEntropy(), method, weight_sharing=approx, seed=3).update((X, y))
    assert torch.allclose(est.operator().to_dense(), ref, atol=1e-13, rtol=1e-11)


def test_expand_factor_scaling_against_curvlinops():
    """The stated convention (docs/architecture.md): expand puts the 1/R on G, curvlinops puts it on A;
    A_curvkit = R A_curvlinops and G_curvkit = G_curvlinops / R, the same product. Reduce: equal factors."""
    cl = pytest.importorskip("curvlinops")
    model = seq_mlp(3)
    X, y = seq_data(seed=3)
    R = X.shape[1]
    for approx, ratio in (("expand", R), ("reduce", 1)):
        op = cl.KFACLinearOperator(ClassesSecond(model), nn.CrossEntropyLoss(), list(model.parameters()), [(X, y)],
                                   fisher_type="type-2", kfac_approx=approx, separate_weight_and_bias=False,
                                   check_deterministic=False)
        op.compute_kronecker_factors()
        ours = KroneckerEstimator(model, CrossEntropy(), "kflr", weight_sharing=approx).update((X, y)).operator()
        for b, name in zip(ours.blocks, ("net.0", "net.2")):
            assert torch.allclose(b.A, ratio * op._input_covariances[name], atol=1e-12)
            assert torch.allclose(b.G, op._gradient_covariances[name] / ratio, atol=1e-12)


@pytest.mark.parametrize("approx", ["expand", "reduce"])
def test_kflr_is_exact_for_one_position_and_one_datum(approx):
    """With one position and one datum, KFLR (either mode) equals the exact GGN block of each layer."""
    model = seq_mlp(4)
    X, y = seq_data(B=1, T=1, seed=4)
    lik = CrossEntropy()
    G = dense_ggn_positions(model, lik, X)
    op = KroneckerEstimator(model, lik, "kflr", weight_sharing=approx).update((X, y)).operator()
    D = op.to_dense()
    for names in (["0.weight", "0.bias"], ["2.weight", "2.bias"]):
        assert torch.allclose(block(D, model, names), block(G, model, names), atol=1e-13)


def test_expand_is_exact_for_a_linear_layer_per_token():
    """Expand is exact for a single weight-shared linear layer with a per-token Gaussian loss and inputs
    identical at every position (the positions are then extra data points of the same layer)."""
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 3)).double()
    x = torch.randn(1, 1, 4).expand(1, 5, 4)
    y = torch.randn(1, 5, 3)
    lik = Gaussian("sum")
    G = dense_ggn_positions(model, lik, x)
    D = KroneckerEstimator(model, lik, "kflr").update((x, y)).operator().to_dense()
    assert torch.allclose(D, G, atol=1e-12)


def test_reduce_is_exact_with_pooled_output():
    """Reduce is exact for a weight-shared linear layer whose positions are pooled (summed) before the loss
    (one datum)."""
    torch.manual_seed(6)

    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 3)

        def forward(self, x):
            return self.lin(x).sum(1)

    model = Pooled().double()
    x, y = torch.randn(1, 5, 4), torch.randint(0, 3, (1,))
    lik = CrossEntropy()
    G = dense_ggn_positions(model, lik, x)
    D = KroneckerEstimator(model, lik, "kflr", weight_sharing="reduce").update((x, y)).operator().to_dense()
    assert torch.allclose(D, G, atol=1e-13)


def test_mean_divides_by_counted_positions_and_padding_changes_nothing():
    """reduction='mean' divides by the counted positions over all the data (padding excluded); padded
    positions' targets change nothing; the operator equals 'sum' / (counted positions)."""
    model = seq_mlp(7)
    X, y = seq_data(seed=7)
    y = y.clone()
    y[0, -2:] = -100
    y[2, -1] = -100
    lik = CrossEntropy("mean", ignore_index=-100)
    est = KroneckerEstimator(model, lik, "kflr").update((X, y))
    assert est.num_data == 3 and est.num_terms == 12 - 3
    other = y.clone()
    other[0, -2:], other[2, -1] = -100, -100
    D = est.operator().to_dense()
    D_sum = KroneckerEstimator(model, CrossEntropy("sum", ignore_index=-100), "kflr").update((X, y)).operator().to_dense()
    assert torch.allclose(D, D_sum / 9, atol=1e-14)
    # the padded positions' output vectors are zero: the head's G equals that of the data without them
    head_G = est.operator().blocks[1].G
    keep = y != -100
    f = model(X).detach()
    S = CrossEntropy().output_hessian_sqrt(f)  # (B, T, C, C)
    hidden = torch.tanh(model[0](X)).detach()
    ref = torch.zeros(3, 3)
    for c in range(3):
        v = (S[..., c] * keep[..., None]).reshape(3, 4, 3)
        ref += torch.einsum("btc,btd->cd", v, v) / 4  # expand: 1/R on G
    assert torch.allclose(head_G, ref / 3 * (3 / 9), atol=1e-14)
    assert hidden.shape == (3, 4, 6)


def test_sequence_kflr_has_curvlinops_cross_position_terms():
    """KFLR back-propagates column c of every position's square root at once (curvlinops' type-2, C passes,
    not C * T): where positions are summed (reduce; blocks from per-sample gradients; layers that mix
    positions) its statistics have the cross-position terms S_t S_t'^T, so it differs from E[KFAC-MC],
    whose cross terms vanish in expectation (labels drawn independently per position). Head of a per-token
    MLP under reduce: G = sum_n sum_c (sum_t S_t[:, c]) (sum_s S_s[:, c])^T."""
    model = seq_mlp(8)
    X, y = seq_data(B=2, T=3, seed=8)
    lik = CrossEntropy("sum")
    kflr = KroneckerEstimator(model, lik, "kflr", weight_sharing="reduce").update((X, y)).operator().blocks[1].G
    S = lik.output_hessian_sqrt(model(X).detach())  # (B, T, C, C)
    all_at_once = torch.einsum("btcr,bsdr->cd", S, S)
    per_position = torch.einsum("btcr,btdr->cd", S, S)
    assert torch.allclose(kflr, all_at_once, atol=1e-13)
    assert rel(kflr, per_position) > 0.1
    mc = KroneckerEstimator(model, lik, "kfac", weight_sharing="reduce", mc_samples=4000, seed=0)
    G_mc = mc.update((X, y)).operator().blocks[1].G
    assert rel(G_mc, per_position) < 0.06  # observed 2.5% (KFLR: 197%)
