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
from curvkit.structure import curvature_kernels

pytestmark = pytest.mark.usefixtures("float64_default")


# ---------------------------------------------------------------------------------------------- references
def dense_ggn_positions(model: nn.Module, lik: Likelihood, X: Tensor, y: Tensor | None = None) -> Tensor:
    """Exact GGN sum_n J_n^T H_n J_n of the reduced loss, H_n block-diagonal over the positions of sample n
    (padded positions zero through y), over the trainable parameters in named_parameters() order."""
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}

    def f(ps: dict[str, Tensor]) -> Tensor:
        return functional_call(model, ps, (X,))

    with curvature_kernels():  # unfused (math) attention
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


# ---------------------------------------------------------------------------------------------- convolutions
def test_conv1d_equals_conv2d_of_height_one():
    """Conv1d (padding, stride, dilation, reflect padding) blocks equal those of the same model written with a
    Conv2d of kernel (1, k) on a height-1 image (whose blocks equal curvlinops'), expand and reduce."""
    torch.manual_seed(9)
    c1 = nn.Conv1d(2, 3, 3, stride=2, padding=2, dilation=2, padding_mode="reflect").double()
    c2 = nn.Conv2d(2, 3, (1, 3), stride=(1, 2), padding=(0, 2), dilation=(1, 2), padding_mode="reflect").double()
    with torch.no_grad():
        c2.weight.copy_(c1.weight[:, :, None, :])
        c2.bias.copy_(c1.bias)
    m1 = nn.Sequential(c1, nn.Tanh(), nn.Flatten(), nn.LazyLinear(3).double())
    X = torch.randn(4, 2, 7, generator=torch.Generator().manual_seed(9))
    m1(X)  # materialise the lazy head
    m2 = nn.Sequential(c2, nn.Tanh(), nn.Flatten(), m1[3])
    y = torch.randint(0, 3, (4,), generator=torch.Generator().manual_seed(9))
    assert torch.allclose(m1(X), m2(X[:, :, None, :]))
    for mode in ("expand", "reduce"):
        o1 = KroneckerEstimator(m1, CrossEntropy(), "kflr", weight_sharing=mode).update((X, y)).operator()
        o2 = KroneckerEstimator(m2, CrossEntropy(), "kflr", weight_sharing=mode).update((X[:, :, None, :], y)).operator()
        for b1, b2 in zip(o1.blocks, o2.blocks):
            assert torch.allclose(b1.G, b2.G, atol=1e-13) and torch.allclose(b1.A, b2.A, atol=1e-13)


class SplitGroups(nn.Module):
    """A grouped convolution written as g separate convolutions on channel slices."""

    def __init__(self, conv: nn.Conv2d):
        super().__init__()
        g = conv.groups
        o, c = conv.out_channels // g, conv.in_channels // g
        self.g, self.c = g, c
        self.parts = nn.ModuleList(nn.Conv2d(c, o, conv.kernel_size, conv.stride, conv.padding).double()
                                   for _ in range(g))
        with torch.no_grad():
            for j, p in enumerate(self.parts):
                p.weight.copy_(conv.weight[j * o:(j + 1) * o])
                p.bias.copy_(conv.bias[j * o:(j + 1) * o])

    def forward(self, x):
        return torch.cat([p(x[:, j * self.c:(j + 1) * self.c]) for j, p in enumerate(self.parts)], dim=1)


@pytest.mark.parametrize("groups,out", [(2, 4), (4, 4)])  # grouped, depthwise
@pytest.mark.parametrize("mode", ["expand", "reduce"])
def test_grouped_conv_has_one_block_per_group(groups, out, mode):
    """A grouped (and a depthwise) Conv2d gets one block per group, equal to the blocks of the same model
    written with one convolution per group; the operators agree on every product."""
    torch.manual_seed(10)
    conv = nn.Conv2d(4, out, 3, padding=1, groups=groups).double()
    head = nn.Linear(out * 16, 3).double()
    m1 = nn.Sequential(conv, nn.Tanh(), nn.Flatten(), head)
    m2 = nn.Sequential(SplitGroups(conv), nn.Tanh(), nn.Flatten(), head)
    g = torch.Generator().manual_seed(10)
    X, y = torch.randn(3, 4, 4, 4, generator=g), torch.randint(0, 3, (3,), generator=g)
    o1 = KroneckerEstimator(m1, CrossEntropy(), "kflr", weight_sharing=mode).update((X, y)).operator()
    o2 = KroneckerEstimator(m2, CrossEntropy(), "kflr", weight_sharing=mode).update((X, y)).operator()
    assert [b.label for b in o1.blocks[:groups]] == [f"0.group{j}" for j in range(groups)]
    for b1, b2 in zip(o1.blocks, o2.blocks):
        assert torch.allclose(b1.G, b2.G, atol=1e-13) and torch.allclose(b1.A, b2.A, atol=1e-13)
    # the same curvature, in each model's parameter order
    v2 = torch.randn(o2.layout.dim, 2, generator=g)
    w2 = o2 @ v2
    parts = o2.layout.unflatten(v2)
    outs = o2.layout.unflatten(w2)
    o = out // groups

    def merged(ts):
        W = torch.cat([ts[2 * j] for j in range(groups)])
        b = torch.cat([ts[2 * j + 1] for j in range(groups)])
        return [W, b, ts[-2], ts[-1]]

    v1 = o1.layout.flatten(merged(parts))
    assert torch.allclose(o1 @ v1, o1.layout.flatten(merged(outs)), atol=1e-12)
    assert o == out // groups


def test_grouped_conv_kflr_is_exact_per_group_for_one_datum():
    """One datum, one output location: each group's block equals the exact GGN's rows/columns of that group."""
    torch.manual_seed(11)
    model = nn.Sequential(nn.Conv1d(4, 4, 3, groups=2), nn.Flatten(), nn.Linear(4, 3)).double()
    X, y = torch.randn(1, 4, 3), torch.randint(0, 3, (1,))
    G = dense_ggn_positions(model, CrossEntropy(), X)
    op = KroneckerEstimator(model, CrossEntropy(), "kflr").update((X, y)).operator()
    lay = op.layout
    for b, ix in zip(op.blocks[:2], op._index[:2]):
        D = torch.kron(b.G, b.A)
        assert torch.allclose(D, G[ix.perm[:, None], ix.perm[None, :]], atol=1e-13)
    assert lay.dim == G.shape[0]


# ---------------------------------------------------------------------------------------------- embeddings
def tiny_lm(V=7, D=4, C=5, padding_idx=None):
    torch.manual_seed(12)
    return nn.Sequential(nn.Embedding(V, D, padding_idx=padding_idx), nn.Tanh(), nn.Linear(D, C)).double()


def test_embedding_block_is_exact_for_one_token():
    """One datum, one position: the embedding block G (x) diag(counts) (W viewed as W^T) equals the exact GGN's
    rows and columns of the embedding weight (zero outside the token's row)."""
    model = tiny_lm()
    ids, y = torch.tensor([[3]]), torch.tensor([[1]])
    G = dense_ggn_positions(model, CrossEntropy(), ids)
    op = KroneckerEstimator(model, CrossEntropy(), "kflr").update((ids, y)).operator()
    b = op.blocks[0]
    assert b.diagonal_input and b.A.shape == (7,) and b.G.shape == (4, 4)
    assert torch.allclose(block(op.to_dense(), model, ["0.weight"]), block(G, model, ["0.weight"]), atol=1e-13)


def test_embedding_block_relation_for_a_sequence():
    """One datum with distinct tokens: the exact GGN has (token v, token v) blocks GGN_vv = sum_c g_r g_r^T
    at the position r holding v; expand gives diag(counts) (x) mean_r(sum_c g_r g_r^T): its G is the mean of
    the exact diagonal token blocks, its token-diagonal blocks are each equal to that mean, it has no blocks
    between different tokens, and its trace equals the exact block's trace."""
    model = tiny_lm()
    ids, y = torch.tensor([[2, 5, 0, 6]]), torch.tensor([[1, 0, 4, 2]])
    G = dense_ggn_positions(model, CrossEntropy("sum"), ids)
    E = block(G, model, ["0.weight"]).reshape(7, 4, 7, 4)  # (v, d, v', d')
    op = KroneckerEstimator(model, CrossEntropy("sum"), "kflr").update((ids, y)).operator()
    b = op.blocks[0]
    used = [2, 5, 0, 6]
    mean_vv = sum(E[v, :, v, :] for v in used) / 4
    assert torch.allclose(b.G * b.A[2], mean_vv, atol=1e-13)
    assert torch.allclose(b.A, torch.bincount(ids.reshape(-1), minlength=7).double())
    D = block(op.to_dense(), model, ["0.weight"])
    assert torch.allclose(D.trace(), E.reshape(28, 28).trace(), atol=1e-12)


def test_embedding_padding_idx_rows_get_no_curvature():
    """Positions holding padding_idx count as zero input rows: that row's entries of the block are zero, as
    in the exact GGN (torch never differentiates that row); a sequence of length 1 is exact."""
    model = tiny_lm(padding_idx=0)
    ids, y = torch.tensor([[0, 3, 0], [4, 0, 3]]), torch.tensor([[1, 2, 3], [0, 1, 4]])
    op = KroneckerEstimator(model, CrossEntropy(), "kfac").update((ids, y)).operator()
    assert op.blocks[0].A[0] == 0 and op.blocks[0].A[3] == 2 / 2 and op.blocks[0].A[4] == 1 / 2
    diag = op.diagonal().tensors[0]  # (V, D) like the weight
    assert bool((diag[0] == 0).all()) and bool((diag[3] > 0).all())
    one = (torch.tensor([[3]]), torch.tensor([[2]]))
    G = dense_ggn_positions(model, CrossEntropy(), one[0])
    D = KroneckerEstimator(model, CrossEntropy(), "kflr").update(one).operator().to_dense()
    assert torch.allclose(block(D, model, ["0.weight"]), block(G, model, ["0.weight"]), atol=1e-13)


@pytest.mark.parametrize("kw,match", [({"max_norm": 1.0}, "max_norm"), ({"scale_grad_by_freq": True}, "scale_grad"),
                                      ({"sparse": True}, "sparse")])
def test_embedding_options_refused(kw, match):
    model = nn.Sequential(nn.Embedding(5, 3, **kw), nn.Linear(3, 2)).double()
    with pytest.raises(ValueError, match=rf"module '0' \(Embedding\) has {match}"):
        KroneckerEstimator(model, CrossEntropy())
    model[0].weight.requires_grad_(False)  # frozen: no block, no refusal
    KroneckerEstimator(model, CrossEntropy())


def test_embedding_ignores_reduce():
    """weight_sharing='reduce' applies to Linear/Conv/attention; an embedding keeps expand (documented)."""
    model = tiny_lm()
    ids, y = torch.tensor([[2, 5, 2]]), torch.tensor([[1, 0, 4]])
    e = KroneckerEstimator(model, CrossEntropy(), "kflr").update((ids, y)).operator()
    r = KroneckerEstimator(model, CrossEntropy(), "kflr", weight_sharing="reduce").update((ids, y)).operator()
    assert torch.equal(e.blocks[0].A, r.blocks[0].A) and torch.allclose(e.blocks[0].G, r.blocks[0].G)
    assert not torch.allclose(e.blocks[1].G, r.blocks[1].G)


# ---------------------------------------------------------------------------------------------- normalisation
class ChannelsLast(nn.Module):
    def forward(self, x):
        return x.flatten(2).mean(-1)


def norm_models():
    torch.manual_seed(13)
    ln = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3)).double()
    rms = nn.Sequential(nn.Linear(4, 5), nn.RMSNorm(5, eps=1e-5), nn.Tanh(), nn.Linear(5, 3)).double()
    gn = nn.Sequential(nn.Unflatten(1, (2, 2)), nn.Conv1d(2, 4, 1), nn.GroupNorm(2, 4), nn.Tanh(), nn.Flatten(),
                       nn.Linear(8, 3)).double()
    bn = nn.Sequential(nn.Unflatten(1, (2, 2)), nn.Conv1d(2, 4, 1), nn.BatchNorm1d(4), nn.Tanh(), nn.Flatten(),
                       nn.Linear(8, 3)).double()
    with torch.no_grad():  # non-trivial affine parameters and running statistics
        for m in (ln, rms, gn, bn):
            for mod in m.modules():
                if isinstance(mod, (nn.LayerNorm, nn.RMSNorm, nn.GroupNorm, nn.BatchNorm1d)):
                    mod.weight.normal_()
                    if getattr(mod, "bias", None) is not None:
                        mod.bias.normal_()
        bn[2].running_mean.normal_()
        bn[2].running_var.uniform_(0.5, 2.0)
    return {"layernorm": (ln, "1"), "rmsnorm": (rms, "1"), "groupnorm": (gn, "2"), "batchnorm": (bn.eval(), "2")}


@pytest.mark.parametrize("name", ["layernorm", "rmsnorm", "groupnorm", "batchnorm"])
@pytest.mark.parametrize("structure", ["full", "diag"])
def test_norm_block_is_the_exact_ggn_block(name, structure):
    """(B, C) outputs: a normalisation layer's block from per-sample gradients is the exact GGN block of its
    (weight, bias) for any batch (norm_structure='full'), or its diagonal ('diag')."""
    model, label = norm_models()[name]
    g = torch.Generator().manual_seed(14)
    X, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
    names = [n for n, _ in model.named_parameters() if n.startswith(label + ".")]
    G = block(dense_ggn_positions(model, CrossEntropy(), X), model, names)
    op = KroneckerEstimator(model, CrossEntropy(), "kflr", norm_structure=structure).update((X, y)).operator()
    D = block(op.to_dense(), model, names)
    assert torch.allclose(D, G if structure == "full" else torch.diag(G.diagonal()), atol=1e-13)
    b = next(b for b in op.blocks if b.weight_name == names[0])
    assert not b.factored and b.G.shape == (1, 1)


def test_norm_block_with_zero_scale_and_no_bias():
    """x_hat is recomputed from the input, so a zero scale (where (y - b) / w fails) and a LayerNorm without a
    bias are exact too."""
    torch.manual_seed(15)
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5, bias=False), nn.Tanh(), nn.Linear(5, 3)).double()
    with torch.no_grad():
        model[1].weight.zero_()
    X, y = torch.randn(5, 4), torch.randint(0, 3, (5,))
    G = block(dense_ggn_positions(model, CrossEntropy(), X), model, ["1.weight"])
    D = block(KroneckerEstimator(model, CrossEntropy(), "kflr").update((X, y)).operator().to_dense(), model,
              ["1.weight"])
    assert G.abs().max() > 1e-3 and torch.allclose(D, G, atol=1e-13)


def test_norm_block_relation_with_positions():
    """(B, T, C) outputs: the LayerNorm block from KFLR's vectors (column c at every position) is
    sum_n sum_c u_{n,c} u_{n,c}^T with u_{n,c} = sum_t J_{n,t}^T S_{n,t}[:, c] (cross-position terms, as
    curvlinops' type-2), equal to the exact GGN block only for one position."""
    torch.manual_seed(16)
    model = nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5), nn.Tanh(), nn.Linear(5, 3)).double()
    X, y = torch.randn(2, 3, 4), torch.randint(0, 3, (2, 3))
    lik = CrossEntropy("sum")
    names = ["1.weight", "1.bias"]
    params = {n: p.detach() for n, p in model.named_parameters()}
    f = model(X).detach()
    J = jacrev(lambda ps: functional_call(model, {**params, **ps}, (X,)))({n: params[n] for n in names})
    Jf = torch.cat([J[n].reshape(2, 3, 3, -1) for n in names], -1)  # (B, T, C, P)
    S = lik.output_hessian_sqrt(f)  # (B, T, C, R)
    u = torch.einsum("btcp,btcr->brp", Jf, S)
    ref = torch.einsum("brp,brq->pq", u, u)
    D = block(KroneckerEstimator(model, lik, "kflr").update((X, y)).operator().to_dense(), model, names)
    assert torch.allclose(D, ref, atol=1e-13)
    assert rel(D, block(dense_ggn_positions(model, lik, X), model, names)) > 0.05
    one = KroneckerEstimator(model, lik, "kflr").update((X[:, :1], y[:, :1])).operator().to_dense()
    assert torch.allclose(block(one, model, names), block(dense_ggn_positions(model, lik, X[:, :1]), model, names),
                          atol=1e-13)


def test_batchnorm_in_training_mode_is_refused():
    model = norm_models()["batchnorm"][0].train()
    with pytest.raises(ValueError, match=r"module '2'.*batch statistics"):
        KroneckerEstimator(model, CrossEntropy())


# ---------------------------------------------------------------------------------------------- attention
class SeparateAttention(nn.Module):
    """nn.MultiheadAttention written with four nn.Linear projections (batch first)."""

    def __init__(self, mha: nn.MultiheadAttention):
        super().__init__()
        E = mha.embed_dim
        self.h = mha.num_heads
        self.q, self.k, self.v, self.out = (nn.Linear(E, E).double() for _ in range(4))
        with torch.no_grad():
            for i, lin in enumerate((self.q, self.k, self.v)):
                lin.weight.copy_(mha.in_proj_weight[i * E:(i + 1) * E])
                lin.bias.copy_(mha.in_proj_bias[i * E:(i + 1) * E])
            self.out.weight.copy_(mha.out_proj.weight)
            self.out.bias.copy_(mha.out_proj.bias)

    def forward(self, x, mask=None):
        B, T, E = x.shape

        def heads(t):
            return t.reshape(B, T, self.h, E // self.h).transpose(1, 2)

        o = nn.functional.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)),
                                                       attn_mask=mask)
        return self.out(o.transpose(1, 2).reshape(B, T, E))


class AttnModel(nn.Module):
    def __init__(self, attn, causal: bool):
        super().__init__()
        torch.manual_seed(17)
        self.inp = nn.Linear(3, 4).double()
        self.attn = attn
        self.head = nn.Linear(4, 5).double()
        self.causal = causal

    def forward(self, x):
        h = self.inp(x)
        T = h.shape[1]
        if isinstance(self.attn, nn.MultiheadAttention):
            mask = torch.ones(T, T, dtype=torch.bool).triu(1) if self.causal else None
            a = self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        else:
            mask = torch.ones(T, T, dtype=torch.bool).tril() if self.causal else None
            a = self.attn(h, mask)
        return self.head(torch.tanh(h + a))


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("method,mode", [("kflr", "expand"), ("kflr", "reduce"), ("kfac", "expand"),
                                         ("empirical", "reduce")])
def test_attention_blocks_equal_separate_linears(method, mode, causal):
    """nn.MultiheadAttention's q, k, v and output blocks (packed in_proj rows, out_proj) equal the blocks of
    the same model written with four nn.Linear projections (same sampled labels for kfac)."""
    torch.manual_seed(18)
    mha = nn.MultiheadAttention(4, 2, batch_first=True).double()
    m1, m2 = AttnModel(mha, causal), AttnModel(SeparateAttention(mha), causal)
    m2.inp.load_state_dict(m1.inp.state_dict())
    m2.head.load_state_dict(m1.head.state_dict())
    g = torch.Generator().manual_seed(19)
    X, y = torch.randn(3, 5, 3, generator=g), torch.randint(0, 5, (3, 5), generator=g)
    assert torch.allclose(m1(X), m2(X), atol=1e-13)
    o1 = KroneckerEstimator(m1, CrossEntropy(), method, weight_sharing=mode, seed=1).update((X, y)).operator()
    o2 = KroneckerEstimator(m2, CrossEntropy(), method, weight_sharing=mode, seed=1).update((X, y)).operator()
    assert [b.name for b in o1.blocks] == ["inp.weight", "attn.q", "attn.k", "attn.v", "attn.out_proj.weight",
                                           "head.weight"]
    assert len(o2.blocks) == 6
    for b1, b2 in zip(o1.blocks, o2.blocks):
        assert torch.allclose(b1.G, b2.G, atol=1e-12) and torch.allclose(b1.A, b2.A, atol=1e-12)
    # and the operators are the same matrix in each model's parameter order
    D1, D2 = o1.to_dense(), o2.to_dense()
    perm = _separate_order(m1, m2)
    assert torch.allclose(D1, D2[perm[:, None], perm[None, :]], atol=1e-12)


def _separate_order(m1: nn.Module, m2: nn.Module) -> Tensor:
    """For each flat entry of m1 (packed attention), the flat entry of m2 (separate Linear) holding it."""
    l2 = ParamLayout.from_module(m2).slices()
    E = 4
    idx = []
    for name, p in m1.named_parameters():
        if name == "attn.in_proj_weight":
            for part in "qkv":
                s = l2[f"attn.{part}.weight"]
                idx.append(torch.arange(s.start, s.stop))
            assert p.shape == (3 * E, E)
        elif name == "attn.in_proj_bias":
            idx += [torch.arange(l2[f"attn.{part}.bias"].start, l2[f"attn.{part}.bias"].stop) for part in "qkv"]
        else:
            key = name.replace("attn.out_proj", "attn.out")
            idx.append(torch.arange(l2[key].start, l2[key].stop))
    return torch.cat(idx)


def test_attention_in_a_transformer_encoder_layer_and_the_module_is_untouched():
    """A nn.TransformerEncoderLayer in eval mode (its fast path off during the capture): the attention output is
    what the module computes, the model and torch's settings are unchanged afterwards."""
    torch.manual_seed(20)
    layer = nn.TransformerEncoderLayer(4, 2, 8, dropout=0.0, batch_first=True).double().eval()
    model = nn.Sequential(nn.Linear(3, 4), layer, nn.Linear(4, 2)).double().eval()
    X, y = torch.randn(2, 3, 3), torch.randint(0, 2, (2, 3))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fast = torch.backends.mha.get_fastpath_enabled()
    est = KroneckerEstimator(model, CrossEntropy(), "kflr").update((X, y))
    assert "1.self_attn.q" in [spec.label for _, spec in est.blocks]
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.backends.mha.get_fastpath_enabled() == fast
    assert not model[1].self_attn._forward_pre_hooks and not model[1].self_attn._forward_hooks
    # a length-1 sequence of one datum: every block is the exact GGN block
    one = (X[:1, :1], y[:1, :1])
    G = dense_ggn_positions(model, CrossEntropy(), one[0])
    op = KroneckerEstimator(model, CrossEntropy(), "kflr").update(one).operator()
    D = op.to_dense()
    for b, ix in zip(op.blocks, op._index):
        if b.factored:
            assert torch.allclose(D[ix.perm[:, None], ix.perm[None, :]], G[ix.perm[:, None], ix.perm[None, :]],
                                  atol=1e-12), b.name


@pytest.mark.parametrize("kw,match", [({"kdim": 3, "vdim": 3}, "kdim=3"), ({"add_bias_kv": True}, "add_bias_kv"),
                                      ({"add_zero_attn": True}, "add_zero_attn"), ({"dropout": 0.5}, "dropout")])
def test_attention_configurations_refused(kw, match):
    model = nn.Sequential(nn.MultiheadAttention(4, 2, batch_first=True, **kw)).double()
    with pytest.raises(ValueError, match=rf"module '0' \(MultiheadAttention\) .*{match}"):
        KroneckerEstimator(model, CrossEntropy())


# ---------------------------------------------------------------------------------------------- mixed models
def tiny_gpt(**kw):
    from curvkit.architectures import causal_lm

    return causal_lm(vocab_size=9, max_len=4, dim=4, depth=1, heads=2, mlp_dim=6, dtype=torch.float64, **kw).eval()


def test_mixed_model_operator_interface_against_dense():
    """A GPT-style model (Embedding, LayerNorm, packed attention, GELU MLP, untied head): one block per
    trainable layer part, and every operator method agrees with the dense matrix of the operator."""
    model = tiny_gpt()
    g = torch.Generator().manual_seed(21)
    ids, y = torch.randint(0, 9, (3, 4), generator=g), torch.randint(0, 9, (3, 4), generator=g)
    op = KroneckerEstimator(model, CrossEntropy(), "kflr").update((ids, y)).operator()
    names = {b.name for b in op.blocks}
    assert {"tok_embed", "pos_embed", "blocks.0.ln1", "blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v",
            "blocks.0.attn.out_proj.weight", "norm", "lm_head.weight"} <= names
    D = op.to_dense()
    d = D.shape[0]
    assert d == sum(p.numel() for p in model.parameters())
    V = torch.randn(d, 3, generator=g)
    assert torch.allclose(op @ V, D @ V, atol=1e-12)
    assert torch.allclose(op.diagonal().flat, D.diagonal(), atol=1e-13)
    assert torch.allclose(op.trace(), D.trace(), atol=1e-12)
    delta = 0.3
    Dd = D + delta * torch.eye(d)
    assert torch.allclose(op.solve(V, damping=delta), torch.linalg.solve(Dd, V), atol=1e-10)
    assert torch.allclose(op.inverse(delta).to_dense(), torch.linalg.inv(Dd), atol=1e-10)
    assert torch.allclose(op.logdet(delta), torch.linalg.slogdet(Dd)[1], atol=1e-9)
    top = torch.linalg.eigvalsh(D)[-5:].flip(0)
    assert torch.allclose(op.eigenvalues(5), top, atol=1e-12)
    # factored damping is approximate for the Kronecker blocks, exact for the norm blocks
    fd = op.factored_damping(delta).to_dense()
    for b, ix in zip(op.blocks, op._index):
        sub = fd[ix.perm[:, None], ix.perm[None, :]]
        if not b.factored:
            assert torch.allclose(sub, Dd[ix.perm[:, None], ix.perm[None, :]], atol=1e-13)
    # sampling reads the damped operator as a precision: covariance (D + delta I)^{-1}
    S = op.add_identity(delta).sample(torch.zeros(d), torch.Generator().manual_seed(3), num_samples=40000)
    var = S.var(0)
    assert float(((var - torch.linalg.inv(Dd).diagonal()) / torch.linalg.inv(Dd).diagonal()).abs().max()) < 0.06


def test_frozen_layers_are_absent_and_the_registry_names_the_kinds():
    from curvkit.layerkinds import handler_for
    from curvkit.structure import read_model

    model = tiny_gpt()
    for p in list(model.tok_embed.parameters()) + list(model.blocks[0].ln1.parameters()):
        p.requires_grad_(False)
    est = KroneckerEstimator(model, CrossEntropy(), "kfac")
    labels = [lp.label for lp in est.plans]
    assert "tok_embed" not in labels and "blocks.0.ln1" not in labels and "pos_embed" in labels
    kinds = {lay.label: getattr(handler_for(lay.module)[0], "kind", None) for lay in read_model(model).layers}
    assert kinds["pos_embed"] == "embedding" and kinds["blocks.0.attn"] == "attention"
    assert kinds["norm"] == "norm" and kinds["lm_head"] == "linear"


def test_weight_tying_gives_both_uses_a_block():
    """A tied parameter: each use gets its blocks, and the operator their sum (tests/test_shared_weights.py)."""
    model = tiny_gpt(tie_weights=True)
    est = KroneckerEstimator(model, CrossEntropy())
    assert est.shared == ["tok_embed.weight"] and {"tok_embed", "lm_head"} <= {lp.label for lp in est.plans}
    model.tok_embed.weight.requires_grad_(False)  # frozen: both uses simply have no block
    est = KroneckerEstimator(model, CrossEntropy())
    assert "lm_head" not in [lp.label for lp in est.plans]


def test_misuse_errors_and_model_untouched():
    """Unsupported layers name the module; Dropout in training mode, a reused module and a Linear subclass with
    its own forward are refused; the model's parameters, hooks and modes are unchanged after an error."""
    torch.manual_seed(22)
    drop = nn.Sequential(nn.Linear(3, 4), nn.Dropout(0.2), nn.Linear(4, 2)).double()
    with pytest.raises(ValueError, match=r"module '1' \(Dropout\) is random in training mode"):
        KroneckerEstimator(drop, CrossEntropy())
    KroneckerEstimator(drop.eval(), CrossEntropy())
    lin = nn.Linear(3, 3).double()
    with pytest.raises(ValueError, match=r"module '0' \(Linear\) is registered under 2 names"):
        KroneckerEstimator(nn.Sequential(lin, nn.Tanh(), lin), CrossEntropy())

    class Scaled(nn.Linear):
        def forward(self, x):
            return 2 * super().forward(x)

    class Bilinear(nn.Module):
        def __init__(self):
            super().__init__()
            self.bil = nn.Bilinear(3, 3, 2)

        def forward(self, x):
            return self.bil(x, x)

    # a registered class's subclass with its own forward, and an unregistered class: the per-sample fallback
    for model, label in ((nn.Sequential(Scaled(3, 2)).double(), "0"), (Bilinear().double(), "bil")):
        before = {k: v.clone() for k, v in model.state_dict().items()}
        est = KroneckerEstimator(model, CrossEntropy())
        assert [lp.handler.kind for lp in est.plans] == ["module"] and est.plans[0].label == label
        est.update((torch.randn(4, 3), torch.randint(0, 2, (4,))))
        assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # a run-time error inside the capture leaves no hook behind
    seq = nn.Sequential(nn.Conv2d(2, 2, (1, 2)), nn.Flatten(), nn.Linear(4, 2)).double()
    X = torch.randn(2, 1, 5)  # torch reads it as one unbatched (C, H, W) image
    with pytest.raises(ValueError, match=r"module '0' \(Conv2d\) got an input of shape \(2, 1, 5\)"):
        KroneckerEstimator(seq, CrossEntropy()).update((X, torch.tensor([0, 1])))
    assert not seq[0]._forward_hooks and not seq[2]._forward_hooks


def test_ids_without_batch_dimension_are_shared_by_every_sample():
    """An embedding called on position ids without a batch dimension (``arange(T)``, nanoGPT / GPT-2 / BERT) or
    with a batch dimension of size 1 gives every sample its own output rows: the blocks equal those of the same
    model with the ids expanded over the batch; a capture that does not know the batch size refuses."""

    class SharedPos(nn.Module):
        def __init__(self, expand: str = "none"):
            super().__init__()
            self.tok, self.pos, self.head = nn.Embedding(5, 3), nn.Embedding(4, 3), nn.Linear(3, 5)
            self.expand = expand

        def forward(self, ids):
            pos = torch.arange(ids.shape[1])
            pos = {"none": pos, "one": pos[None], "batch": pos.expand(ids.shape[0], -1)}[self.expand]
            return self.head(torch.tanh(self.tok(ids) + self.pos(pos)))

    torch.manual_seed(23)
    ref = SharedPos("batch").double()
    X, y = torch.randint(0, 5, (3, 4)), torch.randint(0, 5, (3, 4))
    G = dense_ggn_positions(ref, CrossEntropy(), X)
    R = KroneckerEstimator(ref, CrossEntropy(), "kflr").update((X, y)).operator().to_dense()
    for expand in ("none", "one"):
        model = SharedPos(expand).double()
        model.load_state_dict(ref.state_dict())
        assert torch.allclose(dense_ggn_positions(model, CrossEntropy(), X), G, atol=1e-14)
        for method in ("kflr", "kfac"):
            est = KroneckerEstimator(model, CrossEntropy(), method, seed=1)
            D = est.update((X, y)).operator().to_dense()
            E = KroneckerEstimator(ref, CrossEntropy(), method, seed=1).update((X, y)).operator().to_dense()
            assert torch.allclose(D, E, atol=1e-14) and block(R, ref, ["pos.weight"]).abs().max() > 1e-3
        with est.capture() as cap:  # the batch size is unknown to a bare capture
            f = model(X)
        with pytest.raises(ValueError, match=r"module 'pos' \(Embedding\) does not run on its inputs with the samples "
                                             r"first; its first dimension \(\d\) is not the batch \(3\).*"
                                             r"cap.batch = len\(X\)"):
            est.accumulate(cap, f, y)


def test_kfra_refusal_names_the_module_and_points_to_kflr():
    model = nn.Sequential(nn.Linear(3, 4), nn.LayerNorm(4), nn.Linear(4, 2)).double()
    with pytest.raises(ValueError, match=r"module '1' \(LayerNorm\).*curvature='kflr'"):
        KroneckerEstimator(model, CrossEntropy(), "kfra")


def test_diagonal_estimator_divides_by_counted_terms():
    """DiagonalEstimator with padding: 'mean' divides by the counted loss terms (not the samples)."""
    from curvkit.curvature.estimators import DiagonalEstimator

    torch.manual_seed(23)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    X, y = torch.randn(3, 3), torch.tensor([0, -100, 1])
    padded = DiagonalEstimator(model, CrossEntropy(ignore_index=-100), "empirical").update((X, y))
    kept = DiagonalEstimator(model, CrossEntropy(), "empirical").update((X[[0, 2]], y[[0, 2]]))
    assert padded.num_data == 3 and padded.num_terms == 2
    assert torch.allclose(padded.operator().flat, kept.operator().flat, atol=1e-15)


def test_ekfac_on_a_mixed_model():
    """EKFAC's scalings on a model with an embedding, a LayerNorm and attention are, per block, the diagonal
    of the exact GGN block in the Kronecker eigenbasis (KFLR vectors, (B, C) outputs: exact per-sample rows)."""
    from curvkit.curvature.ekfac import EKFACEstimator

    class Pooled(nn.Module):
        def __init__(self):
            super().__init__()
            torch.manual_seed(24)
            self.emb = nn.Embedding(6, 4)
            self.ln = nn.LayerNorm(4)
            self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
            self.head = nn.Linear(4, 3)

        def forward(self, ids):
            h = self.ln(self.emb(ids))
            return self.head((h + self.attn(h, h, h, need_weights=False)[0]).mean(1))

    model = Pooled().double()
    g = torch.Generator().manual_seed(25)
    ids, y = torch.randint(0, 6, (4, 3), generator=g), torch.randint(0, 3, (4,), generator=g)
    est = EKFACEstimator(model, CrossEntropy(), "kflr").update((ids, y))
    op = est.operator()
    G = dense_ggn_positions(model, CrossEntropy(), ids)
    assert est.basis is not None
    for b, e, ix, s in zip(est.basis.blocks, est.basis.eigh(), est.basis._index, op._spectra):
        M = G[ix.perm[:, None], ix.perm[None, :]]
        QA = torch.eye(b.in_dim) if e.A_eigvecs is None else e.A_eigvecs
        Q = torch.kron(e.G_eigvecs.contiguous(), QA.contiguous())
        assert torch.allclose(s.reshape(-1), (Q.T @ M @ Q).diagonal(), atol=1e-12), b.name


# ---------------------------------------------------------------------------------------------- raw parameters
def tiny_vit():
    from curvkit.architectures import vit

    return vit(image_size=4, patch_size=2, dim=4, depth=1, heads=2, mlp_dim=6, num_classes=3,
               dtype=torch.float64).eval()


@pytest.mark.parametrize("structure", ["diag", "full"])
def test_vit_is_covered_and_raw_parameters_equal_the_dense_ggn(structure):
    """Every parameter of a ViT has a block: patch embedding (weight-shared Linear), attention, MLP, LayerNorms,
    head, and the raw class token and position table, whose blocks (diagonal by default, dense on request)
    equal the exact GGN's rows and columns for (B, C) outputs and KFLR."""
    model = tiny_vit()
    g = torch.Generator().manual_seed(26)
    X, y = torch.randn(3, 1, 4, 4, generator=g), torch.randint(0, 3, (3,), generator=g)
    est = KroneckerEstimator(model, CrossEntropy(), "kflr", parameter_structure=structure).update((X, y))
    op = est.operator()
    assert op.layout.dim == sum(p.numel() for p in model.parameters())
    assert {"cls_token", "pos_embedding"} <= {b.name for b in op.blocks}
    G = dense_ggn_positions(model, CrossEntropy(), X)
    for name in ("cls_token", "pos_embedding"):
        ref = block(G, model, [name])
        assert torch.allclose(block(op.to_dense(), model, [name]), ref if structure == "full" else torch.diag(
            ref.diagonal()), atol=1e-13)


def test_raw_parameter_used_across_samples_is_refused():
    """A (1, D) parameter whose copies would mix samples (here: averaged over the batch) is refused with an
    error naming it; the model is unchanged; the optimiser path (accumulate) refuses raw parameters."""

    class Mixer(nn.Module):
        def __init__(self):
            super().__init__()
            self.shift = nn.Parameter(torch.randn(1, 3))
            self.head = nn.Linear(3, 2)

        def forward(self, x):
            return self.head(x + self.shift.mean(0, keepdim=True))

    model = Mixer().double()
    X, y = torch.randn(4, 3), torch.randint(0, 2, (4,))
    est = KroneckerEstimator(model, CrossEntropy(), "kfac")
    with pytest.raises(ValueError, match=r"raw parameter\(s\) 'shift'.*do not act per sample"):
        est.update((X, y))
    assert model.shift.shape == (1, 3)

    class PerSampleShift(Mixer):
        def forward(self, x):
            return self.head(x + self.shift)

    good = PerSampleShift().double()
    est = KroneckerEstimator(good, CrossEntropy(), "kflr", parameter_structure="full").update((X, y))
    G = dense_ggn_positions(good, CrossEntropy(), X)
    assert torch.allclose(block(est.operator().to_dense(), good, ["shift"]), block(G, good, ["shift"]), atol=1e-13)
    with est.capture() as cap:
        f = good(X)
    with pytest.raises(ValueError, match=r"raw parameter\(s\) 'shift' get their per-sample gradients"):
        est.accumulate(cap, f, y)


def test_blocked_gram_equals_the_full_product():
    """The Gram matrices of tall wide rows multiply only the upper block triangle and mirror it: equal to the
    full product to rounding; narrow rows, and few rows (m n < _GRAM_MIN_SIZE), take the single product."""
    from curvkit.curvature import estimators
    from curvkit.curvature.estimators import _gram

    g = torch.Generator().manual_seed(27)
    for m in (50, 300):
        for n in (5, 127, 128, 257, 383, 384, 513, 1030, 2600):
            a = torch.randn(m, n, generator=g, dtype=torch.float64)
            assert torch.allclose(_gram(a), a.T @ a, atol=1e-11)
    assert 300 * 513 >= estimators._GRAM_MIN_SIZE > 50 * 2600  # both routes above


@pytest.mark.parametrize("case", range(9))
def test_attention_forward_equals_torch(case):
    """The capture's attention_forward gives torch's F.multi_head_attention_forward output and weights
    (self-, encoder-decoder and general attention; causal, boolean, float and key-padding masks; weights
    averaged or per head)."""
    from curvkit.layerkinds.attention import attention_forward

    torch.manual_seed(28)
    E, h, L, S, N = 8, 2, 5, 4, 3
    mha = nn.MultiheadAttention(E, h).double()
    q, k = torch.randn(L, N, E), torch.randn(S, N, E)
    causal = torch.ones(L, L, dtype=torch.bool).triu(1)
    kpm = torch.zeros(N, L, dtype=torch.bool)
    kpm[0, -1] = True
    cases = [dict(query=q, key=q, value=q), dict(query=q, key=q, value=q, need_weights=False),
             dict(query=q, key=q, value=q, attn_mask=causal, need_weights=False, is_causal=True),
             dict(query=q, key=q, value=q, attn_mask=causal),
             dict(query=q, key=q, value=q, key_padding_mask=kpm, need_weights=False),
             dict(query=q, key=q, value=q, key_padding_mask=kpm, attn_mask=causal, average_attn_weights=False),
             dict(query=q, key=q, value=q, attn_mask=torch.randn(L, L)),
             dict(query=q, key=k, value=k), dict(query=q, key=k, value=k.clone(), need_weights=False)]
    kw = dict(cases[case])
    args = (kw.pop("query"), kw.pop("key"), kw.pop("value"), E, h, mha.in_proj_weight, mha.in_proj_bias, None,
            None, False, 0.0, mha.out_proj.weight, mha.out_proj.bias)
    seen = []
    with curvature_kernels(), torch.no_grad():
        ref = nn.functional.multi_head_attention_forward(*args, training=False, **kw)
        out = attention_forward(*args, training=False, sites=lambda *s: seen.append(s[0]), **kw)
    assert torch.allclose(out[0], ref[0], atol=1e-14)
    assert (out[1] is None) == (ref[1] is None) and (ref[1] is None or torch.allclose(out[1], ref[1], atol=1e-14))
    assert seen == ["q", "k", "v", "out"]
