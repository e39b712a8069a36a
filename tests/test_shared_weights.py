"""Issue 30 §2: a parameter used in several places (weight tying) gets the SUM of its uses' Kronecker terms.

Reference: each use's dense GGN block from ``torch.func`` with the tied slots untied (``functional_call(...,
tie_weights=False)``: one tensor per module that holds the parameter), J_m^T H J_m per use m, summed in the
tied coordinates. KFLR on one datum with one position gives each use's exact block (Lemmas 3.21/3.22), so
the sum block equals that reference to 1e-10 in float64 (1e-6 relative for T5, whose T5LayerNorm normalises in
float32); the exact tied GGN block adds the cross terms J_m^T H J_m' between the uses, which a sum of per-use
blocks does not have (as KFAC has no cross terms between layers). Models: GPT-2 (tied wte/lm_head, through
``curvkit.hf.HuggingFace``), T5 (one embedding, three uses: encoder, decoder, lm_head), RoBERTa MLM (tied
word embedding and the ``lm_head.bias`` alias of ``lm_head.decoder.bias``) and a nanoGPT-style model written in
plain PyTorch. Every consumer then takes the sum block: the operator's products, diagonal, inverse and
log-determinant (checked against the dense matrix), a Gauss-Newton step, Kronecker Laplace (log-determinant,
samples, GLM variances) and the continual Kronecker penalty; the Kronecker filters: tests/test_filter_tied.py.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.func import functional_call, hessian, jacrev

from curvkit import layerkinds
from curvkit.continual.laplace import LaplacePenalty
from curvkit.curvature.ekfac import EKFACEstimator
from curvkit.curvature.estimators import KroneckerEstimator
from curvkit.hf import HuggingFace
from curvkit.laplace import Laplace
from curvkit.likelihoods import CrossEntropy
from curvkit.optim import GaussNewton
from curvkit.structure import read_model

transformers = pytest.importorskip("transformers")
D64 = torch.float64
V = 11
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"), pytest.mark.usefixtures("float64_default")]


class NanoGPT(nn.Module):
    """nanoGPT as written: token and position tables, the position table looked up on ``arange(T)`` (no batch
    dimension), one pre-norm MLP block, and the head tied to the token table (``lm_head.weight = wte.weight``)."""

    def __init__(self, vocab: int = V, dim: int = 6, max_len: int = 8):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.ln, self.fc, self.ln_f = nn.LayerNorm(dim), nn.Linear(dim, dim), nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        x = x + torch.tanh(self.fc(self.ln(x)))
        return self.lm_head(self.ln_f(x))


def _ids(B, T, seed):
    return torch.randint(3, V, (B, T), generator=torch.Generator().manual_seed(seed))


def build(name, B=1, T=1):
    """(model, likelihood, (X, y), the shared parameter's canonical name, the float tolerance)."""
    torch.manual_seed(0)
    X, y = _ids(B, T, 0), _ids(B, T, 1)
    if name == "nanogpt":
        return NanoGPT().to(D64).eval(), CrossEntropy("sum"), (X, y), "wte.weight", 1e-10
    T_ = transformers
    if name == "gpt2":
        model = T_.GPT2LMHeadModel(T_.GPT2Config(vocab_size=V, n_positions=8, n_embd=6, n_layer=1, n_head=2,
                                                  tie_word_embeddings=True))
        shared = "model.transformer.wte.weight"
    elif name == "roberta":
        model = T_.RobertaForMaskedLM(T_.RobertaConfig(vocab_size=V, hidden_size=6, num_hidden_layers=1,
                                                       num_attention_heads=2, intermediate_size=8,
                                                       max_position_embeddings=12))
        shared = "model.roberta.embeddings.word_embeddings.weight"
    else:
        model = T_.T5ForConditionalGeneration(T_.T5Config(vocab_size=V, d_model=6, d_kv=3, d_ff=8, num_layers=1,
                                                          num_heads=2, decoder_start_token_id=0))
        for n, p in model.named_parameters():
            if "relative_attention_bias" in n:  # looked up without a batch dimension (tests/test_hf_families.py)
                p.requires_grad_(False)
        X = {"input_ids": X, "decoder_input_ids": _ids(B, T, 2)}
        shared = "model.shared.weight"
    X = {"input_ids": X} if not isinstance(X, dict) else X
    X = {**X, "attention_mask": torch.ones_like(X["input_ids"])}
    tol = 1e-6 if name == "t5" else 1e-10
    return HuggingFace(model.to(D64).eval()), CrossEntropy("sum"), (X, y), shared, tol


def per_use_ggn(model, lik, data, names):
    """(sum over uses of J_m^T H J_m, the exact tied block J^T H J) over the entries of ``names`` (layout order):
    a use is a module holding one of the parameters, its slots untied from the other modules'."""
    X, y = data
    canon = {id(p): n for n, p in model.named_parameters()}
    slots = [(s, canon[id(p)]) for s, p in model.named_parameters(remove_duplicate=False) if canon[id(p)] in names]
    sizes = {n: model.get_parameter(n).numel() for n in names}
    start = dict(zip(names, torch.tensor([0] + [sizes[n] for n in names]).cumsum(0).tolist()))
    P = sum(sizes.values())
    owners: dict[str, list[tuple[str, str]]] = {}
    for s, n in slots:
        owners.setdefault(s.rsplit(".", 1)[0], []).append((s, n))
    base = {s: model.get_parameter(n).detach() for s, n in slots}

    def f(values):
        return functional_call(model, {**base, **values}, (X,), tie_weights=False, strict=False)

    out = f({}).detach()
    H = hessian(lambda o: lik(o.reshape(out.shape), y))(out.reshape(-1))
    Js = []
    for uses in owners.values():
        keys = [s for s, _ in uses]
        jac = jacrev(lambda vals, keys=keys: f(dict(zip(keys, vals))))([base[s] for s in keys])
        J = torch.zeros(out.numel(), P, dtype=D64)
        for (_, n), j in zip(uses, jac):
            J[:, start[n]:start[n] + sizes[n]] += j.reshape(out.numel(), -1)
        Js.append(J)
    per_use = sum(J.T @ H @ J for J in Js)
    J = sum(Js)
    return per_use, J.T @ H @ J


def _sum_block(op, shared):
    (b,) = [b for b in op.blocks if shared in b.names]
    idx = torch.cat([torch.arange(op.layout.slices()[n].start, op.layout.slices()[n].stop) for n in b.names])
    return b, op.to_dense()[idx][:, idx]


CASES = ["nanogpt", "gpt2", "roberta", "t5"]


@pytest.mark.parametrize("name", CASES)
def test_kflr_sum_block_is_the_sum_of_the_uses_dense_ggn_blocks(name):
    model, lik, data, shared, tol = build(name)
    op = KroneckerEstimator(model, lik, "kflr").update(data).operator()
    b, M = _sum_block(op, shared)
    assert not b.factored and " + " in b.name  # one dense block, the sum of the uses
    ref, tied = per_use_ggn(model, lik, data, list(b.names))
    scale = float(ref.abs().max())
    torch.testing.assert_close(M, ref, atol=tol * scale, rtol=0)
    assert float((tied - ref).abs().max()) > 1e-3 * scale  # the cross terms between uses are not in the sum


def test_roberta_bias_alias_and_t5_uses():
    model, lik, data, shared, _ = build("roberta")
    op = KroneckerEstimator(model, lik, "kfac").update(data).operator()
    b, _ = _sum_block(op, shared)
    assert b.names == (shared, "model.lm_head.bias")  # the alias is one parameter of the decoder's use
    assert b.name == "model.roberta.embeddings.word_embeddings + model.lm_head.decoder"
    model, lik, data, shared, _ = build("t5")
    op = KroneckerEstimator(model, lik, "kfac").update(data).operator()
    b, _ = _sum_block(op, shared)  # model.shared itself is never called: a use without data adds nothing
    assert b.name == "model.shared + model.encoder.embed_tokens + model.decoder.embed_tokens + model.lm_head"


@pytest.mark.parametrize("name", ["nanogpt", "gpt2"])
def test_consumers_take_the_sum_block(name):
    model, lik, _, shared, _ = build(name)
    data = (_ids(3, 4, 5), _ids(3, 4, 6))
    if name == "gpt2":
        data = ({"input_ids": data[0], "attention_mask": torch.ones_like(data[0])}, data[1])
    op = KroneckerEstimator(model, lik, "kflr").update(data).operator()
    D = op.to_dense()
    d = D.shape[0]
    g = torch.Generator().manual_seed(3)
    Vs = torch.randn(d, 2, generator=g, dtype=D64)
    torch.testing.assert_close(op @ Vs, D @ Vs, atol=1e-12, rtol=0)
    torch.testing.assert_close(op.diagonal().flat, D.diagonal(), atol=1e-12, rtol=0)
    torch.testing.assert_close(op.solve(Vs, damping=0.3), torch.linalg.solve(D + 0.3 * torch.eye(d), Vs),
                               atol=1e-9, rtol=1e-9)
    torch.testing.assert_close(op.logdet(0.3), torch.linalg.slogdet(D + 0.3 * torch.eye(d))[1], atol=1e-9, rtol=0)
    ek = EKFACEstimator(model, lik).update(data).operator()
    assert torch.isfinite(ek @ Vs).all()
    if name == "nanogpt":  # the continual penalty (tensor inputs): 0.5 N dtheta^T C dtheta (no prior, lam = 1)
        pen = LaplacePenalty(likelihood=lik, structure="kron", curvature="kflr", prior_precision=0.0,
                             reduction="sum")
        pen.consolidate(model, data)
        lay = [lay for lay in pen.layers(model) if shared in (lay.weight_name, lay.bias_name)]
        assert len(lay) == 1 and " + " in lay[0].label
        mean = KroneckerEstimator(model, CrossEntropy("mean"), "kflr").update(data)
        w = model.get_parameter(shared)
        dw = 0.01 * torch.randn(w.shape, generator=g, dtype=D64)
        v = torch.zeros(d, dtype=D64)
        v[mean.layout.slices()[shared]] = dw.reshape(-1)
        want = 0.5 * mean.num_terms * (v @ (mean.operator() @ v))
        with torch.no_grad():
            w.add_(dw)
            got = pen.loss(model)
            w.sub_(dw)
        torch.testing.assert_close(got, want, atol=0, rtol=1e-9)
    # Gauss-Newton: a step moves the tied parameter
    before = model.get_parameter(shared).detach().clone()
    opt = GaussNewton([p for p in model.parameters() if p.requires_grad], model=model, likelihood=lik,
                      curvature="kflr")
    assert torch.isfinite(torch.as_tensor(opt.step(batch=data)))
    assert not torch.equal(model.get_parameter(shared).detach(), before)
    # Kronecker Laplace: log-determinant and samples of the precision N * curvature + prior, sum block included
    post = Laplace(model, lik, "kron", "kflr", prior_precision=0.7).fit(data)
    P = post.precision().to_dense()
    torch.testing.assert_close(post.log_det_precision(), torch.linalg.slogdet(P)[1], atol=1e-9, rtol=0)
    S = post.sample(4000, generator=torch.Generator().manual_seed(0)) - post.mean[None]
    i = post.layout.slices()[shared]
    cov = torch.linalg.inv(P)[i, i]
    emp = S[:, i].T @ S[:, i] / S.shape[0]
    assert float((emp - cov).abs().max()) < 0.15 * float(cov.abs().max())
    assert torch.isfinite(post.log_marginal_likelihood())


def test_a_read_outside_the_planned_uses_is_refused():
    """A module that also uses the tied parameter in its own forward: that read has no block, so the sum would
    miss it; counted in the autograd graph and refused, naming the parameter."""

    class Scaled(NanoGPT):
        def forward(self, idx):
            return super().forward(idx) * self.wte.weight.sum()

    model = Scaled().to(D64)
    X, y = _ids(2, 3, 0), _ids(2, 3, 1)
    for dtype in (None, D64, torch.float32):  # the model's own pass, and passes on an upcast copy
        with pytest.raises(ValueError, match=r"'wte.weight'.*is read 3 times.*only 2 of those reads"):
            KroneckerEstimator(model, CrossEntropy("sum"), compute_dtype=dtype).update((X, y))
    KroneckerEstimator(NanoGPT().to(D64), CrossEntropy("sum"), compute_dtype=D64).update((X, y)).operator()


def test_kfra_refuses_a_tied_parameter():
    a, b = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
    b.weight = a.weight
    model = nn.Sequential(a, nn.Tanh(), b).to(D64)
    with pytest.raises(ValueError, match=r"kfra: parameter '0.weight' is shared by modules '0', '2'"):
        KroneckerEstimator(model, CrossEntropy("sum"), "kfra")


def test_plan_gives_every_use_its_blocks_and_frozen_ties_none():
    model = NanoGPT().to(D64)
    plans = layerkinds.plan(read_model(model), "test")
    uses = [lp.label for lp in plans if lp.optional]
    assert uses == ["wte", "lm_head"]
    model.wte.weight.requires_grad_(False)
    est = KroneckerEstimator(model, CrossEntropy())
    assert not est.shared and "lm_head" not in [lp.label for lp in est.plans]


def test_a_large_tied_head_is_a_pair_block_not_a_refusal():
    """Above SHARED_DENSE_LIMIT a tied embedding and head are kept as a sum of two Kronecker terms
    (tests/test_shared_pairs.py holds the consumers)."""
    model = NanoGPT(vocab=700, dim=6).to(D64)  # 4200 entries > SHARED_DENSE_LIMIT
    X, y = _ids(2, 3, 0), _ids(2, 3, 1)
    op = KroneckerEstimator(model, CrossEntropy("sum")).update((X, y)).operator()
    (b,) = [b for b in op.blocks if "wte.weight" in b.names]
    assert b.pair and b.name == "wte + lm_head" and b.second[0].shape == (700,)
