"""``output_factor='auto'`` on wide layers (``ROWS_OUTPUTS``, issue 30): a block of a sampled method with at least
``ROWS_OUTPUTS`` outputs holds its output factor as its rows while they are fewer than its outputs (a
``LowRankFactor`` in the operator) and as the dense Gram matrix from the update where they would be more. With
the threshold lowered to 8 on a tiny float64 causal LM (blocks of 8, 16, 24 and 40 outputs; 12 and 18 token rows a
batch), every update's operator equals the one with every output factor dense to 1e-10, the kind each block
holds follows its rows, and ema, a state_dict round trip in both kinds, a GaussNewton step and a Kronecker Laplace
fit agree with the dense run; shared parameters, KFLR and narrower layers keep the dense factor."""

from __future__ import annotations

import io

import pytest
import torch

from curvkit.architectures import causal_lm
from curvkit.curvature import KroneckerEstimator, estimators
from curvkit.curvature.estimators import GramRows
from curvkit.laplace import Laplace
from curvkit.likelihoods import CrossEntropy
from curvkit.linalg.kron import LowRankFactor
from curvkit.optim import GaussNewton

DT = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)


def lm(tied: bool = False) -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    model = causal_lm(vocab_size=40, max_len=6, dim=8, depth=1, heads=2, mlp_dim=24, seed=0, dtype=DT,
                      tie_weights=tied)
    ids = torch.randint(0, 40, (3, 7), generator=torch.Generator().manual_seed(0))
    return model, ids[:, :-1], ids[:, 1:]


def kinds(est: KroneckerEstimator) -> dict[str, str]:
    """Per block held as rows: 'rows' (GramRows) or 'dense' (the Gram matrix), from the accumulated statistics."""
    K = len(est.blocks)
    assert est._stats is not None
    return {spec.label: ("rows" if isinstance(G, GramRows) else "dense")
            for (low, (_, spec), G) in zip(est.low_rank, est.blocks, est._stats[K:]) if low}


@pytest.fixture
def rows_from_8(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(estimators, "ROWS_OUTPUTS", 8)


def test_wide_blocks_hold_rows_until_they_outnumber_the_outputs(rows_from_8: None) -> None:
    model, X, y = lm()
    lik = CrossEntropy("mean")
    auto = KroneckerEstimator(model, lik, "kfac", mc_samples=1, seed=3)
    dense = KroneckerEstimator(model, lik, "kfac", mc_samples=1, seed=3, output_factor="dense")
    widths = {spec.label: spec.out_features for (_, spec), low in zip(auto.blocks, auto.low_rank) if low}
    assert widths and all(n >= 8 for n in widths.values())
    assert not any(low for (_, spec), low in zip(auto.blocks, auto.low_rank) if spec.form == "kron"
                   and spec.out_features < 8)
    assert not any(auto.dense_above[i] and not auto.low_rank[i] for i in range(len(auto.blocks)))
    rows, seen = 0, set()
    for batch in ((X[:2], y[:2]), (X, y), (X[1:], y[1:])):  # 12, 18, 12 rows a block: 12, 30, 42 in all
        rows += batch[0].numel()
        auto.update(batch)
        dense.update(batch)
        assert kinds(auto) == {label: "rows" if rows <= n else "dense" for label, n in widths.items()}
        seen |= set(kinds(auto).values())
        op, ref = auto.operator(), dense.operator()
        low = {spec.label for (_, spec), b in zip(auto.blocks, op.blocks) if isinstance(b.G, LowRankFactor)}
        assert low == {label for label, n in widths.items() if rows <= n}
        torch.testing.assert_close(op.to_dense(), ref.to_dense(), **TOL)  # type: ignore[arg-type]
        v = torch.randn(ref.shape[0], 2, generator=torch.Generator().manual_seed(rows), dtype=DT)
        torch.testing.assert_close(op.inverse(1e-2) @ v, ref.inverse(1e-2) @ v, **TOL)  # type: ignore[arg-type]
    assert seen == {"rows", "dense"}  # both kinds were reached and compared


def test_release_ema_and_state_dict_in_both_kinds(rows_from_8: None) -> None:
    model, X, y = lm()
    lik = CrossEntropy("sum")
    for ema in (None, 0.6):
        auto = KroneckerEstimator(model, lik, "kfac", seed=2, ema=ema)
        dense = KroneckerEstimator(model, lik, "kfac", seed=2, ema=ema, output_factor="dense")
        for batch in ((X[:2], y[:2]), (X, y)):
            auto.update(batch)
            dense.update(batch)
            buf = io.BytesIO()
            torch.save(auto.state_dict(), buf)
            buf.seek(0)
            fresh = KroneckerEstimator(model, lik, "kfac", seed=2, ema=ema)
            fresh.load_state_dict(torch.load(buf, weights_only=True))
            assert kinds(fresh) == kinds(auto)
            torch.testing.assert_close(fresh.operator().to_dense(), dense.operator().to_dense(), **TOL)  # type: ignore[arg-type]
        if ema is None:  # the statistics handed over: the same operator, the estimator emptied
            ref = dense.operator().to_dense()
            torch.testing.assert_close(auto.operator(release=True).to_dense(), ref, **TOL)  # type: ignore[arg-type]
            assert auto._stats is None


def test_shared_kflr_and_explicit_forms_are_unchanged(rows_from_8: None) -> None:
    model = lm(tied=True)[0]
    est = KroneckerEstimator(model, CrossEntropy("mean"), "kfac")
    shared = set(est.shared)
    assert shared and not any(low for (_, spec), low in zip(est.blocks, est.low_rank) if set(spec.names) & shared)
    assert not any(KroneckerEstimator(lm()[0], CrossEntropy("mean"), "kflr").low_rank)
    assert not any(KroneckerEstimator(lm()[0], CrossEntropy("mean"), "kfac", output_factor="dense").low_rank)
    explicit = KroneckerEstimator(lm()[0], CrossEntropy("mean"), "kfac", output_factor="low_rank")
    assert any(explicit.low_rank) and not any(explicit.dense_above)


def test_gram_rows_settle_into_the_dense_gram_matrix() -> None:
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 5, generator=g, dtype=DT), torch.randn(4, 5, generator=g, dtype=DT)
    held = GramRows(a, dense_above=True) * 0.5 + GramRows(b, dense_above=True)
    assert isinstance(held, GramRows) and held.rows.shape == (7, 5)  # the rows wait for the update's end
    dense = held.settled()
    assert isinstance(dense, torch.Tensor)
    torch.testing.assert_close(dense, 0.5 * a.T @ a + b.T @ b, **TOL)  # type: ignore[arg-type]
    more = 0.3 * dense + GramRows(a, dense_above=True) * 0.7  # a dense statistic takes further rows
    torch.testing.assert_close(more, 0.3 * dense + 0.7 * a.T @ a, **TOL)  # type: ignore[arg-type]
    assert GramRows(a, dense_above=True).settled().rows.shape == (3, 5)  # type: ignore[union-attr]


def test_gauss_newton_and_laplace_agree_with_the_dense_factors(monkeypatch: pytest.MonkeyPatch) -> None:
    out = {}
    for threshold in (8, 10**9):
        monkeypatch.setattr(estimators, "ROWS_OUTPUTS", threshold)
        model, X, y = lm()
        opt = GaussNewton(model.parameters(), model=model, likelihood=CrossEntropy("mean"), curvature="kfac")
        for _ in range(2):
            opt.step(batch=(X, y))
        assert any(isinstance(b.G, LowRankFactor) for b in opt.estimator.operator().blocks) == (threshold == 8)
        la = Laplace(lm()[0], CrossEntropy("mean"), structure="kron", curvature="kfac").fit([(X[:2], y[:2])])
        out[threshold] = ([p.detach().clone() for p in model.parameters()], la.log_marginal_likelihood().detach(),
                          la.functional_variance(X[:1])[1])
    (p8, m8, v8), (pd, md, vd) = out[8], out[10**9]
    for a, b in zip(p8, pd):
        torch.testing.assert_close(a, b, **TOL)  # type: ignore[arg-type]
    torch.testing.assert_close(m8, md, **TOL)  # type: ignore[arg-type]
    torch.testing.assert_close(v8, vd, **TOL)  # type: ignore[arg-type]
