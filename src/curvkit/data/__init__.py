"""Data for curvkit: IDX reading, the bundled MNIST and KMNIST-test copies, user-supplied MNIST and
Fashion-MNIST files, scikit-learn's 8x8 digits, seeded synthetic sets, transforms and mini-batching.

* :func:`mnist` (bundled full MNIST by default, or ``root=``/``CURVKIT_MNIST_DIR``),
  :func:`fashion_mnist` (user files: ``root=``/``CURVKIT_FASHION_MNIST_DIR``), :func:`kmnist_test`,
  :func:`digits`; all return ``(X, y)`` tensors with int64 labels.
* :mod:`curvkit.data.idx` (:func:`read_idx`, :func:`write_idx`, :class:`DataFileError`),
  :mod:`curvkit.data.transforms`, :mod:`curvkit.data.synthetic`, :mod:`curvkit.data.loader`.

Licenses of the bundled files: ``curvkit/data/bundled/*/LICENSE`` (MNIST: CC BY-SA 3.0;
KMNIST: CC BY-SA 4.0).
"""

from curvkit.data import idx, loader, synthetic, transforms
from curvkit.data.idx import DataFileError, MissingDataFileError, read_idx, write_idx
from curvkit.data.idx_datasets import fashion_mnist, mnist, mnist_vectors
from curvkit.data.kmnist import kmnist_test
from curvkit.data.loader import iterate_batches, train_test_split
from curvkit.data.sklearn_digits import digits

__all__ = [
    "DataFileError",
    "MissingDataFileError",
    "digits",
    "fashion_mnist",
    "idx",
    "iterate_batches",
    "kmnist_test",
    "loader",
    "mnist",
    "mnist_vectors",
    "read_idx",
    "synthetic",
    "train_test_split",
    "transforms",
    "write_idx",
]
from curvkit.data.task_sequence import available_tasks, load_task, synthetic_vision_tasks, to_rgb32
from curvkit.data.vision_sets import cifar10, notmnist, svhn

__all__ += ["available_tasks", "cifar10", "load_task", "notmnist", "svhn", "synthetic_vision_tasks", "to_rgb32"]
