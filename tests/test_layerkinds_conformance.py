"""ONE conformance test over every layer kind, registered and recognised, against the dense float64 GGN.

Each case is a tiny model around one kind, with data for which every block is exact: KFLR with (B, C)
outputs. Blocks from per-sample gradients (normalisation layers, raw parameters, the per-sample fallback of
:mod:`curvkit.layerkinds.generic`) are the exact GGN block for any batch; Kronecker blocks are exact for one
datum and one position, so those cases use B = 1 (kernels spanning the input). Every case must cover 100 %
of the trainable parameters. A new kind is a model factory and one line in ``CASES``.
Tolerance: 1e-10 relative (float64; observed <= 1.1e-12)."""

from __future__ import annotations

import pytest
import torch
from tests.test_layerkinds import block, dense_ggn_positions
from torch import Tensor, nn

from curvkit.curvature.estimators import KroneckerEstimator
from curvkit.likelihoods import CrossEntropy

pytestmark = pytest.mark.usefixtures("float64_default")


class Head(nn.Module):
    """body -> flatten -> tanh -> Linear(C)."""

    def __init__(self, body: nn.Module, width: int, c: int = 3):
        super().__init__()
        self.body, self.out = body, nn.Linear(width, c)

    def forward(self, x: Tensor) -> Tensor:
        h = self.body(x)
        h = h[0] if isinstance(h, tuple) else h
        return self.out(torch.tanh(h.flatten(1)))


class LlamaStyleRMSNorm(nn.Module):  # as transformers' LlamaRMSNorm / Qwen2RMSNorm / T5LayerNorm write it
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))

    def forward(self, x: Tensor) -> Tensor:
        v = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(v + 1e-6)).to(x.dtype)


class LayerNorm2d(nn.LayerNorm):  # ConvNeXt: channels first, own forward
    def forward(self, x: Tensor) -> Tensor:
        return super().forward(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


class LayerScale(nn.Module):
    def __init__(self, c: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.randn(c))

    def forward(self, x: Tensor) -> Tensor:
        return x * self.gamma


class OffsetEmbedding(nn.Embedding):  # BART's learned positional embedding: ids shifted by an offset
    def forward(self, ids: Tensor) -> Tensor:
        return super().forward(ids + 2)


class ScaledEmbedding(nn.Embedding):
    def forward(self, ids: Tensor) -> Tensor:
        return super().forward(ids) * 1.7


def _vec(B: int, d: int) -> Tensor:
    return torch.randn(B, d)


# name -> (model factory, input factory (batch size B))
CASES = {
    "linear": (lambda: Head(nn.Linear(4, 5), 5), lambda B: _vec(B, 4), 1),
    "conv1d": (lambda: Head(nn.Conv1d(2, 3, 4), 3), lambda B: torch.randn(B, 2, 4), 1),
    "conv2d": (lambda: Head(nn.Conv2d(4, 2, 2), 2), lambda B: torch.randn(B, 4, 2, 2), 1),
    "embedding": (lambda: Head(nn.Embedding(6, 3), 3), lambda B: torch.randint(0, 6, (B, 1)), 1),
    "layernorm": (lambda: Head(nn.Sequential(nn.Linear(4, 5), nn.LayerNorm(5)), 5), lambda B: _vec(B, 4), 1),
    "rmsnorm": (lambda: Head(nn.Sequential(nn.Linear(4, 5), nn.RMSNorm(5)), 5), lambda B: _vec(B, 4), 1),
    "groupnorm": (lambda: Head(nn.Sequential(nn.Conv1d(2, 4, 2), nn.GroupNorm(2, 4)), 4),
                  lambda B: torch.randn(B, 2, 2), 1),
    # recognised by what they compute (the per-sample fallback): any batch
    "llama_rmsnorm": (lambda: Head(nn.Sequential(nn.Linear(4, 5), LlamaStyleRMSNorm(5)), 5), lambda B: _vec(B, 4), 4),
    "layernorm2d": (lambda: Head(nn.Sequential(nn.Conv2d(2, 3, 1), LayerNorm2d(3)), 12),
                    lambda B: torch.randn(B, 2, 2, 2), 4),
    "layer_scale": (lambda: Head(nn.Sequential(nn.Linear(4, 5), LayerScale(5)), 5), lambda B: _vec(B, 4), 4),
    "offset_embedding": (lambda: Head(OffsetEmbedding(8, 3), 6), lambda B: torch.randint(0, 6, (B, 2)), 4),
    "scaled_embedding": (lambda: Head(ScaledEmbedding(6, 3), 6), lambda B: torch.randint(0, 6, (B, 2)), 4),
    "conv3d": (lambda: Head(nn.Conv3d(2, 3, 2), 3), lambda B: torch.randn(B, 2, 2, 2, 2), 1),
    "conv_transpose1d": (lambda: Head(nn.ConvTranspose1d(2, 4, 2, groups=2), 12), lambda B: torch.randn(B, 2, 2), 4),
    "conv_transpose2d": (lambda: Head(nn.ConvTranspose2d(2, 2, 2, stride=2), 32), lambda B: torch.randn(B, 2, 2, 2), 4),
    "conv_transpose3d": (lambda: Head(nn.ConvTranspose3d(1, 2, 2), 16), lambda B: torch.randn(B, 1, 1, 1, 1), 4),
    "lstm": (lambda: Head(nn.LSTM(3, 2, batch_first=True), 6), lambda B: torch.randn(B, 3, 3), 4),
    "gru_sequence_first": (lambda: SeqFirstGRU(), lambda B: torch.randn(B, 3, 3), 4),
    "bilinear": (lambda: Head(BilinearSelf(), 2), lambda B: _vec(B, 3), 4),
}


class SeqFirstGRU(nn.Module):
    """PyTorch's default (time, batch, features) layout, transposed inside the model."""

    def __init__(self):
        super().__init__()
        self.gru, self.out = nn.GRU(3, 2, num_layers=2), nn.Linear(2, 3)

    def forward(self, x: Tensor) -> Tensor:
        out, h = self.gru(x.transpose(0, 1))
        return self.out(torch.tanh(out[-1] + h[0]))


class BilinearSelf(nn.Module):
    def __init__(self):
        super().__init__()
        self.bil = nn.Bilinear(3, 3, 2)

    def forward(self, x: Tensor) -> Tensor:
        return self.bil(x, x)


@pytest.mark.parametrize("name", list(CASES))
def test_every_kind_equals_the_dense_ggn(name):
    make, data, B = CASES[name]
    torch.manual_seed(31)
    model = make().double()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    X = data(B)
    y = torch.randint(0, 3, (B,))
    est = KroneckerEstimator(model, CrossEntropy(), "kflr").update((X, y))
    op = est.operator()
    assert op.layout.dim == sum(p.numel() for p in model.parameters())  # 100 % coverage
    G, D = dense_ggn_positions(model, CrossEntropy(), X), op.to_dense()
    names = [n for n, _ in model.named_parameters()]
    assert G.abs().max() > 1e-6
    for b in op.blocks:  # one block per layer here (no groups): its rows and columns of the dense GGN
        if b.factored and B > 1:  # a Kronecker block (the head) is exact for one datum only
            continue
        own = [n for n in names if n in (b.weight_name, b.bias_name)]
        ref, got = block(G, model, own), block(D, model, own)
        err = float((got - ref).norm() / ref.norm())
        assert err < 1e-10, (name, b.name, err)


@pytest.mark.parametrize("mode", ["expand", "reduce"])
def test_conv3d_blocks_equal_those_of_the_equivalent_conv2d(mode):
    """A Conv3d whose depth kernel spans a depth-1 input is a Conv2d: the same Kronecker blocks (its
    patches, strides, dilation, padding and groups; kfac's sampled vectors with one seed)."""
    torch.manual_seed(32)
    c3 = nn.Conv3d(4, 6, (1, 3, 2), stride=(1, 2, 1), padding=(0, 1, 1), dilation=(1, 1, 2), groups=2).double()
    c2 = nn.Conv2d(4, 6, (3, 2), stride=(2, 1), padding=(1, 1), dilation=(1, 2), groups=2).double()
    with torch.no_grad():
        c2.weight.copy_(c3.weight[:, :, 0])
        c2.bias.copy_(c3.bias)

    class Squeeze(nn.Module):
        def forward(self, x: Tensor) -> Tensor:
            return x[:, :, 0]

    m3 = nn.Sequential(c3, nn.Tanh(), nn.Flatten(), nn.LazyLinear(3))
    X = torch.randn(3, 4, 1, 5, 4)
    m3(X)
    m2 = nn.Sequential(Squeeze(), c2, nn.Tanh(), nn.Flatten(), nn.Linear(m3[3].in_features, 3)).double()
    m2[4].load_state_dict(m3[3].state_dict())
    y = torch.randint(0, 3, (3,))
    a = KroneckerEstimator(m3, CrossEntropy(), "kfac", weight_sharing=mode, seed=4).update((X, y)).operator()
    b = KroneckerEstimator(m2, CrossEntropy(), "kfac", weight_sharing=mode, seed=4).update((X, y)).operator()
    assert [x.G.shape for x in a.blocks] == [x.G.shape for x in b.blocks]
    for x, z in zip(a.blocks, b.blocks):
        assert torch.allclose(x.G, z.G, atol=1e-12) and torch.allclose(x.A, z.A, atol=1e-12)


class TiedLM(nn.Module):
    """An embedding and a head that share one weight (a shared parameter's sum block)."""

    def __init__(self):
        super().__init__()
        self.emb, self.mix = nn.Embedding(7, 4), nn.Linear(4, 4)
        self.head = nn.Linear(4, 7)
        self.head.weight = self.emb.weight

    def forward(self, ids: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(self.emb(ids)))).mean(1)


RELEASE_CASES = {**{k: (v[0], v[1], max(v[2], 3), {}) for k, v in CASES.items()},
                 "tied": (TiedLM, lambda B: torch.randint(0, 7, (B, 3)), 3, {}),
                 "low_rank_head": (lambda: Head(nn.Linear(4, 5), 5), lambda B: _vec(B, 4), 3,
                                   {"output_factor": "low_rank"})}


@pytest.mark.parametrize("name", list(RELEASE_CASES))
def test_released_statistics_give_bitwise_the_same_operator(name):
    """``operator(release=True)`` symmetrises and scales the statistics in place instead of copying them: the
    same factors bitwise, on every layer kind, a tied weight and a low-rank head; the estimator is reset after,
    and its next update starts afresh."""
    make, data, B, kw = RELEASE_CASES[name]
    torch.manual_seed(32)
    model = make().double()
    X = data(B)
    y = torch.randint(0, 3, (B,))
    keep = KroneckerEstimator(model, CrossEntropy(), "kfac", seed=5, **kw).update((X, y))
    given = KroneckerEstimator(model, CrossEntropy(), "kfac", seed=5, **kw).update((X, y))
    ref = keep.operator().to_dense()
    assert torch.equal(given.operator(release=True).to_dense(), ref)
    assert given.num_updates == 0 and given.num_data == 0
    with pytest.raises(ValueError, match="no statistics yet"):
        given.operator()
    assert torch.equal(keep.operator().to_dense(), ref)  # the kept estimator's statistics were not touched
    keep.reset()  # both have drawn one batch of labels: the next update of each is the same
    assert torch.equal(given.update((X, y)).operator().to_dense(), keep.update((X, y)).operator().to_dense())


def test_release_refuses_a_running_average():
    model = Head(nn.Linear(4, 5), 5).double()
    est = KroneckerEstimator(model, CrossEntropy(), "kfac", ema=0.9).update((_vec(3, 4).double(),
                                                                               torch.tensor([0, 1, 2])))
    with pytest.raises(ValueError, match=r"release=True.*ema=0.9.*call operator\(\)"):
        est.operator(release=True)


@pytest.mark.parametrize("name", ["bilinear", "lstm"])
def test_generic_fallback_names_a_non_finite_output(name):
    """A module on the per-sample fallback whose output is NaN/inf (a NaN weight) gets a ValueError naming the
    module, not a raw error from the comparison of its replayed output."""
    make, data, B = CASES[name][0], CASES[name][1], max(CASES[name][2], 2)
    torch.manual_seed(35)
    model = make().double()
    with torch.no_grad():
        next(p for n, p in model.named_parameters() if n.startswith("body")).view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match=r"module 'body.*produced NaN or inf.*check the inputs and the model"):
        KroneckerEstimator(model, CrossEntropy(), "kfac").update((data(B), torch.randint(0, 3, (B,))))
