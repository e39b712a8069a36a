"""MESU's vectorised Monte Carlo step on the models people train (issue 25, item 2): a Linear applied to
(batch, tokens, features), a ResNet-style CNN with BatchNorm in training mode, and integer token ids into
an ``nn.Embedding``.

Dense per-sample reference: K deep copies of the module, each set to its weight sample
w_k = mu + sigma * eps_k (the optimiser's own noise), evaluated and back-propagated one by one with plain
autograd in the module's own mode (so a BatchNorm in training mode normalises with the batch statistics
and updates the copy's running statistics). The step must equal MESU's Eq. 3 applied to those K gradients,
and the module's running statistics after the step must be the mean of the K copies' (documented choice:
one update per step, with the batch statistics averaged over the posterior samples).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from curvkit.likelihoods import CrossEntropy
from curvkit.optim import BGD, MESU
from curvkit.posterior.sampling import mc_gradients, mc_gradients_loop, sample_eps

K = 3


class TokenLinear(nn.Module):
    """Per-token Linear layers on (B, T, F) inputs; logits flattened to (B * T, C) (one target per token)."""

    def __init__(self, features=5, hidden=4, classes=3):
        super().__init__()
        self.inp, self.out = nn.Linear(features, hidden), nn.Linear(hidden, classes)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x))).flatten(0, 1)


class TokenPooled(nn.Module):
    """The same per-token Linear, mean-pooled over tokens: logits (B, C)."""

    def __init__(self, features=5, hidden=4, classes=3):
        super().__init__()
        self.inp, self.out = nn.Linear(features, hidden), nn.Linear(hidden, classes)

    def forward(self, x):
        return self.out(torch.tanh(self.inp(x)).mean(1))


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x):
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


def resnet(classes=3):
    return nn.Sequential(nn.Conv2d(1, 3, 3, padding=1, bias=False), nn.BatchNorm2d(3), nn.ReLU(), Block(3),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(3, classes), nn.BatchNorm1d(classes))


class Embedder(nn.Module):
    def __init__(self, vocab=11, dim=4, classes=3):
        super().__init__()
        self.emb, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, classes)

    def forward(self, ids):
        return self.head(self.emb(ids).mean(1))


def _case(kind):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    B, T = 4, 5
    if kind == "tokens_flat":
        return TokenLinear().double(), torch.randn(B, T, 5, generator=g, dtype=torch.float64), \
            torch.randint(0, 3, (B * T,), generator=g)
    if kind == "tokens_pooled":
        return TokenPooled().double(), torch.randn(B, T, 5, generator=g, dtype=torch.float64), \
            torch.randint(0, 3, (B,), generator=g)
    if kind == "resnet_bn":
        return resnet().double().train(), torch.randn(6, 1, 6, 6, generator=g, dtype=torch.float64), \
            torch.randint(0, 3, (6,), generator=g)
    return Embedder().double(), torch.randint(0, 11, (B, T), generator=g), torch.randint(0, 3, (B,), generator=g)


CASES = ["tokens_flat", "tokens_pooled", "resnet_bn", "embedding"]


def _reference(model, X, y, mu, sigma, eps):
    """(g_mu, g_sigma, losses, buffers after the step) from K module copies with plain autograd."""
    g_mu = {n: torch.zeros_like(m) for n, m in mu.items()}
    g_sigma = {n: torch.zeros_like(m) for n, m in mu.items()}
    losses, buffers = [], []
    for k in range(K):
        m = copy.deepcopy(model)
        params = dict(m.named_parameters())
        with torch.no_grad():
            for n in mu:
                params[n].copy_(mu[n] + sigma[n] * eps[n][k])
        loss = F.cross_entropy(m(X), y, reduction="sum")
        loss.backward()
        for n in mu:
            g_mu[n] += params[n].grad / K
            g_sigma[n] += params[n].grad * eps[n][k] / K
        losses.append(loss.detach())
        buffers.append({n: b.detach().clone() for n, b in m.named_buffers()})
    mean_buf = {n: (torch.stack([b[n] for b in buffers]).mean(0) if buffers[0][n].is_floating_point()
                    else buffers[0][n]) for n in buffers[0]}
    return g_mu, g_sigma, torch.stack(losses), mean_buf


@pytest.mark.parametrize("kind", CASES)
def test_mesu_step_equals_the_dense_per_sample_reference(kind):
    model, X, y = _case(kind)
    opt = MESU(model.parameters(), model=model, sigma_prior=0.1, mc_samples=K, seed=3)
    mu = {n: p.detach().clone() for n, p in model.named_parameters()}
    sigma = {n: s.clone() for n, s in opt.sigma_dict().items()}
    eps = sample_eps(mu, K, copy.deepcopy(opt.generator))     # the noise the step will draw
    g_mu, g_sigma, losses, buffers = _reference(model, X, y, mu, sigma, eps)
    loss = opt.step(batch=(X, y))
    torch.testing.assert_close(loss, losses.mean(), rtol=1e-12, atol=1e-12)
    for n, p in model.named_parameters():                      # Eq. 3 with the reference gradients
        s2 = sigma[n] ** 2
        torch.testing.assert_close(p.detach(), mu[n] - s2 * g_mu[n], rtol=1e-10, atol=1e-12)
        expected = sigma[n] - s2 * g_sigma[n] + sigma[n] * (0.1**2 - s2) / 10.0**2
        torch.testing.assert_close(opt.sigma_dict()[n], expected, rtol=1e-10, atol=1e-12)
    own = dict(model.named_buffers())
    assert set(own) == set(buffers)
    for n, b in buffers.items():                               # updated once: the mean of the K samples'
        torch.testing.assert_close(own[n], b, rtol=1e-12, atol=1e-12)


def test_running_statistics_are_updated_once_per_step_and_never_by_the_estimators():
    model, X, y = _case("resnet_bn")
    before = {n: b.clone() for n, b in model.named_buffers()}
    mu = {n: p.detach() for n, p in model.named_parameters()}
    sigma = {n: torch.full_like(p, 0.05) for n, p in mu.items()}
    eps = sample_eps(mu, K, torch.Generator().manual_seed(0))
    loss_fn = lambda f, t: F.cross_entropy(f, t, reduction="sum")  # noqa: E731
    vec = mc_gradients(model, loss_fn, X, y, mu, sigma, eps=eps)
    loop = mc_gradients_loop(model, loss_fn, X, y, mu, sigma, eps=eps)
    for n, b in model.named_buffers():                         # the estimators leave the module alone
        assert torch.equal(b, before[n])
    assert vec.buffers is not None and loop.buffers is not None
    for n in vec.buffers:
        torch.testing.assert_close(vec.buffers[n], loop.buffers[n], rtol=1e-12, atol=1e-12)
    for n in vec.g_mu:
        torch.testing.assert_close(vec.g_mu[n], loop.g_mu[n], rtol=1e-10, atol=1e-12)
    opt = BGD(model.parameters(), model=model, mc_samples=K)
    opt.step(batch=(X, y))
    assert int(model[1].num_batches_tracked) == 1              # one update per step, not K
    model.eval()
    frozen_stats = {n: b.clone() for n, b in model.named_buffers()}
    opt.step(batch=(X, y))                                     # eval mode: running statistics are used, kept
    for n, b in model.named_buffers():
        assert torch.equal(b, frozen_stats[n])


def test_prediction_in_training_mode_leaves_running_statistics_alone():
    model, X, _ = _case("resnet_bn")
    before = {n: b.clone() for n, b in model.named_buffers()}
    opt = MESU(model.parameters(), model=model, mc_samples=K)
    p = opt.predict(X, mc_samples=4)
    assert p.shape == (6, 3)
    torch.testing.assert_close(p.sum(-1), torch.ones(6, dtype=torch.float64))
    for n, b in model.named_buffers():
        assert torch.equal(b, before[n])


def test_token_targets_are_checked_against_the_flattened_output():
    model, X, y = _case("tokens_flat")
    opt = MESU(model.parameters(), model=model, mc_samples=K, loss_fn=CrossEntropy("sum"))
    with pytest.raises(ValueError, match=r"targets must be integer class indices of shape \(20,\)"):
        opt.step(batch=(X, y[:4]))
    with pytest.raises(ValueError, match="inputs must be finite; they contain NaN or inf"):
        opt.step(batch=(X.clone().fill_(float("nan")), y))
