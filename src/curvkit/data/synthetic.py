"""Seeded synthetic data sets for tests and small experiments.

Every generator draws from a private ``torch.Generator`` seeded with ``seed``; the global torch RNG is
neither read nor changed, so results depend on the arguments only.

* :func:`regression` - linear-Gaussian: ``y = X W^T + noise * eps`` with the true weights returned.
* :func:`classification` - Gaussian blobs: one random mean per class, unit-variance isotropic noise.
* :func:`teacher_student` - inputs ``x ~ N(0, I)`` and targets from a random MLP teacher.

>>> X, y, W = regression(5, 3, seed=0)
>>> X.shape, y.shape, W.shape
(torch.Size([5, 3]), torch.Size([5, 1]), torch.Size([1, 3]))
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

from curvkit.models import mlp

__all__ = ["classification", "regression", "teacher_student"]


def _positive_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def _nonneg_float(name: str, value: float) -> float:
    value = float(value)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be a finite non-negative number, got {value!r}")
    return value


def _generator(seed: int) -> torch.Generator:
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {seed!r}")
    return torch.Generator().manual_seed(seed)


def regression(
    n: int,
    d: int,
    noise: float = 0.1,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    outputs: int = 1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Linear-Gaussian regression ``(X, y, W)``.

    ``X`` (n, d) with i.i.d. N(0, 1) entries, true weights ``W`` (outputs, d) with i.i.d. N(0, 1/d)
    entries (so ``X W^T`` has unit variance per output; same layout as an ``nn.Linear(d, outputs,
    bias=False)`` weight), and ``y = X W^T + noise * eps`` (n, outputs) with eps ~ N(0, I). The shape of
    ``y`` matches a (n, outputs) model output, as the Gaussian likelihood requires.
    """
    n, d, outputs = _positive_int("n", n), _positive_int("d", d), _positive_int("outputs", outputs)
    noise = _nonneg_float("noise", noise)
    g = _generator(seed)
    X = torch.randn(n, d, generator=g, dtype=dtype)
    W = torch.randn(outputs, d, generator=g, dtype=dtype) / math.sqrt(d)
    y = X @ W.T + noise * torch.randn(n, outputs, generator=g, dtype=dtype)
    return X, y, W


def classification(
    n: int,
    d: int,
    num_classes: int,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    separation: float = 2.0,
) -> tuple[Tensor, Tensor]:
    """Gaussian blobs ``(X, y)``: X (n, d), y int64 (n,) in 0..num_classes-1.

    Class means ``mu_k ~ N(0, separation^2 I / d)`` (so ``||mu_k|| ~ separation`` for any d); labels
    uniform at random; ``x = mu_y + eps`` with eps ~ N(0, I). Larger ``separation`` = easier problem.
    """
    n, d = _positive_int("n", n), _positive_int("d", d)
    num_classes = _positive_int("num_classes", num_classes)
    if num_classes < 2:
        raise ValueError(f"num_classes must be at least 2, got {num_classes}")
    separation = _nonneg_float("separation", separation)
    g = _generator(seed)
    means = torch.randn(num_classes, d, generator=g, dtype=dtype) * (separation / math.sqrt(d))
    y = torch.randint(num_classes, (n,), generator=g)
    X = means[y] + torch.randn(n, d, generator=g, dtype=dtype)
    return X, y


def teacher_student(
    n: int,
    sizes: Sequence[int],
    activation: str = "tanh",
    noise: float = 0.0,
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    bias: bool = True,
) -> tuple[Tensor, Tensor, nn.Sequential]:
    """Teacher-student regression ``(X, y, teacher)``.

    ``teacher = curvkit.models.mlp(sizes, activation, bias)`` with weights drawn i.i.d.
    N(0, 1/fan_in) and biases N(0, 0.1^2) from the seeded generator (layer by layer, weight then bias);
    ``X`` (n, sizes[0]) ~ N(0, I) and ``y = teacher(X) + noise * eps`` (n, sizes[-1]). The teacher is
    returned in eval mode with ``requires_grad`` off. A student is e.g. ``mlp(sizes, ...)`` with its own
    random initialisation.
    """
    n = _positive_int("n", n)
    sizes = list(sizes)
    noise = _nonneg_float("noise", noise)
    g = _generator(seed)
    with torch.random.fork_rng(devices=[]):  # mlp's default initialisation draws from the global RNG
        teacher = mlp(sizes, activation, bias=bias, dtype=dtype)
    with torch.no_grad():
        for layer in teacher:
            if isinstance(layer, nn.Linear):
                w = torch.randn(layer.weight.shape, generator=g, dtype=dtype) / math.sqrt(layer.in_features)
                layer.weight.copy_(w)
                if layer.bias is not None:
                    layer.bias.copy_(0.1 * torch.randn(layer.bias.shape, generator=g, dtype=dtype))
        teacher.requires_grad_(False)
        teacher.eval()
        X = torch.randn(n, sizes[0], generator=g, dtype=dtype)
        y = teacher(X) + noise * torch.randn(n, sizes[-1], generator=g, dtype=dtype)
    return X, y, teacher
