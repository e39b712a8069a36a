"""Standard image transforms used by the papers, as plain functions on whole tensors.

* :func:`to_unit` - uint8 pixels 0..255 -> floats in [0, 1] (x / 255).
* :func:`pad` - zero padding of the last two (spatial) dims, e.g. 28x28 -> 32x32 with ``pad(X, 2)``.
* :func:`flatten` - (N, H, W) or (N, C, H, W) -> (N, H*W) or (N, C*H*W), row-major.
* :func:`image_vectors` - the preparation every MNIST-style experiment uses: optional padding, pixels to
  [0, 1], flattening, optional standardisation ``(x - mean) / std``.
* :func:`pixel_permutation` / :func:`permute_pixels` - the fixed-seed pixel permutations of
  permuted-MNIST continual-learning tasks: ``permute_pixels(X_flat, perm)[:, j] = X_flat[:, perm[j]]``.

>>> X = torch.tensor([[[0, 255], [51, 102]]], dtype=torch.uint8)
>>> to_unit(X)
tensor([[[0.0000, 1.0000],
         [0.2000, 0.4000]]])
>>> flatten(pad(X, 1)).shape
torch.Size([1, 16])
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["flatten", "image_vectors", "pad", "permute_pixels", "pixel_permutation", "to_unit"]


def _check_tensor(name: str, X: object) -> Tensor:
    if not isinstance(X, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(X).__name__}")
    return X


def to_unit(X: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """uint8 pixels 0..255 -> ``dtype`` values in [0, 1] (``X / 255``); any shape."""
    X = _check_tensor("to_unit", X)
    if X.dtype != torch.uint8:
        raise TypeError(
            f"to_unit: expected uint8 pixels 0..255, got {X.dtype} (already scaled? then skip to_unit)"
        )
    if not dtype.is_floating_point:
        raise TypeError(f"to_unit: dtype must be a floating dtype, got {dtype}")
    return X.to(dtype) / 255


def pad(X: Tensor, padding: int = 2, value: float = 0) -> Tensor:
    """Pad the last two dims by ``padding`` on every side with ``value``: (..., H, W) -> (..., H+2p, W+2p)."""
    X = _check_tensor("pad", X)
    if isinstance(padding, bool) or not isinstance(padding, int) or padding < 0:
        raise ValueError(f"pad: padding must be a non-negative int, got {padding!r}")
    if X.ndim < 2:
        raise ValueError(f"pad: expected images with at least 2 dims (..., H, W), got shape {tuple(X.shape)}")
    if padding == 0:
        return X.clone()
    return F.pad(X, (padding, padding, padding, padding), mode="constant", value=value)


def flatten(X: Tensor) -> Tensor:
    """(N, H, W) -> (N, H*W) and (N, C, H, W) -> (N, C*H*W), row-major (a copy only when needed)."""
    X = _check_tensor("flatten", X)
    if X.ndim not in (3, 4):
        raise ValueError(
            f"flatten: expected a batch of images (N, H, W) or (N, C, H, W), got shape {tuple(X.shape)}"
        )
    return X.reshape(X.shape[0], -1)


def image_vectors(X: Tensor, padding: int = 0, mean: float | None = None, std: float | None = None,
                  dtype: torch.dtype = torch.float32) -> Tensor:
    """uint8 images (N, H, W) or (N, C, H, W) -> (N, D) ``dtype`` vectors: ``pad`` by ``padding``, scale to
    [0, 1] (:func:`to_unit`), flatten, then ``(x - mean) / std`` when both are given."""
    if (mean is None) != (std is None):
        raise ValueError("image_vectors: give both mean and std, or neither")
    if std is not None and not std > 0:
        raise ValueError(f"image_vectors: std must be positive, got {std}")
    X = flatten(to_unit(pad(X, padding) if padding else X, dtype))
    return X if mean is None or std is None else (X - mean) / std


def pixel_permutation(num_pixels: int, seed: int) -> Tensor:
    """A permutation of ``range(num_pixels)`` (int64) fixed by ``seed``; independent of the global RNG.

    Drawn with ``torch.randperm`` from a private ``torch.Generator`` seeded with ``seed``.
    """
    if isinstance(num_pixels, bool) or not isinstance(num_pixels, int) or num_pixels < 1:
        raise ValueError(f"pixel_permutation: num_pixels must be a positive int, got {num_pixels!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"pixel_permutation: seed must be an int, got {seed!r}")
    generator = torch.Generator().manual_seed(seed)
    return torch.randperm(num_pixels, generator=generator)


def permute_pixels(X_flat: Tensor, perm: Tensor) -> Tensor:
    """Reorder the last dim: ``out[..., j] = X_flat[..., perm[j]]``; X_flat (..., D), perm a permutation of D."""
    X_flat = _check_tensor("permute_pixels", X_flat)
    perm = _check_tensor("permute_pixels", perm)
    if X_flat.ndim < 1:
        raise ValueError("permute_pixels: X_flat must have at least one dim (..., D)")
    if perm.ndim != 1 or perm.dtype != torch.int64:
        raise ValueError(f"permute_pixels: perm must be a 1-D int64 tensor, got {perm.dtype} {tuple(perm.shape)}")
    D = X_flat.shape[-1]
    if perm.numel() != D:
        raise ValueError(
            f"permute_pixels: perm has {perm.numel()} entries but X_flat has {D} pixels in its last dim "
            f"(shape {tuple(X_flat.shape)}); flatten the images first"
        )
    if not torch.equal(perm.sort().values, torch.arange(D, device=perm.device)):
        raise ValueError("permute_pixels: perm is not a permutation of 0..D-1")
    return X_flat[..., perm.to(X_flat.device)]
