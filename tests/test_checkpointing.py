"""Activation checkpointing (issue 31, item 5): a model with ``torch.utils.checkpoint`` segments (reentrant and
not) and a tiny GPT-2 with Hugging Face ``gradient_checkpointing_enable()`` in training mode give, at every
entry point (GGN products and diagonal, Hessian products, KFLR, diagonal Laplace, a Gauss-Newton step), the
numbers of the same model without checkpointing (float64, atol 1e-12): the curvature passes run the
checkpointed segments directly. Afterwards torch's checkpointing and the model's hooks are as before, and the
model's own training pass still recomputes."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.utils.checkpoint as cp
from torch import nn

from curvkit.curvature import GGNOperator, HessianOperator
from curvkit.curvature.estimators import KroneckerEstimator
from curvkit.hf import HuggingFace
from curvkit.laplace import Laplace
from curvkit.likelihoods import CrossEntropy
from curvkit.optim.second_order.gauss_newton import GaussNewton

D64 = torch.float64
ATOL = 1e-12
pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"), pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.usefixtures("float64_default")]


class Segmented(nn.Module):
    def __init__(self, reentrant: bool | None):
        super().__init__()
        self.reentrant = reentrant
        self.a, self.b, self.c = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 3)
        self.recomputed = 0

    def inner(self, h):
        self.recomputed += 1
        return torch.tanh(self.b(torch.tanh(h)))

    def forward(self, x):
        h = self.a(x)
        h = self.inner(h) if self.reentrant is None else cp.checkpoint(self.inner, h, use_reentrant=self.reentrant)
        return self.c(h)


def gpt2(kwargs: dict | None):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=11, n_positions=8, n_embd=8, n_layer=2, n_head=2, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0, tie_word_embeddings=False, bos_token_id=1,
                                  eos_token_id=2)
    model = transformers.GPT2LMHeadModel(cfg).to(D64).train()
    if kwargs is not None:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs or None)
    return HuggingFace(model)


def lm_data():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 11, (3, 5), generator=g)
    y = ids.roll(-1, 1)
    y[:, -1] = -100
    return {"input_ids": ids, "position_ids": torch.arange(5).expand(3, 5)}, y


def entry_points(model, lik, data, full: bool = True):
    d = sum(p.numel() for p in model.parameters())
    v = torch.randn(d, dtype=D64, generator=torch.Generator().manual_seed(3))
    out = {"ggn@v": GGNOperator(model, lik, data) @ v, "ggn_diag": GGNOperator(model, lik, data).diagonal().flat,
           "kflr": KroneckerEstimator(model, lik, "kflr").update(data).operator().to_dense()}
    if full:
        out["hessian@v"] = HessianOperator(model, lik, data) @ v
        out["laplace_diag"] = Laplace(model, lik, structure="diag").fit(data).log_marginal_likelihood()
        m = copy.deepcopy(model)
        out["gn_loss"] = GaussNewton(m.parameters(), model=m, likelihood=lik).step(batch=data)
        out["gn_params"] = torch.cat([p.detach().reshape(-1) for p in m.parameters()])
    return out


def assert_same(got, ref):
    for key, value in ref.items():
        torch.testing.assert_close(got[key], value, atol=ATOL, rtol=0, msg=key)


@pytest.mark.parametrize("reentrant", [True, False])
def test_torch_checkpoint_segments_give_the_plain_numbers(reentrant):
    g = torch.Generator().manual_seed(1)
    data = (torch.randn(8, 4, generator=g, dtype=D64), torch.randint(0, 3, (8,), generator=g))
    torch.manual_seed(0)
    plain = Segmented(None).to(D64)
    model = Segmented(reentrant).to(D64)
    model.load_state_dict(plain.state_dict())
    original = (cp.CheckpointFunction, cp._checkpoint_without_reentrant_generator)
    assert_same(entry_points(model, CrossEntropy(), data), entry_points(plain, CrossEntropy(), data))
    assert (cp.CheckpointFunction, cp._checkpoint_without_reentrant_generator) == original
    model.recomputed = 0
    nn.functional.cross_entropy(model(data[0]), data[1]).backward()  # the user's pass still checkpoints
    assert model.recomputed == 2


@pytest.mark.parametrize("kwargs", [{}, {"use_reentrant": True}, {"use_reentrant": False}],
                         ids=["default", "reentrant", "non_reentrant"])
def test_hf_gradient_checkpointing_in_train_mode_gives_the_plain_numbers(kwargs):
    data, lik = lm_data(), CrossEntropy(ignore_index=-100)
    model = gpt2(kwargs)
    wte = model.model.transformer.wte
    hooks = list(wte._forward_hooks)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = entry_points(model, lik, data, full=kwargs == {})
        ref = entry_points(gpt2(None), lik, data, full=kwargs == {})
    assert_same(got, ref)
    assert list(wte._forward_hooks) == hooks and hooks  # enable_input_require_grads's hook, back in place
    assert model.model.transformer.h[0].gradient_checkpointing
