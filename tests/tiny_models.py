"""Tiny float64 instances of the models people train now (curvkit.architectures), with data, for the tests of
the consumers of the Kronecker engine (GaussNewton, the continual Laplace penalties, the Kronecker filters)."""

from __future__ import annotations

import torch
from torch import nn

from curvkit.architectures import add_lora, causal_lm, conv1d_tagger, resnet, vit
from curvkit.likelihoods import CrossEntropy

CASES = ("transformer", "vit", "resnet", "tagger", "lora_gpt")


class TinyTransformer(nn.Module):
    """Token ids (B, T) -> Embedding -> nn.TransformerEncoderLayer (post-norm, ReLU) -> mean -> Linear: (B, C)."""

    def __init__(self, vocab: int = 5, dim: int = 4, classes: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.TransformerEncoderLayer(dim, 2, 6, dropout=0.0, batch_first=True)
        self.head = nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(ids)).mean(1))


class RMSNormAsWritten(nn.Module):
    """transformers' LlamaRMSNorm as written (no registered class): the per-sample fallback takes it."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


class LayerScale(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.gamma


class RecognisedNet(nn.Module):
    """Layers recognised by what they compute, as people write them: token embedding + a nanoGPT-style position
    embedding looked up on ``arange(T)`` (no batch dimension), a Llama-style RMSNorm, a GRU, a layer scale and a
    Linear head on the last step: (B, T) ids -> (B, C)."""

    def __init__(self, vocab: int = 5, T: int = 4, dim: int = 3, classes: int = 3):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(T, dim)
        self.norm, self.rnn = RMSNormAsWritten(dim), nn.GRU(dim, dim, batch_first=True)
        self.scale, self.head = LayerScale(dim), nn.Linear(dim, classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device)))
        out, _ = self.rnn(h)
        return self.head(self.scale(out[:, -1]))


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def tiny_case(name: str):
    """(model, likelihood, (X, y)) of one tiny float64 case; sequence cases pad some positions."""
    g = gen(3)
    if name == "transformer":
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            model = TinyTransformer().double()
        return model, CrossEntropy(), (torch.randint(0, 5, (6, 4), generator=g), torch.randint(0, 3, (6,), generator=g))
    if name == "vit":
        model = vit(image_size=4, patch_size=2, dim=4, depth=1, heads=2, mlp_dim=4, num_classes=3, seed=1,
                    dtype=torch.float64).eval()  # eval: the MHA fast path would apply outside curvature_kernels
        return model, CrossEntropy(), (torch.randn(5, 1, 4, 4, generator=g), torch.randint(0, 3, (5,), generator=g))
    if name == "resnet":
        model = resnet(widths=(2,), num_classes=3, seed=2, dtype=torch.float64)
        with torch.no_grad():  # non-trivial running statistics
            for m in model.modules():
                if isinstance(m, nn.BatchNorm2d):
                    m.running_mean.uniform_(-0.5, 0.5, generator=g)
                    m.running_var.uniform_(0.5, 1.5, generator=g)
        return model.eval(), CrossEntropy(), (torch.randn(4, 1, 4, 4, generator=g), torch.randint(0, 3, (4,), generator=g))
    if name == "tagger":
        model = conv1d_tagger(channels=2, hidden=4, groups=2, num_classes=3, seed=3, dtype=torch.float64)
        y = torch.randint(0, 3, (3, 5), generator=g)
        y[0, 3:] = -100
        y[2, 4] = -100
        return model, CrossEntropy(ignore_index=-100), (torch.randn(3, 2, 5, generator=g), y)
    if name == "lora_gpt":
        base = causal_lm(vocab_size=5, max_len=4, dim=4, depth=1, heads=2, mlp_dim=4, seed=4, dtype=torch.float64)
        model = add_lora(base, rank=1, init_b="normal", seed=5)
        ids = torch.randint(0, 5, (3, 4), generator=g)
        y = torch.randint(0, 5, (3, 4), generator=g)
        y[1, 2:] = -100
        return model, CrossEntropy(ignore_index=-100), (ids, y)
    if name == "recognised":  # not in CASES: the consumers of the per-sample fallback are tested case by case
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(6)
            model = RecognisedNet().double()
        return model, CrossEntropy(), (torch.randint(0, 5, (5, 3), generator=g), torch.randint(0, 3, (5,), generator=g))
    raise KeyError(name)


