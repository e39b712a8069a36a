"""Tiny random-weight ``transformers`` models as written: KFAC, KFLR and EKFAC cover 100 % of the trainable
parameters (the RMSNorm / T5LayerNorm classes and BART's offset position embedding through the per-sample
fallback of :mod:`curvkit.layerkinds.generic`; GPT-2's and BERT's (1, T) position ids without
``position_ids`` through the embedding's batch broadcast), and a Llama RMSNorm block equals the dense GGN
block (KFLR, (B, C) outputs, 1e-10)."""

from __future__ import annotations

import pytest
import torch
from tests.test_layerkinds import block, dense_ggn_positions
from torch import nn

from curvkit.curvature.ekfac import EKFACEstimator
from curvkit.curvature.estimators import KroneckerEstimator
from curvkit.hf import HuggingFace
from curvkit.laplace import Laplace
from curvkit.likelihoods import CrossEntropy
from curvkit.optim import GaussNewton

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("float64_default")
D64 = torch.float64
SMALL = dict(hidden_size=8, intermediate_size=12, num_attention_heads=2, num_key_value_heads=1,
             num_hidden_layers=1, vocab_size=11, max_position_embeddings=16)


def llama():
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**SMALL, tie_word_embeddings=False))


def qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**SMALL, tie_word_embeddings=False))


def gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=11, n_positions=16, n_embd=8, n_layer=1,
                                                                n_head=2, tie_word_embeddings=False))


def bert():
    return transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=11, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=12,
        num_labels=3, max_position_embeddings=16))


def t5():  # the encoder; its token embedding is shared with the decoder's: frozen (weight tying, issue 30 §2)
    model = transformers.T5EncoderModel(transformers.T5Config(vocab_size=11, d_model=8, d_kv=4, d_ff=12, num_layers=1,
                                                              num_heads=2))
    model.shared.requires_grad_(False)
    # its relative position bias is looked up on (T, T) buckets without a batch dimension and permuted to
    # (1, heads, T, T): an output shared by the samples that cannot be widened in place (docs/architecture.md)
    model.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.requires_grad_(False)
    return model


def bart():  # sequence classification; the shared token embedding frozen (weight tying, issue 30 §2)
    model = transformers.BartForSequenceClassification(transformers.BartConfig(
        vocab_size=11, d_model=8, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=12, decoder_ffn_dim=12, max_position_embeddings=16, num_labels=3,
        pad_token_id=1, eos_token_id=2, bos_token_id=0))
    model.model.shared.requires_grad_(False)
    return model


def batch(kind: str, B: int = 2, T: int = 5):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 11, (B, T), generator=g)
    if kind == "bart":
        ids[:, -1] = 2  # the classification head reads the last end-of-sequence token
    if kind in ("bert", "bart"):
        return {"input_ids": ids}, torch.randint(0, 3, (B,), generator=g)
    if kind == "t5":
        return {"input_ids": ids}, torch.randint(0, 8, (B, T), generator=g)
    return {"input_ids": ids}, ids.roll(-1, 1)


MODELS = {"llama": llama, "qwen2": qwen2, "gpt2": gpt2, "bert": bert, "t5": t5, "bart": bart}


@pytest.mark.parametrize("kind", list(MODELS))
def test_kronecker_estimators_cover_every_trainable_parameter(kind):
    torch.manual_seed(1)
    model = MODELS[kind]().to(D64).eval()
    hf = HuggingFace(model, output="last_hidden_state") if kind == "t5" else HuggingFace(model)
    X, y = batch(kind)
    trainable = {n for n, p in hf.named_parameters() if p.requires_grad}
    size = sum(p.numel() for p in hf.parameters() if p.requires_grad)
    for method in ("kfac", "kflr"):
        est = KroneckerEstimator(hf, CrossEntropy(), method).update((X, y))
        op = est.operator()
        covered = {n for b in op.blocks for n in (b.weight_name, b.bias_name) if n}
        assert covered == trainable and op.layout.dim == size, (method, trainable - covered)
        assert torch.isfinite(op @ torch.ones(op.layout.dim, dtype=D64)).all()
    ekfac = EKFACEstimator(hf, CrossEntropy(), "kflr").update((X, y)).operator()
    assert ekfac.layout.dim == size and torch.isfinite(ekfac @ torch.ones(size, dtype=D64)).all()
    kinds = {lp.handler.kind for lp in est.plans}
    if kind in ("llama", "qwen2", "t5", "bart"):
        assert "module" in kinds  # the norms / BART's position embedding: the per-sample fallback


def test_llama_rmsnorm_block_equals_the_dense_ggn():
    """A Llama decoder layer's RMSNorm between two Linear layers, (B, C) outputs: its block is exact."""
    torch.manual_seed(2)
    norm = transformers.models.llama.modeling_llama.LlamaRMSNorm(5)
    model = nn.Sequential(nn.Linear(4, 5), norm, nn.Tanh(), nn.Linear(5, 3)).to(D64)
    with torch.no_grad():
        norm.weight.normal_()
    X, y = torch.randn(6, 4), torch.randint(0, 3, (6,))
    G = block(dense_ggn_positions(model, CrossEntropy(), X), model, ["1.weight"])
    for structure in ("full", "diag"):
        op = KroneckerEstimator(model, CrossEntropy(), "kflr", norm_structure=structure).update((X, y)).operator()
        D = block(op.to_dense(), model, ["1.weight"])
        assert torch.allclose(D, G if structure == "full" else torch.diag(G.diagonal()), atol=1e-12)


@pytest.mark.parametrize("kind", ["llama", "bart"])
def test_gauss_newton_step_and_kronecker_laplace_on_every_parameter(kind):
    """A GaussNewton step moves every trainable parameter (norms and positions included) and a Kronecker
    Laplace posterior over all of them gives finite GLM variances (their equality with J Sigma J^T from the
    dense Jacobian is tested on a tiny model with the same kinds: tests/test_laplace_modern.py, 'recognised')."""
    torch.manual_seed(3)
    model = MODELS[kind]().to(D64).eval()
    hf = HuggingFace(model)
    X, y = batch(kind)
    params = [p for p in hf.parameters() if p.requires_grad]
    before = [p.detach().clone() for p in params]
    GaussNewton(params, model=hf, likelihood=CrossEntropy()).step(batch=(X, y))
    assert all(not torch.equal(p, b) for p, b in zip(params, before))
    post = Laplace(hf, CrossEntropy(), "kron", "kfac").fit((X, y))
    assert post.layout.dim == sum(p.numel() for p in params)
    _, V = post.functional_variance(X)
    assert torch.isfinite(V).all() and V.abs().max() > 0
