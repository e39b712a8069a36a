"""The closed-form forward-mode rules of the dual-number pass (``curvkit.curvature._dual_rules``): the same J v as
``torch.func.jvp`` (float64, to 1e-12) on every kind of call they take or hand back to torch, each rule seen to
run, and the Gauss-Newton quadratic form d_i^T G d_j they feed equal to the dense GGN's."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch import nn
from torch.func import jvp

from curvkit.architectures import causal_lm, vit
from curvkit.curvature import _dual_rules
from curvkit.curvature._dual_rules import dual_rules
from curvkit.likelihoods import CrossEntropy
from curvkit.optim.second_order.linearisation import Linearisation, output_gram
from curvkit.structure import read_model
from reference import dense_ggn_flat
from tiny_models import gen, tiny_case

pytestmark = pytest.mark.usefixtures("float64_default")
ATOL = 1e-12


class Mixed(nn.Module):
    """The calls the rules take and those they hand back: a 1-D linear input, a linear without bias, a frozen
    weight, layer norms over two dimensions and without affine parameters, attention called directly with its
    weights returned and a key padding mask, attention with separate key/value sizes (torch's path)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(3, 4)
        self.nobias = nn.Linear(4, 4, bias=False)
        self.frozen = nn.Linear(4, 4)
        self.frozen.weight.requires_grad_(False)
        self.ln2d = nn.LayerNorm((2, 4))
        self.ln_plain = nn.LayerNorm(4, elementwise_affine=False)
        self.attn = nn.MultiheadAttention(4, 2, batch_first=True)
        self.cross = nn.MultiheadAttention(4, 2, kdim=3, vdim=3, batch_first=True)
        self.vec = nn.Parameter(torch.randn(3))
        self.head = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x (B, 2, 3)
        h = self.frozen(self.nobias(self.inp(x)))
        h = self.ln_plain(self.ln2d(h))
        pad = torch.zeros(x.shape[0], 2, dtype=torch.bool)
        pad[0, 1] = True
        a, w = self.attn(h, h, h, key_padding_mask=pad)  # need_weights=True: the weights are used below
        c, _ = self.cross(h, x, x, need_weights=False)
        side = F.linear(self.vec, self.inp.weight)  # a 1-D input: (4,)
        return self.head(a + c + w.sum(-1, keepdim=True) + side)


def _jvps(model: nn.Module, X, directions):
    """(J d by the dual-number pass with the rules, J d by torch.func.jvp, the rules' calls that they took)."""
    structure = read_model(model)
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    names = list(params)
    taken: dict[str, int] = {}

    def counting(name, rule):
        def run(*a, **k):
            out = rule(*a, **k)
            taken[name] = taken.get(name, 0) + (out is not None)
            return out
        return run

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_dual_rules, "_linear", counting("linear", _dual_rules._linear))
        mp.setattr(_dual_rules, "_layer_norm", counting("layer_norm", _dual_rules._layer_norm))
        with torch.no_grad(), fwAD.dual_level(), dual_rules():
            duals = {n: fwAD.make_dual(params[n], t) for n, t in zip(names, directions)}
            f, Jd = fwAD.unpack_dual(structure.functional_call(duals, (X,)))
    f_ref, Jd_ref = jvp(lambda *p: structure.functional_call(dict(zip(names, p)), (X,)),
                        tuple(params.values()), tuple(directions))
    torch.testing.assert_close(f, f_ref, atol=ATOL, rtol=0)
    return Jd, Jd_ref, taken


def _directions(model: nn.Module, seed: int):
    g = gen(seed)
    return [torch.randn(p.shape, generator=g) for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("case", ["vit", "gpt", "gpt_tied", "transformer", "lora_gpt", "mixed"])
def test_dual_rules_equal_torch_func_jvp(case):
    g = gen(1)
    if case == "vit":
        model = vit(image_size=8, patch_size=4, dim=8, depth=2, heads=2, mlp_dim=12, seed=0, dtype=torch.float64)
        X = torch.randn(5, 1, 8, 8, generator=g)
    elif case.startswith("gpt"):  # causal mask (is_causal inside attention), tied input/output embeddings
        model = causal_lm(vocab_size=7, max_len=6, dim=8, depth=2, heads=2, mlp_dim=12, seed=0,
                          tie_weights=case == "gpt_tied", dtype=torch.float64)
        X = torch.randint(0, 7, (4, 6), generator=g)
    elif case == "mixed":
        torch.manual_seed(0)
        model, X = Mixed(), torch.randn(3, 2, 3, generator=g)
    else:
        model, _, (X, _) = tiny_case(case)
    Jd, Jd_ref, taken = _jvps(model, X, _directions(model, 2))
    assert Jd is not None and Jd.abs().max() > 0.1
    torch.testing.assert_close(Jd, Jd_ref, atol=ATOL, rtol=0)
    assert taken.get("linear", 0) > 0
    if case != "transformer":  # post-norm TransformerEncoderLayer: its norms too, checked in the others
        assert taken.get("layer_norm", 0) > 0
    assert torch._C._len_torch_function_stack() == 0


def test_attention_projections_take_the_linear_rule():
    """nn.MultiheadAttention's packed in-projection and out-projection are evaluated by the linear rule (two
    calls per attention layer besides the MLP's two), not by torch's broadcast batched products."""
    model = vit(image_size=8, patch_size=4, dim=8, depth=1, heads=2, mlp_dim=12, seed=0, dtype=torch.float64)
    X = torch.randn(3, 1, 8, 8, generator=gen(4))
    _, _, taken = _jvps(model, X, _directions(model, 5))
    assert taken["linear"] == 1 + 2 + 2 + 1  # patch embedding, in/out projections, MLP, head


def _small_case(case: str, n: int, g: torch.Generator):
    """(model, X, y, likelihood): a float64 ViT classifier or a causal LM with a padded target, n samples."""
    if case == "vit":
        model = vit(image_size=4, patch_size=2, dim=4, depth=1, heads=2, mlp_dim=6, num_classes=3, seed=1,
                    dtype=torch.float64)
        return model, torch.randn(n, 1, 4, 4, generator=g), torch.randint(0, 3, (n,), generator=g), CrossEntropy()
    model = causal_lm(vocab_size=5, max_len=4, dim=4, depth=1, heads=2, mlp_dim=6, seed=2, dtype=torch.float64)
    X, y = torch.randint(0, 5, (n, 4), generator=g), torch.randint(0, 5, (n, 4), generator=g)
    y[1, 2:] = -100
    return model, X, y, CrossEntropy(ignore_index=-100)


@pytest.mark.parametrize("case", ["vit", "gpt"])
def test_quadratic_form_of_the_dual_route_equals_the_dense_ggn(case):
    """The Gauss-Newton step size's M_ij = d_i^T G d_j from the dual-number route (Linearisation + output_gram)
    equals the dense exact GGN's, on a ViT and on a causal LM with padding."""
    g = gen(6)
    model, X, y, lik = _small_case(case, 4 if case == "vit" else 3, g)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    lin = Linearisation(model, read_model(model), names)
    assert lin.route == "dual"
    f = lin.record(X)
    dirs = [[torch.randn(p.shape, generator=g) for p in model.parameters()] for _ in range(2)]
    D = torch.stack([torch.cat([t.reshape(-1) for t in d]) for d in dirs], 1)
    M = output_gram(lik, f, y, lin(dirs))
    torch.testing.assert_close(M, D.T @ dense_ggn_flat(model, lik, (X, y)) @ D, atol=ATOL, rtol=0)


@pytest.mark.parametrize("case", ["vit", "gpt"])
def test_ggn_operator_forward_mode_takes_the_rules_and_equals_the_dense_ggn(case, monkeypatch):
    """GGNOperator's one-column forward-mode product (the route once torch._dynamo is loaded) runs under the
    closed-form rules (linear maps, layer norms, attention) and gives the dense exact GGN's product."""
    import torch._dynamo  # the forward-mode route (without it the double-backward one is taken)

    from curvkit.curvature import GGNOperator

    g = gen(7)
    model, X, y, lik = _small_case(case, 20, g)  # 20 samples: the product runs in pieces of the batch
    taken = {"linear": 0, "layer_norm": 0}
    for rule in taken:
        original = getattr(_dual_rules, f"_{rule}")

        def counting(*args, _original=original, _rule=rule, **kwargs):
            out = _original(*args, **kwargs)
            taken[_rule] += out is not None
            return out
        monkeypatch.setattr(_dual_rules, f"_{rule}", counting)
    op = GGNOperator(model, lik, (X, y))
    v = torch.randn(op.layout.dim, generator=g)
    torch.testing.assert_close(op @ v, dense_ggn_flat(model, lik, (X, y)) @ v, atol=ATOL, rtol=0)
    assert op._use_forward_mode and taken["linear"] > 0 and taken["layer_norm"] > 0
    assert torch._C._len_torch_function_stack() == 0


# ---------------------------------------------------------------------------------------------- kept primals
class Drifting(nn.Module):
    """Calls its second linear map only on the first pass: a later pass does not repeat the recorded one."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(3, 4), nn.Linear(4, 4), nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        h = torch.tanh(self.a(x))
        if self.calls == 1:
            h = self.b(h)
        return self.head(h)


class Swapping(nn.Module):
    """Calls two linear maps of the same shape on the same input in the other order after the first pass."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.head = nn.Linear(3, 4), nn.Linear(3, 4), nn.Linear(4, 2)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        first, second = (self.a, self.b) if self.calls == 1 else (self.b, self.a)
        u = torch.tanh(first(x))
        return self.head(u * torch.sigmoid(second(x)))


class InPlace(nn.Module):
    """Changes its last linear map's output in place (the recorded output with it; no later call's input shows
    it, only the output's version counter)."""

    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return torch.tanh(self.head(torch.tanh(self.a(x))).mul_(2.0))


def _reference_jd(model, X, dirs):
    structure = read_model(model)
    params = {n: p.detach() for n, p in model.named_parameters()}
    return torch.stack([jvp(lambda *p: structure.functional_call(dict(zip(params, p)), (X,)),
                            tuple(params.values()), tuple(d))[1] for d in dirs])


@pytest.mark.parametrize("case", ["vit", "gpt"])
def test_kept_primals_give_the_same_products(case):
    """With the recorded pass's linear outputs kept (the default), every direction's J d equals the one that
    recomputes them and torch.func's, and the record is replayed whole for each of several directions."""
    g = gen(7)
    if case == "vit":
        model = vit(image_size=8, patch_size=4, dim=8, depth=2, heads=2, mlp_dim=12, seed=0, dtype=torch.float64)
        X = torch.randn(5, 1, 8, 8, generator=g)
    else:
        model = causal_lm(vocab_size=7, max_len=6, dim=8, depth=2, heads=2, mlp_dim=12, seed=0, dtype=torch.float64)
        X = torch.randint(0, 7, (4, 6), generator=g)
    names = [n for n, _ in model.named_parameters()]
    lin = Linearisation(model, read_model(model), names)
    with torch.enable_grad():
        lin.record(X)
    record = lin._primals
    assert record is not None and len(record.outputs) > 0
    dirs = [[torch.randn(p.shape, generator=g) for p in model.parameters()] for _ in range(3)]
    kept = lin(dirs)
    assert lin._primals is record and record.position == len(record.outputs)
    lin.release()
    torch.testing.assert_close(kept, lin(dirs), atol=ATOL, rtol=0)
    torch.testing.assert_close(kept, _reference_jd(model, X, dirs), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kind", [Drifting, Swapping, InPlace])
def test_a_pass_that_does_not_repeat_the_record_recomputes_its_primals(kind):
    torch.manual_seed(0)
    model = kind()
    X = torch.randn(6, 3, generator=gen(8))
    lin = Linearisation(model, read_model(model), [n for n, _ in model.named_parameters()])
    lin.record(X)
    assert lin._primals is not None
    dirs = [[torch.randn(p.shape, generator=gen(9)) for p in model.parameters()]]
    got = lin(dirs)
    assert lin._primals is None  # the mismatch was seen, the primals recomputed
    if kind is not InPlace:
        model.calls = 1  # the reference sees the passes the products saw
    torch.testing.assert_close(got, _reference_jd(model, X, dirs), atol=ATOL, rtol=0)


def test_gauss_newton_step_replays_the_captured_forward():
    """A GaussNewton step on a ViT takes the primals of its captured forward pass (attention evaluated by the
    capture's own interception) and releases them after the quadratic model; steps that skip the quadratic model
    (quadratic_every) keep none."""
    from curvkit.optim import GaussNewton

    model = vit(image_size=8, patch_size=4, dim=8, depth=1, heads=2, mlp_dim=12, seed=0, dtype=torch.float64)
    g = gen(10)
    X, y = torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 10, (6,), generator=g)
    opt = GaussNewton(model.parameters(), model=model, likelihood=CrossEntropy(), curvature="kfac",
                      quadratic_every=2, tau_every=0, zeta_every=0)
    lin = opt._linearisation
    seen = []
    call = Linearisation.__call__

    def spy(self, directions):
        out = call(self, directions)
        seen.append(self._primals is not None and self._primals.position == len(self._primals.outputs) > 0)
        return out

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Linearisation, "__call__", spy)
        for _ in range(3):
            opt.step(batch=(X, y))
            assert lin._primals is None
    assert seen == [True, True]  # steps 1 and 2 evaluate the quadratic model, step 3 takes the mean alpha
    assert [r["quadratic"] for r in opt.history] == [True, True, False]


def test_gauss_newton_without_kept_primals_takes_the_same_steps():
    """keep_primals=False recomputes the primals (no record kept) and takes the same steps to rounding; a value
    that is not a bool is refused."""
    from curvkit.optim import GaussNewton

    g = gen(11)
    X, y = torch.randn(6, 1, 8, 8, generator=g), torch.randint(0, 10, (6,), generator=g)
    models = [vit(image_size=8, patch_size=4, dim=8, depth=1, heads=2, mlp_dim=12, seed=0, dtype=torch.float64)
              for _ in range(2)]
    opts = [GaussNewton(m.parameters(), model=m, likelihood=CrossEntropy(), curvature="kfac", tau_every=1,
                        keep_primals=keep) for m, keep in zip(models, (True, False))]
    records = []
    record = Linearisation.record

    def spy(self, X, forward=None, keep_primals=True):
        records.append(keep_primals)
        return record(self, X, forward, keep_primals)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(Linearisation, "record", spy)
        for _ in range(2):
            for opt in opts:
                opt.step(batch=(X, y))
    assert records == [True, False, True, False]
    for a, b in zip(*(m.parameters() for m in models)):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=0)
    assert [r["alpha"] for r in opts[0].history] == pytest.approx([r["alpha"] for r in opts[1].history], rel=1e-10)
    with pytest.raises(ValueError, match="keep_primals must be True or False"):
        GaussNewton(models[0].parameters(), model=models[0], likelihood=CrossEntropy(), keep_primals="yes")


class Plain(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(3, 4), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.a(x)))


class ComputedWeight(nn.Module):
    """A linear map whose weight is computed in every pass (weight normalisation's form): not a parameter, so
    it is identified by its values' fingerprint, as the inputs are."""

    def __init__(self):
        super().__init__()
        self.v, self.g, self.head = nn.Parameter(torch.randn(4, 3)), nn.Parameter(torch.ones(4, 1)), nn.Linear(4, 2)

    def forward(self, x):
        W = self.g * self.v / self.v.norm(dim=1, keepdim=True)
        return self.head(torch.tanh(nn.functional.linear(x, W)))


def test_a_parameter_changed_in_place_after_the_record_is_seen():
    """Weights and biases that are parameters are checked by memory and version counter, not by value: a bias
    written in place between the recorded pass and the products (which no later call's input would show: its
    output is the one replayed) makes the products recompute their primals and give J d at the new bias."""
    torch.manual_seed(0)
    for change in (None, "weight", "bias"):
        model = Plain().double()  # not a Sequential: the dual-number route (a Sequential records tangents)
        X = torch.randn(6, 3, generator=gen(8), dtype=torch.float64)
        lin = Linearisation(model, read_model(model), [n for n, _ in model.named_parameters()])
        assert lin.route == "dual"
        with torch.enable_grad():
            lin.record(X)
        with torch.no_grad():
            if change is not None:
                getattr(model.a, change).add_(0.5)
        dirs = [[torch.randn(p.shape, generator=gen(9), dtype=torch.float64) for p in model.parameters()]]
        if change is None:  # nothing changed: the record is replayed whole
            record = lin._primals
            got = lin(dirs)
            assert lin._primals is record and record.position == len(record.outputs) == 2
            continue
        got = lin(dirs)
        assert lin._primals is None, change
        torch.testing.assert_close(got, _reference_jd(model, X, dirs), atol=ATOL, rtol=0)


def test_a_computed_weight_is_replayed_by_its_fingerprint():
    torch.manual_seed(0)
    model = ComputedWeight().double()
    X = torch.randn(6, 3, generator=gen(8), dtype=torch.float64)
    lin = Linearisation(model, read_model(model), [n for n, _ in model.named_parameters()])
    assert lin.route == "dual"
    with torch.enable_grad():
        lin.record(X)
    record = lin._primals
    dirs = [[torch.randn(p.shape, generator=gen(9), dtype=torch.float64) for p in model.parameters()]]
    got = lin(dirs)
    assert lin._primals is record and record.position == len(record.outputs) == 2
    torch.testing.assert_close(got, _reference_jd(model, X, dirs), atol=ATOL, rtol=0)
