"""Model builders used across the papers. All return plain ``nn.Module`` (``nn.Sequential``) objects.

* :func:`mlp` - fully connected net, thesis Eq. 3.10 (no activation after the last layer).
* :func:`lenet` - a LeNet-style CNN for 28x28 or 32x32 single-channel images.
* :func:`autoencoder` - the D-1000-500-250-30-250-500-1000-D family (thesis section 4.5; Hinton &
  Salakhutdinov 2006), with a width multiplier; its outputs are logits for a Bernoulli likelihood.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch
from torch import nn

_ACTIVATIONS: dict[str, type[nn.Module]] = {
    "relu": nn.ReLU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "identity": nn.Identity,
}


def activation(name: str) -> nn.Module:
    try:
        return _ACTIVATIONS[name]()
    except KeyError:
        raise ValueError(f"unknown activation {name!r}; choose one of {sorted(_ACTIVATIONS)}") from None


def mlp(
    sizes: Sequence[int],
    activation_name: str = "relu",
    bias: bool = True,
    dtype: torch.dtype | None = None,
    seed: int | None = None,
) -> nn.Sequential:
    """MLP with layer widths ``sizes`` = (d_0, d_1, ..., d_L); activation between layers, none at the end.

    ``seed``: the weights are torch's default ``nn.Linear`` initialisation drawn from a local
    ``torch.Generator().manual_seed(seed)`` (the same values as ``torch.manual_seed(seed)`` followed by the
    construction, but the global random generator is neither read nor changed); None draws them from the
    global generator, as ``nn.Linear`` does.

    >>> mlp([4, 5, 3], "tanh")
    Sequential(
      (0): Linear(in_features=4, out_features=5, bias=True)
      (1): Tanh()
      (2): Linear(in_features=5, out_features=3, bias=True)
    )
    """
    sizes = list(sizes)
    if len(sizes) < 2 or any(int(s) < 1 for s in sizes):
        raise ValueError(f"mlp sizes must be at least two positive widths, got {sizes}")
    gen = None if seed is None else torch.Generator().manual_seed(int(seed))
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b, bias=bias) if gen is None else _seeded_linear(a, b, bias, gen))
        if i < len(sizes) - 2:
            layers.append(activation(activation_name))
    net = nn.Sequential(*layers)
    return net.to(dtype) if dtype is not None else net


def _seeded_linear(n_in: int, n_out: int, bias: bool, gen: torch.Generator) -> nn.Linear:
    """``nn.Linear(n_in, n_out)`` with its default initialisation (``reset_parameters``: weight
    U(-1/sqrt(n_in), 1/sqrt(n_in)) through kaiming_uniform_(a=sqrt(5)), bias U(-1/sqrt(n_in), 1/sqrt(n_in)))
    drawn from ``gen``, in the same order; nothing is drawn from the global generator."""
    layer = nn.utils.skip_init(nn.Linear, n_in, n_out, bias=bias)
    with torch.no_grad():
        nn.init.kaiming_uniform_(layer.weight, a=math.sqrt(5), generator=gen)
        if layer.bias is not None:
            bound = 1 / math.sqrt(n_in) if n_in > 0 else 0.0
            nn.init.uniform_(layer.bias, -bound, bound, generator=gen)
    return layer


def lenet(
    in_channels: int = 1,
    num_classes: int = 10,
    image_size: int = 28,
    channels: tuple[int, int] = (6, 16),
    hidden: tuple[int, int] = (120, 84),
    activation_name: str = "relu",
    dtype: torch.dtype | None = None,
) -> nn.Sequential:
    """LeNet-5-style CNN: conv5-pool2-conv5-pool2-fc-fc-fc (padding 2 on the first conv for 28x28)."""
    if image_size not in (28, 32):
        raise ValueError(f"lenet supports 28x28 or 32x32 images, got {image_size}")
    pad = 2 if image_size == 28 else 0
    c1, c2 = channels
    net = nn.Sequential(
        nn.Conv2d(in_channels, c1, 5, padding=pad), activation(activation_name), nn.MaxPool2d(2),
        nn.Conv2d(c1, c2, 5), activation(activation_name), nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(c2 * 5 * 5, hidden[0]), activation(activation_name),
        nn.Linear(hidden[0], hidden[1]), activation(activation_name),
        nn.Linear(hidden[1], num_classes),
    )
    return net.to(dtype) if dtype is not None else net


def autoencoder(
    input_dim: int = 784,
    width: float = 1.0,
    activation_name: str = "tanh",
    code_dim: int = 30,
    dtype: torch.dtype | None = None,
) -> nn.Sequential:
    """D-1000-500-250-30-250-500-1000-D autoencoder; hidden widths scaled by ``width`` (code layer fixed).

    The thesis (Sec. 4.5) does not state the hidden activation; the default here is tanh on every hidden
    layer including the 30-unit code, the choice of the authors' public autoencoder example. The output
    gives logits (Bernoulli likelihood) or means (Gaussian), with no output activation.
    """
    if width <= 0:
        raise ValueError(f"width must be positive, got {width}")
    h = [max(1, round(w * width)) for w in (1000, 500, 250)]
    sizes = [input_dim, *h, code_dim, *reversed(h), input_dim]
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(nn.Linear(a, b))
        if i < len(sizes) - 2:
            layers.append(activation(activation_name))
    net = nn.Sequential(*layers)
    return net.to(dtype) if dtype is not None else net
