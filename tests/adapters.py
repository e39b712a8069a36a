"""Tiny fine-tuning models for the frozen-parameter tests: a frozen base with low-rank adapters (LoRA),
written as modules (:func:`module_lora`) and as raw ``nn.Parameter`` s (:func:`raw_lora`), float64.

Both compute ``h <- base(h) + B A h`` per layer (tanh between layers); only the adapters A (rank x in)
and B (out x rank), and the head's parameters where there is one, are trainable.
"""

from __future__ import annotations

import itertools

import torch
from torch import Tensor, nn


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update ``lora_B(lora_A(x))``."""

    def __init__(self, n_in: int, n_out: int, rank: int = 2):
        super().__init__()
        self.base = nn.Linear(n_in, n_out)
        self.base.requires_grad_(False)
        self.lora_A = nn.Linear(n_in, rank, bias=False)
        self.lora_B = nn.Linear(rank, n_out, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x))


def module_lora(sizes=(6, 16, 3), rank: int = 2, seed: int = 0) -> nn.Sequential:
    """``LoRALinear - Tanh - LoRALinear`` (the adapters are ``nn.Linear`` modules)."""
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(itertools.pairwise(sizes)):
        layers.append(LoRALinear(a, b, rank))
        if i < len(sizes) - 2:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers).double()


class RawLoRA(nn.Module):
    """Frozen ``nn.Linear`` layers with adapters held as raw parameters in ``nn.ParameterList`` s, which are
    registered after the layers but used inside every layer's forward (none of them is "the last layer")."""

    def __init__(self, sizes=(6, 8, 3), rank: int = 2):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(a, b) for a, b in itertools.pairwise(sizes)])
        self.layers.requires_grad_(False)
        self.lora_A = nn.ParameterList([nn.Parameter(0.3 * torch.randn(rank, a)) for a in sizes[:-1]])
        self.lora_B = nn.ParameterList([nn.Parameter(0.3 * torch.randn(b, rank)) for b in sizes[1:]])

    def forward(self, x: Tensor) -> Tensor:
        for i, lin in enumerate(self.layers):
            x = lin(x) + x @ self.lora_A[i].T @ self.lora_B[i].T
            if i < len(self.layers) - 1:
                x = torch.tanh(x)
        return x


def raw_lora(sizes=(6, 8, 3), rank: int = 2, seed: int = 0) -> RawLoRA:
    torch.manual_seed(seed)
    return RawLoRA(sizes, rank).double()


class HeadedRawLoRA(nn.Module):
    """A :class:`RawLoRA` body followed by a trainable ``head`` Linear that produces the output (registered
    FIRST, so registration order would pick the adapters as the last layer)."""

    def __init__(self, sizes=(6, 8, 5), classes: int = 3, rank: int = 2):
        super().__init__()
        self.head = nn.Linear(sizes[-1], classes)
        self.body = RawLoRA(sizes, rank)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(torch.tanh(self.body(x)))


def headed_raw_lora(seed: int = 0) -> HeadedRawLoRA:
    torch.manual_seed(seed)
    return HeadedRawLoRA().double()


def frozen_snapshot(model: nn.Module) -> dict[str, Tensor]:
    """Copies of the frozen parameters and of every buffer, to check later that nothing changed them."""
    out = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    out.update({f"buffer:{n}": b.detach().clone() for n, b in model.named_buffers()})
    return out


def assert_frozen_unchanged(model: nn.Module, snapshot: dict[str, Tensor]) -> None:
    now = {n: p.detach() for n, p in model.named_parameters()}
    now.update({f"buffer:{n}": b.detach() for n, b in model.named_buffers()})
    changed = [n for n, t in snapshot.items() if not torch.equal(now[n], t)]
    assert not changed, f"frozen parameters or buffers changed: {changed}"


def num_trainable(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
