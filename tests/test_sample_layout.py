"""Issue 30 §4: the Kronecker routes find the SAMPLE dimension of every layer by what it depends on
(:func:`curvkit.curvature.capture.check_sample_rows`), never by a shape coincidence. A sequence-first
transformer (nn.TransformerEncoderLayer(batch_first=False) in a model that transposes inside) with T == B once
gave LayerNorm blocks 18-27 % wrong, silently; it is refused now for T == B and T != B alike, with a message
about the layout, and its batch-first twin (same weights) gives the exact blocks. Float64, tolerance 1e-12."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.func import functional_call, jacrev

from curvkit.curvature import KroneckerEstimator, kfac, kflr
from curvkit.laplace import Laplace
from curvkit.likelihoods import CrossEntropy
from curvkit.structure import UnsupportedModelError, curvature_kernels
from test_layerkinds import block, dense_ggn_positions

D64 = torch.float64


class Tagger(nn.Module):
    """(B, T, 3) -> (B, T, 4) through one encoder layer, written sequence-first (PyTorch's default) or not."""

    def __init__(self, batch_first: bool):
        super().__init__()
        self.batch_first = batch_first
        self.emb = nn.Linear(3, 8)
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        h = self.emb(x)
        h = h if self.batch_first else h.transpose(0, 1)
        h = self.enc(h)
        return self.head(h if self.batch_first else h.transpose(0, 1))


def _twins():
    torch.manual_seed(0)
    seq = Tagger(False).double().eval()
    bat = Tagger(True).double().eval()
    bat.load_state_dict(seq.state_dict())
    return seq, bat


def _data(B, T, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(B, T, 3, generator=g, dtype=D64), torch.randint(0, 4, (B, T), generator=g)


@pytest.mark.parametrize("T", [5, 4])
@pytest.mark.parametrize("method", [kfac, kflr])
def test_sequence_first_is_refused_for_every_length(method, T):
    seq, _ = _twins()
    X, y = _data(5, T)
    match = "dimension 1 of its output" if T == 5 else "first dimension \\(4\\) is not the batch \\(5\\)"
    with pytest.raises(UnsupportedModelError, match=match) as err:
        method(seq, CrossEntropy("sum"), (X, y))
    assert "batch_first=True" in str(err.value) and "enc." in str(err.value)


def test_sequence_first_laplace_is_refused():
    seq, _ = _twins()
    X, y = _data(5, 5)
    with pytest.raises(UnsupportedModelError, match="batch_first=True"):
        Laplace(seq, CrossEntropy("sum"), structure="kron").fit((X, y))


def test_batch_first_twin_has_the_exact_blocks_with_t_equal_b():
    """Same weights, batch-first, T == B: each LayerNorm block of KFLR is sum_n sum_c u_nc u_nc^T with
    u_nc = sum_t J_nt^T S_nt[:, c] (test_layerkinds.test_norm_block_relation_with_positions), from per-sample
    Jacobians; with one position, every block (Linear, attention, LayerNorm) is the exact GGN block."""
    _, bat = _twins()
    lik = CrossEntropy("sum")
    X, y = _data(5, 5)
    op = KroneckerEstimator(bat, lik, "kflr").update((X, y)).operator().to_dense()
    params = {n: p.detach() for n, p in bat.named_parameters()}
    f = bat(X).detach()
    S = lik.output_hessian_sqrt(f)  # (B, T, C, R)
    for ln in ("enc.norm1", "enc.norm2"):
        names = [f"{ln}.weight", f"{ln}.bias"]
        with curvature_kernels():
            J = jacrev(lambda ps: functional_call(bat, {**params, **ps}, (X,)))({n: params[n] for n in names})
        Jf = torch.cat([J[n].reshape(*f.shape, -1) for n in names], -1)  # (B, T, C, P)
        u = torch.einsum("btcp,btcr->brp", Jf, S)
        torch.testing.assert_close(block(op, bat, names), torch.einsum("brp,brq->pq", u, u), atol=1e-12, rtol=0)
    X1, y1 = X[:1, :1], y[:1, :1]
    one = KroneckerEstimator(bat, lik, "kflr").update((X1, y1)).operator()
    G = dense_ggn_positions(bat, lik, X1)
    for b in one.blocks:
        names = [b.weight_name] + ([b.bias_name] if getattr(b, "bias_name", None) else [])
        if b.weight_name.startswith("enc.self_attn.in_proj"):
            continue  # q/k/v rows of the packed weight: compared through the whole operator below
        torch.testing.assert_close(block(one.to_dense(), bat, names), block(G, bat, names), atol=1e-12, rtol=0)


class PositionTable(nn.Module):
    """A learned position table looked up without a batch dimension (nanoGPT's wpe(torch.arange(T)))."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.tok, self.pos, self.head = nn.Embedding(7, 6), nn.Embedding(8, 6), nn.Linear(6, 7)

    def forward(self, ids):
        return self.head(torch.tanh(self.tok(ids) + self.pos(torch.arange(ids.shape[1]))))


def test_position_table_without_batch_dimension_with_t_equal_b_is_refused():
    """With T == B the ids (T,) of the table look like a batch on the first pass; they are traced and refused."""
    model = PositionTable().double()
    ids = torch.randint(0, 7, (4, 4), generator=torch.Generator().manual_seed(3))
    with pytest.raises(UnsupportedModelError, match="'pos'") as err:
        kfac(model, CrossEntropy("sum"), (ids, ids))
    assert "ids.expand(batch, -1)" in str(err.value)
    model.pos.requires_grad_(False)
    kfac(model, CrossEntropy("sum"), (ids, ids))  # the rest is fine


def test_position_table_without_batch_dimension_gets_one_copy_per_sample():
    """With T != B the ids (T,) cannot be samples: every sample gets its own output rows, so the blocks equal
    those of the same model with the ids expanded over the batch (float64, 1e-13)."""

    class Expanded(PositionTable):
        def forward(self, ids):
            pos = torch.arange(ids.shape[1]).expand(ids.shape[0], -1)
            return self.head(torch.tanh(self.tok(ids) + self.pos(pos)))

    model, ref = PositionTable().double(), Expanded().double()
    ref.load_state_dict(model.state_dict())
    ids = torch.randint(0, 7, (4, 3), generator=torch.Generator().manual_seed(3))
    for method in ("kfac", "kflr"):
        got = KroneckerEstimator(model, CrossEntropy("sum"), method, seed=0).update((ids, ids)).operator()
        want = KroneckerEstimator(ref, CrossEntropy("sum"), method, seed=0).update((ids, ids)).operator()
        torch.testing.assert_close(got.to_dense(), want.to_dense(), atol=1e-13, rtol=0)


def _traced_batches(monkeypatch):
    """Record the batch size of every samples-first trace the estimators run."""
    import curvkit.curvature.estimators as estimators

    seen = []
    real = estimators.check_sample_rows

    def recording(blocks, sites, f, *args, **kwargs):
        seen.append(int(f.shape[0]))
        return real(blocks, sites, f, *args, **kwargs)

    monkeypatch.setattr(estimators, "check_sample_rows", recording)
    return seen


def test_a_fresh_estimator_traces_two_samples_where_they_stand_for_the_batch(monkeypatch):
    """The estimator's own pass traces the sample dimension on a forward pass of two samples (no second backward
    pass of the batch on a kept graph: issue 35, "Lean factors"), where the two-sample layout scales with the
    batch: a ResNet, a GPT (embeddings, packed attention) and a ViT (raw class token). The batch-first twin with
    T == B too; the sequence-first one and ids without a batch dimension are traced on the batch itself and
    refused as before (test_sequence_first_is_refused_for_every_length,
    test_position_table_without_batch_dimension_with_t_equal_b_is_refused)."""
    from curvkit.architectures import causal_lm, resnet, vit

    g = torch.Generator().manual_seed(0)
    cases = [(resnet(widths=(4, 8), seed=0, dtype=D64).eval(), torch.randn(6, 1, 12, 12, generator=g, dtype=D64),
              torch.randint(0, 10, (6,), generator=g)),
             (causal_lm(vocab_size=16, max_len=8, dim=8, depth=1, heads=2, mlp_dim=16, seed=0, dtype=D64),
              torch.randint(0, 16, (5, 8), generator=g), torch.randint(0, 16, (5, 8), generator=g)),
             (vit(image_size=8, patch_size=4, dim=8, depth=1, heads=2, mlp_dim=16, num_classes=10, seed=0, dtype=D64),
              torch.randn(4, 1, 8, 8, generator=g, dtype=D64), torch.randint(0, 10, (4,), generator=g)),
             (_twins()[1], *_data(5, 5))]
    for model, X, y in cases:
        seen = _traced_batches(monkeypatch)
        KroneckerEstimator(model, CrossEntropy("sum"), "kfac", weight_sharing="reduce").update((X, y))
        assert seen == [2], type(model).__name__
        monkeypatch.undo()
    seq, _ = _twins()
    seen = _traced_batches(monkeypatch)
    with pytest.raises(UnsupportedModelError, match="dimension 1 of its output"):
        KroneckerEstimator(seq, CrossEntropy("sum"), "kfac").update(_data(5, 5))
    assert seen[-1] == 5  # the two-sample pass has positions first (5 != 2): the batch itself is traced


def test_a_later_estimator_of_the_same_model_is_not_traced_again_unless_the_model_changed(monkeypatch):
    """The traced layouts are kept per model (``estimators._TRACED``): a second estimator of the same model,
    planned the same, with the same batch size runs no trace. A new batch size, another model object or other
    plans (a frozen layer) are traced again, and so is the same model after a module's attribute changed: the
    batch-first twin made sequence-first (``batch_first`` flipped, T == B, every shape as before) is refused
    as a sequence-first model is, not handed the blocks of the layout traced before."""
    lik = CrossEntropy("sum")
    _, bat = _twins()
    X, y = _data(5, 5)
    seen = _traced_batches(monkeypatch)
    first = KroneckerEstimator(bat, lik, "kfac", seed=0).update((X, y)).operator().to_dense()
    assert seen == [2]
    again = KroneckerEstimator(bat, lik, "kfac", seed=0).update((X, y)).operator().to_dense()
    assert seen == [2]
    torch.testing.assert_close(again, first, rtol=0, atol=0)
    KroneckerEstimator(bat, lik, "kfac").update(_data(4, 5))
    KroneckerEstimator(copy.deepcopy(bat), lik, "kfac").update((X, y))
    bat.head.requires_grad_(False)
    KroneckerEstimator(bat, lik, "kfac").update((X, y))
    assert seen == [2, 2, 2, 2]
    bat.head.requires_grad_(True)
    bat.batch_first = False
    bat.enc.self_attn.batch_first = False
    with pytest.raises(UnsupportedModelError, match="dimension 1 of its output"):
        KroneckerEstimator(bat, lik, "kfac").update((X, y))


class Draws(nn.Module):
    """A module that draws from the global RNG in its forward pass (its output does not depend on the draw)."""

    def forward(self, x):
        return x + 0 * torch.rand(x.shape, dtype=x.dtype)


def test_the_two_sample_trace_leaves_the_global_rng_as_it_was():
    """The two-sample pass runs under a forked RNG: a fresh estimator leaves the global RNG where one that has
    traced its layout already does (the batch's own pass draws the same numbers in both)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), Draws(), nn.Linear(8, 3)).double()
    X, y = torch.randn(6, 4, dtype=D64), torch.randint(0, 3, (6,))
    traced = KroneckerEstimator(model, CrossEntropy("sum"), "kfac", seed=0)
    traced.update((X, y))
    state = torch.get_rng_state()
    KroneckerEstimator(copy.deepcopy(model), CrossEntropy("sum"), "kfac", seed=0).update((X, y))  # traced anew
    after_fresh = torch.get_rng_state()
    torch.set_rng_state(state)
    traced.reset()
    traced.update((X, y))
    assert torch.equal(torch.get_rng_state(), after_fresh)


class CountsCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(3, 4), nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.head(torch.tanh(self.a(x)))


def test_a_model_that_counts_its_calls_is_traced_at_every_batch_and_few_layouts_are_kept(monkeypatch):
    """A plain attribute that changes at every call is part of the key: every batch is traced again (correct,
    not faster), and the layouts kept for the model stay bounded (estimators._TRACED_KEPT)."""
    import curvkit.curvature.estimators as estimators

    model = CountsCalls().double()
    X, y = torch.randn(6, 3, dtype=D64), torch.randint(0, 2, (6,))
    seen = _traced_batches(monkeypatch)
    est = KroneckerEstimator(model, CrossEntropy("sum"), "kfac", seed=0)
    for _ in range(estimators._TRACED_KEPT + 4):
        est.update((X, y))
    assert len(seen) == estimators._TRACED_KEPT + 4
    assert len(estimators._TRACED[model]) == estimators._TRACED_KEPT
