"""One torch thread for the chapter-5 experiments: their networks are small, and on a shared 2-core machine a
second OpenMP thread spin-waits (measured here: a 784-100-100-10 training step 50x slower with 2 threads
under a load of 5 than with 1)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch


def single_threaded(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Run ``fn`` with ``torch.set_num_threads(1)``, restoring the previous setting afterwards."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            return fn(*args, **kwargs)
        finally:
            torch.set_num_threads(threads)

    return wrapper
