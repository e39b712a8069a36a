"""Pieces shared by the MESU experiments: flattened MNIST in [0, 1] and the papers' MLP initialisation."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from curvkit.models import mlp


def mnist_flat(n_train: int | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Bundled MNIST scaled to [0, 1] and flattened: (X_train (N, 784), y_train, X_test, y_test);
    ``n_train`` keeps the first n training images."""
    from curvkit.data import mnist_vectors

    return (*mnist_vectors(train=True, n=n_train), *mnist_vectors(train=False))


def kaiming_uniform_mlp(sizes: Sequence[int], seed: int) -> nn.Sequential:
    """ReLU MLP with weights U(+-sqrt(6/fan_in)) and biases U(+-1/sqrt(fan_in)), drawn from a generator
    seeded with ``seed``.

    The MESU paper says "Kaiming uniform" without the variant; this is ``torch.nn.init.kaiming_uniform_``
    with its defaults for the weights (bound sqrt(6/fan_in)) and PyTorch's usual bias bound."""
    model = mlp(sizes, "relu", seed=seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model:
            if isinstance(layer, nn.Linear):
                bound = math.sqrt(6.0 / layer.in_features)
                layer.weight.uniform_(-bound, bound, generator=g)
                b = 1.0 / math.sqrt(layer.in_features)
                layer.bias.uniform_(-b, b, generator=g)
    return model
