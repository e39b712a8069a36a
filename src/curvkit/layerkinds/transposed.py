"""A linear layer that stores its weight transposed: GPT-2's ``transformers.pytorch_utils.Conv1D``.

``Conv1D(nf, nx)`` computes ``y = x W + b`` with ``W`` of shape (nx, nf) = (in, out) and ``b`` (out,) on
inputs (B, *S, in): an ``nn.Linear`` whose weight is ``W^T``. Its block is the Linear block of
``W_hat = [W^T | b]`` (out, in + 1): ``G (x) A`` with G (out, out) and A (in + 1, in + 1), the same factors
as the layer written with ``nn.Linear(in, out)`` and weight ``W^T``; only the ``index`` differs, which
places ``W_hat[o, i] = W[i, o]`` at position ``i * out + o`` of ``W.flatten()`` and the bias column after
it: a :class:`curvkit.linalg.kron.StridedIndex` (:func:`~curvkit.linalg.kron.transposed_index`), read and
written through a transposed view, never an integer map of the weight's size. Positions share the weight as for ``nn.Linear``
(expand or reduce).

GPT-2's fused query/key/value projection ``c_attn`` (one ``Conv1D(3E, E)``) gets ONE block: the layer as
written, with a (3E, 3E) output factor that keeps the correlations between the query, key and value outputs,
as the same layer written as ``nn.Linear(E, 3E)`` would get. ``nn.MultiheadAttention``'s packed projection is
split into q, k, v blocks because its handler knows that packing; a ``Conv1D`` does not say that it packs
three projections, and three blocks would be the block-diagonal part of this one (``G_qq (x) A``, ...: the
cross terms dropped), at a third of the factor's size.

``transformers`` is optional: :mod:`curvkit.layerkinds` recognises the class by its qualified name
(:data:`LAZY`) without importing it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from torch import Tensor, nn

from curvkit.layerkinds._base import BlockSpec, LayerHandler, weight_and_bias
from curvkit.layerkinds.linear import LinearHandler
from curvkit.linalg.kron import transposed_index

__all__ = ["LAZY", "TransposedLinearHandler", "transposed_index"]


class TransposedLinearHandler(LinearHandler):
    """A linear layer with weight (in, out) and bias (out,): GPT-2's ``Conv1D`` (module docstring). The
    sizes are read from the weight; the rows are the Linear handler's."""

    kind = "transposed_linear"
    takes_shards = False  # its block is a transposed view of the weight (not verified on shards)

    def sizes(self, module: nn.Module) -> tuple[int, int]:
        mod: Any = module
        return int(mod.weight.shape[0]), int(mod.weight.shape[1])

    def blocks(self, module: nn.Module, label: str, names: Mapping[str, str | None], what: str) -> list[BlockSpec]:
        w, b = weight_and_bias(module, label, names, what)
        assert w is not None
        n_in, n_out = self.sizes(module)
        return [BlockSpec(label, w, b, n_out, n_in, index=transposed_index(n_in, n_out, b is not None))]

    def bilinear(self, module: nn.Module) -> bool:
        """No tangent, squared-gradient or paired-rows rule of its own (the Linear handler's read the weight as
        (out, in); its block is a transposed view)."""
        return False

    def paired_rows(self, module: nn.Module) -> Literal["samples", "positions"] | None:
        return None

    def squares(self, module: nn.Module, x: Tensor | None = None) -> bool:
        return False


#: Module classes of optional libraries, by (module, qualified name): registered on first sight.
LAZY: dict[tuple[str, str], type[LayerHandler]] = {
    ("transformers.pytorch_utils", "Conv1D"): TransposedLinearHandler,
}
