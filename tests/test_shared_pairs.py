"""Issue 30 §2-3: a tied weight above ``SHARED_DENSE_LIMIT`` (GPT-2's 50,257 x 768 embedding and head) is ONE
block that is the sum of two Kronecker terms, ``G (x) A + G2 (x) A2`` (``KroneckerBlock.second``), in every
consumer that takes it: the operator, GaussNewton, KFAC natural gradient and Kronecker Laplace (factored prior).

The limit is lowered here (monkeypatched) so that tiny float64 models take the pair route; the references are
the same estimator's exact dense sum block (``dense_sum``, the route below the limit) and dense float64 algebra
on it: the pair block must equal the dense sum entry for entry, and every closed form (the factored-damped
inverse, log-determinants, samples) must equal its dense counterpart.
"""

from __future__ import annotations

import math

import pytest
import torch
from tests.test_kron_pair import _rearranged
from tests.test_shared_weights import NanoGPT
from torch import nn

from curvkit.continual.laplace import LaplacePenalty
from curvkit.curvature import CurvatureConfig, GGNOperator, estimators
from curvkit.curvature.ekfac import EKFACEstimator
from curvkit.curvature.estimators import KroneckerEstimator
from curvkit.laplace import Laplace
from curvkit.likelihoods import CrossEntropy
from curvkit.optim import GaussNewton, NaturalGradient
from curvkit.optim.second_order.direction import FactoredInverse

D64 = torch.float64
V = 40
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("float64_default")]


def _data(B=3, T=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, V, (B, T), generator=g), torch.randint(0, V, (B, T), generator=g)


def _model():
    torch.manual_seed(0)
    return NanoGPT(vocab=V, dim=5).to(D64)


@pytest.fixture
def pairs(monkeypatch):
    """Every shared weight above 10 entries takes the pair route."""
    monkeypatch.setattr(estimators, "SHARED_DENSE_LIMIT", 10)


def _operators(monkeypatch, curvature="kflr", **kw):
    """(pair operator, dense-sum operator) of the same estimator on the same data."""
    model, data = _model(), _data()
    monkeypatch.setattr(estimators, "SHARED_DENSE_LIMIT", 10**9)
    dense = KroneckerEstimator(model, CrossEntropy("sum"), curvature, **kw).update(data).operator()
    monkeypatch.setattr(estimators, "SHARED_DENSE_LIMIT", 10)
    pair = KroneckerEstimator(model, CrossEntropy("sum"), curvature, **kw).update(data).operator()
    return pair, dense


def _pair_block(op):
    (b,) = [b for b in op.blocks if b.pair]
    return b


@pytest.mark.parametrize("kw", [{}, {"curvature": "kfac", "output_factor": "low_rank", "mc_samples": 3}],
                         ids=["kflr-dense", "kfac-lowrank"])
def test_the_pair_block_equals_the_dense_sum_and_its_closed_forms_their_dense_counterparts(monkeypatch, kw):
    pair, dense = _operators(monkeypatch, **kw)
    b = _pair_block(pair)
    assert b.name == "wte + lm_head" and b.low_rank_output == ("output_factor" in kw)
    D = dense.to_dense()
    torch.testing.assert_close(pair.to_dense(), D, atol=1e-12, rtol=0)
    d = D.shape[0]
    Vs = torch.randn(d, 3, generator=torch.Generator().manual_seed(1), dtype=D64)
    I = torch.eye(d, dtype=D64)
    torch.testing.assert_close(pair @ Vs, D @ Vs, atol=1e-12, rtol=0)
    torch.testing.assert_close(pair.diagonal().flat, D.diagonal(), atol=1e-12, rtol=0)
    torch.testing.assert_close(pair.trace(), D.trace(), atol=1e-10, rtol=0)
    torch.testing.assert_close((2.5 * pair).to_dense(), 2.5 * D, atol=1e-11, rtol=0)
    # exact damping: no closed form for two terms plus delta I -> conjugate gradients / the dense log-determinant
    torch.testing.assert_close(pair.solve(Vs, damping=0.3), torch.linalg.solve(D + 0.3 * I, Vs), atol=1e-8, rtol=0)
    torch.testing.assert_close(pair.logdet(0.3), torch.linalg.slogdet(D + 0.3 * I)[1], atol=1e-9, rtol=0)
    # factored damping rides on the second term: G A + (G2 + k/pi I)(A2 + pi k I), pi from the second term
    delta = 0.3
    k = math.sqrt(delta)
    (pi,) = [p for p, blk in zip(pair.damping_split(), pair.blocks) if blk.pair]
    G2, A2 = (torch.diag(t) if t.dim() == 1 else t for t in b.second)
    tG, tA = float(G2.trace()) / b.out_dim, float(A2.trace()) / b.in_dim
    assert pi == pytest.approx(math.sqrt(tA / tG), rel=1e-12)
    damped = pair.factored_damping(delta)
    extra = (torch.kron(G2 + (k / pi) * torch.eye(b.out_dim), A2 + pi * k * torch.eye(b.in_dim))
             - torch.kron(G2, A2))
    sl = pair._index[pair.blocks.index(b)].perm
    want = D.clone()
    want[sl[:, None], sl[None, :]] += extra
    Dd = damped.to_dense()
    others = [i for i in range(d) if i not in set(sl.tolist())]
    torch.testing.assert_close(Dd[sl][:, sl], want[sl][:, sl], atol=1e-11, rtol=0)
    torch.testing.assert_close(Dd[others][:, others], pair.factored_damping(delta).to_dense()[others][:, others])
    inv = pair.inverse(delta, method="factored")
    torch.testing.assert_close(inv @ Vs, torch.linalg.solve(Dd, Vs), atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(pair.solve(Vs, delta, method="factored"), torch.linalg.solve(Dd, Vs), atol=1e-10,
                               rtol=1e-10)
    # samples of the damped operator read as a precision: covariance Dd^{-1}
    S = damped.sample(torch.zeros(d), generator=torch.Generator().manual_seed(0), num_samples=40000)
    C = torch.linalg.inv(Dd)
    assert float((S.T @ S / S.shape[0] - C).abs().max()) < 0.05 * float(C.abs().max())
    with pytest.raises(ValueError, match=r"sum of two Kronecker terms.*factored_damping"):
        pair.add_identity(0.1).sample(torch.zeros(d))
    with pytest.raises(ValueError, match=r"eigendecomposition: block 'wte \+ lm_head' is the sum of two Kronecker"):
        pair.eigh()


def test_gauss_newton_and_natural_gradient_take_the_pair(monkeypatch):
    pair, _ = _operators(monkeypatch)
    omegas = pair.damping_split()
    g = torch.randn(pair.layout.dim, generator=torch.Generator().manual_seed(2), dtype=D64)
    grads = dict(zip(pair.layout.names, pair.layout.unflatten(g)))
    d = FactoredInverse(pair, 0.2, omegas).apply(grads)
    got = pair.layout.flatten([d[n] for n in pair.layout.names])
    torch.testing.assert_close(got, torch.linalg.solve(pair.factored_damping(0.2, pi=omegas).to_dense(), g),
                               atol=1e-10, rtol=1e-10)
    lik = CrossEntropy("sum")
    for curvature, extra in (("kflr", {}), ("kfac", {"inversion": "eigen"})):
        model = _model()
        before = model.wte.weight.detach().clone()
        opt = GaussNewton([p for p in model.parameters()], model=model, likelihood=lik, curvature=curvature, **extra)
        assert math.isfinite(float(opt.step(batch=_data())))
        assert _pair_block(opt._op).name == "wte + lm_head"
        assert not torch.equal(model.wte.weight.detach(), before)
    model = _model()
    X, y = _data()
    ng = NaturalGradient(model.parameters(), model=model, likelihood=lik, curvature="kfac")
    lik(model(X), y).backward()
    before = model.wte.weight.detach().clone()
    ng.step(batch=(X, y))
    assert torch.isfinite(model.wte.weight).all() and not torch.equal(model.wte.weight.detach(), before)


def test_kronecker_laplace_takes_the_pair_with_the_prior_on_its_second_term(pairs):
    model, data = _model(), _data()
    lik = CrossEntropy("sum")
    post = Laplace(model, lik, "kron", "kflr", prior_precision=0.7).fit(data)
    (blk,) = [pb for pb in post.blocks if any(f.pair for f in getattr(pb, "factors", []))]
    (b,) = [f for f in blk.factors if f.pair]
    N, lam = float(post.num_data), 0.7
    P = post.precision().to_dense()
    # the pair's precision block: N G (x) A + (sqrt(N) G2 + sqrt(lam) I) (x) (sqrt(N) A2 + sqrt(lam) I)
    G1 = b.G.to_dense() if b.low_rank_output else b.G
    G2, A2 = (torch.diag(t) if t.dim() == 1 else t for t in b.second)
    A1 = torch.diag(b.A) if b.A.dim() == 1 else b.A
    sN, sl = math.sqrt(N), math.sqrt(lam)
    want = N * torch.kron(G1, A1) + torch.kron(sN * G2 + sl * torch.eye(b.out_dim), sN * A2 + sl * torch.eye(b.in_dim))
    sl_idx = torch.cat([torch.arange(post.layout.slices()[n].start, post.layout.slices()[n].stop) for n in b.names])
    view = blk.views[blk.factors.index(b)]
    perm = sl_idx[view.perm] if hasattr(view, "perm") else None
    if perm is not None:
        torch.testing.assert_close(P[perm][:, perm], want, atol=1e-10, rtol=1e-12)
    torch.testing.assert_close(post.log_det_precision(), torch.linalg.slogdet(P)[1], atol=1e-9, rtol=0)
    v = torch.randn(P.shape[0], 2, generator=torch.Generator().manual_seed(4), dtype=D64)
    torch.testing.assert_close(post.covariance() @ v, torch.linalg.solve(P, v), atol=1e-10, rtol=1e-10)
    S = post.sample(20000, generator=torch.Generator().manual_seed(0)) - post.mean[None]
    i = post.layout.slices()["wte.weight"]
    cov = torch.linalg.inv(P)[i, i]
    emp = S[:, i].T @ S[:, i] / S.shape[0]
    assert float((emp - cov).abs().max()) < 0.08 * float(cov.abs().max())
    # the marginal likelihood is differentiable in the prior precision through the pair's log-determinant
    t = torch.tensor(0.7, dtype=D64, requires_grad=True)
    lml = post.log_marginal_likelihood(prior_precision=t)
    (grad,) = torch.autograd.grad(lml, t)
    h = 1e-5
    fd = (post.log_marginal_likelihood(prior_precision=0.7 + h) - post.log_marginal_likelihood(prior_precision=0.7 - h))
    torch.testing.assert_close(grad, fd / (2 * h), atol=1e-5, rtol=1e-5)
    probs = post.predict(data[0], method="mc", num_samples=8, generator=torch.Generator().manual_seed(0))
    assert torch.isfinite(torch.as_tensor(probs)).all()
    # the GLM predictive: J P^{-1} J^T with J the Jacobian of the logits in every posterior parameter (the tied
    # weight one tensor: both uses' rows summed) and P the dense precision
    Xq = data[0][:2]
    f, var = post.functional_variance(Xq, diagonal=False)
    params = {n: model.get_parameter(n).detach() for n in post.layout.names}
    jac = torch.func.jacrev(lambda ps: torch.func.functional_call(model, ps, (Xq,)))(params)
    J = torch.cat([jac[n].reshape(f.numel(), -1) for n in post.layout.names], 1)
    full = J @ torch.linalg.solve(P, J.T)
    C = f.shape[-1]
    blocks = torch.stack([full[i * C:(i + 1) * C, i * C:(i + 1) * C] for i in range(f.numel() // C)])
    torch.testing.assert_close(var.reshape(blocks.shape), blocks, atol=1e-9, rtol=1e-8)
    with pytest.raises(ValueError, match=r"prior_form=.exact.*prior_form=.factored. takes it"):
        Laplace(model, lik, "kron", "kflr", prior_form="exact").fit(data)


@pytest.mark.parametrize("curvature", ["empirical", "kflr"])
def test_ekfac_takes_the_pair_in_the_eigenbasis_of_its_nearest_kronecker_product(pairs, curvature):
    """EKFAC's pair block is ``Q diag(s) Q^T`` with ``Q = QG (x) QA`` the eigenbasis of the Kronecker product
    nearest to the pair (the dense best rank-one approximation of its rearrangement) and ``s = diag(Q^T C Q)``,
    C the second moment of the TRUE per-sample gradients of the tied weight (both uses, cross terms included:
    autograd per sample for 'empirical'; for 'kflr' at one position per sequence, where its rows are exact, the
    exact GGN block), i.e. EKFAC's defining property."""
    model, data = _model(), _data(B=5, T=4 if curvature == "empirical" else 1)  # kflr: exact at one position
    lik = CrossEntropy("sum")
    est = EKFACEstimator(model, lik, curvature).update(data)
    op = est.operator()
    b = _pair_block(est.basis)
    (j,) = [i for i, blk in enumerate(est.basis.blocks) if blk.pair]
    nk = est.one_term_basis().blocks[j]
    m, n = b.out_dim, b.in_dim
    pair = torch.kron(b.G, b.A) + torch.kron(torch.diag(b.second[0]), b.second[1])
    U, S, Vh = torch.linalg.svd(_rearranged(pair, m, n))
    torch.testing.assert_close(_rearranged(torch.kron(nk.G, nk.A), m, n), S[0] * torch.outer(U[:, 0], Vh[0]),
                               atol=1e-10, rtol=0)
    assert float(torch.linalg.eigvalsh(nk.G).min()) > -1e-10 and float(torch.linalg.eigvalsh(nk.A).min()) > -1e-10
    e = est.one_term_basis().eigh()[j]
    Q = torch.kron(e.G_eigvecs, e.A_eigvecs)
    block = op.block(["wte.weight"]).to_dense()
    if curvature == "empirical":
        X, y = data
        g = torch.stack([torch.autograd.grad(nn.functional.cross_entropy(model(X[i:i + 1]).reshape(-1, V),
                                                                         y[i], reduction="sum"),
                                             model.wte.weight)[0].reshape(-1) for i in range(X.shape[0])])
        # (N, V * D): the per-sample gradients of the tied weight (both uses); the head's view [W] is the flat order
        C = g.T @ g
    else:  # kflr: the rows are the output Hessian's square root, so C is the exact GGN block of the tied weight
        C = GGNOperator(model, lik, data).block(["wte.weight"]).to_dense()
    s = (Q.T @ C @ Q).diagonal()
    torch.testing.assert_close(block, Q @ torch.diag(s) @ Q.T, atol=1e-10, rtol=1e-10)
    # its inverse and log-determinant are the closed forms of that matrix
    d = op.layout.dim
    v = torch.randn(d, generator=torch.Generator().manual_seed(5), dtype=D64)
    D = op.to_dense()
    torch.testing.assert_close(op.solve(v, damping=0.1), torch.linalg.solve(D + 0.1 * torch.eye(d), v), atol=1e-9,
                               rtol=1e-9)
    torch.testing.assert_close(op.logdet(0.1), torch.linalg.slogdet(D + 0.1 * torch.eye(d))[1], atol=1e-9, rtol=0)


def test_ekfac_refuses_a_pair_with_a_low_rank_head_naming_its_fixes(pairs, monkeypatch):
    """A vocabulary-sized tied head (its G low rank) plus the embedding's term has no thin eigenbasis for EKFAC's
    nearest Kronecker product: refused with the fixes EKFAC accepts (freezing, or its config's dense factor)."""
    monkeypatch.setattr(estimators, "LOW_RANK_OUTPUTS", 8)
    with pytest.raises(ValueError, match=r"freeze the tied weight.*config=CurvatureConfig\(output_factor='dense'\)"):
        EKFACEstimator(_model(), CrossEntropy("sum"), "kfac").update(_data())
    cfg = CurvatureConfig(output_factor="dense")
    assert EKFACEstimator(_model(), CrossEntropy("sum"), "kfac", config=cfg).update(_data()).operator() is not None


@pytest.mark.parametrize("mode", ["online", "ewc"])
def test_the_continual_penalty_is_the_quadratic_form_of_the_pair(pairs, mode):
    """Two tasks: the penalty is ``0.5 sum_t N_t dtheta_t^T C_t dtheta_t`` (no prior; dtheta from the last anchor
    for 'online', from each task's own for 'ewc') with C_t the pair operator of task t (dense, the reference);
    its analytic gradient equals autograd's; with one task, memory='summed' equals 'per_task'."""
    model = _model()
    tasks = [_data(seed=0), _data(B=2, seed=5)]
    lik = CrossEntropy("sum")
    pen = LaplacePenalty(likelihood=lik, structure="kron", curvature="kflr", prior_precision=0.0, reduction="sum",
                         mode=mode)
    (lay,) = [lay for lay in pen.layers(model) if lay.pair]
    assert lay.label == "wte + lm_head" and lay.index is None
    refs, anchors = [], []
    g = torch.Generator().manual_seed(7)
    for data in tasks:
        est = KroneckerEstimator(model, CrossEntropy("mean"), "kflr").update(data)
        refs.append((est.num_terms, est.operator().to_dense()))
        anchors.append([p.detach().clone() for p in model.parameters()])
        pen.consolidate(model, data)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * torch.randn(p.shape, generator=g, dtype=D64))
    layout = est.layout
    names = [n for n, _ in model.named_parameters()]

    def flat(tensors):
        return layout.flatten([tensors[names.index(n)] for n in layout.names])

    theta = flat([p.detach() for p in model.parameters()])
    want = sum(0.5 * n * (theta - flat(anchors[t if mode == "ewc" else -1])) @ C @ (
        theta - flat(anchors[t if mode == "ewc" else -1])) for t, (n, C) in enumerate(refs))
    torch.testing.assert_close(pen.loss(model), want, atol=0, rtol=1e-9)
    auto = torch.autograd.grad(pen.loss(model), list(model.parameters()))
    for a, b in zip(pen.gradient(model), auto):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    assert pen.curvature_bound() > 0
    if mode == "online":
        one = [LaplacePenalty(likelihood=lik, structure="kron", curvature="kflr", reduction="sum", memory=m)
               for m in ("per_task", "summed")]
        for p_ in one:
            p_.consolidate(_model(), tasks[0])
        torch.testing.assert_close(one[0].loss(model), one[1].loss(model), atol=0, rtol=1e-12)


def test_two_embeddings_sharing_a_large_table_are_refused(pairs):
    """No use in the weight's standard view: not a pair (pair_in_view), so refused at construction."""

    class TwoTables(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Embedding(V, 5), nn.Embedding(V, 5)
            self.b.weight = self.a.weight
            self.head = nn.Linear(5, 3)

        def forward(self, idx):
            return self.head(self.a(idx) + self.b(idx.flip(1)))

    with pytest.raises(ValueError, match=r"shares a.weight with 1 other use\(s\) \(a \+ b\); their sum has 200 "
                                         r"entries, more than SHARED_DENSE_LIMIT = 10.*two uses of one whole weight"):
        KroneckerEstimator(TwoTables().to(D64), CrossEntropy("sum"))


def test_three_genuinely_different_terms_are_exact_below_the_limit_and_refused_above(monkeypatch):
    """A tied head, a lookup of its table AND a second Linear use (three Kronecker terms no two of which merge):
    one exact dense block up to SHARED_DENSE_LIMIT (equal to the sum of the three uses' own blocks), refused at
    construction above it (a block holds at most two terms; only lookups are merged)."""

    class ThreeUses(nn.Module):
        def __init__(self):
            super().__init__()
            self.wte, self.mix, self.head = nn.Embedding(V, 5), nn.Linear(5, V, bias=False), nn.Linear(5, V, bias=False)
            self.mix.weight = self.head.weight = self.wte.weight

        def forward(self, idx):
            h = torch.tanh(self.wte(idx))
            return self.head(h + torch.tanh(self.mix(h))[..., :5])

    torch.manual_seed(0)
    model, data = ThreeUses().to(D64), _data()
    monkeypatch.setattr(estimators, "SHARED_DENSE_LIMIT", 10**9)
    est = KroneckerEstimator(model, CrossEntropy("sum"), "kflr").update(data)
    (b,) = est.operator().blocks
    assert not b.factored and b.name.count("+") == 2
    uses = est.use_blocks(list(est._stats), est.scale(), float(est.num_data))
    from curvkit.linalg.kron import KroneckerOperator, dense_sum

    want = KroneckerOperator(est.layout, [dense_sum(est.layout, uses)]).to_dense()
    torch.testing.assert_close(est.operator().to_dense(), want, atol=1e-12, rtol=0)
    monkeypatch.setattr(estimators, "SHARED_DENSE_LIMIT", 10)
    with pytest.raises(ValueError, match=r"shares wte.weight with 2 other use\(s\).*more than SHARED_DENSE_LIMIT = 10"
                                         r".*two uses of one whole weight"):
        KroneckerEstimator(model, CrossEntropy("sum"), "kflr")


def test_t5_head_and_two_lookups_of_its_table_are_a_pair_with_the_lookups_merged(pairs):
    """T5's one embedding: read by ``shared`` (never called), the encoder's and the decoder's lookups and the tied
    head. Above the limit the lookups are merged into one term (``merge_terms``: G the trace-weighted mean of
    their G, A the summed counts: KFAC-expand's factors of one lookup at the union of their positions) and
    paired with the head's: checked against the uses' own blocks, with the trace kept exactly."""
    from tests.test_shared_weights import build

    model, lik, (X, y), shared, _ = build("t5", B=2, T=3)
    est = KroneckerEstimator(model, lik, "kflr").update((X, y))
    op = est.operator()
    (b,) = [b for b in op.blocks if shared in b.names]
    assert b.pair and b.name == "model.shared + model.encoder.embed_tokens + model.decoder.embed_tokens + model.lm_head"
    uses = est.use_blocks(est._means(), est.scale())
    by_label = {spec.label: blk for (_, spec), blk in zip(est.blocks, uses)}
    head = by_label["model.lm_head"]
    lookups = [by_label[f"model.{m}"] for m in ("shared", "encoder.embed_tokens", "decoder.embed_tokens")]
    assert float(lookups[0].A.sum()) == 0.0  # model.shared itself never runs
    t = [float(u.A.sum()) for u in lookups]
    G = sum(w * u.G for w, u in zip(t, lookups)) / sum(t)
    A = sum(u.A for u in lookups)
    # in the head's (V, D) view the merged lookup term is diag(A) (x) G (the embedding's W^T term transposed)
    want = torch.kron(head.G, head.A) + torch.kron(torch.diag(A), G)
    sl = op._index[op.blocks.index(b)].perm
    torch.testing.assert_close(op.to_dense()[sl][:, sl], want, atol=1e-12, rtol=0)
    exact_trace = sum(float(u.G.trace()) * float(u.A.sum()) for u in lookups) + float(head.G.trace() * head.A.trace())
    assert float(torch.diagonal(want).sum()) == pytest.approx(exact_trace, rel=1e-12)
    # the consumers take it: a Gauss-Newton step moves the shared table, Laplace fits
    before = model.get_parameter(shared).detach().clone()
    opt = GaussNewton([p for p in model.parameters() if p.requires_grad], model=model, likelihood=lik,
                      curvature="kflr")
    assert math.isfinite(float(opt.step(batch=(X, y))))
    assert not torch.equal(model.get_parameter(shared).detach(), before)
    post = Laplace(model, lik, "kron", "kflr", prior_precision=0.5).fit((X, y))
    assert torch.isfinite(post.log_marginal_likelihood())


@pytest.mark.parametrize("name", ["gpt2", "roberta"])
def test_hugging_face_tied_heads_as_pairs_equal_their_dense_sums(monkeypatch, name):
    """GPT-2's tied wte/lm_head and RoBERTa's tied word embedding with the head's bias alias (a bias column in
    the head's view, read by the head only) as pair blocks equal the dense sums; a Gauss-Newton step runs."""
    from tests.test_shared_weights import build

    model, lik, (X, y), shared, _ = build(name, B=2, T=3)
    ops = []
    for limit in (10**9, 10):
        monkeypatch.setattr(estimators, "SHARED_DENSE_LIMIT", limit)
        ops.append(KroneckerEstimator(model, lik, "kflr").update((X, y)).operator())
    (b,) = [b for b in ops[1].blocks if shared in b.names]
    assert b.pair and (b.bias_name is not None) == (name == "roberta")
    torch.testing.assert_close(ops[1].to_dense(), ops[0].to_dense(), atol=1e-12, rtol=0)
    before = model.get_parameter(shared).detach().clone()
    opt = GaussNewton([p for p in model.parameters() if p.requires_grad], model=model, likelihood=lik,
                      curvature="kflr")
    assert math.isfinite(float(opt.step(batch=(X, y))))
    assert not torch.equal(model.get_parameter(shared).detach(), before)
