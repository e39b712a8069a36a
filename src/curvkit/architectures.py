"""Small modern architectures, written as researchers write them, for tests, benchmarks and experiments.

Every builder takes ``seed`` (the weights are a deterministic function of it; the global torch RNG is
left exactly as it was) and ``dtype``, and uses plain PyTorch modules in their usual form, so that what
curvkit does on them is what it does on a user's model:

* :func:`vit` - a Vision Transformer: image patches as tokens (a weight-shared ``nn.Linear`` on the
  flattened patches), a class token and a position table as raw ``nn.Parameter`` (as torchvision, timm
  and Hugging Face write them), pre-norm ``nn.TransformerEncoderLayer`` blocks (packed
  ``nn.MultiheadAttention``, LayerNorm, GELU), a LayerNorm and a linear head on the class token or on the
  mean token. Output (B, classes).
* :func:`causal_lm` - a GPT-style next-token model: token and position ``nn.Embedding``, pre-norm blocks
  of causal ``nn.MultiheadAttention`` and a GELU MLP with residual additions, a final LayerNorm and an
  output ``nn.Linear`` (``tie_weights=True`` shares it with the token embedding, as GPT-2 does). Input
  (B, T) token ids, output (B, T, vocab) logits.
* :func:`resnet` - a ResNet with BatchNorm: a conv stem and BasicBlocks (two 3x3 convolutions with
  BatchNorm and a residual addition, a strided 1x1 projection where the shape changes), global average
  pooling and a linear head. Output (B, classes).
* :func:`conv1d_tagger` - a sequence labeller: Conv1d, GroupNorm, GELU, a depthwise (grouped) Conv1d,
  GroupNorm, and a per-time-step linear head. Input (B, channels, T), output (B, T, classes).
* :class:`LoRALinear` / :func:`add_lora` - low-rank adapters (Hu et al. 2021) on ``nn.Linear`` modules:
  the base weight frozen, ``lora_A`` (r, in) and ``lora_B`` (out, r) trainable ``nn.Linear`` modules,
  output ``base(x) + (alpha / r) lora_B(lora_A(x))``.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Iterable
from typing import Literal, TypeVar

import torch
from torch import Tensor, nn

from curvkit.validation import integer

__all__ = ["LoRALinear", "add_lora", "causal_lm", "conv1d_tagger", "resnet", "vit"]

M = TypeVar("M", bound=nn.Module)


def _seeded(build: Callable[[], M], seed: int, dtype: torch.dtype | None) -> M:
    """``build()`` with the global CPU RNG seeded ``seed`` inside ``torch.random.fork_rng`` (restored after)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(int(seed))
        model = build()
    return model.to(dtype) if dtype is not None else model


def _positive(name: str, value: int) -> int:
    """A size: an ``int`` >= 1 (:func:`curvkit.validation.integer`; floats such as 2.0 are refused too)."""
    if not isinstance(value, int):
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    return integer(name, value)


# ---------------------------------------------------------------------------------------------- ViT
class ViT(nn.Module):
    """Vision Transformer (Dosovitskiy et al. 2021) for (B, channels, H, W) images; see :func:`vit`."""

    def __init__(self, image_size: int, patch_size: int, channels: int, dim: int, depth: int, heads: int,
                 mlp_dim: int, num_classes: int, pool: Literal["cls", "mean"]):
        super().__init__()
        if image_size % patch_size:
            raise ValueError(f"image_size {image_size} must be a multiple of patch_size {patch_size}")
        if dim % heads:
            raise ValueError(f"dim {dim} must be a multiple of heads {heads}")
        if pool not in ("cls", "mean"):
            raise ValueError(f"pool must be 'cls' or 'mean', got {pool!r}")
        self.patch_size, self.pool = patch_size, pool
        num_patches = (image_size // patch_size) ** 2
        self.patch_embed = nn.Linear(channels * patch_size**2, dim)
        self.cls_token = nn.Parameter(0.02 * torch.randn(1, 1, dim))
        self.pos_embedding = nn.Parameter(0.02 * torch.randn(1, num_patches + 1, dim))
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, mlp_dim, dropout=0.0, activation="gelu", batch_first=True,
                                       norm_first=True)
            for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, num_classes)

    def patches(self, x: Tensor) -> Tensor:
        """(B, C, H, W) -> (B, N, C * p * p) non-overlapping patches, row-major over the grid."""
        if x.dim() != 4:
            raise ValueError(f"ViT expects images of shape (batch, channels, height, width), got {tuple(x.shape)}")
        p = self.patch_size
        B, C, H, W = x.shape
        x = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
        return x.reshape(B, (H // p) * (W // p), C * p * p)

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.patch_embed(self.patches(x))
        cls = self.cls_token.expand(tokens.shape[0], -1, -1)
        h = torch.cat([cls, tokens], dim=1) + self.pos_embedding
        for block in self.blocks:
            h = block(h)
        h = self.norm(h)
        return self.head(h[:, 0] if self.pool == "cls" else h[:, 1:].mean(1))


def vit(image_size: int = 28, patch_size: int = 7, channels: int = 1, dim: int = 64, depth: int = 2,
        heads: int = 4, mlp_dim: int = 128, num_classes: int = 10, pool: Literal["cls", "mean"] = "cls",
        seed: int = 0, dtype: torch.dtype | None = None) -> ViT:
    """A ViT for (B, channels, image_size, image_size) images (module docstring). The defaults (28x28
    MNIST, 16 patches of 7x7, width 64, 2 blocks of 4 heads) have 72,074 parameters."""
    for name, v in (("image_size", image_size), ("patch_size", patch_size), ("channels", channels),
                    ("dim", dim), ("depth", depth), ("heads", heads), ("mlp_dim", mlp_dim),
                    ("num_classes", num_classes)):
        _positive(name, v)
    return _seeded(lambda: ViT(image_size, patch_size, channels, dim, depth, heads, mlp_dim, num_classes, pool),
                   seed, dtype)


# ---------------------------------------------------------------------------------------------- causal LM
class CausalBlock(nn.Module):
    """Pre-norm transformer block with causal self-attention: h + attn(ln1(h)), then h + mlp(ln2(h))."""

    def __init__(self, dim: int, heads: int, mlp_dim: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, mlp_dim), nn.GELU(), nn.Linear(mlp_dim, dim))

    def forward(self, h: Tensor) -> Tensor:
        T = h.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool, device=h.device).triu(1)  # True = not allowed
        x = self.ln1(h)
        h = h + self.attn(x, x, x, attn_mask=causal, need_weights=False)[0]
        return h + self.mlp(self.ln2(h))


class CausalLM(nn.Module):
    """GPT-style next-token model: (B, T) token ids -> (B, T, vocab) logits; see :func:`causal_lm`."""

    def __init__(self, vocab_size: int, max_len: int, dim: int, depth: int, heads: int, mlp_dim: int,
                 tie_weights: bool):
        super().__init__()
        if dim % heads:
            raise ValueError(f"dim {dim} must be a multiple of heads {heads}")
        self.max_len = max_len
        self.tok_embed = nn.Embedding(vocab_size, dim)
        self.pos_embed = nn.Embedding(max_len, dim)
        self.blocks = nn.ModuleList(CausalBlock(dim, heads, mlp_dim) for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)
        if tie_weights:
            self.lm_head.weight = self.tok_embed.weight

    def forward(self, ids: Tensor) -> Tensor:
        if ids.dim() != 2 or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"CausalLM expects (batch, tokens) integer token ids, got dtype {ids.dtype} shape "
                             f"{tuple(ids.shape)}")
        if ids.shape[1] > self.max_len:
            raise ValueError(f"sequence length {ids.shape[1]} exceeds max_len {self.max_len}")
        pos = torch.arange(ids.shape[1], device=ids.device).expand(ids.shape[0], -1)  # (B, T): one row per sample
        h = self.tok_embed(ids) + self.pos_embed(pos)
        for block in self.blocks:
            h = block(h)
        return self.lm_head(self.norm(h))


def causal_lm(vocab_size: int = 64, max_len: int = 32, dim: int = 32, depth: int = 2, heads: int = 4,
              mlp_dim: int = 64, tie_weights: bool = False, seed: int = 0,
              dtype: torch.dtype | None = None) -> CausalLM:
    """A GPT-style causal language model (module docstring); targets are the next tokens (B, T)."""
    for name, v in (("vocab_size", vocab_size), ("max_len", max_len), ("dim", dim), ("depth", depth),
                    ("heads", heads), ("mlp_dim", mlp_dim)):
        _positive(name, v)
    return _seeded(lambda: CausalLM(vocab_size, max_len, dim, depth, heads, mlp_dim, tie_weights), seed, dtype)


# ---------------------------------------------------------------------------------------------- ResNet
class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus the shortcut (identity, or strided 1x1 conv + BN), then ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """Stem, stages of BasicBlocks (the first of each later stage strided), pooling, head; see :func:`resnet`."""

    def __init__(self, channels: int, widths: tuple[int, ...], blocks_per_stage: int, num_classes: int):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(channels, widths[0], 3, 1, 1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU())
        stages: list[nn.Module] = []
        c = widths[0]
        for i, w in enumerate(widths):
            for j in range(blocks_per_stage):
                stages.append(BasicBlock(c, w, 2 if (i > 0 and j == 0) else 1))
                c = w
        self.stages = nn.Sequential(*stages)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(c, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.pool(self.stages(self.stem(x))).flatten(1))


def resnet(channels: int = 1, widths: Iterable[int] = (8, 16), blocks_per_stage: int = 1, num_classes: int = 10,
           seed: int = 0, dtype: torch.dtype | None = None) -> ResNet:
    """A small ResNet with BatchNorm (module docstring); BatchNorm in training mode couples the samples of a
    batch, so structured per-sample curvature needs ``model.eval()`` (or the Kronecker estimators' and
    GaussNewton's explicit ``batch_statistics="couple"``)."""
    widths = tuple(_positive("widths entry", int(w)) for w in widths)
    if not widths:
        raise ValueError("widths must name at least one stage width")
    _positive("channels", channels), _positive("blocks_per_stage", blocks_per_stage), _positive("num_classes", num_classes)
    return _seeded(lambda: ResNet(channels, widths, blocks_per_stage, num_classes), seed, dtype)


# ---------------------------------------------------------------------------------------------- Conv1d tagger
class Conv1dTagger(nn.Module):
    """(B, channels, T) -> (B, T, classes): per-time-step labels from 1-D convolutions; see :func:`conv1d_tagger`."""

    def __init__(self, channels: int, hidden: int, groups: int, num_classes: int, kernel_size: int):
        super().__init__()
        if hidden % groups:
            raise ValueError(f"hidden {hidden} must be a multiple of groups {groups}")
        pad = kernel_size // 2
        self.conv1 = nn.Conv1d(channels, hidden, kernel_size, padding=pad)
        self.norm1 = nn.GroupNorm(groups, hidden)
        self.conv2 = nn.Conv1d(hidden, hidden, kernel_size, padding=pad, groups=hidden)  # depthwise
        self.norm2 = nn.GroupNorm(groups, hidden)
        self.act = nn.GELU()
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x: Tensor) -> Tensor:
        h = self.act(self.norm1(self.conv1(x)))
        h = h + self.act(self.norm2(self.conv2(h)))
        return self.head(h.transpose(1, 2))


def conv1d_tagger(channels: int = 3, hidden: int = 8, groups: int = 2, num_classes: int = 5, kernel_size: int = 3,
                  seed: int = 0, dtype: torch.dtype | None = None) -> Conv1dTagger:
    """A Conv1d + GroupNorm sequence labeller (module docstring); ``kernel_size`` must be odd."""
    for name, v in (("channels", channels), ("hidden", hidden), ("groups", groups), ("num_classes", num_classes),
                    ("kernel_size", kernel_size)):
        _positive(name, v)
    if kernel_size % 2 == 0:
        raise ValueError(f"kernel_size must be odd (same-length output), got {kernel_size}")
    return _seeded(lambda: Conv1dTagger(channels, hidden, groups, num_classes, kernel_size), seed, dtype)


# ---------------------------------------------------------------------------------------------- LoRA
class LoRALinear(nn.Module):
    """``base(x) + (alpha / r) lora_B(lora_A(x))`` with ``base`` frozen (Hu et al. 2021).

    ``base`` is an ``nn.Linear`` or GPT-2's ``transformers.pytorch_utils.Conv1D`` (a linear layer whose
    weight is stored (in, out); recognised by its class, transformers is not imported). ``lora_A`` (in -> r)
    and ``lora_B`` (r -> out) are bias-free ``nn.Linear`` modules, so every curvature structure that knows
    ``nn.Linear`` covers them. ``init_b='zeros'`` (LoRA's choice: the adapted model
    starts as the base) or ``'normal'`` (small random B; a zero B makes the output independent of A to
    first order, so A's curvature is zero).
    """

    def __init__(self, base: nn.Module, rank: int, alpha: float | None = None,
                 init_b: Literal["zeros", "normal"] = "zeros", generator: torch.Generator | None = None):
        super().__init__()
        dims = _linear_dims(base)
        if dims is None:
            raise TypeError(f"LoRALinear adapts an nn.Linear or GPT-2's Conv1D, got {type(base).__name__}")
        in_features, out_features = dims
        _positive("rank", rank)
        if init_b not in ("zeros", "normal"):
            raise ValueError(f"init_b must be 'zeros' or 'normal', got {init_b!r}")
        self.base = base
        for p in self.base.parameters():
            p.requires_grad_(False)
        weight = base.weight
        assert isinstance(weight, Tensor)
        kw = {"dtype": weight.dtype, "device": weight.device}
        self.lora_A = nn.Linear(in_features, rank, bias=False, **kw)
        self.lora_B = nn.Linear(rank, out_features, bias=False, **kw)
        with torch.no_grad():  # nn.Linear's own init, redrawn from ``generator`` (the global RNG is not used)
            nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5), generator=generator)
            if init_b == "zeros":
                nn.init.zeros_(self.lora_B.weight)
            else:
                nn.init.normal_(self.lora_B.weight, std=1.0 / rank, generator=generator)
        self.scaling = float(alpha if alpha is not None else rank) / rank

    def forward(self, x: Tensor) -> Tensor:
        return self.base(x) + self.scaling * self.lora_B(self.lora_A(x))

    @property
    def weight(self) -> Tensor:
        """The adapted layer's effective weight, ``W + (alpha / r) B A``, in the base's layout ((out, in) for
        nn.Linear, (in, out) for Conv1D); not a parameter. PyTorch's fused ``nn.TransformerEncoderLayer``
        inference path reads ``linear1.weight`` / ``linear2.weight`` instead of calling the modules: with this
        it computes the adapted layer too."""
        delta = self.scaling * (self.lora_B.weight @ self.lora_A.weight)  # (out, in)
        base_weight = self.base.weight
        assert isinstance(base_weight, Tensor)
        return base_weight + (delta if type(self.base) is nn.Linear else delta.T)

    @property
    def bias(self) -> Tensor | None:
        """The base layer's bias (the adapters have none)."""
        bias = self.base.bias
        return bias if isinstance(bias, Tensor) else None


def _linear_dims(module: nn.Module) -> tuple[int, int] | None:
    """(in, out) of an ``nn.Linear`` or of GPT-2's ``Conv1D`` (weight (in, out)); None for anything else."""
    if type(module) is nn.Linear:
        return module.in_features, module.out_features
    cls = type(module)
    weight = getattr(module, "weight", None)
    if (cls.__module__, cls.__name__) == ("transformers.pytorch_utils", "Conv1D") and isinstance(weight, Tensor) \
            and weight.dim() == 2:
        return int(weight.shape[0]), int(weight.shape[1])
    return None


def add_lora(model: nn.Module, rank: int, targets: Callable[[str, nn.Module], bool] | None = None,
             alpha: float | None = None, init_b: Literal["zeros", "normal"] = "zeros", freeze_rest: bool = True,
             seed: int = 0) -> nn.Module:
    """A COPY of ``model`` with every ``nn.Linear`` (or GPT-2 ``Conv1D``) for which ``targets(name, module)``
    holds (default: all,
    except those inside ``nn.MultiheadAttention``, whose forward reads ``out_proj.weight`` directly and
    would bypass an adapter) replaced by a :class:`LoRALinear`; with ``freeze_rest`` every other parameter
    is frozen too. The user's model is not changed. Raises if no module matched."""
    model = copy.deepcopy(model)
    inside_mha = {f"{n}.out_proj" for n, m in model.named_modules() if isinstance(m, nn.MultiheadAttention)}
    chosen = [n for n, m in model.named_modules()
              if _linear_dims(m) is not None and n not in inside_mha and (targets is None or targets(n, m))]
    if not chosen:
        raise ValueError("add_lora: no nn.Linear (or GPT-2 Conv1D) module matched the targets")
    if freeze_rest:
        for p in model.parameters():
            p.requires_grad_(False)

    for name in chosen:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        base = getattr(parent, attr)
        gen = torch.Generator(device=base.weight.device).manual_seed(int(seed) + len(name))
        setattr(parent, attr, LoRALinear(base, rank, alpha, init_b, generator=gen))
    return model
