"""Shared part of ``laplace-ood`` and ``laplace-adversarial`` (thesis Secs. 5.2.2-5.2.3): the networks on
dynamically binarised MNIST and the five prediction methods, each as a differentiable function of the
input with FIXED Monte Carlo samples (so attacks differentiate one function; digest recommendation).

Training (thesis: prior precision 1e-2, lr 1e-2, momentum 0.9, 250 epochs; batch size not stated, 100
here): one network with dropout p = 0.5 on both hidden layers (the "trained networks are identical":
deterministic pass, MC dropout and both Laplace approximations all use it) and a fully factorised Gaussian
(FFG) trained by curvkit's Bayes-by-Backprop optimiser (:class:`curvkit.optim.BBBSGD`, one weight sample
per step, initial sigma 1e-3). BBBSGD has no KL term (it is the MESU paper's Eq. 2), so our FFG is a
maximum-expected-likelihood mean-field Gaussian rather than the thesis's variational posterior; this is
stated in the reports. The prior precision 1e-2 is read as a Gaussian prior on the SUMMED log-likelihood
(weight decay 1e-2 / N on the mean loss; digest ambiguity on the prior's scale).

Laplace (on the dropout-trained network in eval mode): KF (KFLR factors, Eq. 5.14) and diagonal (sampled-
label Fisher, Eq. 5.10), curvature over ``binarisations`` binary samples of each training image, N and
lambda by grid search on the validation cross-entropy of the MC predictive.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from curvkit import checkpoint
from curvkit.data import mnist
from curvkit.laplace import Laplace, grid_search, predictive_function
from curvkit.likelihoods import CrossEntropy
from curvkit.optim import BBBSGD
from curvkit.structure import read_model

PRIOR = 1e-2
Predict = Callable[[Tensor], Tensor]


@dataclass
class MnistSetup:
    hidden: int
    n_train: int | None
    epochs: int
    binarisations: int
    mc: int  # posterior samples per method
    grid: tuple[list[float], list[float]]  # (N factors, lambda values)
    val: int = 10000


def load(setup: MnistSetup) -> dict[str, Tensor]:
    Xtr, ytr = mnist(train=True)
    Xte, yte = mnist(train=False)
    Xtr, Xte = Xtr.reshape(-1, 784).float() / 255, Xte.reshape(-1, 784).float() / 255
    n_val = setup.val if setup.n_train is None else max(200, setup.n_train // 5)
    n = 60000 - n_val if setup.n_train is None else setup.n_train
    return {"Xtr": Xtr[:n], "ytr": ytr[:n], "Xval": Xtr[n:n + n_val], "yval": ytr[n:n + n_val], "Xte": Xte, "yte": yte}


def binarise(x: Tensor, gen: torch.Generator) -> Tensor:
    return torch.bernoulli(x, generator=gen)


def _net(hidden: int, dropout: float, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    layers: list[nn.Module] = [nn.Linear(784, hidden), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers += [nn.Linear(hidden, hidden), nn.ReLU()]
    if dropout:
        layers.append(nn.Dropout(dropout))
    layers.append(nn.Linear(hidden, 10))
    return nn.Sequential(*layers)


def train_models(setup: MnistSetup, data: dict[str, Tensor], out: Path, seed: int) -> tuple[nn.Module, nn.Module, Any]:
    """(dropout net, FFG mean net, FFG optimiser), trained or read back from ``out/models`` (or, when that has
    none, from a sibling ``laplace-ood`` run of the same setting: ``out/../laplace-ood/models``)."""
    name = f"mnist_h{setup.hidden}_e{setup.epochs}_n{setup.n_train}_s{seed}.pt"
    path = out / "models" / name
    sibling = out.parent / "laplace-ood" / "models" / name
    if not path.exists() and sibling.exists():
        path = sibling
    drop, ffg = _net(setup.hidden, 0.5, seed), _net(setup.hidden, 0.0, seed + 1)
    # lr on the summed minibatch loss (batch 100): 5e-4 is about the dropout net's momentum-SGD step
    opt_f = BBBSGD(ffg.parameters(), model=ffg, lr=5e-4, sigma_init=1e-3, mc_samples=1, seed=seed)
    if path.exists():
        state = checkpoint.load(path)
        drop.load_state_dict(state["drop"])
        ffg.load_state_dict(state["ffg"])
        opt_f.load_state_dict(state["opt_f"])
        return drop.eval(), ffg.eval(), opt_f
    N = data["Xtr"].shape[0]
    opt_d = torch.optim.SGD(drop.parameters(), lr=1e-2, momentum=0.9, weight_decay=PRIOR / N)
    gen = torch.Generator().manual_seed(seed)
    for _ in range(setup.epochs):
        drop.train()
        for idx in torch.randperm(N, generator=gen).split(100):
            x, y = binarise(data["Xtr"][idx], gen), data["ytr"][idx]
            opt_d.zero_grad()
            F.cross_entropy(drop(x), y).backward()
            opt_d.step()
            opt_f.step(batch=(binarise(data["Xtr"][idx], gen), y))
    checkpoint.save({"drop": drop.state_dict(), "ffg": ffg.state_dict(), "opt_f": opt_f.state_dict()}, path)
    return drop.eval(), ffg.eval(), opt_f


def fit_laplace(setup: MnistSetup, net: nn.Module, data: dict[str, Tensor], seed: int) -> dict[str, Any]:
    """KF and diagonal Laplace on the (eval-mode) dropout net, each tuned by the grid search."""
    gen = torch.Generator().manual_seed(seed + 11)
    N = data["Xtr"].shape[0]

    def batches() -> Any:
        for _ in range(setup.binarisations):
            for i in range(0, N, 500):
                yield binarise(data["Xtr"][i:i + 500], gen), data["ytr"][i:i + 500]

    out: dict[str, Any] = {}
    nval = min(2000, data["Xval"].shape[0])
    val = (binarise(data["Xval"][:nval], torch.Generator().manual_seed(seed + 12)), data["yval"][:nval])
    specs: list[tuple[str, Any, str]] = [("KF Laplace", "kron", "kflr"), ("Diag Laplace", "diag", "mc_fisher")]
    for name, structure, curv in specs:
        post = Laplace(net, CrossEntropy(), structure, curv, prior_precision=PRIOR, seed=seed).fit(batches(), num_data=N)
        sel = grid_search(post, val, [N * f for f in setup.grid[0]], setup.grid[1], method="mc",
                          num_samples=max(10, setup.mc // 5), seed=seed, batch_size=1000)
        out[name] = {"posterior": post, "N": sel["best"][0], "lambda": sel["best"][1], "val_nll": sel["nll"]}
    return out


def predictors(setup: MnistSetup, drop: nn.Module, ffg: nn.Module, opt_f: Any, laplace: dict[str, Any],
               seed: int) -> dict[str, Predict]:
    """method -> differentiable x -> probabilities (B, 10), with FIXED posterior / dropout samples."""
    K = setup.mc
    gm = torch.Generator().manual_seed(seed + 3)
    # K fixed dropout masks (p = 0.5, inverted scaling), shared by all inputs: the MC-dropout analogue of
    # fixed weight samples; the global RNG is never touched
    masks = [(torch.bernoulli(torch.full((setup.hidden,), 0.5), generator=gm) * 2,
              torch.bernoulli(torch.full((setup.hidden,), 0.5), generator=gm) * 2) for _ in range(K)]
    l1, l2, l3 = (m for m in drop.modules() if isinstance(m, nn.Linear))

    def deterministic(x: Tensor) -> Tensor:
        return drop(x).softmax(-1)

    def mc_dropout(x: Tensor) -> Tensor:
        out = 0
        for m1, m2 in masks:
            h = torch.relu(l1(x)) * m1
            h = torch.relu(l2(h)) * m2
            out = out + l3(h).softmax(-1)
        return out / K  # type: ignore[return-value]

    sig = opt_f.sigma_dict()
    g = torch.Generator().manual_seed(seed + 5)
    mu = {n: p.detach() for n, p in ffg.named_parameters()}
    ffg_samples = [{n: mu[n] + sig[n].detach().abs() * torch.randn(mu[n].shape, generator=g) for n in mu}
                   for _ in range(K)]
    fstruct = read_model(ffg)

    def ffg_fn(x: Tensor) -> Tensor:
        return sum(fstruct.functional_call(w, (x,)).softmax(-1) for w in ffg_samples) / K  # type: ignore[return-value]

    out: dict[str, Predict] = {"Deterministic": deterministic, "MC Dropout": mc_dropout}
    for name, entry in laplace.items():
        post = entry["posterior"]
        post.num_data, post.prior_precision = entry["N"], entry["lambda"]
        out[name] = predictive_function(post, post.sample(K, torch.Generator().manual_seed(seed + 7)))
    out["FFG"] = ffg_fn
    return out


def batched(fn: Predict, X: Tensor, batch: int = 1000) -> Tensor:
    with torch.no_grad():
        return torch.cat([fn(X[i:i + batch]) for i in range(0, X.shape[0], batch)])


def entropy(p: Tensor) -> Tensor:
    return -(p * p.clamp_min(1e-12).log()).sum(-1)
