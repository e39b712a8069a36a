"""LLC inputs (issue 11): targets validated as the curvature operators validate them, data as a DataLoader
or any iterable of batches, large batches split into pieces, undefined statistics reported as undefined,
and the SLT hyperparameter and tensor checks."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from curvkit.likelihoods import CrossEntropy, Gaussian
from curvkit.slt import (
    MinibatchStream,
    SGLDConfig,
    effective_dimension,
    estimate_llc,
    estimate_llc_potential,
    plot_chains,
    quadratic_llc,
    run_sgld,
    summary,
    thresholded_rank,
)
from curvkit.slt.sampler import chunked_grad_fn, stacked_mlp_grad_fn

DT = torch.float64
CFG = SGLDConfig(epsilon=1e-3, gamma=10.0, num_chains=3, num_draws=20)


def _classifier(outputs: int = 3, n: int = 64, seed: int = 0) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    net = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, outputs)).to(DT)
    X = torch.randn(n, 4, generator=g, dtype=DT)
    y = torch.randint(0, outputs, (n,), generator=g)
    return net, X, y


# ----------------------------------------------------------------------------- targets
def test_mse_targets_with_the_wrong_shape_are_refused():
    """(n, 1) targets for 10 outputs used to broadcast to (n, 10) and measure another loss; (n,) targets for one
    output used to broadcast to (n, n)."""
    net, X, _ = _classifier(outputs=10)
    y1 = torch.randn(64, 1, dtype=DT)
    with pytest.raises(ValueError, match=r"mse_half.*\(10,\).*\(1,\).*broadcasting"):
        estimate_llc(net, (X, y1), loss="mse_half", batch_size=16, config=CFG)
    with pytest.raises(ValueError, match="targets must have the output's shape"):
        estimate_llc(net, (X, y1), loss=Gaussian(), batch_size=16, config=CFG)
    one = nn.Sequential(nn.Linear(4, 1)).to(DT)
    with pytest.raises(ValueError, match=r"mse_half.*\(1,\).*\(\)"):
        estimate_llc(one, (X, torch.randn(64, dtype=DT)), loss="mse_half", batch_size=16, config=CFG)
    # the right shape runs, and gives the Gaussian likelihood's numbers (sigma = 1: the same loss)
    y10 = torch.randn(64, 10, dtype=DT)
    a = estimate_llc(net, (X, y10), loss="mse_half", batch_size=16, config=CFG, seed=1)
    b = estimate_llc(net, (X, y10), loss=Gaussian(), batch_size=16, config=CFG, seed=1)
    assert torch.allclose(a.loss_trace, b.loss_trace, rtol=1e-12, atol=0)


@pytest.mark.parametrize("bad", [3, -1, -100])
def test_class_targets_out_of_range_are_clear_errors(bad):
    """A label K (raw torch IndexError before) or a negative one (-100 was silently IGNORED by cross_entropy's
    ignore_index, so the loss averaged over fewer samples) is refused, naming the valid range; a label far
    into the data set (not in the first rows) too."""
    net, X, y = _classifier(outputs=3)
    y = y.clone()
    y[50] = bad
    for loss in ("cross_entropy", CrossEntropy()):
        with pytest.raises(ValueError, match=r"\[0, 2\]"):
            estimate_llc(net, (X, y), loss=loss, batch_size=16, config=CFG)


def test_class_targets_of_the_wrong_form_are_clear_errors():
    net, X, y = _classifier(outputs=3)
    with pytest.raises(ValueError, match=r"shape \(n,\).*y.view\(-1\)"):
        estimate_llc(net, (X, y[:, None]), batch_size=16, config=CFG)
    with pytest.raises(ValueError, match=r"y.long\(\)"):
        estimate_llc(net, (X, y.to(DT)), batch_size=16, config=CFG)
    with pytest.raises(ValueError, match=r"class indices.*got torch.bool"):
        estimate_llc(net, (X, y == 1), batch_size=16, config=CFG)
    # int32 / uint8 class indices (a raw dtype error from torch before) give the int64 numbers
    ref = estimate_llc(net, (X, y), batch_size=16, config=CFG, seed=2)
    for dtype in (torch.int32, torch.uint8):
        assert torch.equal(estimate_llc(net, (X, y.to(dtype)), batch_size=16, config=CFG, seed=2).loss_trace,
                           ref.loss_trace)
    # class probabilities (n, K) stay accepted and equal one-hot class indices
    onehot = nn.functional.one_hot(y, 3).to(DT)
    a = estimate_llc(net, (X, y), batch_size=16, config=CFG, seed=2)
    b = estimate_llc(net, (X, onehot), batch_size=16, config=CFG, seed=2)
    assert torch.allclose(a.loss_trace, b.loss_trace, rtol=1e-12, atol=0)
    # ... but not unnormalised or negative "probabilities" (torch computes some other objective from them)
    for bad in (2 * onehot, onehot - 0.5 * nn.functional.one_hot((y + 1) % 3, 3).to(DT)):
        with pytest.raises(ValueError, match="must be >= 0 and sum to 1"):
            estimate_llc(net, (X, bad), batch_size=16, config=CFG)


def test_nan_data_and_bad_inputs_are_refused():
    net, X, y = _classifier()
    Xn = X.clone()
    Xn[40, 2] = float("nan")
    with pytest.raises(ValueError, match=r"data inputs X contains NaN or inf \(1 of"):
        estimate_llc(net, (Xn, y), batch_size=16, config=CFG)
    yr = torch.randn(64, 3, dtype=DT)
    yr[63, 0] = float("inf")
    with pytest.raises(ValueError, match="data targets y contains NaN or inf"):
        estimate_llc(net, (X, yr), loss="mse_half", batch_size=16, config=CFG)
    with pytest.raises(ValueError, match=r"cannot be evaluated on the inputs \(shape \(64, 5\)"):
        estimate_llc(net, (torch.randn(64, 5, dtype=DT), y), batch_size=16, config=CFG)
    with pytest.raises(ValueError, match="share a positive leading batch size"):
        estimate_llc(net, (X, y[:10]), batch_size=16, config=CFG)
    with pytest.raises(ValueError, match=r"init_loss must be a finite number.*SGLDConfig\(init_loss="):
        estimate_llc(net, (X, y), batch_size=16, config=CFG, init_loss="full")


def test_a_summed_or_per_sample_loss_is_refused():
    """A callable loss must be the batch MEAN (a reduction='sum' loss multiplied the LLC by the batch size) and
    a 0-d tensor (a per-sample vector gave a raw torch.func error)."""
    net, X, y = _classifier()
    with pytest.raises(ValueError, match=r"MEAN per-sample loss.*reduction='mean'"):
        estimate_llc(net, (X, y), loss=nn.CrossEntropyLoss(reduction="sum"), batch_size=16, config=CFG)
    with pytest.raises(ValueError, match="0-dimensional"):
        estimate_llc(net, (X, y), loss=nn.CrossEntropyLoss(reduction="none"), batch_size=16, config=CFG)
    a = estimate_llc(net, (X, y), loss=nn.CrossEntropyLoss(), batch_size=16, config=CFG, seed=3)
    b = estimate_llc(net, (X, y), batch_size=16, config=CFG, seed=3)
    assert torch.equal(a.loss_trace, b.loss_trace)


def test_random_or_batch_coupled_modules_are_refused_and_eval_mode_runs():
    """Dropout / BatchNorm in training mode gave raw vmap errors (and BatchNorm would update the user's
    running statistics); in eval mode the model runs and its buffers are unchanged."""
    torch.manual_seed(0)
    X, y = torch.randn(64, 4, dtype=DT), torch.randint(0, 3, (64,))
    drop = nn.Sequential(nn.Linear(4, 6), nn.Dropout(0.5), nn.Linear(6, 3)).to(DT)
    with pytest.raises(ValueError, match=r"estimate_llc: module '1' \(Dropout\).*model.eval\(\)"):
        estimate_llc(drop, (X, y), batch_size=16, config=CFG)
    bn = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3)).to(DT)
    with pytest.raises(ValueError, match=r"module '1' \(BatchNorm1d\).*model.eval\(\)"):
        estimate_llc(bn, (X, y), batch_size=16, config=CFG)
    bn.eval()
    before = {k: v.clone() for k, v in bn.state_dict().items()}
    r = estimate_llc(bn, (X, y), batch_size=16, config=CFG)
    assert math.isfinite(r.llc_mean)
    assert all(torch.equal(before[k], v) for k, v in bn.state_dict().items())


def test_reused_module_is_left_intact():
    """A module registered twice (called twice per forward): torch's functional_call used to leave a plain
    tensor in place of its nn.Parameter; the structure reader's call leaves the model exactly as it was, and
    the losses are those of the model itself."""
    torch.manual_seed(0)
    lin = nn.Linear(3, 3)
    net = nn.Sequential(lin, nn.Tanh(), lin).to(DT)
    w, b = lin.weight, lin.bias
    X, y = torch.randn(32, 3, dtype=DT), torch.randint(0, 3, (32,))
    cfg = SGLDConfig(epsilon=1e-3, gamma=10.0, num_chains=2, num_draws=5, init_loss="full")
    r = estimate_llc(net, (X, y), batch_size=None, config=cfg, seed=0)
    assert net[0].weight is w and net[2].weight is w and net[0].bias is b
    assert isinstance(net[0].weight, nn.Parameter) and isinstance(net[2].weight, nn.Parameter)
    assert [n for n, _ in net.named_parameters()] == ["0.weight", "0.bias"]
    full = float(nn.functional.cross_entropy(net(X), y).detach())
    assert r.init_loss == pytest.approx(full, rel=1e-14) and r.loss_trace[0, 0] == pytest.approx(full, rel=1e-14)


# ----------------------------------------------------------------------------- data as an iterable
def test_dataloader_and_iterables_give_the_pair_numbers():
    """A DataLoader (any batch size; shuffle=False), a list or a generator of batches is D_n, concatenated: the
    numbers equal those of the (X, y) pair bit for bit, under the same seed; the minibatches are curvkit's own
    (batch_size, seeded), not the loader's."""
    net, X, y = _classifier(n=70)
    ref = estimate_llc(net, (X, y), batch_size=16, config=CFG, seed=4)
    loader = DataLoader(TensorDataset(X, y), batch_size=9, shuffle=False)
    via_loader = estimate_llc(net, loader, batch_size=16, config=CFG, seed=4)
    via_list = estimate_llc(net, [(X[:30], y[:30]), (X[30:], y[30:])], batch_size=16, config=CFG, seed=4)
    via_gen = estimate_llc(net, ((X[i:i + 25], y[i:i + 25]) for i in range(0, 70, 25)), batch_size=16,
                           config=CFG, seed=4)
    via_xy_list = estimate_llc(net, [X, y], batch_size=16, config=CFG, seed=4)  # accepted before iterables
    for r in (via_loader, via_list, via_gen, via_xy_list):
        assert torch.equal(r.loss_trace, ref.loss_trace) and r.n == 70 and r.batch_size == 16
    other = estimate_llc(net, loader, batch_size=16, config=CFG, seed=5)
    assert not torch.equal(other.loss_trace, ref.loss_trace)


def test_bad_iterables_are_clear_errors():
    net, X, y = _classifier()
    with pytest.raises(ValueError, match="data is empty"):
        estimate_llc(net, [], config=CFG)
    with pytest.raises(ValueError, match="batch 1 of data does not match batch 0"):
        estimate_llc(net, [(X, y), (X[:, :3], y)], config=CFG)
    with pytest.raises(TypeError, match=r"batch 0 of data is not an \(X, y\) pair"):
        estimate_llc(net, [{"x": X, "y": y}], config=CFG)


# ----------------------------------------------------------------------------- large batches in pieces
class _Recorder(nn.Module):
    """Not an MLP chain (LayerNorm): takes the vmap path; records the rows each forward call sees."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Tanh(), nn.Linear(6, 3))
        self.rows: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(int(x.shape[0]))
        return self.net(x)


def test_large_batches_are_processed_in_bounded_pieces():
    """A full batch of n = 200 rows with 2 chains and max_rows = 64 reaches the model in pieces of at most
    64 // 2 = 32 rows (no-grad evaluations: at most 64), and the numbers equal the whole-batch ones to
    rounding (float64, rel 1e-12)."""
    torch.manual_seed(0)
    model = _Recorder().to(DT)
    X, y = torch.randn(200, 4, dtype=DT), torch.randint(0, 3, (200,))
    cfg = SGLDConfig(epsilon=1e-3, gamma=10.0, num_chains=2, num_draws=6, init_loss="full")
    whole = estimate_llc(model, (X, y), batch_size=None, config=cfg, seed=0, max_rows=None)
    assert max(model.rows) == 200
    model.rows.clear()
    split = estimate_llc(model, (X, y), batch_size=None, config=cfg, seed=0, max_rows=64)
    assert max(model.rows) <= 64 and model.rows.count(32) >= 6 * 6  # 7 pieces per step, 6 steps
    assert torch.allclose(split.loss_trace, whole.loss_trace, rtol=1e-12, atol=0)
    assert split.init_loss == pytest.approx(whole.init_loss, rel=1e-13)
    assert split.llc_mean == pytest.approx(whole.llc_mean, rel=1e-9)


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("vectorise", ["auto", "vmap"])
def test_pieces_equal_whole_minibatches(shared, vectorise):
    """Minibatches of 40 rows x 3 chains split with max_rows = 30 (10 rows per chain and piece): same trajectory
    to rounding on the MLP fast path and the vmap path, independent or shared batches; a budget that fits the
    batch leaves the numbers bit-identical."""
    net, X, y = _classifier(n=120)
    cfg = SGLDConfig(epsilon=1e-3, gamma=10.0, num_chains=3, num_draws=15, shared_batches=shared)
    whole = estimate_llc(net, (X, y), batch_size=40, config=cfg, seed=6, vectorise=vectorise, max_rows=None)
    split = estimate_llc(net, (X, y), batch_size=40, config=cfg, seed=6, vectorise=vectorise, max_rows=30)
    fits = estimate_llc(net, (X, y), batch_size=40, config=cfg, seed=6, vectorise=vectorise, max_rows=120)
    assert torch.allclose(split.loss_trace, whole.loss_trace, rtol=1e-12, atol=0)
    assert torch.equal(fits.loss_trace, whole.loss_trace)


def test_chunked_grad_fn_weights_pieces_by_size():
    """The piece weights m_k / m with unequal pieces (7 rows in pieces of 3, 3, 1): the mean gradient and loss."""
    seen = []

    def step(params, batch):
        x, _ = batch
        seen.append(x.shape[1])
        return {"w": x.sum(dim=1)}, x.mean(dim=(1, 2))  # gradient = sum over the piece (not a mean)

    x = torch.arange(2 * 7 * 1, dtype=DT).view(2, 7, 1)
    grads, values = chunked_grad_fn(step, 0, 3)({"w": torch.zeros(2, 1, dtype=DT)}, (x, torch.zeros(2, 7)))
    assert seen == [3, 3, 1]
    assert torch.allclose(values, x.mean(dim=(1, 2)))
    expect = sum(x[:, s:s + 3].sum(dim=1) * (min(3, 7 - s) / 7) for s in (0, 3, 6))
    assert torch.allclose(grads["w"], expect)


def test_flatten_mlp_takes_the_fast_path_and_equals_vmap():
    """An MLP starting with nn.Flatten on image-shaped inputs is an MLP chain for the structure reader: the
    batched path applies, with the vmap path's numbers."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.ReLU(), nn.Linear(5, 3)).to(DT)
    X, y = torch.randn(48, 3, 2, 2, dtype=DT), torch.randint(0, 3, (48,))
    assert stacked_mlp_grad_fn(net, nn.functional.cross_entropy, 0, input_shape=(3, 2, 2)) is not None
    assert stacked_mlp_grad_fn(net[1:], nn.functional.cross_entropy, 0, input_shape=(3, 4)) is None
    for shared in (False, True):
        cfg = SGLDConfig(epsilon=1e-3, gamma=10.0, num_chains=2, num_draws=10, shared_batches=shared)
        fast = estimate_llc(net, (X, y), batch_size=12, config=cfg, seed=1)
        slow = estimate_llc(net, (X, y), batch_size=12, config=cfg, seed=1, vectorise="vmap")
        assert torch.allclose(fast.loss_trace, slow.loss_trace, rtol=1e-12, atol=0)


# ----------------------------------------------------------------------------- undefined statistics
def test_one_chain_reports_undefined_statistics_as_undefined(tmp_path):
    """One chain: llc_std was 0.0 while llc_stderr and R-hat were NaN. All three are NaN now, None in to_dict
    (strict JSON), and the plot and summary cope."""
    net, X, y = _classifier()
    cfg = SGLDConfig(epsilon=1e-3, gamma=10.0, num_chains=1, num_draws=20)
    r = estimate_llc(net, (X, y), batch_size=16, config=cfg)
    assert math.isnan(r.llc_std) and math.isnan(r.llc_stderr) and math.isnan(r.rhat)
    assert r.llc_mean == pytest.approx(float(r.llc_per_chain[0]), rel=1e-14)
    d = r.to_dict()
    assert d["llc_std"] is None and d["llc_stderr"] is None and d["rhat"] is None
    json.dumps(d, allow_nan=False)
    s = summary(r)
    assert math.isnan(s["llc_std"]) and math.isnan(s["rhat"]) and math.isfinite(s["late_drift"])
    assert plot_chains(r, tmp_path / "one.png").stat().st_size > 0
    pot = estimate_llc_potential(lambda w: (w**2).sum(), torch.zeros(2, dtype=DT),
                                 SGLDConfig(epsilon=1e-3, gamma=1.0, nbeta=10.0, num_chains=1, num_draws=1))
    assert math.isnan(pot.llc_std) and math.isnan(summary(pot)["late_drift"])
    two = estimate_llc(net, (X, y), batch_size=16, config=SGLDConfig(epsilon=1e-3, gamma=10.0, num_chains=2,
                                                                     num_draws=20))
    assert two.llc_std == pytest.approx(float(two.llc_per_chain.std(unbiased=True)), rel=1e-12)
    assert two.to_dict()["llc_std"] == two.llc_std


# ----------------------------------------------------------------------------- SLT hyperparameters and tensors
@pytest.mark.parametrize("kw, match", [
    ({"num_chains": 2.5}, "num_chains must be an integer >= 1, got 2.5"),
    ({"num_chains": True}, "num_chains must be an integer >= 1, got True"),
    ({"num_draws": float("nan")}, "num_draws must be an integer >= 1, got nan"),
    ({"thinning": float("inf")}, "thinning must be an integer >= 1, got inf"),
    ({"num_burnin": -1}, "num_burnin must be an integer >= 0"),
    ({"epsilon": "small"}, "epsilon must be a number, got 'small'"),
    ({"epsilon": float("inf")}, "epsilon must be a finite number > 0"),
    ({"gamma": float("inf")}, "gamma must be a finite number >= 0"),
    ({"gamma": float("nan")}, "gamma must be a finite number >= 0"),
    ({"nbeta": float("nan")}, "nbeta must be a finite number > 0"),
    ({"shared_batches": "no"}, "shared_batches must be True or False"),
])
def test_sgld_config_refuses_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        SGLDConfig(**kw)


def test_sgld_config_stores_numbers():
    cfg = SGLDConfig(num_chains=2.0, num_draws=10, epsilon=torch.tensor(1e-3), gamma=1)
    assert cfg.num_chains == 2 and isinstance(cfg.num_chains, int)
    assert isinstance(cfg.epsilon, float) and cfg.epsilon == pytest.approx(1e-3) and isinstance(cfg.gamma, float)
    assert "epsilon=0.001" in str(SGLDConfig(epsilon=1e-3))


def test_batch_size_and_max_rows_are_validated():
    net, X, y = _classifier()
    for bad in (2.5, 0, -3, float("nan"), True):
        with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
            estimate_llc(net, (X, y), batch_size=bad, config=CFG)
        with pytest.raises(ValueError, match="batch_size must be an integer >= 1"):
            MinibatchStream(X, y, bad, 2, torch.Generator())
    with pytest.raises(ValueError, match="max_rows must be an integer >= 1"):
        estimate_llc(net, (X, y), config=CFG, max_rows=0)


def test_nan_loss_at_w_star_is_not_called_a_divergence():
    """A loss that is already NaN at w* (before any step) is a data/model problem, not an unstable sampler."""
    cfg = SGLDConfig(epsilon=1e-3, gamma=1.0, nbeta=10.0, num_chains=2, num_draws=3)
    w = {"w": torch.zeros(2, dtype=DT)}
    with pytest.raises(ValueError, match=r"loss at w\* \(before any SGLD step\) is NaN/inf"):
        run_sgld(lambda p, b: (p["w"] ** 2).sum() * float("nan"), w, lambda: None, None, cfg, 10.0,
                 torch.Generator().manual_seed(0))


def test_potential_inputs_are_validated():
    cfg = SGLDConfig(epsilon=1e-3, gamma=1.0, nbeta=10.0, num_chains=2, num_draws=3)
    with pytest.raises(ValueError, match="w_star contains NaN or inf"):
        estimate_llc_potential(lambda w: (w**2).sum(), torch.tensor([0.0, float("nan")], dtype=DT), cfg)
    with pytest.raises(ValueError, match="0-dimensional"):
        estimate_llc_potential(lambda w: w**2, torch.zeros(2, dtype=DT), cfg)
    with pytest.raises(ValueError, match="potential at w_star is inf"):
        estimate_llc_potential(lambda w: (w**2).sum() + float("inf"), torch.zeros(2, dtype=DT), cfg)
    with pytest.raises(ValueError, match="n must be an integer >= 1"):
        estimate_llc_potential(lambda w: (w**2).sum(), torch.zeros(2, dtype=DT), cfg, n=0)
    with pytest.raises(ValueError, match="floating-point"):
        estimate_llc_potential(lambda w: (w**2).sum(), torch.zeros(2, dtype=torch.int64), cfg)


def test_spectrum_helpers_refuse_non_finite_input():
    """NaN eigenvalues were dropped by the h > 0 filter (a silently smaller N_eff); z = inf gave N_eff = 0;
    quadratic_llc with a NaN nbeta returned NaN and with gamma < 0 a negative denominator."""
    h = torch.tensor([1.0, float("nan"), 2.0], dtype=DT)
    with pytest.raises(ValueError, match="eigenvalues contains NaN or inf"):
        effective_dimension(h, 1.0)
    with pytest.raises(ValueError, match="z must be a finite number > 0"):
        effective_dimension(torch.ones(3, dtype=DT), float("inf"))
    with pytest.raises(ValueError, match="eigenvalues contains NaN or inf"):
        thresholded_rank(h, 0.1)
    with pytest.raises(ValueError, match="threshold must be a finite number >= 0"):
        thresholded_rank(torch.ones(3, dtype=DT), float("inf"))
    with pytest.raises(ValueError, match="eigenvalues is empty"):
        thresholded_rank(torch.ones(0, dtype=DT), 0.1)
    with pytest.raises(ValueError, match="nbeta must be a finite number > 0"):
        quadratic_llc(torch.ones(3, dtype=DT), float("nan"), 1.0)
    with pytest.raises(ValueError, match="gamma must be a finite number >= 0"):
        quadratic_llc(torch.ones(3, dtype=DT), 10.0, -1.0)
    with pytest.raises(ValueError, match="eigenvalues contains NaN or inf"):
        quadratic_llc(h, 10.0, 1.0)
    # valid input: the closed forms
    hh = torch.tensor([3.0, 1.0, 0.0, -1.0], dtype=DT)
    assert effective_dimension(hh, 1.0) == pytest.approx(3 / 4 + 1 / 2)
    assert quadratic_llc(hh, 10.0, 2.0) == pytest.approx(0.5 * (30 / 32 + 10 / 12))
