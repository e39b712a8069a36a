"""Smoke runs of the chapter-5 experiments, each asserting something the run must get right.

Like the project's experiment smoke loop, the end-to-end runs are behind ``-m slow`` (about a minute in all on
two idle cores) except the fastest one; their parts have fast dedicated tests (test_laplace.py,
test_online_laplace.py, test_laplace_hmc.py, test_data_vision_sets.py).
"""

import json
from dataclasses import replace

import pytest
import torch
from torch import nn

from curvkit.continual import DatasetSequence
from curvkit.continual.laplace import MultiHead
from curvkit.continual.task_sequence import SequenceConfig
from curvkit.experiments import registry
from curvkit.experiments._laplace_continual import Method, run_method


@pytest.mark.slow
def test_laplace_regression_smoke(tmp_path):
    res = registry.run("laplace-regression", "smoke", tmp_path, seed=0)
    assert res["train_rmse"] < 3.0  # the MAP fits x^3 within the noise std
    assert 0.5 < res["hmc"]["accept_rate"] < 0.99
    # thesis Sec. 5.2.1: unregularised Laplace over-estimates the uncertainty near the data
    assert res["holds"]["unregularised_overestimate_near_data"]
    assert json.loads((tmp_path / "results.json").read_text())["methods"]["KF [R]"]["N"] >= 20
    assert (tmp_path / "fig5_1_toy_regression.png").exists()


@pytest.mark.slow
def test_online_laplace_permuted_smoke(tmp_path):
    res = registry.run("online-laplace-permuted", "smoke", tmp_path, seed=0)
    runs = res["runs"]
    # KF Online Laplace remembers the first task better than plain fine-tuning, and every task is learnt
    assert runs["online KF lam=3"]["first"][-1] > runs["none"]["first"][-1]
    assert min(runs["online KF lam=3"]["latest"]) > 0.5  # 10 classes: chance is 0.1
    assert len(runs["joint"]["acc"]) == 3


def test_online_laplace_disjoint_smoke(tmp_path):
    res = registry.run("online-laplace-disjoint", "smoke", tmp_path, seed=0)
    # a stronger Laplace penalty keeps more of task 1 (digits 0-4) after learning task 2
    for tag in ("KF", "D"):
        assert res["first_task"][tag][-1] > res["first_task"][tag][0]
    assert set(res["curves"]) == {"KF", "D", "SI"}


@pytest.mark.slow
def test_dataset_sequence_smoke(tmp_path):
    res = registry.run("dataset-sequence", "smoke", tmp_path, seed=0)
    assert res["tasks"] == [f"synthetic-{i}" for i in range(1, 6)]
    kf = res["runs"]["online KF lam=3"]["acc"][-1]
    assert len(kf) == 5 and min(kf) > 0.5  # every head still classifies its task after all five (chance 0.1)
    assert "synthetic-1" in (tmp_path / "report.md").read_text()


@pytest.mark.slow
def test_laplace_ood_smoke(tmp_path):
    res = registry.run("laplace-ood", "smoke", tmp_path, seed=0)
    m = res["methods"]
    # the Laplace predictive keeps the network's accuracy (Table 5.1) and is more uncertain on KMNIST
    # letters than on MNIST digits (AUROC of entropy > 0.5)
    assert abs(m["KF Laplace"]["accuracy"] - m["Deterministic"]["accuracy"]) < 0.05
    assert m["KF Laplace"]["auroc_KMNIST"] > 0.6 and m["Deterministic"]["accuracy"] > 0.6
    assert (tmp_path / "fig5_2_ood_entropy.png").exists()


@pytest.mark.slow
def test_laplace_adversarial_smoke(tmp_path):
    res = registry.run("laplace-adversarial", "smoke", tmp_path, seed=0)
    for name, curve in res["fgsm"].items():
        assert curve["accuracy"][-1] < curve["accuracy"][0], name  # FGSM lowers every method's accuracy
    for name, tr in res["targeted"].items():
        assert tr["target"][-1] > tr["target"][0], name  # the targeted attack moves predictions to class 0


def test_a_run_whose_network_dies_is_restarted_with_a_larger_lr_decay(tmp_path, make_linear_tasks):
    # The first model handed out has a dead trunk (all ReLUs off), the way momentum SGD left the LeNet at the
    # fourth dataset-sequence task; the run must not be reported, but retried with k = 1 (thesis Sec. 5.4.1 tunes
    # k "to prevent the objective from diverging").
    data = make_linear_tasks()
    made = []

    def model_fn(seed):
        torch.manual_seed(seed)
        model = MultiHead(nn.Sequential(nn.Linear(8, 10), nn.ReLU()), [nn.Linear(10, 3) for _ in range(2)])
        if not made:
            with torch.no_grad():
                model.trunk[0].bias.fill_(-1e3)
        made.append(model)
        return model

    cfg = SequenceConfig(lr=0.1, momentum=0.9, batch_size=16, min_epochs=2, max_epochs=4, patience=1, val_size=20,
                         multi_head=True)
    res = run_method(Method("online", "diag", 3.0), model_fn, DatasetSequence(data), cfg, tmp_path, seed=0,
                     params_fn=lambda m: m.shared_parameters())
    assert len(made) == 2 and res["lr_retries"] == 1 and res["lr_decay_k"] == 1.0
    assert res["lr"] == pytest.approx([0.1, 0.05]) and min(res["acc"][-1]) > 0.5
    # read back only under the protocol it was asked with (the restart is part of the result, not of the request)
    again = run_method(Method("online", "diag", 3.0), model_fn, DatasetSequence(data), cfg, tmp_path, seed=0)
    assert again["config"] == res["config"] and again["lr"] == res["lr"] and len(made) == 2
    with pytest.raises(ValueError, match=r"another protocol .*lr_decay_k"):
        run_method(Method("online", "diag", 3.0), model_fn, DatasetSequence(data), replace(cfg, lr_decay_k=0.5),
                   tmp_path, seed=0)
