"""The exact damped inverse, log-determinant and sampler of a sum of two Kronecker terms (issue 30, section 2:
a parameter used twice, e.g. a tied embedding and output layer) against the dense matrix, float64, 1e-10."""

from __future__ import annotations

import pytest
import torch

from curvkit.linalg.kron import KroneckerPairEigh
from curvkit.linalg.krylov import NotPositiveDefiniteError

DT = torch.float64
TOL = dict(rtol=1e-10, atol=1e-10)


def _psd(n: int, rank: int, g: torch.Generator) -> torch.Tensor:
    R = torch.randn(rank, n, generator=g, dtype=DT)
    return R.T @ R


def _dense(M: torch.Tensor) -> torch.Tensor:
    return torch.diag(M) if M.dim() == 1 else M


@pytest.mark.parametrize(("diag_g2", "diag_a"), [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("damping", [0.3, 0.0])
def test_pair_equals_the_dense_sum(diag_g2: bool, diag_a: bool, damping: float) -> None:
    g = torch.Generator().manual_seed(0)
    out, n_in = 5, 4
    G1, A1 = _psd(out, 2, g), _psd(n_in, 3, g)  # rank-deficient first term
    G2, A2 = _psd(out, out + 2, g), _psd(n_in, n_in + 1, g)
    if diag_g2:
        G2 = G2.diagonal().clone()
    if diag_a:
        A1, A2 = A1.diagonal().clone(), A2.diagonal().clone()
    pi = 1.7
    k = damping ** 0.5
    M = (torch.kron(G1, _dense(A1)) + torch.kron(_dense(G2) + k / pi * torch.eye(out, dtype=DT),
                                               _dense(A2) + pi * k * torch.eye(n_in, dtype=DT)))
    pair = KroneckerPairEigh.of(G1, A1, G2, A2, damping, pi)
    X = torch.randn(out, n_in, 3, generator=g, dtype=DT)
    ref = torch.linalg.solve(M, X.reshape(out * n_in, 3)).reshape(out, n_in, 3)
    torch.testing.assert_close(pair.solve(X), ref, **TOL)  # type: ignore[arg-type]
    torch.testing.assert_close(pair.logdet(), torch.linalg.slogdet(M)[1], **TOL)  # type: ignore[arg-type]
    d = out * n_in
    S = pair.sample(torch.eye(d, dtype=DT).reshape(out, n_in, d)).reshape(d, d)  # columns: a square root
    torch.testing.assert_close(S @ S.T, torch.linalg.inv(M), **TOL)  # type: ignore[arg-type]


def test_pair_refuses_an_undamped_singular_second_term() -> None:
    g = torch.Generator().manual_seed(1)
    with pytest.raises(NotPositiveDefiniteError, match=r"output factor of 'tied'.*increase the damping"):
        KroneckerPairEigh.of(_psd(4, 4, g), _psd(3, 3, g), _psd(4, 2, g), _psd(3, 3, g), 0.0, what="'tied'")


@pytest.mark.parametrize("diag_a", [False, True])
def test_a_low_rank_first_output_factor_stays_thin(diag_a: bool) -> None:
    """GPT-2's tied embedding and head in the head's (V, D) view: the head's low-rank G (x) A plus the
    embedding's diag(token counts) (x) G_emb; the thin route equals the dense sum."""
    from curvkit.linalg.kron import LowRankFactor

    g = torch.Generator().manual_seed(2)
    V, D = 7, 3
    G1 = LowRankFactor.from_rows(torch.randn(2, V, generator=g, dtype=DT))
    counts = torch.rand(V, generator=g, dtype=DT) * 3
    counts[0] = 0.0  # a token never seen: only the damping there
    A1, A2 = _psd(D, 4, g), _psd(D, 2, g)
    if diag_a:
        A1, A2 = A1.diagonal().clone(), A2.diagonal().clone()
    damping, pi = 0.2, 0.8
    k = damping ** 0.5
    M = torch.kron(G1.to_dense(), _dense(A1)) + torch.kron(torch.diag(counts + k / pi),
                                                            _dense(A2) + pi * k * torch.eye(D, dtype=DT))
    pair = KroneckerPairEigh.of(G1, A1, counts, A2, damping, pi)  # type: ignore[arg-type]
    assert pair.span is not None and pair.WG.shape == (V, 2)
    X = torch.randn(V, D, 2, generator=g, dtype=DT)
    ref = torch.linalg.solve(M, X.reshape(V * D, 2)).reshape(V, D, 2)
    torch.testing.assert_close(pair.solve(X), ref, **TOL)  # type: ignore[arg-type]
    torch.testing.assert_close(pair.logdet(), torch.linalg.slogdet(M)[1], **TOL)  # type: ignore[arg-type]
    d = V * D
    S = pair.sample(torch.eye(d, dtype=DT).reshape(V, D, d)).reshape(d, d)
    torch.testing.assert_close(S @ S.T, torch.linalg.inv(M), **TOL)  # type: ignore[arg-type]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("low_rank", [False, True])
def test_a_tied_embedding_and_head_in_the_heads_view(bias: bool, low_rank: bool) -> None:
    """The two uses of a tied (V, D) weight - a head's ``G_h (x) A_h`` of ``[W | b]`` and an embedding's
    ``G_e (x) diag(counts)`` of ``W^T`` - in the head's view (``pair_in_view``) are exactly their dense sum
    (``dense_sum``), and ``KroneckerPairEigh`` of them is the factored-damped sum's exact inverse and
    log-determinant (a low-rank head factor stays thin)."""
    from curvkit.linalg.kron import (
        KroneckerBlock,
        LowRankFactor,
        block_positions,
        dense_sum,
        pair_in_view,
        transposed_index,
    )
    from curvkit.linalg.layout import ParamLayout

    g = torch.Generator().manual_seed(4)
    V, D = 9, 3
    names = ["W", "b"] if bias else ["W"]
    layout = ParamLayout(names, [torch.Size((V, D)), torch.Size((V,))][:len(names)])
    G_h = LowRankFactor.from_rows(torch.randn(2, V, generator=g, dtype=DT)) if low_rank else _psd(V, 4, g)
    head = KroneckerBlock(G_h, _psd(D + bias, D + 2, g), "W", "b" if bias else None)
    counts = torch.randint(0, 3, (V,), generator=g).to(DT)
    emb = KroneckerBlock(_psd(D, D + 1, g), counts, "W", None, transposed_index(V, D, False), "emb")
    G1, A1, G2, A2 = pair_in_view(head, emb)
    view = torch.kron(_dense(G1.to_dense() if low_rank else G1), A1) + torch.kron(_dense(G2), A2)
    perm = block_positions(layout, "W", "b" if bias else None).reshape(-1)
    M = dense_sum(layout, [head, emb]).A
    torch.testing.assert_close(M[perm][:, perm], view, **TOL)
    damping, pi = 0.2, 1.3
    k = damping ** 0.5
    n = D + bias
    damped = torch.kron(_dense(G1.to_dense() if low_rank else G1), A1) + torch.kron(
        _dense(G2) + k / pi * torch.eye(V, dtype=DT), A2 + pi * k * torch.eye(n, dtype=DT))
    pair = KroneckerPairEigh.of(G1, A1, G2, A2, damping, pi)
    assert (pair.span is not None) == low_rank  # thin: no V x V matrix
    X = torch.randn(V, n, 2, generator=g, dtype=DT)
    ref = torch.linalg.solve(damped, X.reshape(V * n, 2)).reshape(V, n, 2)
    torch.testing.assert_close(pair.solve(X), ref, **TOL)
    torch.testing.assert_close(pair.logdet(), torch.linalg.slogdet(damped)[1], **TOL)
    with pytest.raises(ValueError, match="neither the standard nor the whole transposed view"):
        pair_in_view(head, KroneckerBlock(_psd(D, D, g), counts[:D], "W", None,
                                          transposed_index(D, D, False)[0:2], "part"))


def _rearranged(M: torch.Tensor, m: int, n: int) -> torch.Tensor:
    """Van Loan's rearrangement: R(G (x) A) = vec(G) vec(A)^T."""
    return M.reshape(m, n, m, n).permute(0, 2, 1, 3).reshape(m * m, n * n)


@pytest.mark.parametrize("diag_g2", [False, True])
def test_nearest_kronecker_is_the_best_rank_one_approximation_of_the_rearranged_sum(diag_g2: bool) -> None:
    from curvkit.linalg.factors import nearest_kronecker

    g = torch.Generator().manual_seed(3)
    G1, A1, A2 = _psd(5, 2, g), _psd(4, 3, g), _psd(4, 4, g)
    G2 = torch.rand(5, generator=g, dtype=DT) if diag_g2 else _psd(5, 5, g)
    M = torch.kron(G1, A1) + torch.kron(_dense(G2), A2)
    G, A = nearest_kronecker(G1, A1, G2, A2)
    U, S, Vh = torch.linalg.svd(_rearranged(M, 5, 4))
    torch.testing.assert_close(_rearranged(torch.kron(G, A), 5, 4), S[0] * torch.outer(U[:, 0], Vh[0]), **TOL)
    assert float(torch.linalg.eigvalsh(G).min()) > -1e-12 and float(torch.linalg.eigvalsh(A).min()) > -1e-12
    # a sum that is itself a Kronecker product comes back exactly: a term without data, proportional factors
    for G2_, A2_ in ((torch.zeros(5, 5, dtype=DT), A2), (2.5 * G1, A2), (G2, 3.0 * A1)):
        G, A = nearest_kronecker(G1, A1, G2_, A2_)
        torch.testing.assert_close(torch.kron(G, A), torch.kron(G1, A1) + torch.kron(_dense(G2_), A2_), **TOL)
