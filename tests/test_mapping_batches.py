"""Batches that are mappings of tensors (``{"ids": ..., "mask": ...}``) through the whole engine, without
transformers: the input helpers of curvkit.validation, exact operators against dense references (products,
diagonals, dense matrices, per-sample rows, the forward-mode pass in pieces, the batched-backward diagonal),
Kronecker / diagonal / EKFAC estimators equal to the same model fed one packed tensor (raw parameters
included), and DistributedOperator over shards taken with ``take_samples``."""

from __future__ import annotations

from collections import UserDict

import pytest
import torch
from torch import Tensor, nn

from curvkit.curvature import EmpiricalFisherOperator, GGNOperator, HessianOperator, MCFisherOperator
from curvkit.curvature.ekfac import EKFACEstimator, FirstBatchBasisWarning
from curvkit.curvature.estimators import DiagonalEstimator, KroneckerEstimator
from curvkit.likelihoods import CrossEntropy
from curvkit.validation import (
    check_inputs,
    describe_inputs,
    inputs_to,
    iter_batches,
    map_inputs,
    num_samples,
    split_samples,
    take_samples,
)
from reference import dense_ef_flat, dense_ggn_flat, dense_hessian_ror

D64 = torch.float64
ATOL = 1e-10


class DictTagger(nn.Module):
    """Per-token logits from a mapping batch {"ids": (B, T) long, "feats": (B, T, F), "mask": (B, T)}: an
    embedding, a Linear on the features, a raw position table (1, T, D), LayerNorm, a Linear head."""

    def __init__(self, V: int = 7, F: int = 3, T: int = 4, D: int = 4, C: int = 3, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.emb, self.proj = nn.Embedding(V, D), nn.Linear(F, D)
        self.pos = nn.Parameter(0.3 * torch.randn(1, T, D))
        self.norm, self.head = nn.LayerNorm(D), nn.Linear(D, C)
        self.to(D64)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        h = self.emb(batch["ids"]) + self.proj(batch["feats"]) + self.pos
        return self.head(torch.tanh(self.norm(h)) * batch["mask"][..., None])


class Packed(nn.Module):
    """The same model fed ONE tensor (B, T, 1 + F + 1) = [ids, feats, mask] (shares the parameters)."""

    def __init__(self, model: DictTagger):
        super().__init__()
        self.model = model

    def forward(self, X: Tensor) -> Tensor:
        return self.model({"ids": X[..., 0].long(), "feats": X[..., 1:-1], "mask": X[..., -1]})


class DictMLP(nn.Module):
    """(B, C) logits from {"a": (B, 3), "b": (B, 2)}: Linear layers only (the batched-backward diagonal)."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.a, self.b, self.head = nn.Linear(3, 5), nn.Linear(2, 5), nn.Linear(5, 4)
        self.to(D64)

    def forward(self, batch: dict[str, Tensor]) -> Tensor:
        return self.head(torch.tanh(self.a(batch["a"]) + self.b(batch["b"])))


def tagger_batch(B: int, T: int = 4, V: int = 7, F: int = 3, C: int = 3, seed: int = 0, pad: bool = True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=D64)
    y = torch.randint(0, C, (B, T), generator=g)
    if pad:  # the last positions of every other sample are padding
        mask[::2, T - 1:] = 0
        y[::2, T - 1:] = -100
    return {"ids": ids, "feats": torch.randn(B, T, F, generator=g, dtype=D64), "mask": mask}, y


def pack(X: dict[str, Tensor]) -> Tensor:
    return torch.cat([X["ids"][..., None].to(D64), X["feats"], X["mask"][..., None]], dim=-1)


# ---------------------------------------------------------------------------------------------- the helpers
def test_input_helpers_treat_a_mapping_like_a_tensor():
    X, _ = tagger_batch(5)
    assert num_samples(X) == 5 and num_samples(X["feats"]) == 5
    part = take_samples(X, slice(1, 3))
    assert list(part) == ["ids", "feats", "mask"] and all(v.shape[0] == 2 for v in part.values())
    torch.testing.assert_close(take_samples(X, [4, 0])["feats"], X["feats"][[4, 0]])
    pieces = split_samples(X, 2)
    assert [num_samples(p) for p in pieces] == [3, 2]
    torch.testing.assert_close(torch.cat([p["ids"] for p in pieces]), X["ids"])
    assert [t.shape[0] for t in split_samples(X["feats"], 2)] == [3, 2]
    moved = inputs_to(X, "cpu")
    assert moved["ids"] is X["ids"] and inputs_to(X, None) is X
    assert map_inputs(lambda t: t[:1], X["ids"]).shape == (1, 4)
    assert describe_inputs(X) == "{'ids': (5, 4), 'feats': (5, 4, 3), 'mask': (5, 4)}"


def test_iter_batches_reads_mappings_into_plain_dicts():
    X, y = tagger_batch(3)
    (X1, y1), = list(iter_batches((UserDict(X), y), mappings=True))  # any Mapping (a BatchEncoding is a UserDict)
    assert type(X1) is dict and list(X1) == list(X) and y1 is y
    assert len(list(iter_batches([(X, y), (take_samples(X, slice(0, 1)), y[:1])], mappings=True))) == 2


def test_readers_of_tensor_batches_refuse_a_mapping_by_name():
    """Readers that take tensor inputs only (the default of iter_batches: the block recursions) say so
    instead of failing inside the model."""
    X, y = tagger_batch(3)
    with pytest.raises(TypeError, match=r"batch 0: X is a mapping of tensors \(\{'ids': \(3, 4\).*does not take yet"):
        list(iter_batches((X, y)))


@pytest.mark.parametrize("batch_size,shared", [(4, False), (4, True), (None, False)])
def test_llc_of_mapping_batches_equals_the_llc_of_the_packed_tensor(batch_size, shared):
    """estimate_llc on (mapping, y) pairs, read from several batches, is the LLC of the same model fed one packed
    tensor (same seed: the same SGLD minibatches, rows of every tensor of the mapping), with the pieces of
    max_rows and a curvkit likelihood on per-token outputs."""
    from curvkit.slt import SGLDConfig, estimate_llc

    model = DictTagger()
    X, y = tagger_batch(10)
    cfg = SGLDConfig(num_chains=2, num_draws=6, num_burnin=2, epsilon=1e-3, shared_batches=shared)
    lik = CrossEntropy("mean", ignore_index=-100)
    batches = [(take_samples(X, slice(0, 6)), y[:6]), (take_samples(X, slice(6, 10)), y[6:])]
    a = estimate_llc(model, batches, loss=lik, batch_size=batch_size, config=cfg, seed=3, max_rows=3)
    b = estimate_llc(Packed(model), (pack(X), y), loss=lik, batch_size=batch_size, config=cfg, seed=3, max_rows=3)
    torch.testing.assert_close(a.loss_trace, b.loss_trace, atol=1e-10, rtol=1e-10)
    assert a.llc_mean == pytest.approx(b.llc_mean, rel=1e-9, abs=1e-9)


@pytest.mark.parametrize("data,error,match", [
    ((tagger_batch(3)[0], torch.zeros(2)), ValueError, r"share a positive leading batch size.*'ids': \(3, 4\)"),
    (({"a": torch.zeros(3, 2), "b": torch.zeros(2, 2)}, torch.zeros(3)), ValueError, "share one positive leading"),
    (({"a": torch.zeros(3, 2), "flag": True}, torch.zeros(3)), TypeError, "'flag' is not"),
    (({}, torch.zeros(3)), ValueError, "empty mapping"),
    (({"a": torch.zeros(0, 2)}, torch.zeros(0)), ValueError, "share one positive leading"),
    ({"input_ids": torch.zeros(3, 2), "labels": torch.zeros(3)}, TypeError, r"batch.pop\('labels'\)"),
    ([{"input_ids": torch.zeros(3, 2)}], TypeError, r"batch 0 of data is not an \(X, y\) pair but a mapping.*batch.pop"),
])
def test_malformed_mapping_batches_are_refused_with_what_is_wrong(data, error, match):
    with pytest.raises(error, match=match):
        list(iter_batches(data, mappings=True))
    with pytest.raises(TypeError, match=r"tensor .* or a mapping"):
        check_inputs([1, 2])


# ---------------------------------------------------------------------------------------------- exact operators
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_exact_operators_on_mapping_batches_equal_dense_references(reduction):
    """Two padded batches (the second of 16 samples: the forward-mode pass runs in two pieces, taken from the
    mapping): GGN, Hessian and empirical Fisher products, GGN diagonal and dense matrix (per-sample rows, vmapped
    over mapping samples) equal the dense references."""
    model = DictTagger()
    data = [tagger_batch(3, seed=1), tagger_batch(16, seed=2)]
    lik = CrossEntropy(reduction, ignore_index=-100)
    v = torch.randn(sum(p.numel() for p in model.parameters()), 2, generator=torch.Generator().manual_seed(0), dtype=D64)
    G = GGNOperator(model, lik, data)
    ref = dense_ggn_flat(model, lik, data)
    assert G.num_data == 19
    torch.testing.assert_close(G @ v, ref @ v, atol=ATOL, rtol=0)
    torch.testing.assert_close(G.quadratic_form(v), torch.einsum("ik,ij,jk->k", v, ref, v), atol=ATOL, rtol=0)
    torch.testing.assert_close(G.diagonal().flat, ref.diagonal(), atol=ATOL, rtol=0)
    torch.testing.assert_close(G.to_dense(), ref, atol=ATOL, rtol=0)
    H = HessianOperator(model, lik, data)
    torch.testing.assert_close(H @ v, dense_hessian_ror(model, lik, data) @ v, atol=ATOL, rtol=0)
    E = EmpiricalFisherOperator(model, lik, data)
    torch.testing.assert_close(E @ v, dense_ef_flat(model, lik, data) @ v, atol=ATOL, rtol=0)


def test_single_mapping_batch_every_tangent_route_and_the_mc_fisher():
    """One batch (the cached linearisation; reverse-over-reverse tangents too) and the MC Fisher, whose labels
    are drawn on the mapping batch's outputs, against the references."""
    model = DictTagger(seed=1)
    X, y = tagger_batch(5, seed=3)
    lik = CrossEntropy("mean", ignore_index=-100)
    ref = dense_ggn_flat(model, lik, (X, y))
    v = torch.randn(ref.shape[0], generator=torch.Generator().manual_seed(1), dtype=D64)
    for kw in ({}, {"cache_linearisation": False}, {"reverse_tangents": True}):
        torch.testing.assert_close(GGNOperator(model, lik, (X, y), **kw) @ v, ref @ v, atol=ATOL, rtol=0)
    F = MCFisherOperator(model, lik, (X, y), mc_samples=2, seed=4)
    torch.testing.assert_close(F @ v, dense_ef_flat(model, lik, (X, y), labels=[F.labels[0]]) @ v, atol=ATOL, rtol=0)


def test_batched_backward_diagonal_on_a_mapping_batch():
    model = DictMLP()
    g = torch.Generator().manual_seed(0)
    X = {"a": torch.randn(6, 3, generator=g, dtype=D64), "b": torch.randn(6, 2, generator=g, dtype=D64)}
    y = torch.randint(0, 4, (6,), generator=g)
    lik = CrossEntropy("sum")
    G = GGNOperator(model, lik, (X, y), cache_linearisation=False)
    torch.testing.assert_close(G.diagonal().flat, dense_ggn_flat(model, lik, (X, y)).diagonal(), atol=ATOL, rtol=0)
    assert G._layer_specs, "the batched-backward route must have been taken"


def test_output_of_the_wrong_size_names_the_mapping():
    class Wrong(DictMLP):
        def forward(self, batch):
            return super().forward(batch)[:2]

    X = {"a": torch.zeros(3, 3, dtype=D64), "b": torch.zeros(3, 2, dtype=D64)}
    with pytest.raises(ValueError, match=r"= \(3, C\).*'a': \(3, 3\)"):
        GGNOperator(Wrong(), CrossEntropy(), (X, torch.zeros(3, dtype=torch.long)))


# ---------------------------------------------------------------------------------------------- estimators
def _same_operator(a, b) -> None:
    torch.testing.assert_close(a.to_dense(), b.to_dense(), atol=1e-12, rtol=0)


@pytest.mark.parametrize("method,sharing", [("kflr", "expand"), ("kfac", "reduce"), ("empirical", "expand")])
def test_kronecker_estimator_on_mappings_equals_the_packed_tensor_model(method, sharing):
    """The tagger (embedding, linear, raw position table, LayerNorm, head: every parameter covered) fed mapping
    batches gives the factors of the same parameters fed packed tensors (same seed, same labels); the raw
    parameter's per-sample check runs on mapping samples."""
    model = DictTagger(seed=2)
    data = [tagger_batch(3, seed=5), tagger_batch(2, seed=6)]
    lik = CrossEntropy("mean", ignore_index=-100)
    kw = {"weight_sharing": sharing, "seed": 7}
    est = KroneckerEstimator(model, lik, method, **kw).update(data)
    ref = KroneckerEstimator(Packed(model), lik, method, **kw).update([(pack(X), y) for X, y in data])
    assert est.num_data == 5 and est._raw_checked
    assert {n for b in est.operator().blocks for n in (b.weight_name, b.bias_name) if n} == {
        n for n, _ in model.named_parameters()}
    _same_operator(est.operator(), ref.operator())


@pytest.mark.parametrize("method", ["ggn", "mc_fisher", "empirical"])
def test_diagonal_and_ekfac_estimators_on_mappings(method):
    model = DictTagger(seed=3)
    data = [tagger_batch(3, seed=8), tagger_batch(4, seed=9)]
    packed = [(pack(X), y) for X, y in data]
    lik = CrossEntropy("mean", ignore_index=-100)
    est = DiagonalEstimator(model, lik, method, seed=1).update(data)
    ref = DiagonalEstimator(Packed(model), lik, method, seed=1).update(packed)
    assert est.num_data == 7
    torch.testing.assert_close(est.operator().flat, ref.operator().flat, atol=1e-12, rtol=0)
    if method == "ggn":
        torch.testing.assert_close(est.operator().flat, dense_ggn_flat(model, lik, data).diagonal(), atol=ATOL, rtol=0)
        with pytest.warns(FirstBatchBasisWarning):  # both take the first batch's basis (the same one)
            _same_operator(EKFACEstimator(model, lik, "kflr").update(data).operator(),
                           EKFACEstimator(Packed(model), lik, "kflr").update(packed).operator())


# ---------------------------------------------------------------------------------------------- data-parallel
def _sharded_mapping_worker(rank: int, world: int) -> None:
    from curvkit.distributed import DistributedOperator, Reducer

    red = Reducer()
    model = DictTagger(seed=4)
    X, y = tagger_batch(5, seed=10)
    rows = red.shard(num_samples(X))
    lik = CrossEntropy("mean", ignore_index=-100)
    dop = DistributedOperator(GGNOperator(model, lik, (take_samples(X, rows), y[rows])), red)
    v = torch.randn(dop.layout.dim, generator=torch.Generator().manual_seed(0), dtype=D64)
    torch.testing.assert_close(dop @ v, GGNOperator(model, lik, (X, y)) @ v, atol=ATOL, rtol=0)
    assert dop.num_data == 5


def test_sharded_mapping_batches():
    from curvkit.distributed import spawn

    spawn(_sharded_mapping_worker, 2, timeout=120)
