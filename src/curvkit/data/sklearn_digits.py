"""scikit-learn's bundled 8x8 handwritten digits (1797 images, 10 classes; UCI optdigits test set).

scikit-learn is a development dependency only, so it is imported lazily.
"""

from __future__ import annotations

import torch

__all__ = ["digits"]


def digits(dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``(X, y)``: X (1797, 8, 8) of ``dtype`` with the integer counts 0..16 that scikit-learn gives
    (not rescaled; divide by 16 for [0, 1]), y int64 (1797,) labels 0..9.

    Raises ImportError (with the install command) when scikit-learn is not installed.
    """
    if not dtype.is_floating_point:
        raise TypeError(f"digits: dtype must be a floating dtype, got {dtype}")
    try:
        from sklearn.datasets import load_digits
    except ImportError as err:
        raise ImportError(
            "curvkit.data.digits needs scikit-learn, which is only a development dependency: "
            "pip install scikit-learn  (or pip install 'curvkit[dev]')"
        ) from err
    bunch = load_digits()
    X = torch.as_tensor(bunch.images, dtype=dtype)
    y = torch.as_tensor(bunch.target, dtype=torch.int64)
    return X, y
