"""Low-rank output factors (issue 22, section 3): ``LowRankFactor`` against the dense matrix it stands for,
``KroneckerOperator`` blocks with one against the same operator with the dense factor, and
``KroneckerEstimator(output_factor=...)`` on a small causal LM (float64) against its dense factors."""

from __future__ import annotations

import pytest
import torch

from curvkit.architectures import causal_lm
from curvkit.curvature import KroneckerEstimator, estimators
from curvkit.likelihoods import CrossEntropy
from curvkit.linalg.kron import KroneckerBlock, KroneckerOperator, KroneckerSpectralOperator, LowRankFactor
from curvkit.linalg.layout import ParamLayout
from curvkit.structure import UnsupportedModelError

DT = torch.float64


def _rows(k: int, n: int, seed: int, rank: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    R = torch.randn(k, n, generator=g, dtype=DT)
    if rank is not None:  # rank-deficient rows
        R = torch.randn(k, rank, generator=g, dtype=DT) @ R[:rank]
    return R


@pytest.mark.parametrize("rank", [None, 2])
def test_low_rank_factor_equals_its_dense_matrix(rank: int | None) -> None:
    R = _rows(4, 9, 0, rank)
    F = LowRankFactor.from_rows(R, scale=0.5)
    D = 0.5 * R.T @ R
    assert F.rank == (4 if rank is None else 2) and F.complement == 9 - F.rank
    torch.testing.assert_close(F.to_dense(), D)
    torch.testing.assert_close(F.U.T @ F.U, torch.eye(F.rank, dtype=DT))
    X = torch.randn(9, 5, dtype=DT)
    torch.testing.assert_close(F @ X, D @ X)
    torch.testing.assert_close(F.diagonal(), D.diagonal())
    torch.testing.assert_close(F.trace(), D.trace())
    assert F.frobenius() == pytest.approx(float(torch.linalg.matrix_norm(D)))
    S = F.shifted(0.3)
    torch.testing.assert_close(S.to_dense(), D + 0.3 * torch.eye(9, dtype=DT))
    torch.testing.assert_close(S.inverse("G").to_dense(), torch.linalg.inv(D + 0.3 * torch.eye(9, dtype=DT)))
    torch.testing.assert_close((2.0 * S).to_dense(), 2 * S.to_dense())


def test_low_rank_factor_refuses_a_singular_inverse_and_bad_parts() -> None:
    F = LowRankFactor.from_rows(_rows(3, 7, 1))
    with pytest.raises(ValueError, match="not positive definite after damping"):
        F.inverse("G of 'head'")
    with pytest.raises(ValueError, match="s must be"):
        LowRankFactor(F.U, F.s[:2])
    with pytest.raises(ValueError, match="finite"):
        LowRankFactor(F.U, F.s * float("nan"))


def _operators() -> tuple[KroneckerOperator, KroneckerOperator]:
    """One low-rank-G block (5 outputs, rank 3, with bias) and one ordinary block; the same with dense G."""
    layout = ParamLayout(["w", "b", "v"], [(5, 2), (5,), (3, 4)])
    g = torch.Generator().manual_seed(3)
    M = torch.randn(6, 3, generator=g, dtype=DT)
    A1 = M.T @ M  # (3, 3) = in 2 + bias
    N = torch.randn(5, 3, generator=g, dtype=DT)
    G2, A2 = N.T @ N, torch.eye(4, dtype=DT) + 0.1
    R = _rows(3, 5, 4)
    low = KroneckerOperator(layout, [KroneckerBlock(LowRankFactor.from_rows(R), A1, "w", "b"),
                                     KroneckerBlock(G2, A2, "v")])
    dense = KroneckerOperator(layout, [KroneckerBlock(R.T @ R, A1, "w", "b"), KroneckerBlock(G2, A2, "v")])
    return low, dense


def test_kronecker_operator_with_a_low_rank_block_equals_the_dense_one() -> None:
    low, dense = _operators()
    D = dense.to_dense()
    torch.testing.assert_close(low.to_dense(), D)
    V = torch.randn(low.layout.dim, 3, dtype=DT)
    torch.testing.assert_close(low @ V, D @ V)
    torch.testing.assert_close(low @ V[:, 0], D @ V[:, 0])
    torch.testing.assert_close(low.diagonal().flat, D.diagonal())
    torch.testing.assert_close(low.trace(), D.trace())
    eye = torch.eye(D.shape[0], dtype=DT)
    torch.testing.assert_close(low.logdet(0.1), torch.logdet(D + 0.1 * eye))
    torch.testing.assert_close(low.eigenvalues(4), torch.linalg.eigvalsh(D).flip(0)[:4])
    torch.testing.assert_close(low.eigenvalues(3, which="smallest"), torch.linalg.eigvalsh(D).flip(0)[-3:])
    inv = low.inverse(0.1)
    torch.testing.assert_close(inv @ V, torch.linalg.solve(D + 0.1 * eye, V))
    torch.testing.assert_close(inv.diagonal().flat, torch.linalg.inv(D + 0.1 * eye).diagonal())
    torch.testing.assert_close(inv.trace(), torch.linalg.inv(D + 0.1 * eye).trace())
    torch.testing.assert_close(inv.logdet(), -torch.logdet(D + 0.1 * eye))
    torch.testing.assert_close(low.solve(V, 0.1), torch.linalg.solve(D + 0.1 * eye, V))
    # factored damping and its inverse: the same as with the dense factor
    torch.testing.assert_close(low.inverse(0.1, method="factored") @ V, dense.inverse(0.1, method="factored") @ V)
    torch.testing.assert_close((2.0 * low).to_dense(), 2 * D)
    torch.testing.assert_close(low.add_identity(0.2).to_dense(), D + 0.2 * eye)
    with pytest.raises(ValueError, match="not positive definite"):
        low.inverse(0.0)


def test_sampling_with_a_low_rank_block_has_the_damped_inverse_covariance() -> None:
    low, dense = _operators()
    damped = low.add_identity(0.5)
    gen = torch.Generator().manual_seed(5)
    S = damped.sample(torch.zeros(low.layout.dim, dtype=DT), generator=gen, num_samples=40000)
    cov = S.T @ S / S.shape[0]
    ref = torch.linalg.inv(dense.to_dense() + 0.5 * torch.eye(low.layout.dim, dtype=DT))
    assert float((cov - ref).abs().max()) < 0.05 * float(ref.abs().max())  # Monte Carlo: 40k samples


def test_eigenbasis_spectrum_of_a_low_rank_block_has_a_complement_row() -> None:
    """An eigenbasis correction on a thin G: rows r + 1, the last one for every direction off span(U); equal
    to the same spectrum on a complete basis [U, U_perp] with that row repeated."""
    from curvkit.linalg.factors import KroneckerEigh

    low, _ = _operators()
    g = torch.Generator().manual_seed(9)
    spectra = [torch.rand(e.G_values.numel(), e.A_eigvals.numel(), generator=g, dtype=DT) + 0.1 for e in low.eigh()]
    S = KroneckerSpectralOperator.in_eigenbasis_of(low, spectra)
    e = low.eigh()[0]
    U = e.G_eigvecs
    full = torch.linalg.qr(torch.cat([U, torch.eye(U.shape[0], dtype=DT)], 1))[0]  # [U, U_perp] up to signs
    full[:, : U.shape[1]] = U
    lam = torch.cat([spectra[0][:-1], spectra[0][-1:].expand(e.G_rest, -1)])
    ref = KroneckerSpectralOperator(low.layout, low._index,
                                    [KroneckerEigh(torch.zeros(full.shape[1], dtype=DT), full, e.A_eigvals,
                                                   e.A_eigvecs), low.eigh()[1]], [lam, spectra[1]], ["w", "v"])
    D = ref.to_dense()
    torch.testing.assert_close(S.to_dense(), D)
    V = torch.randn(low.layout.dim, 3, generator=g, dtype=DT)
    torch.testing.assert_close(S @ V, D @ V)
    torch.testing.assert_close(S.diagonal().flat, D.diagonal())
    torch.testing.assert_close(S.trace(), D.trace())
    torch.testing.assert_close(S.inverse(damping=0.2) @ V, torch.linalg.solve(D + 0.2 * torch.eye(D.shape[0], dtype=DT), V))
    with pytest.raises(ValueError, match=r"expected \(4, 3\)"):  # r = 3 rows without the complement's
        KroneckerSpectralOperator.in_eigenbasis_of(low, [spectra[0][:-1], spectra[1]])


# ------------------------------------------------------------------ the estimator
def _lm() -> tuple[torch.nn.Module, torch.Tensor, torch.Tensor]:
    model = causal_lm(vocab_size=40, max_len=6, dim=8, depth=1, heads=2, mlp_dim=16, seed=0, dtype=DT)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 40, (3, 7), generator=g)
    return model, ids[:, :-1], ids[:, 1:]


@pytest.mark.parametrize(("method", "sharing"), [("kfac", "expand"), ("kfac", "reduce"), ("empirical", "expand"),
                                                 ("projection", "expand")])
def test_low_rank_output_factors_equal_the_dense_factors(method: str, sharing: str) -> None:
    model, X, y = _lm()
    lik = CrossEntropy("mean")
    ests = {of: KroneckerEstimator(model, lik, method, weight_sharing=sharing, output_factor=of, mc_samples=2,  # type: ignore[arg-type]
                                   seed=1) for of in ("dense", "low_rank")}
    ops = {of: e.update((X, y)).update((X[:2], y[:2])).operator() for of, e in ests.items()}
    assert all(b.low_rank_output for b in ops["low_rank"].blocks if b.factored)
    assert not any(b.low_rank_output for b in ops["dense"].blocks)
    torch.testing.assert_close(ops["low_rank"].to_dense(), ops["dense"].to_dense())
    v = torch.randn(ops["dense"].layout.dim, dtype=DT)
    torch.testing.assert_close(ops["low_rank"].inverse(1e-2) @ v, ops["dense"].inverse(1e-2) @ v)


def test_low_rank_statistics_with_ema_and_a_state_dict_round_trip(tmp_path: object) -> None:
    import io

    model, X, y = _lm()
    lik = CrossEntropy("sum")
    kw = {"ema": 0.7, "seed": 2}
    low = KroneckerEstimator(model, lik, "kfac", output_factor="low_rank", **kw)  # type: ignore[arg-type]
    dense = KroneckerEstimator(model, lik, "kfac", output_factor="dense", **kw)  # type: ignore[arg-type]
    for est in (low, dense):
        est.update((X, y)).update((X[1:], y[1:]))
    torch.testing.assert_close(low.operator().to_dense(), dense.operator().to_dense())
    buf = io.BytesIO()
    torch.save(low.state_dict(), buf)
    buf.seek(0)
    fresh = KroneckerEstimator(model, lik, "kfac", output_factor="low_rank", **kw)  # type: ignore[arg-type]
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    torch.testing.assert_close(fresh.operator().to_dense(), dense.operator().to_dense())
    with pytest.raises(ValueError, match="output_factor"):
        KroneckerEstimator(model, lik, "kfac", output_factor="dense", **kw).load_state_dict(low.state_dict())  # type: ignore[arg-type]


def test_auto_keeps_only_the_wide_output_layer_low_rank(monkeypatch: pytest.MonkeyPatch) -> None:
    model, X, y = _lm()
    monkeypatch.setattr(estimators, "LOW_RANK_OUTPUTS", 32)  # the 40-token head is "wide", the rest is not
    est = KroneckerEstimator(model, CrossEntropy("mean"), "kfac")
    wide = [spec.label for (_, spec), low in zip(est.blocks, est.low_rank) if low]
    assert wide and all(spec.out_features > 32 for (_, spec), low in zip(est.blocks, est.low_rank) if low)
    assert all(spec.out_features <= 32 for (_, spec), low in zip(est.blocks, est.low_rank) if not low and spec.form == "kron")
    op = est.update((X, y)).operator()
    dense = KroneckerEstimator(model, CrossEntropy("mean"), "kfac", output_factor="dense").update((X, y)).operator()
    torch.testing.assert_close(op.to_dense(), dense.to_dense())


def test_low_rank_refusals_name_the_option(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _lm()[0]
    lik = CrossEntropy("mean")
    with pytest.raises(ValueError, match=r"output_factor='low_rank' needs .*'kfac'.*got curvature='kflr'"):
        KroneckerEstimator(model, lik, "kflr", output_factor="low_rank")
    KroneckerEstimator(model, lik, "kfac", output_factor="low_rank", keep_per_sample=True)  # EKFAC takes it
    with pytest.raises(ValueError, match="output_factor must be"):
        KroneckerEstimator(model, lik, "kfac", output_factor="thin")  # type: ignore[arg-type]
    monkeypatch.setattr(estimators, "LOW_RANK_OUTPUTS", 32)
    with pytest.raises(UnsupportedModelError, match=r"kflr: module 'lm_head' \(Linear\) has 40 outputs.*"
                       r"curvature='kfac'.*output_factor='dense' to form it anyway"):
        KroneckerEstimator(model, lik, "kflr")  # auto: the wide layer's factor would be dense and full rank
    KroneckerEstimator(model, lik, "kflr", output_factor="dense")  # forming it anyway is allowed


def test_gram_rows_stay_exact_and_at_most_square() -> None:
    a, b = _rows(4, 5, 7), _rows(3, 5, 8)
    total = estimators.GramRows(a) * 0.5 + estimators.GramRows(b)
    assert total.rows.shape[0] <= 5  # 7 rows of 5 columns compressed to the (5, 5) triangle
    torch.testing.assert_close(total.rows.T @ total.rows, 0.5 * a.T @ a + b.T @ b)
    with pytest.raises(ValueError, match="non-negative"):
        estimators.GramRows(a) * -1.0
