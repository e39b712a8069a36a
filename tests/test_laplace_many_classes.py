"""Laplace with many classes (issue 21, section 2): what the fit and the predictives hold in memory, tested
structurally (the largest tensor any operation creates, recorded by a dispatch mode), not by timing.

* The probit GLM predictive needs only the diagonal of ``J Sigma J^T``: no (B, C, C) tensor per batch and no
  (P, P) covariance, for Kronecker, diagonal and last-layer posteriors; the largest tensor is of the order of the
  posterior's own factors (C x C for the head) or of one chunk of Jacobian pieces (``_jacobians.BUDGET``).
* The exact diagonal GGN reads the softmax Hessian's square-root columns without copying them (the diagonal
  fit of a 1,000-class head spent most of its time copying (B, C, C) column blocks).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from curvkit.laplace import Laplace, _jacobians
from curvkit.likelihoods import CrossEntropy
from curvkit.models import mlp

DT = torch.float64


class Largest(TorchDispatchMode):
    """Records the largest tensor (number of entries, shape, operation) any operation returns."""

    def __init__(self) -> None:
        super().__init__()
        self.numel, self.shape, self.op = 0, (), ""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() > self.numel:
                self.numel, self.shape, self.op = t.numel(), tuple(t.shape), str(func)
        return out


class CountShape(TorchDispatchMode):
    """Counts the operations that return a tensor of the given shape."""

    def __init__(self, shape: tuple[int, ...]) -> None:
        super().__init__()
        self.shape, self.n = shape, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.n += sum(isinstance(t, torch.Tensor) and tuple(t.shape) == self.shape for t in tree_leaves(out))
        return out


C, B = 300, 16


def _fitted(structure: str, subset: str = "all") -> Laplace:
    net = mlp([8, 16, C], "tanh", dtype=DT, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(32, 8, generator=g, dtype=DT), torch.randint(0, C, (32,), generator=g)
    curvature = "kfac" if structure == "kron" else "mc_fisher"
    return Laplace(net, CrossEntropy(), structure, curvature, subset=subset, prior_precision=1.0).fit((X, y))


@pytest.mark.parametrize("structure,subset", [("kron", "all"), ("diag", "all"), ("kron", "last_layer")])
def test_probit_glm_predictive_never_forms_c_by_c_per_point_nor_p_by_p(structure, subset, monkeypatch):
    post = _fitted(structure, subset)
    monkeypatch.setattr(_jacobians, "BUDGET", 2**12, raising=False)  # small chunks: the bound below is the factors' size
    X = torch.randn(B, 8, dtype=DT)
    ref = post.predict(X, "glm", batch_size=B)
    with Largest() as rec:
        probs = post.predict(X, "glm", batch_size=B)
    torch.testing.assert_close(probs, ref)
    P = post.layout.dim
    assert rec.numel <= max(C * C, B * C * 16), (rec.shape, rec.op)  # the head's factor, one batch's pieces
    assert rec.numel < B * C * C / 4 and rec.numel < P * P / 4, (rec.shape, rec.op)


def test_the_mc_link_is_the_one_glm_path_that_forms_the_per_point_covariance():
    post = _fitted("kron")
    X = torch.randn(B, 8, dtype=DT)
    with Largest() as rec:
        post.predict(X, "glm", link="mc", num_samples=4, batch_size=B, generator=torch.Generator().manual_seed(0))
    assert rec.numel >= B * C * C  # (B, C, C): the recorder sees it (so the test above can fail)


def test_softmax_square_root_columns_are_laid_out_for_the_column_batched_backward_pass():
    """Columns ``sqrt(p_c) (e_c - p)`` (their definition), whose column-first permutation - what the layerwise
    diagonal back-propagates - is already contiguous (no (B, C, r) copy per chunk)."""
    lik = CrossEntropy()
    f = torch.randn(5, 7, dtype=DT)
    p = f.softmax(-1)
    S = lik.output_hessian_sqrt_columns(f, slice(2, 6))
    ref = torch.stack([p[:, c].sqrt()[:, None] * (torch.eye(7, dtype=DT)[c] - p) for c in range(2, 6)], -1)
    torch.testing.assert_close(S, ref)
    assert S.permute(2, 0, 1).is_contiguous()
    full = lik.output_hessian_sqrt_columns(f, slice(0, 7))
    torch.testing.assert_close(full @ full.transpose(1, 2), torch.diag_embed(p) - p[:, :, None] * p[:, None, :])
    seq = torch.randn(2, 3, 7, dtype=DT)  # outputs with positions
    Ss = lik.output_hessian_sqrt_columns(seq, slice(0, 7))
    q = seq.softmax(-1)
    torch.testing.assert_close(Ss @ Ss.transpose(-1, -2), torch.diag_embed(q) - q[..., :, None] * q[..., None, :])


@pytest.mark.parametrize("case", ["mlp", "padded_lm", "reduce_lm"])
def test_kflr_output_factor_in_closed_form_equals_the_back_propagated_columns(case):
    """KFLR's output factor of the output layer is ``sum H_L / R`` (one (C, N) x (N, C) product for the softmax)
    instead of C Gram matrices of square-root columns; ``keep_per_sample=True`` keeps the column path."""
    from curvkit import architectures as arch
    from curvkit.curvature.estimators import KroneckerEstimator

    g = torch.Generator().manual_seed(0)
    if case == "mlp":
        model = mlp([8, 16, 40], "tanh", dtype=DT, seed=0)
        X, y, lik = torch.randn(6, 8, generator=g, dtype=DT), torch.randint(0, 40, (6,), generator=g), CrossEntropy()
    else:
        model = arch.causal_lm(vocab_size=9, max_len=5, dim=8, depth=1, heads=2, mlp_dim=8, dtype=DT).eval()
        X, y = torch.randint(0, 9, (3, 5), generator=g), torch.randint(0, 9, (3, 5), generator=g)
        y[0, 2:] = -100
        lik = CrossEntropy(ignore_index=-100)
    kw = dict(weight_sharing="reduce") if case == "reduce_lm" else {}
    C = 40 if case == "mlp" else 9
    with CountShape((C, C)) as fast_count:
        fast = KroneckerEstimator(model, lik, "kflr", **kw).update((X, y)).operator()
    with CountShape((C, C)) as cols_count:
        cols = KroneckerEstimator(model, lik, "kflr", keep_per_sample=True, **kw).update((X, y)).operator()
    assert cols_count.n >= C  # one (C, C) Gram per square-root column
    if case != "reduce_lm":  # expand (or one position): the closed form, a handful of (C, C) tensors
        assert cols_count.n - fast_count.n >= C - 8, (fast_count.n, cols_count.n)
    for a, b in zip(fast.blocks, cols.blocks):
        torch.testing.assert_close(a.G, b.G)
        torch.testing.assert_close(a.A, b.A)
