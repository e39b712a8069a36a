"""Parameter layout conventions, the base operator types, and the model builders."""

import pytest
import torch

from curvkit.linalg import DenseOperator, DiagonalOperator, ParamLayout
from curvkit.models import autoencoder, lenet, mlp

pytestmark = pytest.mark.usefixtures("float64_default")


def test_layout_order_is_named_parameters_row_major():
    net = mlp([3, 2, 2])
    lay = ParamLayout.from_module(net)
    assert lay.names == ("0.weight", "0.bias", "2.weight", "2.bias")
    assert lay.dim == 3 * 2 + 2 + 2 * 2 + 2
    params = list(net.parameters())
    flat = lay.flatten(params)
    torch.testing.assert_close(flat[:6], params[0].detach().reshape(-1))
    back = lay.unflatten(flat)
    for a, b in zip(back, params):
        torch.testing.assert_close(a, b.detach())
    # trailing column dimension
    M = torch.randn(lay.dim, 3)
    assert next(t.shape for t in lay.unflatten(M)) == (2, 3, 3)
    torch.testing.assert_close(lay.flatten(lay.unflatten(M)), M)


def test_layout_errors():
    lay = ParamLayout.from_module(mlp([3, 2]))
    with pytest.raises(ValueError, match="expected 2 parameter-shaped tensors"):
        lay.flatten([torch.zeros(2, 3)])
    with pytest.raises(ValueError, match=r"'0\.bias' has shape"):
        lay.flatten([torch.zeros(2, 3), torch.zeros(3)])
    with pytest.raises(ValueError, match="vector of length 8"):
        lay.unflatten(torch.zeros(7))
    frozen = mlp([3, 2])
    for p in frozen.parameters():
        p.requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        ParamLayout.from_module(frozen)


def test_operator_products_and_algebra():
    lay = ParamLayout.from_module(mlp([3, 2]))
    g = torch.Generator().manual_seed(0)
    R = torch.randn(lay.dim, lay.dim, generator=g)
    M = R @ R.T + torch.eye(lay.dim)
    op = DenseOperator(lay, M)
    v = torch.randn(lay.dim, generator=g)
    torch.testing.assert_close(op @ v, M @ v)
    torch.testing.assert_close(lay.flatten(op @ lay.unflatten(v)), M @ v)
    torch.testing.assert_close((op + op * 2.0).to_dense(), 3 * M)
    torch.testing.assert_close(op.add_identity(0.5).diagonal().flat, M.diagonal() + 0.5)
    with pytest.raises(ValueError, match="cannot multiply"):
        op @ torch.zeros(lay.dim + 1)
    with pytest.raises(TypeError):
        op @ 3.0  # type: ignore[operator]


def test_diagonal_operator():
    lay = ParamLayout.from_module(mlp([3, 2]))
    d = torch.rand(lay.dim) + 0.1
    D = DiagonalOperator.from_flat(lay, d)
    v = torch.randn(lay.dim)
    torch.testing.assert_close(D @ v, d * v)
    torch.testing.assert_close(D.inverse() @ (D @ v), v)
    torch.testing.assert_close(D.logdet(), d.log().sum())
    torch.testing.assert_close(D.trace(), d.sum())
    torch.testing.assert_close(D.to_dense(), torch.diag(d))
    with pytest.raises(ValueError, match="non-positive"):
        DiagonalOperator.from_flat(lay, -d).inverse()
    with pytest.raises(ValueError, match="shape"):
        DiagonalOperator(lay, [torch.zeros(3, 3), torch.zeros(2)])


def test_models_shapes():
    net = mlp([784, 100, 10])
    assert net(torch.zeros(2, 784)).shape == (2, 10)
    assert isinstance(mlp([4, 5, 3], "identity", bias=False)[1], torch.nn.Identity)
    assert lenet()(torch.zeros(2, 1, 28, 28)).shape == (2, 10)
    assert lenet(image_size=32)(torch.zeros(2, 1, 32, 32)).shape == (2, 10)
    ae = autoencoder(input_dim=20, width=0.01)
    assert ae(torch.zeros(2, 20)).shape == (2, 20)
    widths = [m.out_features for m in ae if isinstance(m, torch.nn.Linear)]
    assert widths == [10, 5, 2, 30, 2, 5, 10, 20]
    with pytest.raises(ValueError, match="unknown activation"):
        mlp([2, 2, 2], "gelu6")
    with pytest.raises(ValueError, match="at least two"):
        mlp([2])


@pytest.mark.parametrize("dtype", [None, torch.float32])
def test_seeded_mlp_leaves_the_global_generator_alone(dtype):
    """mlp(seed=s) draws from a local generator: the global RNG state is unchanged, the same seed gives the
    same weights (whatever the global state), and they are torch's default nn.Linear initialisation after
    torch.manual_seed(s), the values mlp(seed=s) always produced (the experiments' networks are unchanged)."""
    state = torch.random.get_rng_state()
    a = mlp([6, 5, 4, 3], "tanh", dtype=dtype, seed=3)
    assert torch.equal(torch.random.get_rng_state(), state)
    torch.rand(7)  # another global state: the seeded weights do not depend on it
    b = mlp([6, 5, 4, 3], "tanh", dtype=dtype, seed=3)
    c = mlp([6, 5, 4, 3], "tanh", dtype=dtype, seed=4)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        ref = [torch.nn.Linear(i, o) for i, o in ((6, 5), (5, 4), (4, 3))]
    ref_params = [p.to(dtype) if dtype else p for lay in ref for p in lay.parameters()]
    for pa, pb, pr in zip(a.parameters(), b.parameters(), ref_params):
        assert torch.equal(pa, pb) and torch.equal(pa, pr) and pa.dtype == pr.dtype
    assert not any(torch.equal(pa, pc) for pa, pc in zip(a.parameters(), c.parameters()))
    nobias = mlp([6, 5], bias=False, dtype=dtype, seed=3)  # the weight's draws come first, as in nn.Linear
    assert nobias[0].bias is None and torch.equal(nobias[0].weight, a[0].weight)
