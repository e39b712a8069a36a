"""EKFAC (eigenvalue-corrected Kronecker curvature): the scalings are the exact GGN's second moments along
the Kronecker eigenvectors, so EKFAC is the Frobenius projection of the block onto that eigenbasis."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from curvkit.curvature import kflr
from curvkit.curvature.ekfac import EKFACEstimator
from curvkit.likelihoods import CrossEntropy, Gaussian
from curvkit.linalg.kron import KroneckerSpectralOperator
from reference import block_mask, dense_ggn

D64 = torch.float64


def _eigvectors(op, layout, block, e):
    """(d, n_l) flat eigenvectors vec_row(QG[:, i] QA[:, j]^T) of one block, in (i, j) row-major order."""
    names = layout.names
    cols = []
    for i in range(e.G_eigvecs.shape[1]):
        for j in range(e.A_eigvecs.shape[1]):
            W = torch.outer(e.G_eigvecs[:, i], e.A_eigvecs[:, j])
            parts = {block.weight_name: W[:, : W.shape[1] - (block.bias_name is not None)]}
            if block.bias_name is not None:
                parts[block.bias_name] = W[:, -1]
            cols.append(layout.flatten([parts.get(n, torch.zeros(s, dtype=D64)).reshape(s)
                                        for n, s in zip(names, layout.shapes)]))
    return torch.stack(cols, dim=1)


@pytest.mark.parametrize("model_kind", ["mlp", "cnn"])
@pytest.mark.parametrize("lik", [CrossEntropy("mean"), Gaussian("sum")], ids=["ce-mean", "gauss-sum"])
def test_ekfac_scalings_are_the_ggn_along_the_kronecker_eigenvectors(model_kind, lik, make_mlp, make_cnn):
    if model_kind == "mlp":
        model, X = make_mlp((4, 5, 3), "tanh"), torch.randn(9, 4, dtype=D64, generator=torch.Generator().manual_seed(1))
    else:
        model, X = make_cnn(image=6), torch.randn(7, 1, 6, 6, dtype=D64, generator=torch.Generator().manual_seed(1))
    gen = torch.Generator().manual_seed(2)
    y = torch.randint(0, 3, (X.shape[0],), generator=gen) if isinstance(lik, CrossEntropy) else \
        torch.randn(X.shape[0], 3, generator=gen, dtype=D64)
    data = [(X[:4], y[:4]), (X[4:], y[4:])]  # two unequal batches: the same as one
    basis = kflr(model, lik, data)
    E = EKFACEstimator(model, lik, "kflr", basis=basis).update(data).operator()
    assert isinstance(E, KroneckerSpectralOperator)
    G = dense_ggn(model, lik, data)
    mask = block_mask(model)
    Gb = G * mask
    Ed = E.to_dense()
    for block, e, spectrum in zip(basis.blocks, basis.eigh(), E._spectra):
        U = _eigvectors(basis, basis.layout, block, e)
        torch.testing.assert_close((U * (G @ U)).sum(0), spectrum.reshape(-1), atol=1e-10, rtol=1e-10)
        torch.testing.assert_close((U * (Ed @ U)).sum(0), spectrum.reshape(-1), atol=1e-10, rtol=1e-10)
    # the projection onto the eigenbasis is at least as close to the exact blocks as KFLR's eigenvalues
    assert float((Ed - Gb).norm()) <= float((basis.to_dense() - Gb).norm()) + 1e-12


def test_ekfac_basis_from_the_first_batch_and_closed_forms(make_mlp):
    model = make_mlp((4, 6, 3), "relu")
    g = torch.Generator().manual_seed(3)
    X, y = torch.randn(12, 4, generator=g, dtype=D64), torch.randint(0, 3, (12,), generator=g)
    lik = CrossEntropy("mean")
    est = EKFACEstimator(model, lik)
    E = est.update((X, y)).operator()
    basis = kflr(model, lik, (X, y))
    ref = EKFACEstimator(model, lik, basis=basis).update((X, y)).operator()
    torch.testing.assert_close(E.to_dense(), ref.to_dense(), atol=1e-12, rtol=0)
    b = torch.randn(E.layout.dim, dtype=D64, generator=g)
    x = E.solve(b, damping=0.1)  # closed form in the eigenbasis
    torch.testing.assert_close((E.to_dense() + 0.1 * torch.eye(E.layout.dim, dtype=D64)) @ x, b, atol=1e-10, rtol=0)
    torch.testing.assert_close(E.logdet(0.1), torch.logdet(E.to_dense() + 0.1 * torch.eye(E.layout.dim, dtype=D64)))
    with pytest.raises(ValueError, match="kfra"):
        EKFACEstimator(model, lik, "kfra")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="KroneckerOperator"):
        EKFACEstimator(model, lik, basis=E)  # type: ignore[arg-type]


def test_ekfac_takes_unregistered_layers():
    model = nn.Sequential(nn.Linear(4, 4), nn.PReLU(), nn.Linear(4, 3)).double()
    op = EKFACEstimator(model, CrossEntropy()).update((torch.randn(3, 4, dtype=torch.float64), torch.randint(0, 3, (3,)))).operator()
    assert op.layout.dim == sum(p.numel() for p in model.parameters())


@pytest.mark.usefixtures("float64_default")
@pytest.mark.parametrize("name", ["transformer", "vit", "resnet"])
def test_ekfac_scalings_on_modern_models(name):
    """On a transformer (embedding, attention, LayerNorm), a ViT (raw class token and position table, patches)
    and a ResNet in eval mode (convolutions, BatchNorm), every block's scalings are the diagonal of the exact
    GGN block in the block's Kronecker eigenbasis (KFLR vectors, (B, C) outputs: exact per-sample rows)."""
    from reference import dense_ggn_flat
    from tiny_models import tiny_case

    model, lik, (X, y) = tiny_case(name)
    est = EKFACEstimator(model, lik, "kflr").update((X, y))
    op = est.operator()
    G = dense_ggn_flat(model, lik, (X, y))
    assert est.basis is not None
    for b, e, ix, s in zip(est.basis.blocks, est.basis.eigh(), est.basis._index, op._spectra):
        M = G[ix.perm[:, None], ix.perm[None, :]]
        QA = torch.eye(b.in_dim) if e.A_eigvecs is None else e.A_eigvecs
        Q = torch.kron(e.G_eigvecs.contiguous(), QA.contiguous())
        assert torch.allclose(s.reshape(-1), (Q.T @ M @ Q).diagonal(), atol=1e-12), b.name


def test_ekfac_warns_when_later_batches_reuse_the_first_batchs_basis(make_mlp):
    """Without ``basis=`` the second batch is accumulated in the first batch's eigenbasis: one warning that says
    so; the fix it names (the basis of all the data) gives EKFAC over the union, batch by batch."""
    import warnings

    from curvkit.curvature.ekfac import FirstBatchBasisWarning

    model = make_mlp((4, 6, 3), "tanh")
    g = torch.Generator().manual_seed(5)
    X, y = torch.randn(16, 4, generator=g, dtype=D64), torch.randint(0, 3, (16,), generator=g)
    batches = [(X[:8], y[:8]), (X[8:], y[8:])]
    lik = CrossEntropy("sum")
    with pytest.warns(FirstBatchBasisWarning, match="basis=KroneckerEstimator") as record:
        first = EKFACEstimator(model, lik).update(batches).update((X[:4], y[:4])).operator()
    assert len([w for w in record if issubclass(w.category, FirstBatchBasisWarning)]) == 1  # once per estimator
    with warnings.catch_warnings():
        warnings.simplefilter("error", FirstBatchBasisWarning)
        basis = kflr(model, lik, (X, y))
        union = EKFACEstimator(model, lik, basis=basis).update(batches).operator()
        whole = EKFACEstimator(model, lik).update((X, y)).operator()  # one batch: no warning
    torch.testing.assert_close(union.to_dense(), whole.to_dense(), atol=1e-10, rtol=1e-10)
    assert float((first.to_dense() - whole.to_dense()).norm()) > 1e-6  # the first-batch basis differs
