"""The ``modern`` experiment (issue 22, section 2) and what it added to the shared run machinery
(:func:`curvkit.experiments._second_order.train_run`: AdamW, GaussNewton options, test-set metrics in eval
mode, kept weights): the helpers read the curves and the scores correctly, GaussNewton's default refusal of a
ResNet with BatchNorm in training mode is recorded (not hidden as a divergence) and the ResNet's GaussNewton runs
take the explicit ``batch_statistics='couple'``, and, in the slow set, the smoke scale runs end to end through
the CLI and an interrupted run resumes to the uninterrupted result."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from curvkit import checkpoint
from curvkit.architectures import resnet, vit
from curvkit.experiments import modern
from curvkit.experiments._report import torch_threads
from curvkit.experiments._second_order import RunSpec, Task, evaluate, train_run
from curvkit.likelihoods import CrossEntropy
from curvkit.optim import GaussNewton


def _images(n: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def _task(build, n=48, batch=16, test=True) -> Task:
    X, y = _images(n)
    Xt, yt = _images(20, seed=1)
    return Task("t", build, CrossEntropy("mean"), X, y, batch, 1e-4, modern.metrics, 24,
                test=(Xt, yt) if test else None)


def _tiny_vit() -> nn.Module:
    return vit(dim=8, depth=1, heads=2, mlp_dim=8, seed=3)


def _tiny_resnet() -> nn.Module:
    return resnet(widths=(2,), seed=3)


# ---------------------------------------------------------------------------------------------- train_run additions
def test_evaluate_reports_test_metrics_in_eval_mode_and_restores_the_mode():
    model = _tiny_resnet()
    task = _task(lambda: model)
    stats = {k: v.clone() for k, v in model.state_dict().items()}
    out = evaluate(task, model)
    assert model.training  # restored
    assert all(torch.equal(stats[k], v) for k, v in model.state_dict().items())  # running stats untouched
    with torch.no_grad():
        f = model.eval()(task.test[0])
    model.train()
    assert out["test_accuracy"] == pytest.approx(float((f.argmax(1) == task.test[1]).double().mean()))
    assert out["test_loss"] == pytest.approx(float(nn.functional.cross_entropy(f, task.test[1])), rel=1e-5)
    assert {"loss", "accuracy", "test_loss", "test_accuracy"} == set(out)


def test_adamw_run_matches_torch_adamw_and_keeps_its_weights(tmp_path):
    task = _task(_tiny_vit, test=False)
    rec = train_run(task, RunSpec("a", "adamw", 3, lr=1e-2, eval_every=3), tmp_path / "a", batch_seed=2,
                    keep_model=True)
    ref = _tiny_vit()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=1e-4)
    gen = torch.Generator().manual_seed(2)
    perm = torch.randperm(48, generator=gen)
    losses = []
    for t in range(3):
        idx = perm[16 * t:16 * (t + 1)]
        opt.zero_grad()
        loss = CrossEntropy("mean")(ref(task.X[idx]), task.Y[idx])
        losses.append(float(loss.detach()) + 0.5 * 1e-4 * sum(float((p.detach() ** 2).sum()) for p in ref.parameters()))
        loss.backward()
        opt.step()
    assert rec["loss"] == pytest.approx(losses, rel=1e-6)
    stored = checkpoint.load(tmp_path / "a" / "model.pt")
    assert all(torch.allclose(stored[k], v) for k, v in ref.state_dict().items())


def test_gauss_newton_options_reach_the_optimiser_and_old_keys_stay_valid(tmp_path):
    spec = RunSpec("g", "gauss_newton", 1, curvature="kfac", options=(("weight_sharing", "reduce"),))
    from curvkit.experiments._second_order import _make_optimizer

    opt = _make_optimizer(_task(_tiny_vit), spec, _tiny_vit())
    assert isinstance(opt, GaussNewton) and opt.defaults["weight_sharing"] == "reduce"
    with pytest.raises(ValueError, match="GaussNewton's"):
        _make_optimizer(_task(_tiny_vit), RunSpec("a", "adamw", 1, options=(("tau", 1.0),)), _tiny_vit())
    # a run without options has the key it had before ``options`` existed (stored runs are read back)
    rec = train_run(_task(_tiny_vit, test=False), RunSpec("a", "adam", 1), tmp_path / "k")
    assert "options" not in rec["key"]["spec"] and "test_n" not in rec["key"]


def test_a_model_gauss_newton_refuses_is_an_error_not_a_divergence(tmp_path, monkeypatch):
    """An UnsupportedModelError is a ValueError, which train_run otherwise records as a divergence; a refusal
    (at construction, as BatchNorm in training mode, or during a step) must propagate instead."""
    from curvkit.structure import UnsupportedModelError

    spec = RunSpec("g", "gauss_newton", 2, curvature="kfac")
    with pytest.raises(UnsupportedModelError, match="BatchNorm"):
        train_run(_task(_tiny_resnet, test=False), spec, tmp_path / "g")

    def refuse(self, *args, **kwargs):
        raise UnsupportedModelError("GaussNewton: module 'x' (Probe) refused in a step")

    monkeypatch.setattr(GaussNewton, "step", refuse)
    with pytest.raises(UnsupportedModelError, match="refused in a step"):
        train_run(_task(_tiny_vit, test=False), spec, tmp_path / "h")
    assert not (tmp_path / "g" / "result.pt").exists() and not (tmp_path / "h" / "result.pt").exists()


# ---------------------------------------------------------------------------------------------- experiment helpers
def test_gauss_newton_refuses_batchnorm_in_training_mode_by_default_and_takes_it_with_the_option():
    X, y = _images(8)
    model = _tiny_resnet()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    msg = modern.gauss_newton_refusal(model, X, y)
    assert msg is not None and "BatchNorm" in msg and "model.eval()" in msg and "batch_statistics='couple'" in msg
    assert modern.gauss_newton_refusal(model, X, y, **dict(modern.RESNET_GN_OPTIONS)) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items()) and model.training
    assert modern.gauss_newton_refusal(_tiny_vit(), X, y) is None
    sc = modern.SCALES["smoke"]
    assert [s.kind for s in modern.run_specs(sc, "resnet", False)] == ["adamw"] * len(sc.adamw_lrs)
    for arch in ("vit", "resnet"):
        gn = [s for s in modern.run_specs(sc, arch, True) if s.kind == "gauss_newton"]
        assert [(s.curvature, dict(s.options)["weight_sharing"]) for s in gn] == list(sc.gn)
        assert all(dict(s.options).get("batch_statistics") == ("couple" if arch == "resnet" else None) for s in gn)


def test_reach_and_final_objective_read_the_smoothed_curve():
    rec = {"loss": [4.0, 2.0, 1.0, 1.0], "time": [0.1, 0.2, 0.3, 0.4], "diverged": None}
    # trailing means (window 10): 4, 3, 7/3, 2
    assert modern.final_objective(rec) == pytest.approx(2.0)
    assert modern.reach(rec, 2.5) == (3, pytest.approx(0.3))
    assert modern.reach(rec, 1.0) == (None, None)
    assert modern.final_objective({**rec, "diverged": {"step": 2}}) == math.inf


def test_map_network_is_chosen_by_its_eval_mode_training_loss():
    runs = {"adamw-lr1": {"diverged": None, "loss": [0.1], "evals": [{"loss": 0.9}]},  # lowest objective
            "adamw-lr2": {"diverged": None, "loss": [0.3], "evals": [{"loss": 0.4}]},
            "adamw-lr3": {"diverged": {"step": 2}, "loss": [0.1], "evals": [{"loss": math.inf}]},
            "gn-kfac-expand": {"diverged": None, "loss": [0.1], "evals": [{"loss": 0.1}]}}
    assert modern.choose_map(runs) == "adamw-lr2"


def test_classification_scores_on_known_probabilities():
    p = torch.tensor([[0.9, 0.1], [0.2, 0.8], [0.6, 0.4]])
    y = torch.tensor([0, 1, 1])
    p_ood = torch.tensor([[0.5, 0.5], [0.55, 0.45]])
    s = modern.classification_scores(p, y, p_ood)
    assert s["accuracy"] == pytest.approx(2 / 3)
    assert s["nll"] == pytest.approx(-(math.log(0.9) + math.log(0.8) + math.log(0.4)) / 3, rel=1e-6)
    # every OOD entropy exceeds every in-distribution entropy
    assert s["auroc_kmnist"] == 1.0
    conf, correct = np.array([0.9, 0.8, 0.6]), np.array([1.0, 1.0, 0.0])
    assert s["ece"] == pytest.approx(float(np.abs(conf - correct).sum() / 3))  # one sample per bin


def test_claims_compare_against_the_right_references():
    opt = {"vit": {"best_adamw": "adamw-lr1", "summary": {
        "adamw-lr1": {"updates": 10, "updates_to_best_adamw": 9, "seconds_to_best_adamw": 1.0},
        "gn-kfac-expand": {"updates": 10, "updates_to_best_adamw": 5, "seconds_to_best_adamw": 2.0}}}}
    unc = {"vit": {"MAP": {"nll": 1.0, "ece": 0.1, "auroc_kmnist": 0.5},
                   "A": {"nll": 0.9, "ece": 0.05, "auroc_kmnist": 0.6},
                   "B": {"nll": 0.9, "ece": 0.2, "auroc_kmnist": 0.6},
                   "C": {"not_run": "why"},
                   "L": {"nll": 0.5, "ece": 0.05, "auroc_kmnist": 0.7,
                         "lora_map": {"nll": 0.4, "ece": 0.1, "auroc_kmnist": 0.5}}}}
    cont = {"online KF lam=1": {"mean_seen": [0.9, 0.8]}, "online D lam=1": {"mean_seen": [0.9, 0.7]},
            "none": {"mean_seen": [0.9, 0.6]}}
    h = modern.claims(opt, unc, cont, modern.SCALES["smoke"])
    assert h["vit: GN reaches the best AdamW objective in fewer updates"] is True
    assert h["vit: GN reaches the best AdamW objective in less wall-clock"] is False
    assert [h[f"vit: A {w} its MAP"] for w in ("lowers the test NLL of", "lowers the ECE of",
                                                 "raises the KMNIST AUROC of")] == [True, True, True]
    assert [h[f"vit: B {w} its MAP"] for w in ("lowers the test NLL of", "lowers the ECE of",
                                                 "raises the KMNIST AUROC of")] == [True, False, True]
    assert h["vit: L lowers the test NLL of its MAP"] is False  # compared with the LoRA-fine-tuned MAP
    assert h["vit: L raises the KMNIST AUROC of its MAP"] is True
    assert not any(k.startswith("vit: C") for k in h)
    assert h["continual: online KF (lam=1) above diagonal and fine-tuning after the last task"] is True


# ---------------------------------------------------------------------------------------------- end to end
def _numbers(x):
    """``x`` without what depends on the wall-clock (timings, machine)."""
    if isinstance(x, dict):
        return {k: _numbers(v) for k, v in x.items()
                if k not in ("time", "seconds", "machine") and not k.startswith("seconds")}
    if isinstance(x, list):
        return [_numbers(v) for v in x]
    return x


@pytest.mark.slow
def test_smoke_runs_through_the_cli_and_an_interrupted_run_resumes_to_the_same_result(tmp_path):
    from curvkit.cli import main

    assert main(["reproduce", "modern", "--scale", "smoke", "--out", str(tmp_path / "full")]) == 0
    import json

    full = json.loads((tmp_path / "full" / "results.json").read_text())
    assert (tmp_path / "full" / "optimisation_vit.png").exists() and (tmp_path / "full" / "continual_vit.png").exists()
    # the ResNet-BN: GaussNewton's default refusal recorded, its runs with batch_statistics='couple'
    res, sc = full["optimisation"]["resnet"], modern.SCALES["smoke"]
    assert "BatchNorm" in res["default_refusal"] and res["gauss_newton_refusal"] is None
    assert res["gauss_newton_options"] == {"batch_statistics": "couple"}
    gn = {k: v for k, v in res["summary"].items() if k.startswith("gn")}
    assert len(gn) == len(sc.gn) and all(v["updates"] == sc.resnet_steps and not v["diverged"] for v in gn.values())
    for arch, width in (("vit", sc.vit["dim"]), ("resnet", sc.resnet_widths[-1])):
        u = full["uncertainty"][arch]
        assert u["KF Laplace (last layer)"]["parameters"] == width * 10 + 10  # the head, found from the graph
        for name, r in u.items():
            if "not_run" not in r:
                assert 0 <= r["ece"] <= 1 and 0 <= r["auroc_kmnist"] <= 1 and r["nll"] > 0, name
    assert len(full["continual"]["none"]["mean_seen"]) == 3
    assert "batch_statistics='couple'" in (tmp_path / "full" / "report.md").read_text()
    with torch_threads(1):
        assert modern.reproduce("smoke", tmp_path / "cut", stop_after=2) is None
        assert modern.reproduce("smoke", tmp_path / "cut", stop_after=3) is None  # interrupted twice
        assert modern.reproduce("smoke", tmp_path / "cut") is not None
        resumed = json.loads((tmp_path / "cut" / "results.json").read_text())
        stored = {f: f.stat().st_mtime_ns for f in (tmp_path / "cut").rglob("*.pt")}
        assert modern.reproduce("smoke", tmp_path / "cut") is not None  # finished: everything read back
        assert {f: f.stat().st_mtime_ns for f in (tmp_path / "cut").rglob("*.pt")} == stored  # nothing redone
        again = json.loads((tmp_path / "cut" / "results.json").read_text())
    assert _numbers(resumed) == _numbers(full)
    assert _numbers(again) == _numbers(resumed)


def test_cli_lists_modern_with_every_scale(capsys):
    from curvkit.cli import build_parser, main

    assert main(["reproduce", "--list"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("modern "))
    assert "smoke/medium/paper" in line
    for scale in ("smoke", "medium", "paper"):
        args = build_parser().parse_args(["reproduce", "modern", "--scale", scale, "--out", "x"])
        assert (args.name, args.scale) == ("modern", scale)


@pytest.mark.parametrize("scale", ["smoke", "medium", "paper"])
def test_every_scale_builds_its_models_and_runs(scale):
    sc = modern.SCALES[scale]
    X = torch.rand(2, 1, 28, 28)
    for arch in modern.ARCHS:
        assert modern.model_fn(arch, sc, 0)()(X).shape == (2, 10)
    specs = modern.run_specs(sc, "vit", True)
    assert [s.lr for s in specs if s.kind == "adamw"] == list(sc.adamw_lrs)
    assert ("kfac", "expand") in sc.gn and ("kfac", "reduce") in sc.gn and any(c == "kflr" for c, _ in sc.gn)
    assert all(s.steps == sc.resnet_steps for s in modern.run_specs(sc, "resnet", False))
    assert [m.label for m in modern.continual_methods(sc)][-1] == "none"
