"""Issue 30 §4: ``peft`` LoRA models through :class:`curvkit.hf.HuggingFace`: a ``PeftModel`` without
``task_type`` (forward(*args, **kwargs)) takes the wrapped model's keys, ``PeftModelForCausalLM`` passes
``position_ids`` on, an unwrapped peft model is refused with the fix; exact operators on the adapters equal
dense float64 references (to float32 precision:
LlamaRMSNorm computes in float32) and the Kronecker estimators cover every adapter."""

from __future__ import annotations

import warnings

import pytest
import torch

from curvkit.curvature import GGNOperator
from curvkit.curvature.estimators import KroneckerEstimator
from curvkit.hf import HuggingFace, is_transformers_model
from curvkit.likelihoods import CrossEntropy
from reference import dense_ggn_flat

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
D64 = torch.float64
pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore:GGNOperator. torch.func.vmap failed:RuntimeWarning"),
              pytest.mark.usefixtures("float64_default")]


def lora_llama(task_type, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16)
    base = transformers.LlamaForCausalLM(cfg).to(D64).eval()
    conf = peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj"], task_type=task_type,
                           init_lora_weights=False)  # random B: the adapters' curvature is not zero
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return peft.get_peft_model(base, conf)


def batch(B=2, T=4, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (B, T), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}, ids.roll(-1, 1)


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])
def test_peft_model_takes_the_wrapped_models_keys(task_type):
    model = lora_llama(task_type)
    hf = HuggingFace(model)
    X, _ = batch()
    ref = model.get_base_model()(**X).logits
    torch.testing.assert_close(hf(X), ref, atol=0, rtol=0)
    pos = torch.arange(4).expand(2, 4)
    torch.testing.assert_close(hf({**X, "position_ids": pos}), ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(hf({**X, "position_ids": pos + 1}).shape, ref.shape)
    with pytest.raises(ValueError, match="attention_masks"):
        hf({"input_ids": X["input_ids"], "attention_masks": X["attention_mask"]})
    with pytest.raises(ValueError, match="labels"):
        hf({**X, "labels": X["input_ids"]})


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])
def test_unwrapped_peft_model_is_refused_with_the_fix(task_type):
    model = lora_llama(task_type)
    assert is_transformers_model(model)
    X, y = batch()
    for build in (lambda: GGNOperator(model, CrossEntropy(), (X, y)),
                  lambda: KroneckerEstimator(model, CrossEntropy())):
        with pytest.raises(TypeError, match=r"peft-wrapped .*curvkit\.hf\.HuggingFace\(model\)"):
            build()


@pytest.mark.parametrize("task_type", [None, "CAUSAL_LM"])
def test_lora_ggn_and_kronecker_coverage(task_type):
    """The GGN over the adapters equals the dense reference; KFAC, KFLR and EKFAC give every adapter a block."""
    hf = HuggingFace(lora_llama(task_type))
    X, y = batch()
    data = ({**X, "position_ids": torch.arange(4).expand(2, 4)}, y)
    lik = CrossEntropy("sum")
    trainable = {n for n, p in hf.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    G = GGNOperator(hf, lik, data)
    ref = dense_ggn_flat(hf, lik, [data])
    # LlamaRMSNorm normalises in float32 (hidden_states.to(torch.float32)) even in a float64 model, so the
    # forward-mode products and the reverse-mode reference agree to float32 precision only (8e-8 measured)
    torch.testing.assert_close(G.to_dense(), ref, atol=1e-6 * float(ref.abs().max()), rtol=0)
    for method in ("kfac", "kflr"):
        op = KroneckerEstimator(hf, lik, method).update(data).operator()
        assert {n for b in op.blocks for n in (b.weight_name, b.bias_name) if n} == trainable
    from curvkit.curvature.ekfac import EKFACEstimator
    ek = EKFACEstimator(hf, lik).update(data).operator()
    assert ek.layout.dim == G.layout.dim


def test_lora_kflr_on_one_token_is_the_exact_ggn_block():
    """One sample, one token: each adapter's KFLR block is the exact GGN block (Lemma 3.21)."""
    hf = HuggingFace(lora_llama(None))
    X, y = batch(B=1, T=1)
    lik = CrossEntropy("sum")
    G = GGNOperator(hf, lik, (X, y)).to_dense()
    K = KroneckerEstimator(hf, lik, "kflr").update((X, y)).operator().to_dense()
    assert G.abs().max() > 1e-6
    torch.testing.assert_close(K, G * _block_mask(hf), atol=1e-6 * float(G.abs().max()), rtol=0)  # float32 norms


def _block_mask(model):
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    return torch.block_diag(*[torch.ones(s, s, dtype=D64) for s in sizes])
