"""Blocks fed by one input share ONE input statistic (``KroneckerEstimator``): HF Llama's q, k and v projections
and its gate and up projections each read the same hidden states through their own views of them, and the
estimator recognises the memory (``estimators._rows_key``), forms the Gram matrix once and keeps it one tensor
through updates, ``ema``, ``reduce``, a state_dict round trip and the operator (one factor object). The operator
equals the one with every statistic formed separately to 1e-12 (float64)."""

from __future__ import annotations

import io

import pytest
import torch

from curvkit.curvature import KroneckerEstimator, estimators
from curvkit.hf import HuggingFace
from curvkit.likelihoods import CrossEntropy

transformers = pytest.importorskip("transformers")

DT = torch.float64
GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


def llama() -> tuple[torch.nn.Module, dict[str, torch.Tensor], torch.Tensor]:
    cfg = transformers.LlamaConfig(hidden_size=16, intermediate_size=24, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=30, attn_implementation="eager")
    torch.manual_seed(0)
    model = HuggingFace(transformers.LlamaForCausalLM(cfg).to(DT).eval())
    ids = torch.randint(0, 30, (3, 6), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids[:, :-1]}, ids[:, 1:]


def inputs_of(est: KroneckerEstimator, stats: list) -> dict[str, torch.Tensor]:
    return {spec.label: A for (_, spec), A in zip(est.blocks, stats[:len(est.blocks)])}


def assert_shared(est: KroneckerEstimator, stats: list) -> None:
    A = inputs_of(est, stats)
    for layer in (0, 1):
        for group in GROUPS:
            objs = {id(t) for label, t in A.items() if f"layers.{layer}." in label and label.endswith(group)}
            assert len(objs) == 1, (layer, group)
    assert len({id(t) for t in A.values()}) < len(A)


@pytest.mark.parametrize(("sharing", "ema"), [("expand", None), ("reduce", None), ("expand", 0.5)])
def test_one_input_statistic_for_the_blocks_of_one_input(monkeypatch: pytest.MonkeyPatch, sharing: str,
                                                         ema: float | None) -> None:
    model, X, y = llama()
    lik = CrossEntropy("mean")
    est = KroneckerEstimator(model, lik, "kfac", seed=3, weight_sharing=sharing, ema=ema)  # type: ignore[arg-type]
    for batch in ((X, y), ({"input_ids": X["input_ids"][:2]}, y[:2])):
        est.update(batch)
        assert est._stats is not None
        assert_shared(est, est._stats)
    buf = io.BytesIO()
    torch.save(est.state_dict(), buf)
    buf.seek(0)
    fresh = KroneckerEstimator(model, lik, "kfac", seed=3, weight_sharing=sharing, ema=ema)  # type: ignore[arg-type]
    fresh.load_state_dict(torch.load(buf, weights_only=True))
    assert fresh._stats is not None
    assert_shared(fresh, fresh._stats)
    op = est.operator()
    q, k = (b for b in op.blocks if b.name.endswith(("layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight")))
    assert q.A is k.A  # one factor for the blocks of one input
    torch.testing.assert_close(fresh.operator().to_dense(), op.to_dense(), rtol=0, atol=0)

    monkeypatch.setattr(estimators, "_rows_key", lambda t: (id(t),))  # each module's view its own: nothing shared
    apart = KroneckerEstimator(model, lik, "kfac", seed=3, weight_sharing=sharing, ema=ema)  # type: ignore[arg-type]
    apart.update((X, y)).update(({"input_ids": X["input_ids"][:2]}, y[:2]))
    assert apart._stats is not None
    assert len({id(t) for t in inputs_of(apart, apart._stats).values()}) == len(apart.blocks)
    torch.testing.assert_close(op.to_dense(), apart.operator().to_dense(), rtol=1e-12, atol=1e-12)


def test_an_input_changed_in_place_between_readers_is_not_shared() -> None:
    """Same memory, but written in place between the two reads: its version counter differs, two statistics."""

    class Rewrite(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b, self.out = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.Linear(4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = torch.tanh(x)
            u = self.a(h)
            h.mul_(2.0)  # the same tensor, new values
            return self.out(torch.tanh(u + self.b(h)))

    torch.manual_seed(1)
    model = Rewrite().to(DT)
    X, y = torch.randn(5, 4, dtype=DT), torch.randint(0, 3, (5,))
    est = KroneckerEstimator(model, CrossEntropy("mean"), "kflr").update((X, y))
    A = inputs_of(est, est._stats)  # type: ignore[arg-type]
    assert A["a"] is not A["b"]
    torch.testing.assert_close(A["b"][:4, :4], 4.0 * A["a"][:4, :4])
