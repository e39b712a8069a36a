"""Hugging Face transformers models (tiny configurations, random weights, float64, no download) through
curvkit.hf.HuggingFace: a GPT-2-style causal LM (untied, per-token padding by labels -100), a BERT-style
sequence classifier with an attention mask, a ViT classifier. Exact products and diagonals against dense
references, Kronecker factors covering every parameter, GPT-2's Conv1D blocks against the same model written
with nn.Linear and against the exact GGN block, the adapter's calling conventions, and bad input (no logits,
missing or unknown keys, labels in the batch, tied embeddings, padding without an attention mask), with the
user's model unchanged."""

from __future__ import annotations

import copy
import math
import warnings

import pytest
import torch
from torch import Tensor, nn

from curvkit.curvature import GGNOperator, HessianOperator
from curvkit.curvature.estimators import DiagonalEstimator, KroneckerEstimator
from curvkit.hf import HuggingFace, is_transformers_model
from curvkit.laplace import Laplace
from curvkit.layerkinds import TransposedLinearHandler, handler_for
from curvkit.likelihoods import CrossEntropy
from curvkit.linalg.layout import ParamLayout
from curvkit.structure import UnsupportedModelError
from reference import dense_ggn_flat, dense_hessian_ror, flat_model

transformers = pytest.importorskip("transformers")

D64 = torch.float64
ATOL = 1e-10
pytestmark = [pytest.mark.filterwarnings("ignore:GGNOperator. torch.func.vmap failed:RuntimeWarning"),
              pytest.mark.usefixtures("float64_default")]  # (transformers 4.46 builds masks in the default dtype)


# ---------------------------------------------------------------------------------------------- tiny models
def gpt2(tie: bool = False, seed: int = 0, layers: int = 1) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=11, n_positions=8, n_embd=8, n_layer=layers, n_head=2,
                                  pad_token_id=0, bos_token_id=1, eos_token_id=2, tie_word_embeddings=tie)
    return transformers.GPT2LMHeadModel(cfg).to(D64).eval()


def bert(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=13, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                  intermediate_size=16, num_labels=3, max_position_embeddings=8, pad_token_id=0)
    return transformers.BertForSequenceClassification(cfg).to(D64).eval()


def vit(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    cfg = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=1, hidden_size=8, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=16, num_labels=4)
    return transformers.ViTForImageClassification(cfg).to(D64).eval()


def lm_batch(B: int = 3, T: int = 5, V: int = 11, seed: int = 0, short: int = 3):
    """Right-padded token ids (sample 0 has ``short`` tokens), its mask, batch-shaped position ids, and the
    next-token labels with -100 at the last position and the padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    mask[0, short:] = 0
    ids[0, short:] = 0
    y = ids.roll(-1, 1)
    y[:, -1] = -100
    y[0, short - 1:] = -100
    return {"input_ids": ids, "attention_mask": mask, "position_ids": torch.arange(T).expand(B, T)}, y


def cls_batch(B: int = 3, T: int = 5, V: int = 13, seed: int = 0):
    X, _ = lm_batch(B, T, V, seed)
    return X, torch.randint(0, 3, (B,), generator=torch.Generator().manual_seed(seed + 1))


def image_batch(B: int = 3, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return {"pixel_values": torch.randn(B, 1, 8, 8, generator=g, dtype=D64)}, torch.randint(0, 4, (B,), generator=g)


def state(model: nn.Module):
    """Everything a curvature computation must leave alone."""
    return ({k: v.clone() for k, v in model.state_dict().items()}, [m.training for m in model.modules()],
            [(id(p), p.requires_grad) for p in model.parameters()], model.config.to_dict(),
            [(len(m._forward_hooks), len(m._forward_pre_hooks)) for m in model.modules()])


def assert_same_state(model: nn.Module, before) -> None:
    after = state(model)
    assert after[1:] == before[1:]
    for k in before[0]:
        torch.testing.assert_close(after[0][k], before[0][k], atol=0, rtol=0)


def probe(d: int, k: int = 2, seed: int = 0) -> Tensor:
    return torch.randn(d, k, generator=torch.Generator().manual_seed(seed), dtype=D64)


# ---------------------------------------------------------------------------------------------- the adapter
def test_adapter_calling_conventions_and_output():
    model = gpt2()
    hf = HuggingFace(model)
    X, _ = lm_batch()
    with torch.no_grad():
        ref = model(**X).logits
        for out in (hf(X), hf(**X), hf(X["input_ids"], attention_mask=X["attention_mask"],
                                         position_ids=X["position_ids"])):
            assert isinstance(out, Tensor)
            torch.testing.assert_close(out, ref, atol=0, rtol=0)
        hidden = HuggingFace(transformers.GPT2Model(model.config).eval(), output="last_hidden_state")(X)
    assert hidden.shape == (3, 5, 8)
    assert dict(hf.named_parameters()).keys() == {f"model.{n}" for n, _ in model.named_parameters()}
    assert all(p is q for p, q in zip(hf.parameters(), model.parameters()))  # wrapped, not copied
    assert is_transformers_model(model) and not is_transformers_model(hf)
    with pytest.raises(ValueError, match=r"not parameters of ViTForImageClassification.forward.*pixel_values"):
        HuggingFace(vit(), dropout=0.0)  # its **kwargs are declared (TransformersKwargs): checked against them
    assert HuggingFace(vit(), output_attentions=True)._fixed == {"return_dict": True, "output_attentions": True}
    with pytest.raises(ValueError, match="given both"):
        hf(X, input_ids=X["input_ids"])
    with pytest.raises(TypeError, match=r"mapping of tensors .* or one tensor"):
        hf([X["input_ids"]])
    with pytest.raises(TypeError, match=r"batch entries \['output_attentions'\] are not tensors.*constructor"):
        hf({**X, "output_attentions": True})


# ---------------------------------------------------------------------------------------------- exact operators
@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_gpt2_exact_products_and_diagonal_equal_dense_references(reduction):
    """Per-token cross-entropy with padding (labels -100, attention mask): GGN and Hessian products, the GGN
    diagonal (per-sample rows over mapping samples) equal the dense references."""
    hf = HuggingFace(gpt2(seed=1))
    data = lm_batch(seed=2)
    lik = CrossEntropy(reduction, ignore_index=-100)
    G = GGNOperator(hf, lik, data)
    ref = dense_ggn_flat(hf, lik, data)
    V = probe(G.layout.dim)
    assert G.num_terms == 2 + 4 + 4
    torch.testing.assert_close(G @ V, ref @ V, atol=ATOL, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # HF's mask code cannot be vmapped: a loop over samples
        torch.testing.assert_close(G.diagonal().flat, ref.diagonal(), atol=ATOL, rtol=0)
    H = HessianOperator(hf, lik, data)
    torch.testing.assert_close(H @ V, dense_hessian_ror(hf, lik, data) @ V, atol=ATOL, rtol=0)


def test_gpt2_right_padding_equals_the_truncated_sequence():
    """A padded position (label -100, mask 0) adds no curvature: the padded batch's GGN equals that of the same
    data with sample 0 cut to its tokens (two batches), products and diagonal; the forward-mode pass takes the
    16-sample batch in pieces."""
    hf = HuggingFace(gpt2(seed=3))
    (X, y) = lm_batch(B=16, seed=4)
    lik = CrossEntropy("mean", ignore_index=-100)
    cut = ({k: v[:1, :3] for k, v in X.items()}, y[:1, :3])
    rest = ({k: v[1:] for k, v in X.items()}, y[1:])
    padded, split = GGNOperator(hf, lik, (X, y)), GGNOperator(hf, lik, [cut, rest])
    V = probe(padded.layout.dim, seed=1)
    assert padded.num_terms == split.num_terms == 2 + 15 * 4
    torch.testing.assert_close(padded @ V, split @ V, atol=ATOL, rtol=0)
    assert padded._split_tangents  # the pieces gave the whole batch's outputs


def test_bert_classifier_with_attention_mask_equals_dense_references():
    hf = HuggingFace(bert(seed=1))
    data = cls_batch(seed=3)
    lik = CrossEntropy("mean")
    G = GGNOperator(hf, lik, data)
    ref = dense_ggn_flat(hf, lik, data)
    V = probe(G.layout.dim)
    torch.testing.assert_close(G @ V, ref @ V, atol=ATOL, rtol=0)
    est = DiagonalEstimator(hf, lik, "ggn").update(data)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        torch.testing.assert_close(est.operator().flat, ref.diagonal(), atol=ATOL, rtol=0)
    H = HessianOperator(hf, lik, data)
    torch.testing.assert_close(H @ V, dense_hessian_ror(hf, lik, data) @ V, atol=ATOL, rtol=0)


def test_vit_classifier_equals_dense_references_with_either_batch_form():
    hf = HuggingFace(vit(seed=2))
    X, y = image_batch(seed=5)
    lik = CrossEntropy("sum")
    ref = dense_ggn_flat(hf, lik, (X, y))
    V = probe(ref.shape[0])
    for inputs in (X, X["pixel_values"]):  # a mapping, or the main input as one tensor
        G = GGNOperator(hf, lik, (inputs, y))
        torch.testing.assert_close(G @ V, ref @ V, atol=ATOL, rtol=0)
    torch.testing.assert_close(G.diagonal().flat, ref.diagonal(), atol=ATOL, rtol=0)
    H = HessianOperator(hf, lik, (X, y))
    torch.testing.assert_close(H @ V, dense_hessian_ror(hf, lik, (X, y)) @ V, atol=ATOL, rtol=0)


# ---------------------------------------------------------------------------------------------- Kronecker
def _names(est: KroneckerEstimator) -> set[str]:
    return {n for b in est.operator().blocks for n in (b.weight_name, b.bias_name) if n}


@pytest.mark.parametrize("sharing", ["expand", "reduce"])
@pytest.mark.parametrize("which", ["gpt2", "bert", "vit"])
def test_kronecker_factors_cover_every_parameter(which, sharing):
    """kfac and kflr on each model: one block per layer kind's block, every trainable parameter in exactly one,
    finite, and the model unchanged (its hooks removed)."""
    model = {"gpt2": gpt2, "bert": bert, "vit": vit}[which]()
    data = {"gpt2": lm_batch, "bert": cls_batch, "vit": image_batch}[which]()
    hf = HuggingFace(model)
    before = state(model)
    lik = CrossEntropy("mean", ignore_index=-100)
    for method in ("kfac", "kflr"):
        est = KroneckerEstimator(hf, lik, method, weight_sharing=sharing).update(data)
        K = est.operator()
        assert _names(est) == {n for n, _ in hf.named_parameters()}
        assert torch.isfinite(K @ torch.ones(K.layout.dim, dtype=D64)).all()
    if which == "gpt2":
        kinds = {lp.label: lp.handler.kind for lp in est.plans}
        assert kinds["model.transformer.h.0.attn.c_attn"] == "transposed_linear"
        assert kinds["model.lm_head"] == "linear"
    assert_same_state(model, before)


def linear_twin(model: nn.Module) -> nn.Module:
    """A copy of the GPT-2 with every Conv1D replaced by nn.Linear(in, out) holding W^T and b."""
    twin = copy.deepcopy(model)
    for name, mod in list(twin.named_modules()):
        if type(mod).__name__ == "Conv1D":
            lin = nn.Linear(*mod.weight.shape, dtype=D64)
            with torch.no_grad():
                lin.weight.copy_(mod.weight.T)
                lin.bias.copy_(mod.bias)
            parent, _, attr = name.rpartition(".")
            setattr(twin.get_submodule(parent), attr, lin)
    return twin


def _transpose_conv(model: nn.Module, tensors: list[Tensor]) -> list[Tensor]:
    """Parameter-shaped tensors of the Conv1D model <-> of its Linear twin (the Conv1D weights transposed)."""
    conv = {f"model.{n}.weight" for n, m in model.named_modules() if type(m).__name__ == "Conv1D"}
    names = [n for n, _ in HuggingFace(model).named_parameters()]
    return [t.T if n in conv else t for n, t in zip(names, tensors)]


@pytest.mark.parametrize("method,sharing", [("kflr", "expand"), ("kflr", "reduce"), ("kfac", "expand"),
                                            ("empirical", "reduce")])
def test_conv1d_blocks_equal_the_linear_blocks_of_the_transposed_weight(method, sharing):
    model = gpt2(seed=4, layers=2)
    twin = linear_twin(model)
    data = lm_batch(seed=6)
    lik = CrossEntropy("mean", ignore_index=-100)
    with torch.no_grad():
        torch.testing.assert_close(HuggingFace(twin)(data[0]), HuggingFace(model)(data[0]), atol=1e-13, rtol=0)
    K = KroneckerEstimator(HuggingFace(model), lik, method, weight_sharing=sharing, seed=2).update(data).operator()
    R = KroneckerEstimator(HuggingFace(twin), lik, method, weight_sharing=sharing, seed=2).update(data).operator()
    assert len(K.blocks) == len(R.blocks)
    for a, b in zip(K.blocks, R.blocks):
        assert a.weight_name == b.weight_name
        torch.testing.assert_close(a.G, b.G, atol=1e-12, rtol=0)
        torch.testing.assert_close(a.A, b.A, atol=1e-12, rtol=0)
    g = torch.Generator().manual_seed(3)
    v = [torch.randn(p.shape, generator=g, dtype=D64) for p in HuggingFace(twin).parameters()]
    Kv = K @ _transpose_conv(model, v)
    for x, y in zip(_transpose_conv(model, Kv), R @ v):
        torch.testing.assert_close(x, y, atol=1e-12, rtol=0)
    inv = K.inverse(damping=1e-2) @ _transpose_conv(model, v)
    for x, y in zip(_transpose_conv(model, inv), R.inverse(damping=1e-2) @ v):
        torch.testing.assert_close(x, y, atol=1e-10, rtol=0)


def test_conv1d_kflr_on_one_token_is_the_exact_ggn_block():
    """One datum, one position: every Conv1D block of KFLR equals the exact GGN's block of its weight and
    bias (thesis Lemma 3.21), read through the block's (in, out) index."""
    hf = HuggingFace(gpt2(seed=5))
    X = {"input_ids": torch.tensor([[4]]), "attention_mask": torch.ones(1, 1, dtype=torch.long),
         "position_ids": torch.zeros(1, 1, dtype=torch.long)}
    y = torch.tensor([[7]])
    lik = CrossEntropy("sum")
    G = GGNOperator(hf, lik, (X, y)).to_dense()
    K = KroneckerEstimator(hf, lik, "kflr").update((X, y)).operator().to_dense()
    lay = ParamLayout.from_module(hf)
    sl = lay.slices()
    conv = [n for n, m in hf.named_modules() if type(m).__name__ == "Conv1D"]
    assert len(conv) == 4
    for name in conv:
        idx = torch.cat([torch.arange(sl[f"{name}.{p}"].start, sl[f"{name}.{p}"].stop) for p in ("weight", "bias")])
        block = G[idx[:, None], idx[None, :]]
        assert block.abs().max() > 1e-6
        torch.testing.assert_close(K[idx[:, None], idx[None, :]], block, atol=1e-12, rtol=0)


def _explicit(op):
    """The operator with every structured block index replaced by its int64 positions (the map before
    StridedIndex)."""
    from curvkit.linalg.kron import KroneckerBlock, KroneckerOperator, StridedIndex

    return KroneckerOperator(op.layout, [KroneckerBlock(
        b.G, b.A, b.weight_name, b.bias_name, b.index.materialize() if isinstance(b.index, StridedIndex) else b.index,
        b.label, b.factored) for b in op.blocks], op.damping)


def test_conv1d_and_embedding_blocks_are_strided_views_equal_to_the_explicit_maps(tmp_path):
    """GPT-2's Conv1D and embedding blocks hold a StridedIndex (the transposed view), no integer tensor of a
    block's size is referenced by the operator after products, and the KFAC operator (products, diagonal,
    inverse products) and the Kronecker Laplace posterior (precision, samples) equal those of the explicit
    int64 maps; the posterior's state_dict round-trips through a weights_only=True checkpoint."""
    from curvkit.checkpoint import load, save
    from curvkit.linalg.kron import StridedIndex
    from reference import int_tensors

    hf = HuggingFace(gpt2(seed=4, layers=2))
    data = lm_batch(seed=6)
    est = KroneckerEstimator(hf, CrossEntropy("mean", ignore_index=-100), "kfac", seed=2).update(data)
    K = est.operator()
    kinds = {lp.label: lp.handler.kind for lp in est.plans}
    strided = [b for b in K.blocks if isinstance(b.index, StridedIndex)]
    assert {b.weight_name.rpartition(".")[0] for b in strided} == {
        n for n, k in kinds.items() if k in ("transposed_linear", "embedding")}
    assert len(strided) == 2 * 4 + 2  # 4 Conv1D per layer; wte, wpe
    E = _explicit(K)
    v = probe(K.layout.dim, 3, seed=1)
    torch.testing.assert_close(K @ v, E @ v, atol=0, rtol=0)
    torch.testing.assert_close(K.diagonal().to_dense(), E.diagonal().to_dense(), atol=0, rtol=0)
    torch.testing.assert_close(K.inverse(1e-2) @ v, E.inverse(1e-2) @ v, atol=1e-10, rtol=0)
    torch.testing.assert_close(K.inverse(1e-2, method="factored") @ v, E.inverse(1e-2, method="factored") @ v,
                               atol=1e-10, rtol=0)
    smallest = min(b.out_dim * b.in_dim for b in strided)
    assert not [t.shape for t in int_tensors(K) if t.numel() >= smallest]
    assert [t.shape for t in int_tensors(E) if t.numel() >= smallest]  # (the check sees explicit maps)

    lik = CrossEntropy(ignore_index=-100)
    post = Laplace(hf, lik, "kron", curvature="kflr", prior_form="exact", prior_precision=0.5).fit(data)
    ref = KroneckerEstimator(hf, CrossEntropy("sum", ignore_index=-100), "kflr").update(
        data).operator()
    eye = torch.eye(ref.layout.dim, dtype=D64)
    torch.testing.assert_close(post.precision().to_dense(), _explicit(ref).to_dense() + 0.5 * eye, atol=1e-10, rtol=0)
    save(post.state_dict(), tmp_path / "post.pt")
    loaded = Laplace(hf, lik, "kron", curvature="kflr", prior_form="exact", prior_precision=0.5)
    loaded.load_state_dict(load(tmp_path / "post.pt"))
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    torch.testing.assert_close(loaded.sample(3, generator=g1), post.sample(3, generator=g2), atol=0, rtol=0)
    torch.testing.assert_close(loaded.precision().to_dense(), post.precision().to_dense(), atol=0, rtol=0)


@pytest.mark.parametrize("which,layers", [("bert", ("model.bert.pooler.dense", "model.classifier")),
                                          ("vit", ("model.classifier",))])
def test_kflr_blocks_of_the_heads_are_the_exact_ggn_blocks_for_one_sample(which, layers):
    """One sample: the Linear layers applied once per sample (BERT's pooler and classifier, ViT's classifier
    on the class token) have KFLR blocks equal to the exact GGN's blocks of their [W | b] (thesis Lemma 3.21)."""
    model, data = {"bert": (bert(seed=7), cls_batch(B=1, seed=9)), "vit": (vit(seed=7), image_batch(B=1, seed=9))}[which]
    hf = HuggingFace(model)
    lik = CrossEntropy("sum")
    G = GGNOperator(hf, lik, data).to_dense()
    K = KroneckerEstimator(hf, lik, "kflr").update(data).operator().to_dense()
    sl = ParamLayout.from_module(hf).slices()
    for name in layers:
        idx = torch.cat([torch.arange(sl[f"{name}.{p}"].start, sl[f"{name}.{p}"].stop) for p in ("weight", "bias")])
        block = G[idx[:, None], idx[None, :]]
        assert block.abs().max() > 1e-6
        torch.testing.assert_close(K[idx[:, None], idx[None, :]], block, atol=1e-12, rtol=0)


def test_conv1d_handler_is_registered_on_first_sight():
    conv = transformers.pytorch_utils.Conv1D(6, 4)
    handler, why = handler_for(conv)
    assert isinstance(handler, TransposedLinearHandler) and why is None

    class Custom(transformers.pytorch_utils.Conv1D):
        def forward(self, x):
            return super().forward(x) * 2

    handler, why = handler_for(Custom(6, 4))
    assert handler is None and "own forward" in why


# ---------------------------------------------------------------------------------------------- bad input
def test_a_raw_transformers_model_is_refused_with_the_fix():
    model = gpt2()
    data = lm_batch()
    for build in (lambda: GGNOperator(model, CrossEntropy(ignore_index=-100), data),
                  lambda: KroneckerEstimator(model, CrossEntropy()), lambda: DiagonalEstimator(model, CrossEntropy())):
        with pytest.raises(TypeError, match=r"GPT2LMHeadModel is a Hugging Face transformers model.*"
                                            r"curvkit.hf.HuggingFace\(model\)"):
            build()


def test_output_without_logits_names_what_it_has():
    base = transformers.GPT2Model(gpt2().config).eval()
    before = state(base)
    X, y = lm_batch()
    with pytest.raises(ValueError, match=r"HuggingFace\(GPT2Model\): the model's output "
                                         r"\(BaseModelOutputWithPastAndCrossAttentions\) has no 'logits' tensor "
                                         r"\(its tensor entries: 'last_hidden_state'\)"):
        GGNOperator(HuggingFace(base), CrossEntropy(ignore_index=-100), (X, y))
    assert_same_state(base, before)


@pytest.mark.parametrize("batch,error,match", [
    ({"attention_mask": torch.ones(3, 5, dtype=torch.long)}, ValueError,
     r"the batch has no 'input_ids' or 'inputs_embeds', which GPT2LMHeadModel.forward needs; got "
     r"\{'attention_mask': \(3, 5\)\}"),
    ({"input_ids": torch.ones(3, 5, dtype=torch.long), "attention_masks": torch.ones(3, 5)}, ValueError,
     r"key\(s\) \['attention_masks'\] that GPT2LMHeadModel.forward does not take \(it takes: input_ids, .*"
     r"attention_mask"),
    ({"input_ids": torch.ones(3, 5, dtype=torch.long), "labels": torch.ones(3, 5, dtype=torch.long)}, ValueError,
     r"holds 'labels'.*y of the \(X, y\) pair"),
    ({"input_ids": torch.ones(3, 5, dtype=torch.long), "use_cache": torch.ones(3, 1)}, ValueError,
     r"\['use_cache'\] are fixed by the adapter"),
])
def test_batches_without_the_needed_keys_are_refused(batch, error, match):
    """Refused before the model runs (no forward call), nothing in the model changed."""
    model = gpt2()
    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    before = state(model)
    y = torch.zeros(3, 5, dtype=torch.long)
    with pytest.raises(error, match=match):
        GGNOperator(HuggingFace(model), CrossEntropy(), (batch, y))
    assert not calls
    assert_same_state(model, before)


class TwoInputs(nn.Module):
    """A keyword-batch model whose forward requires two inputs (no defaults) and returns a mapping."""

    def __init__(self):
        super().__init__()
        self.embed, self.types, self.head = nn.Embedding(7, 4), nn.Embedding(2, 4), nn.Linear(4, 3)
        self.calls = 0

    def forward(self, input_ids, token_type_ids, attention_mask=None):
        self.calls += 1
        return {"logits": self.head(self.embed(input_ids) + self.types(token_type_ids)).mean(1)}


def test_required_forward_arguments_are_read_from_the_signature():
    model = TwoInputs()
    ids = torch.randint(0, 7, (3, 4), generator=torch.Generator().manual_seed(0))
    y = torch.tensor([0, 2, 1])
    with pytest.raises(ValueError, match=r"HuggingFace\(TwoInputs\): the batch has no \['token_type_ids'\], which "
                                         r"TwoInputs.forward requires \(parameters without a default\); got "
                                         r"\{'input_ids': \(3, 4\)\}"):
        GGNOperator(HuggingFace(model), CrossEntropy(), ({"input_ids": ids}, y))
    assert model.calls == 0
    X = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids)}
    hf = HuggingFace(model)
    G = GGNOperator(hf, CrossEntropy(), (X, y))
    V = probe(G.layout.dim)
    torch.testing.assert_close(G @ V, dense_ggn_flat(hf, CrossEntropy(), (X, y)) @ V, atol=ATOL, rtol=0)
    fixed = HuggingFace(model, token_type_ids=torch.zeros(1, 4, dtype=torch.long))  # fixed by an option instead
    assert fixed._required == ("input_ids",)


def test_padded_batch_without_attention_mask_is_refused():
    model = gpt2()
    before = state(model)
    X, y = lm_batch()
    lik = CrossEntropy(ignore_index=-100)
    unmasked = {"input_ids": X["input_ids"], "position_ids": X["position_ids"]}
    for build in (lambda: GGNOperator(HuggingFace(model), lik, (unmasked, y)),
                  lambda: KroneckerEstimator(HuggingFace(model), lik).update((unmasked, y))):
        with pytest.raises(ValueError, match=r"input_ids contain the padding id 0 \(config.pad_token_id\) at 2 "
                                             r"position\(s\) but the batch has no attention_mask"):
            build()
    assert_same_state(model, before)
    full = {"input_ids": X["input_ids"].clamp_min(1), "position_ids": X["position_ids"]}
    GGNOperator(HuggingFace(model), lik, (full, y))  # no padding id: no mask needed
    GGNOperator(HuggingFace(model), lik, ({**unmasked, "attention_mask": torch.ones(3, 5, dtype=torch.long)}, y))


def test_tied_embeddings_name_both_uses_and_the_fix_and_exact_operators_take_them():
    model = gpt2(tie=True, seed=2)
    hf = HuggingFace(model)
    before = state(model)
    data = lm_batch(seed=1)
    lik = CrossEntropy("mean", ignore_index=-100)
    # the Kronecker estimators: the sum of the two uses' terms (tests/test_shared_weights.py)
    op = KroneckerEstimator(hf, lik).update(data).operator()
    assert [b.name for b in op.blocks if "model.transformer.wte.weight" in b.names] == [
        "model.transformer.wte + model.lm_head"]
    assert_same_state(model, before)
    G = GGNOperator(hf, lik, data)  # the tied parameter is one parameter of the exact operators
    assert G.layout.dim == sum(p.numel() for p in model.parameters())
    assert model.lm_head.weight is model.transformer.wte.weight
    V = probe(G.layout.dim)
    ref = dense_ggn_flat(hf, lik, data)
    torch.testing.assert_close(G @ V, ref @ V, atol=ATOL, rtol=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        torch.testing.assert_close(DiagonalEstimator(hf, lik, "ggn").update(data).operator().flat, ref.diagonal(),
                                   atol=ATOL, rtol=0)
    H = HessianOperator(hf, lik, data)
    torch.testing.assert_close(H @ V, dense_hessian_ror(hf, lik, data) @ V, atol=ATOL, rtol=0)
    assert_same_state(model, before)


def test_errors_inside_the_engine_leave_the_model_as_it_was():
    """Refusals raised while the engine runs the model (a training-mode model with dropout; position ids
    without the batch dimension met by a capture that does not know the batch size; an option the forward does not take): the model keeps
    its parameters, buffers, train/eval flags, requires_grad flags, configuration and hooks."""
    X, y = lm_batch()
    lik = CrossEntropy(ignore_index=-100)
    model = gpt2().train()
    before = state(model)
    for build in (lambda: GGNOperator(HuggingFace(model), lik, (X, y)),
                  lambda: KroneckerEstimator(HuggingFace(model), lik).update((X, y)),
                  lambda: DiagonalEstimator(HuggingFace(model), lik, "ggn").update((X, y))):
        with pytest.raises(UnsupportedModelError, match=r"'model.transformer.drop' \(Dropout\) is random in "
                                                        r"training mode.*model.eval\(\)"):
            build()
    assert_same_state(model, before)
    assert model.training
    model = gpt2()
    before = state(model)
    no_positions = {k: v for k, v in X.items() if k != "position_ids"}
    # without position_ids GPT-2 looks up (1, T) positions: every sample gets its rows (the same blocks)
    est = KroneckerEstimator(HuggingFace(model), lik).update((no_positions, y))
    ref = KroneckerEstimator(HuggingFace(model), lik).update((X, y))
    torch.testing.assert_close(est.operator().to_dense(), ref.operator().to_dense(), atol=1e-13, rtol=0)
    with est.capture() as cap:  # a bare capture does not know the batch size: refused
        f = HuggingFace(model)(no_positions)
    with pytest.raises(UnsupportedModelError, match=r"'model.transformer.wpe' \(Embedding\) does not run on its "
                                                    r"inputs with the samples first; its first dimension \(1\) is "
                                                    r"not the batch \(3\)"):
        est.accumulate(cap, f, y)
    assert_same_state(model, before)
    model = bert()
    before = state(model)
    with pytest.raises(ValueError, match=r"option\(s\) \['dropout'\] are not parameters of "
                                         r"BertForSequenceClassification.forward"):
        HuggingFace(model, dropout=0.0)  # (declared **kwargs: checked; GPT-2's undeclared ones take anything)
    assert_same_state(model, before)


# ---------------------------------------------------------------------------------------------- consumers
#: Per model: its tensor batch (the main input alone: token ids without padding, or pixel values) and the
#: parameters GaussNewton and Kronecker Laplace take on this branch (nn.Linear [W | b] blocks; Conv1D,
#: Embedding, LayerNorm and position-embedding blocks are read through an index those consumers refuse here).
CONSUMERS = {
    "gpt2": (lambda: gpt2(seed=6), lambda: lm_batch(B=6, seed=8), ("lm_head",)),
    "bert": (lambda: bert(seed=6), lambda: cls_batch(B=6, seed=8), ("query", "key", "value", "dense", "classifier")),
    "vit": (lambda: vit(seed=3), lambda: image_batch(B=6, seed=7), ("classifier", "mlp.fc", "intermediate.dense",
                                                                    "output.dense")),
}


def tensor_batch(data):
    """The main input alone as one tensor (hf(tensor)); token ids with the padding id replaced (no mask)."""
    X, y = data
    return (X["input_ids"].clamp_min(1), y) if "input_ids" in X else (X["pixel_values"], y)


@pytest.mark.parametrize("which", ["gpt2", "bert", "vit"])
def test_gauss_newton_steps_on_the_linear_layers_of_each_model(which):
    """Three KFLR Gauss-Newton steps (hf called with the main input as one tensor: integer token ids or pixel
    values) on the model's nn.Linear layers lower the loss and leave every frozen parameter, buffer and flag
    alone."""
    from curvkit.optim import GaussNewton

    build, batch, keep = CONSUMERS[which]
    model = build()
    hf = HuggingFace(model)
    for n, p in hf.named_parameters():
        p.requires_grad_(any(k in n for k in keep))
    assert any(p.requires_grad for p in hf.parameters()) and not all(p.requires_grad for p in hf.parameters())
    frozen = {n: p.detach().clone() for n, p in hf.named_parameters() if not p.requires_grad}
    X, y = tensor_batch(batch())
    lik = CrossEntropy(ignore_index=-100)
    with torch.no_grad():
        start = float(lik(hf(X), y))
    opt = GaussNewton(hf.parameters(), model=hf, likelihood=lik, curvature="kflr")
    for _ in range(3):
        opt.step(batch=(X, y))
    with torch.no_grad():
        assert float(lik(hf(X), y)) < start - 0.02  # (gpt2 2.40 -> 1.33, bert 1.10 -> 1.04, vit 1.38 -> 1.33)
    for n, p in hf.named_parameters():
        if n in frozen:
            torch.testing.assert_close(p.detach(), frozen[n], atol=0, rtol=0)


@pytest.mark.parametrize("which", ["gpt2", "bert", "vit"])
def test_laplace_fits_on_each_model(which):
    """Full GGN Laplace over EVERY parameter (Conv1D, attention, LayerNorm, embeddings): the precision is the
    prior plus the dense reference GGN of the summed loss. Also the diagonal GGN Laplace (the reference's
    diagonal; GPT-2's per-token outputs included), and Kronecker Laplace on the nn.Linear layers
    (prior_form='exact': the prior plus the KFLR estimator's operator of the summed loss; finite log marginal
    likelihood). The model is left as it was."""
    from curvkit.laplace import Laplace

    build, batch, keep = CONSUMERS[which]
    model = build()
    hf = HuggingFace(model)
    data = tensor_batch(batch())
    lik = CrossEntropy(ignore_index=-100)
    before = state(model)
    G = dense_ggn_flat(hf, CrossEntropy("sum", ignore_index=-100), data)
    eye = torch.eye(G.shape[0], dtype=D64)
    full = Laplace(hf, lik, structure="full", curvature="ggn", prior_precision=0.5).fit(data)
    torch.testing.assert_close(full.precision().to_dense(), G + 0.5 * eye, atol=1e-10, rtol=0)
    assert_same_state(model, before)
    diag = Laplace(hf, lik, structure="diag", curvature="ggn", prior_precision=0.5).fit(data)
    torch.testing.assert_close(diag.precision().to_dense().diagonal(), G.diagonal() + 0.5, atol=1e-10, rtol=0)
    for n, p in hf.named_parameters():
        p.requires_grad_(any(k in n for k in keep))
    kron = Laplace(hf, lik, structure="kron", prior_form="exact", prior_precision=0.5).fit(data)
    K = KroneckerEstimator(hf, CrossEntropy("sum", ignore_index=-100), "kflr").update(data).operator().to_dense()
    torch.testing.assert_close(kron.precision().to_dense(), K + 0.5 * torch.eye(K.shape[0], dtype=D64),
                               atol=1e-10, rtol=0)
    assert torch.isfinite(kron.log_marginal_likelihood())


#: Per model: a mapping batch (text: right-padded input_ids with their attention_mask and batch-shaped position
#: ids, GPT-2's targets -100 at the padding and the last position; ViT: pixel_values) and the module left frozen
#: (the token embedding; the ViT's patch projection).
MAPPING = {
    "gpt2": (lambda: gpt2(seed=6), lambda: lm_batch(B=4, seed=8), "transformer.wte"),
    "bert": (lambda: bert(seed=6), lambda: cls_batch(B=4, seed=8), "word_embeddings"),
    "vit": (lambda: vit(seed=3), lambda: image_batch(B=4, seed=7), "patch_embeddings.projection"),
}


def flat_trainable(model: nn.Module) -> Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters() if p.requires_grad])


@pytest.mark.parametrize("which", ["gpt2", "bert", "vit"])
def test_gauss_newton_steps_on_mapping_batches_equal_the_dense_reference_step(which):
    """GaussNewton.step(batch=(mapping, y)) on EVERY layer but a frozen one (text: the token embedding, with the
    attention mask in the batch; ViT: the patch projection, its raw class token and position table running as
    per-sample copies of the mapping's samples): one step (KFLR, exact damped inverse, weight decay, the three zeta candidates, rho)
    is the dense float64 step: the direction d = (K + (lambda + zeta) I)^{-1} (g + lambda theta) with K the
    estimator's Kronecker curvature on the mapping batch, alpha* = -d^T g_E / d^T (G + (lambda + tau) I) d
    with the dense exact GGN G (Eqs. 4.17-4.20), the zeta of the smallest q among the three, the loss before
    and after the step of the model called on the whole dict. Three steps lower the loss; the frozen
    parameter, buffers, flags, configuration and hooks are left alone."""
    from curvkit.optim import GaussNewton

    build, batch, frozen_name = MAPPING[which]
    model = build()
    hf = HuggingFace(model)
    for n, p in hf.named_parameters():
        p.requires_grad_(frozen_name not in n)
    before = state(model)
    frozen = {n: p.detach().clone() for n, p in hf.named_parameters() if not p.requires_grad}
    assert len(frozen) in (1, 2)  # (a weight, or a layer's weight and bias)
    X, y = batch()
    if which != "vit":  # padded: masked positions (and GPT-2's -100 targets)
        assert (X["attention_mask"] == 0).any() and ((y == -100).any() or which == "bert")
    lik = CrossEntropy(ignore_index=-100)
    wd, tau, zeta = 1e-3, 0.5, 2.0
    # dense references at theta0 (the model called on the whole dict)
    f, theta0 = flat_model(hf)
    E = lambda th: lik(f(th, X), y) + 0.5 * wd * th.pow(2).sum()  # noqa: E731
    gE = torch.func.grad(E)(theta0)
    G = dense_ggn_flat(hf, lik, (X, y))
    K = KroneckerEstimator(hf, lik, "kflr").update((X, y)).operator().to_dense()
    eye = torch.eye(theta0.numel(), dtype=D64)
    opt = GaussNewton(hf.parameters(), model=hf, likelihood=lik, curvature="kflr", inversion="eigen",
                      weight_decay=wd, tau=tau, zeta=zeta, tau_every=1, zeta_every=1, omega_zeta=0.5)
    E0 = float(opt.step(batch=(X, y)))
    rec = opt.history[-1]
    theta1 = flat_trainable(hf)
    # the three candidate directions and their quadratic models, densely
    q = {}
    for z in (zeta, 0.5 * zeta, zeta / 0.5):
        d = torch.linalg.solve(K + (wd + z) * eye, gE)
        dCd = float(d @ (G + (wd + tau) * eye) @ d)
        alpha = -float(d @ gE) / dCd
        q[z] = (alpha, alpha * float(d @ gE) + 0.5 * alpha**2 * dCd, d)
    best = min(q, key=lambda z: q[z][1])
    alpha, predicted, d = q[best]
    assert rec["zeta"] == best and opt.zeta == best
    assert rec["alpha"] == pytest.approx(alpha, rel=1e-9)
    assert rec["predicted_change"] == pytest.approx(predicted, rel=1e-9)
    torch.testing.assert_close(theta1 - theta0, alpha * d, atol=1e-10, rtol=0)
    assert E0 == pytest.approx(float(E(theta0)), rel=1e-12)
    assert rec["loss_after"] == pytest.approx(float(E(theta1)), rel=1e-12)
    for _ in range(2):
        opt.step(batch=(X, y))
    assert float(E(flat_trainable(hf))) < E0 - 0.02  # (gpt2 2.401 -> 1.719, bert 1.110 -> 1.059, vit 1.394 -> 1.128)
    for n, p in hf.named_parameters():
        if n in frozen:
            torch.testing.assert_close(p.detach(), frozen[n], atol=0, rtol=0)
    after = state(model)
    assert after[1:] == before[1:]
    for k, v in before[0].items():
        if not any(k == n.removeprefix("model.") for n, p in hf.named_parameters() if p.requires_grad):
            torch.testing.assert_close(after[0][k], v, atol=0, rtol=0)


def test_gauss_newton_closure_with_a_mapping_batch_equals_the_batch_step():
    """step(closure) whose closure calls hf(X) on BERT's mapping batch records the mapping (attention mask
    included) for the curvature and the quadratic model: the same parameters as step(batch=(X, y)). A closure
    that calls hf(**X) (no positional batch) is refused, and so is a closure with a padded likelihood (only the
    targets mark the padding, and the closure does not pass them)."""
    from curvkit.optim import GaussNewton

    build, batch, _ = MAPPING["bert"]
    X, y = batch()
    lik = CrossEntropy()
    models = []
    for use_closure in (False, True):
        hf = HuggingFace(build())
        opt = GaussNewton(hf.parameters(), model=hf, likelihood=lik, curvature="kflr", tau_every=1, zeta_every=2)

        def closure(hf=hf, opt=opt):
            opt.zero_grad()
            loss = lik(hf(X), y)
            loss.backward()
            return loss

        for _ in range(2):
            opt.step(closure) if use_closure else opt.step(batch=(X, y))
        models.append(flat_trainable(hf))
    torch.testing.assert_close(models[1], models[0], atol=1e-12, rtol=0)
    with pytest.raises(TypeError, match=r"closure must call the model on the batch as its one positional argument"):
        opt.step(lambda: lik(hf(**X), y).backward())
    padded = CrossEntropy(ignore_index=-100)
    opt = GaussNewton(hf.parameters(), model=hf, likelihood=padded, curvature="kflr")
    with pytest.raises(TypeError, match=r"has padding \(ignore_index=-100\).*use step\(batch=\(X, y\)\)"):
        opt.step(lambda: padded(hf(X), y).backward())
    assert opt.num_steps == 0


def test_gauss_newton_refuses_bad_mapping_batches_by_name():
    """Mapping batches with a floating entry of another dtype, NaN in a floating entry, entries of different
    batch sizes, or targets for another number of samples: errors that name the entry; nothing changes."""
    from curvkit.optim import GaussNewton

    hf = HuggingFace(vit(seed=3))
    X, y = image_batch(B=4)
    opt = GaussNewton(hf.parameters(), model=hf, likelihood=CrossEntropy(), curvature="kflr")
    theta = flat_trainable(hf)
    bad_nan = X["pixel_values"].clone()
    bad_nan[0, 0, 0, 0] = float("nan")
    for data, error, match in (
            (({"pixel_values": X["pixel_values"].float()}, y), ValueError,
             r"GaussNewton.step: batch X\['pixel_values'\] has dtype torch.float32 but the model's parameters are "
             r"torch.float64"),
            (({"pixel_values": bad_nan}, y), ValueError,
             r"batch X\['pixel_values'\] contains NaN or inf \(1 of 256 entries\); nothing was changed"),
            ((X, y[:3]), ValueError, r"batch y has shape \(3,\) for X of shape \{'pixel_values': \(4, 1, 8, 8\)\}"),
            (({"pixel_values": X["pixel_values"], "head_mask": torch.ones(2, 2)}, y), ValueError,
             r"GaussNewton.step: batch X: the tensors of an input mapping must share one positive leading batch size"),
            ((X, y, y), TypeError, r"batch must be a pair \(X, y\), X a tensor or a mapping of tensors"),
            (([X["pixel_values"]], y), TypeError, r"got a tuple of list, Tensor")):
        with pytest.raises(error, match=match):
            opt.step(batch=data)
    assert opt.num_steps == 0
    torch.testing.assert_close(flat_trainable(hf), theta, atol=0, rtol=0)


def _rows(X, rows):
    return {k: v[rows] for k, v in X.items()}


def _cover_all_but_one_module(which):
    build, batch, frozen_name = MAPPING[which]
    hf = HuggingFace(build())
    for n, p in hf.named_parameters():
        p.requires_grad_(frozen_name not in n)
    return hf, batch()


def _dense_glm(post, hf, X):
    """(f, J Sigma J^T per position): J the dense Jacobian of the model called on the whole dict (attention
    mask included) in the posterior's parameters, Sigma its dense covariance."""
    f, theta = flat_model(hf)
    assert post.names == [n for n, p in hf.named_parameters() if p.requires_grad]  # the same flat order
    J = torch.func.jacrev(lambda th: f(th, X))(theta)  # (B, *P, C, d)
    S = post.covariance().to_dense()
    return f(theta, X), torch.einsum("...ci,ij,...dj->...cd", J, S, J)


@pytest.mark.filterwarnings("ignore:Laplace GLM predictive. torch.func.vmap failed:RuntimeWarning")
@pytest.mark.parametrize("which", ["gpt2", "bert", "vit"])
@pytest.mark.parametrize("structure,curvature,form", [("kron", "kflr", "exact"), ("kron", "kfac", "factored"),
                                                      ("diag", "ggn", "factored"), ("full", "ggn", "factored")])
def test_laplace_on_mapping_batches_equals_the_dense_references(which, structure, curvature, form):
    """Laplace.fit on two mapping batches (input_ids, attention_mask, position ids; GPT-2 right-padded with
    targets -100; ViT pixel_values, its raw class token and position table included) over every parameter
    but a frozen module (MAPPING): N counts the samples; the precision
    is the prior plus the dense GGN of the summed loss (full; its diagonal for diag) or N/n times the
    Kronecker engine's operator on the same mapping batch (kron, exact form); the GLM predictive's
    J Sigma J^T per position, its diagonal and the probit predictive equal the dense Jacobian of the model
    called on the whole dict; the MC predictive at fixed samples is the mean softmax of the model on the
    dict at those samples. The model is left as it was."""
    hf, (X, y) = _cover_all_but_one_module(which)
    before = state(hf.model)
    lik = CrossEntropy(ignore_index=-100)
    lam = 0.5
    kw = {"norm_structure": "full"} if structure == "kron" else {}
    post = Laplace(hf, lik, structure, curvature, prior_precision=lam, prior_form=form, **kw)
    post.fit([(_rows(X, slice(0, 2)), y[:2]), (_rows(X, slice(2, None)), y[2:])])
    assert post.num_data == post.num_seen == 4
    assert post.input_spec == {k: (v.dtype, tuple(v.shape[1:])) for k, v in X.items()}
    eye = torch.eye(post.layout.dim, dtype=D64)
    if structure != "kron" or form == "exact":
        summed = CrossEntropy("sum", ignore_index=-100)
        if structure == "kron":
            K = KroneckerEstimator(hf, summed, "kflr", norm_structure="full").update((X, y)).operator()
            ref = K.to_dense() + lam * eye
        else:
            ref = dense_ggn_flat(hf, summed, (X, y)) + lam * eye
        P = post.precision().to_dense()
        torch.testing.assert_close(P, torch.diag(ref.diagonal()) if structure == "diag" else ref, atol=1e-10, rtol=0)
    f_ref, V_ref = _dense_glm(post, hf, X)
    f, V = post.functional_variance(X, batch_size=3)
    torch.testing.assert_close(f, f_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(V, V_ref, atol=1e-10, rtol=1e-10)
    _, Vd = post.functional_variance(X, batch_size=2, diagonal=True)
    torch.testing.assert_close(Vd, V_ref.diagonal(dim1=-2, dim2=-1), atol=1e-10, rtol=1e-10)
    probit = (f_ref / torch.sqrt(1 + math.pi / 8 * V_ref.diagonal(dim1=-2, dim2=-1))).softmax(-1)
    torch.testing.assert_close(post.predict(X, "glm", batch_size=3), probit, atol=1e-12, rtol=0)
    samples = post.sample(3, generator=torch.Generator().manual_seed(0))
    fs, _ = flat_model(hf)
    mc = sum(fs(s, X).softmax(-1) for s in samples) / 3
    torch.testing.assert_close(post.predict(X, "mc", samples=samples, batch_size=3), mc, atol=1e-12, rtol=0)
    assert_same_state(hf.model, before)


def test_laplace_checks_mapping_inputs_against_the_fit_and_saves_their_spec():
    """Predictions on a posterior fitted on mapping batches: another set of keys, a tensor, an entry of another
    dtype kind or number of dimensions are refused naming the entry; a state_dict keeps the per-key spec (a
    loaded posterior predicts the same); a fit on a mapping whose tensors disagree on the batch size is refused."""
    hf, (X, y) = _cover_all_but_one_module("bert")
    lik = CrossEntropy()
    post = Laplace(hf, lik, "kron", prior_precision=0.5).fit((X, y))
    ok = post.predict(X)
    assert ok.shape == (4, 3)
    torch.testing.assert_close(post.predict({**X, "attention_mask": X["attention_mask"].int()}), ok)
    ids = X["input_ids"]
    for bad, match in (
            ({"input_ids": ids, "attention_mask": X["attention_mask"]}, r"X is \{'input_ids': \(4, 5\), "
             r"'attention_mask': \(4, 5\)\}, but the posterior was fitted on a mapping \{'input_ids': inputs \(B, 5\) "
             r"of dtype torch.int64, .*pass the same input keys"),
            (ids, r"X is \(4, 5\), but the posterior was fitted on a mapping"),
            ({**X, "attention_mask": X["attention_mask"].double()}, r"X\['attention_mask'\] has dtype torch.float64, "
             r"but the posterior was fitted on .*convert it with X\['attention_mask'\].to\(torch.int64\)"),
            ({**X, "input_ids": ids[:, :, None]}, r"X\['input_ids'\] has shape \(4, 5, 1\), but the posterior"),
            ({**X, "input_ids": ids[:3]}, r"X: the tensors of an input mapping must share one positive leading batch")):
        with pytest.raises(ValueError, match=match):
            post.predict(bad)
    loaded = Laplace(hf, lik, "kron", prior_precision=0.5)
    loaded.load_state_dict(post.state_dict())
    assert loaded.input_spec == post.input_spec
    torch.testing.assert_close(loaded.predict(X), ok, atol=0, rtol=0)
    with pytest.raises(ValueError, match=r"batch 0: X: the tensors of an input mapping must share one positive"):
        Laplace(hf, lik, "diag").fit(({**X, "input_ids": ids[:3]}, y))
    images, labels = image_batch(B=4)
    images["pixel_values"][1, 0, 2, 3] = float("nan")
    with pytest.raises(ValueError, match=r"batch 0 of the data: the inputs X\['pixel_values'\] contain NaN or inf "
                                         r"\(1 of 256 entries\)"):
        Laplace(HuggingFace(vit()), lik, "diag").fit((images, labels))


def test_lora_adapters_on_gpt2_conv1d():
    """``add_lora`` adapts GPT-2's Conv1D attention projections (weight stored (in, out)): the adapted layer is
    ``x W + b + s B A x``; only the adapters are trainable; full-GGN Laplace on them is the prior plus the dense
    GGN of the adapters; Kronecker Laplace and a Gauss-Newton step run on them and leave the base unchanged."""
    from curvkit.architectures import LoRALinear, add_lora
    from curvkit.laplace import Laplace
    from curvkit.optim import GaussNewton

    model = gpt2(layers=2)
    lora = add_lora(model, rank=2, targets=lambda n, m: n.endswith("attn.c_attn"), init_b="normal", seed=3)
    adapted = [m for m in lora.modules() if isinstance(m, LoRALinear)]
    assert len(adapted) == 2 and all(type(m.base).__name__ == "Conv1D" for m in adapted)
    layer = adapted[0]
    x = torch.randn(3, 8, dtype=D64)
    by_hand = x @ layer.base.weight + layer.base.bias + layer.scaling * x @ layer.lora_A.weight.T @ layer.lora_B.weight.T
    torch.testing.assert_close(layer(x), by_hand, atol=ATOL, rtol=0)
    trainable = sorted(n for n, p in lora.named_parameters() if p.requires_grad)
    assert trainable and all("lora_" in n for n in trainable) and len(trainable) == 4
    assert all(p.requires_grad for n, p in model.named_parameters()), "the user's model is not changed"

    hf = HuggingFace(lora)
    data = tensor_batch(lm_batch())
    lik = CrossEntropy(ignore_index=-100)
    base = {n: p.detach().clone() for n, p in hf.named_parameters() if not p.requires_grad}
    G = dense_ggn_flat(hf, CrossEntropy("sum", ignore_index=-100), data)  # over the trainable adapters only
    assert G.shape[0] == sum(p.numel() for p in hf.parameters() if p.requires_grad)
    full = Laplace(hf, lik, structure="full", curvature="ggn", prior_precision=0.5).fit(data)
    torch.testing.assert_close(full.precision().to_dense(), G + 0.5 * torch.eye(G.shape[0], dtype=D64),
                               atol=1e-10, rtol=0)
    kron = Laplace(hf, lik, structure="kron", curvature="kfac", prior_precision=0.5).fit(data)
    assert torch.isfinite(kron.log_marginal_likelihood())
    gn = GaussNewton([p for p in hf.parameters() if p.requires_grad], model=hf, likelihood=lik)
    first = float(gn.step(batch=data))
    with torch.no_grad():
        after = float(lik(hf(data[0]), data[1]))
    assert first == first and after < first
    for n, p in hf.named_parameters():
        if n in base:
            assert torch.equal(p, base[n]), n


def test_llc_of_a_transformers_model_on_mapping_batches_equals_the_llc_on_tensors():
    """estimate_llc of a tiny BERT classifier on Hugging Face style batches ({"input_ids", "attention_mask"},
    labels as the pair's y) is the LLC of the same model on the token-id tensor (the adapter's main input; a mask
    of ones is the default), same seed, to rounding; padding in the mapping changes it (the mask takes part)."""
    from curvkit.slt import SGLDConfig, estimate_llc

    hf = HuggingFace(bert())
    g = torch.Generator().manual_seed(0)
    ids, y = torch.randint(1, 13, (8, 5), generator=g), torch.randint(0, 3, (8,), generator=g)
    mask = torch.ones_like(ids)
    cfg = SGLDConfig(num_chains=2, num_draws=5, epsilon=1e-3)
    batches = [({"input_ids": ids[:4], "attention_mask": mask[:4]}, y[:4]),
               ({"input_ids": ids[4:], "attention_mask": mask[4:]}, y[4:])]
    a = estimate_llc(hf, batches, batch_size=4, config=cfg, seed=1)
    b = estimate_llc(hf, (ids, y), batch_size=4, config=cfg, seed=1)
    torch.testing.assert_close(a.loss_trace, b.loss_trace, atol=1e-10, rtol=1e-10)
    assert a.llc_mean == pytest.approx(b.llc_mean, rel=1e-8)
    padded = mask.clone()
    padded[:, -2:] = 0
    c = estimate_llc(hf, ({"input_ids": ids, "attention_mask": padded}, y), batch_size=4, config=cfg, seed=1)
    assert not torch.allclose(c.loss_trace, b.loss_trace)
