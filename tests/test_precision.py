"""The precision policy (curvkit.precision, docs/architecture.md "Precision"): a bf16 model's curvature is
accumulated, factorised and inverted in float32 (or float64 on request), and with ``compute_dtype`` its passes
run on an upcast copy. References: float64 at the SAME rounded (bf16) weights and inputs."""

import pytest
import torch
from torch import nn

from curvkit.curvature.estimators import DiagonalEstimator, KroneckerEstimator
from curvkit.curvature.exact import GGNOperator
from curvkit.laplace import Laplace
from curvkit.likelihoods import CrossEntropy
from curvkit.optim.second_order import GaussNewton
from curvkit.precision import statistics_dtype

BF16 = torch.bfloat16


def _models(seed: int = 0) -> tuple[nn.Module, nn.Module]:
    """A bf16 MLP and its float64 copy at the same (rounded) weights."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).to(BF16)
    m64 = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    m64.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    return m, m64


def _batches(n: int, size: int = 16) -> tuple[list, list]:
    g = torch.Generator().manual_seed(1)
    b = [(torch.randn(size, 5, generator=g).to(BF16), torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]
    return b, [(X.double(), y) for X, y in b]


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.double() - ref).abs().max() / ref.abs().max())


def test_statistics_dtype_policy():
    assert statistics_dtype(BF16) == torch.float32
    assert statistics_dtype(torch.float16) == torch.float32
    assert statistics_dtype(torch.float64) == torch.float64
    assert statistics_dtype(BF16, torch.float64) == torch.float64
    with pytest.raises(ValueError, match="statistics_dtype must be"):
        statistics_dtype(torch.float32, BF16)
    m, _ = _models()
    with pytest.raises(ValueError, match="compute_dtype must be"):
        DiagonalEstimator(m, CrossEntropy(), compute_dtype=torch.float16)


def test_kronecker_error_does_not_grow_with_batches():
    """Default (float32 statistics, bf16 passes): KFLR's factors after 256 batches are no worse than after one
    (tolerance: relative max error against float64 at the same rounded weights)."""
    m, m64 = _models()
    b, b64 = _batches(256, 4)
    lik = CrossEntropy()
    errs = []
    for n in (1, 256):
        ref = KroneckerEstimator(m64, lik, "kflr").update(b64[:n]).operator().to_dense()
        est = KroneckerEstimator(m, lik, "kflr").update(b[:n])
        op = est.operator()
        assert op.blocks[0].G.dtype == torch.float32
        errs.append(_rel(op.to_dense(), ref))
    assert errs[1] <= errs[0] and errs[0] < 1e-2


def test_diagonal_compute_dtype_matches_float64():
    """compute_dtype=float32: the 64-batch exact GGN diagonal of a bf16 model agrees with float64 at the same
    rounded weights to 1e-4 (relative max error); the default (bf16 passes) is worse but float32."""
    m, m64 = _models()
    b, b64 = _batches(64)
    lik = CrossEntropy()
    ref = DiagonalEstimator(m64, lik).update(b64).operator().flat
    up = DiagonalEstimator(m, lik, compute_dtype=torch.float32).update(b).operator().flat
    assert up.dtype == torch.float32 and _rel(up, ref) < 1e-4
    default = DiagonalEstimator(m, lik).update(b).operator().flat
    assert default.dtype == torch.float32 and _rel(default, ref) < 1e-2
    # the exact operator over several batches: diagonal summed in float32, passes upcast on request
    X = torch.cat([x for x, _ in b[:4]]), torch.cat([y for _, y in b[:4]])
    d64 = GGNOperator(m64, lik, (X[0].double(), X[1])).diagonal().flat
    op = GGNOperator(m, lik, b[:4], compute_dtype=torch.float32)
    assert op.dtype == torch.float32 and _rel(op.diagonal().flat, d64) < 1e-5
    assert GGNOperator(m, lik, b[:4]).diagonal().flat.dtype == torch.float32


@pytest.mark.slow
def test_diagonal_error_does_not_grow_with_batches():
    m, m64 = _models()
    b, b64 = _batches(256)
    lik = CrossEntropy()
    errs = [_rel(DiagonalEstimator(m, lik).update(b[:n]).operator().flat,
                 DiagonalEstimator(m64, lik).update(b64[:n]).operator().flat) for n in (1, 256)]
    assert errs[1] <= errs[0]


@pytest.mark.parametrize("structure", ["kron", "diag", "full"])
def test_laplace_bf16_model(structure):
    """A bf16 model's Laplace posterior is built and used in float32 (no 'cholesky not implemented for
    BFloat16'); with compute_dtype=float32 its log marginal likelihood is float64's at the rounded weights."""
    m, m64 = _models()
    b, b64 = _batches(3)
    lik = CrossEntropy()
    curvature = "kflr" if structure == "kron" else "ggn"
    ref = Laplace(m64, lik, structure, curvature).fit(b64)
    post = Laplace(m, lik, structure, curvature).fit(b)
    assert post.dtype == torch.float32
    X = b[0][0]
    for out in (post.predict(X, "glm"), post.predict(X, "mc", num_samples=4), post.sample(2)):
        assert out.dtype == torch.float32 and bool(torch.isfinite(out).all())
    lml = post.log_marginal_likelihood()
    assert lml.dtype == torch.float32
    up = Laplace(m, lik, structure, curvature, compute_dtype=torch.float32).fit(b)
    assert abs(float(up.log_det_precision()) - float(ref.log_det_precision())) < 1e-3
    assert abs(float(lml) - float(ref.log_marginal_likelihood())) < 0.5
    p64 = Laplace(m, lik, structure, curvature, statistics_dtype=torch.float64).fit(b)
    assert p64.log_marginal_likelihood().dtype == torch.float64
    glm = up.predict(X, "glm")
    assert float((glm.double() - ref.predict(X.double(), "glm")).abs().max()) < 1e-2  # bf16 forward pass


def test_gauss_newton_bf16_model():
    """GaussNewton on a bf16 model: float32 factors and inverses, bf16 parameters, finite steps that lower
    the loss."""
    m, _ = _models()
    b, _ = _batches(1, 32)
    opt = GaussNewton(m.parameters(), model=m, likelihood=CrossEntropy(), curvature="kflr")
    losses = [float(opt.step(batch=b[0])) for _ in range(5)]
    assert opt.statistics_dtype == torch.float32
    assert opt.estimator.operator().blocks[0].G.dtype == torch.float32
    assert all(p.dtype == BF16 for p in m.parameters())
    assert losses[-1] < losses[0]


def test_bf16_gpt2_with_float32_lora_adapters():
    """Laplace-LoRA as used: a bf16 transformers GPT-2 with peft LoRA adapters in float32, end to end:
    Kronecker Laplace (fit, evidence, GLM and MC predictives), GaussNewton on the adapters, MESU."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from curvkit.hf import HuggingFace
    from curvkit.optim.mesu import MESU

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                                  tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    base = transformers.GPT2LMHeadModel(cfg).to(BF16).eval()
    with pytest.warns(UserWarning):  # peft: GPT-2's Conv1D takes fan_in_fan_out=True
        peft.get_peft_model(base, peft.LoraConfig(r=2, target_modules=["c_attn"], lora_dropout=0.0))
    adapters = [p for p in base.parameters() if p.requires_grad]
    assert adapters and all(p.dtype == torch.float32 for p in adapters)
    model = HuggingFace(base)  # the LoRA layers are injected into base
    g = torch.Generator().manual_seed(0)
    X, y = {"input_ids": torch.randint(0, 32, (4, 6), generator=g)}, torch.randint(0, 32, (4, 6), generator=g)
    lik = CrossEntropy()
    post = Laplace(model, lik, "kron", "kfac").fit([(X, y)] * 2)
    assert post.dtype == torch.float32 and bool(torch.isfinite(post.log_marginal_likelihood()))
    for probs in (post.predict(X, "glm"), post.predict(X, "mc", num_samples=3)):
        assert probs.shape == (4, 6, 32) and probs.dtype == torch.float32
        assert torch.allclose(probs.sum(-1), torch.ones(4, 6), atol=1e-4)
    frozen = {n: p.clone() for n, p in base.named_parameters() if not p.requires_grad}
    opt = GaussNewton(adapters, model=model, likelihood=lik, curvature="kfac")
    before = [p.clone() for p in adapters]
    for _ in range(2):
        assert bool(torch.isfinite(opt.step(batch=(X, y))))
    assert any(not torch.equal(a, b) for a, b in zip(adapters, before))
    mesu = MESU(adapters, model=model, mc_samples=2)
    loss_fn = CrossEntropy(reduction="sum")

    def closure():
        loss = loss_fn(model(X), y)
        loss.backward()
        return loss

    assert bool(torch.isfinite(mesu.step(closure)))
    assert all(torch.equal(p, frozen[n]) for n, p in base.named_parameters() if not p.requires_grad)


def test_vit_kronecker_compute_dtype():
    """compute_dtype on a model with attention, LayerNorm and raw parameters (class token, position table):
    KFLR of a bf16 ViT equals float64's at the rounded weights to 1e-5 (relative max error)."""
    from curvkit.architectures import vit

    m = vit(image_size=8, patch_size=4, dim=8, depth=1, heads=2, mlp_dim=8, num_classes=3, seed=0).eval().to(BF16)
    m64 = vit(image_size=8, patch_size=4, dim=8, depth=1, heads=2, mlp_dim=8, num_classes=3, seed=0).eval().double()
    m64.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    g = torch.Generator().manual_seed(0)
    X, y = torch.randn(6, 1, 8, 8, generator=g).to(BF16), torch.randint(0, 3, (6,), generator=g)
    lik = CrossEntropy()
    ref = KroneckerEstimator(m64, lik, "kflr").update((X.double(), y)).operator().to_dense()
    before = {k: v.clone() for k, v in m.state_dict().items()}
    up = KroneckerEstimator(m, lik, "kflr", compute_dtype=torch.float32).update((X, y)).operator().to_dense()
    assert up.dtype == torch.float32 and _rel(up, ref) < 1e-5
    assert all(torch.equal(v, before[k]) and v.dtype == BF16 for k, v in m.state_dict().items())
    assert _rel(KroneckerEstimator(m, lik, "kflr").update((X, y)).operator().to_dense(), ref) < 5e-2


@pytest.mark.parametrize("structure", ["kron", "diag"])
def test_laplace_fp16_model(structure):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 3)).half()
    X, y = torch.randn(8, 4).half(), torch.randint(0, 3, (8,))
    post = Laplace(m, CrossEntropy(), structure).fit((X, y))
    assert post.dtype == torch.float32 and bool(torch.isfinite(post.log_marginal_likelihood()))
    assert post.predict(X).dtype == torch.float32


def test_ekfac_bf16_model():
    """EKFAC of a bf16 model: the eigenbasis and its scalings in float32 (the per-sample rows cast to the
    basis's dtype), near float64's at the rounded weights (bf16 passes: 5e-2 relative)."""
    from curvkit.curvature.ekfac import EKFACEstimator

    m, m64 = _models()
    b, b64 = _batches(2)
    lik = CrossEntropy()
    op = EKFACEstimator(m, lik).update(b).operator()
    ref = EKFACEstimator(m64, lik).update(b64).operator()
    assert op.dtype == torch.float32
    assert _rel(op.to_dense(), ref.to_dense()) < 5e-2


@pytest.mark.parametrize("curvature", ["kron", "diag"])
def test_continual_laplace_penalty_bf16_model(curvature):
    """The continual Laplace penalty of a bf16 model: float32 curvature and value, gradients in the
    parameters' dtype, autograd's equal to the analytic one (to bf16 rounding)."""
    from curvkit.continual.laplace import LaplacePenalty

    m, _ = _models()
    b, _ = _batches(1)
    pen = LaplacePenalty(curvature=curvature, task_size=16)
    pen.on_task_end(m, b[0])
    with torch.no_grad():
        for p in m.parameters():
            p.add_(0.05)
    loss = pen.loss(m)
    assert loss.dtype == torch.float32 and float(loss) > 0
    auto = torch.autograd.grad(loss, list(m.parameters()))
    for a, g in zip(auto, pen.gradient(m)):
        assert a.dtype == g.dtype == BF16
        assert torch.allclose(a.float(), g.float(), rtol=2e-2, atol=1e-3 * float(g.abs().max()))
