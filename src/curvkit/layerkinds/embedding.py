"""``nn.Embedding``: a lookup ``h_{n,r} = W[id_{n,r}]`` is a linear layer with one-hot inputs.

The weight W is (V, D) = (in, out), transposed relative to ``nn.Linear``: the block views it as
``W_hat = W^T`` (D, V) (its ``index``), so ``G`` is (D, D) and the input factor, the second moment of
one-hot rows, is DIAGONAL: under expand ``A = (1/N) sum_{n,r} e_{id} e_{id}^T = diag(token counts) / N``,
stored as a V-vector (never a V x V matrix: GPT-2's V is 50,257). Positions always use expand: under
reduce the input factor would be a dense V x V matrix of count products (ASDL's choice), so an
embedding ignores ``weight_sharing='reduce'`` (documented in docs/architecture.md).

Ids shared by the batch. A lookup of ids without a batch dimension (``wpe(torch.arange(T))``, as nanoGPT,
GPT-2 and BERT write their position embeddings) or with a batch dimension of size 1 (``(1, T)`` position
ids) gives one output that the model broadcasts over the samples. Where the capture knows the batch size B
(the estimators' own passes set it), the layer's output is replaced by its copy expanded over the batch,
``out.expand(B, ...)`` (the same values; a 1-D lookup gains a leading dimension of size B, which broadcasting
against the (B, T, D) token embeddings gives anyway), so the gradient of each sample's copy is that sample's
output rows and the statistics are the per-sample ones of ``B`` identical id rows. A 1-D lookup of exactly B
ids is read as one id per sample (a label or time-step embedding), unless the module was seen looking up
1-D ids of another length than the batch before (then they are positions: a predictive's last, smaller
chunk stays right); position ids whose length equals the batch size in the FIRST pass are read per sample,
so give such ids their batch dimension ((1, T) or (B, T)).

Ids of two or more dimensions without the batch (T5's relative attention bias: an Embedding looked up on the
(T, T) bucket ids, whose (T, T, heads) output the model permutes to (1, heads, T, T) and broadcasts over the
batch) cannot be widened in place (the model's own reshapes expect its shape). Where the capture knows the batch
size B and the ids' first dimension is neither B nor 1 (or the module was seen so before), the output is kept
and emitted as a SHARED site (:attr:`~curvkit.layerkinds.Site.shared`): its id rows are the same for every
sample, and its per-sample output rows are read from per-sample gradients of the output, which the consumers
form by one batched backward pass of each sample's part of their vectors (the sample's gradient of a tensor all
samples use; costs B times that backward pass's memory).

``padding_idx``: torch never updates that row (its gradient is zero), so positions holding it count as a
zero input row: the row gets no curvature. Refused: ``max_norm`` (renormalises W in place during the
forward pass, so the function changes while it is evaluated), ``scale_grad_by_freq`` and ``sparse`` (the
gradient torch returns is then not the loss gradient the curvature belongs to, or not a dense tensor).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any
from weakref import WeakKeyDictionary

from torch import Tensor, nn

from curvkit.layerkinds._base import BlockSpec, Emit, LayerHandler, Site, batch_of, batched_input, recording
from curvkit.linalg.kron import transposed_index
from curvkit.structure import refuse

__all__ = ["EmbeddingHandler"]

#: modules seen looking up 1-D ids of another length than the batch: shared positions from then on
_SHARED: WeakKeyDictionary[nn.Module, bool] = WeakKeyDictionary()


class EmbeddingHandler(LayerHandler):
    """``nn.Embedding`` (module docstring)."""

    kind = "embedding"
    takes_shards = True

    def check(self, module: nn.Module, label: str, what: str) -> None:
        for attr, why in (("max_norm", "renormalises its weight in place during the forward pass"),
                          ("scale_grad_by_freq", "scales its gradient by token frequency (not the loss gradient)"),
                          ("sparse", "has sparse gradients")):
            value = getattr(module, attr)
            if value not in (None, False):
                raise refuse(what, label, module, f"has {attr}={value!r}: it {why}",
                             f"build it with {attr}={None if attr == 'max_norm' else False}, or freeze it")

    def blocks(self, module: nn.Module, label: str, names: Mapping[str, str | None], what: str) -> list[BlockSpec]:
        w = names["weight"]
        assert w is not None
        mod: Any = module
        V, D = int(mod.num_embeddings), int(mod.embedding_dim)
        index = transposed_index(V, D, False)  # W_hat[d, v] = W[v, d]
        return [BlockSpec(label, w, None, D, V, ids=True, index=index, sharing="expand")]

    def attach(self, module: nn.Module, label: str, blocks: Sequence[BlockSpec], emit: Emit, what: str) -> list[Any]:
        m: Any = module
        D, pad = int(m.embedding_dim), m.padding_idx

        def hook(mod: nn.Module, inputs: tuple[Any, ...], out: Tensor) -> Tensor | None:
            if not recording(out):
                return None
            ids = batched_input(mod, label, inputs[0], 1, what, "token ids (batch, ...)").detach()
            B, wide = ids.shape[0], None
            batch = batch_of(emit)
            if batch is not None and ids.shape[0] != batch and (ids.dim() == 1 or ids.shape[0] != 1):
                _SHARED[mod] = True  # arange(T), (T, T) buckets: shared by the samples from now on
            shared = False
            if batch is not None and ids.dim() == 1 and (ids.shape[0] != batch or _SHARED.get(mod, False)):
                wide = out.unsqueeze(0).expand(batch, *out.shape)
            elif batch is not None and batch > 1 and ids.dim() >= 2 and ids.shape[0] == 1:  # (1, T) position ids
                wide = out.expand(batch, *out.shape[1:])
            elif batch is not None and ids.dim() >= 2 and _SHARED.get(mod, False):  # (T, T) buckets: kept as is
                shared = True
            if wide is not None or shared:  # ids shared by every sample: each sample gets its own output rows
                B = batch  # type: ignore[assignment]
                if wide is not None:
                    out = wide
                ids = ids.reshape(1, -1).expand(B, -1)
            ids = ids.reshape(B, -1).long()
            if pad is not None:
                ids = ids.masked_fill(ids == pad, -1)
            emit(Site(0, ids, out, lambda g: g.reshape(B, -1, D), shared))
            return wide

        return [module.register_forward_hook(hook)]
