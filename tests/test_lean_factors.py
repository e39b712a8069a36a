"""Kronecker input factors formed inside the forward pass, one layer at a time (issue 35, "Lean factors").

The input statistic of every block is formed when its layer runs and its input rows are dropped there; a
convolution's patches are unfolded a few samples at a time. The factors must be those of the whole-batch
formulas: checked here against input factors written out from the unfolded patches of every layer
(float64, 1e-12 relative), with chunks of one sample forced, and against the path that keeps the rows
(``keep_per_sample``), for expand and reduce, on a ResNet (convolutions, BatchNorm in eval mode), a GPT
(embeddings, packed attention, LayerNorm) and a ViT (raw class token and position table).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import curvkit.curvature.estimators as estimators
from curvkit.architectures import causal_lm, resnet, vit
from curvkit.curvature.estimators import KroneckerEstimator
from curvkit.layerkinds import norm
from curvkit.layerkinds.conv import conv_patches
from curvkit.likelihoods import CrossEntropy

TOL = 1e-12


def _models() -> dict[str, tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(0)
    f64 = torch.float64
    return {
        "resnet": (resnet(widths=(4, 8), seed=0, dtype=f64).eval(),
                   (torch.randn(6, 1, 12, 12, generator=g, dtype=f64), torch.randint(0, 10, (6,), generator=g))),
        "gpt": (causal_lm(vocab_size=16, max_len=8, dim=8, depth=1, heads=2, mlp_dim=16, seed=0, dtype=f64),
                (torch.randint(0, 16, (3, 8), generator=g), torch.randint(0, 16, (3, 8), generator=g))),
        "vit": (vit(image_size=8, patch_size=4, dim=8, depth=1, heads=2, mlp_dim=16, num_classes=10, seed=0,
                    dtype=f64),
                (torch.randn(4, 1, 8, 8, generator=g, dtype=f64), torch.randint(0, 10, (4,), generator=g))),
    }


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    a = a.to_dense() if hasattr(a, "to_dense") else a
    b = b.to_dense() if hasattr(b, "to_dense") else b
    return float((a - b).abs().max()) <= TOL * max(1.0, float(b.abs().max()))


def _written_out_input_factors(model: nn.Module, X: torch.Tensor, mode: str) -> dict[str, torch.Tensor]:
    """sum_n sum_t a_hat a_hat^T (expand) or sum_n a_bar a_bar^T (reduce) of every Conv2d/Linear weight,
    from its whole-batch input rows (patches unfolded at once)."""
    rows: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if isinstance(mod, (nn.Conv2d, nn.Linear)):
            def hook(m: nn.Module, inp: tuple[torch.Tensor, ...], out: torch.Tensor, name: str = name) -> None:
                x = inp[0].detach()
                a = conv_patches(m, x) if isinstance(m, nn.Conv2d) else x.reshape(x.shape[0], -1, x.shape[-1])
                if m.bias is not None:
                    a = torch.cat([a, a.new_ones(*a.shape[:-1], 1)], dim=-1)
                r = a.mean(1) if mode == "reduce" else a.reshape(-1, a.shape[-1])
                rows[f"{name}.weight"] = r.T @ r
            hooks.append(mod.register_forward_hook(hook))
    with torch.no_grad():
        model(X)
    for h in hooks:
        h.remove()
    return rows


@pytest.mark.parametrize("mode", ["expand", "reduce"])
@pytest.mark.parametrize("name", ["resnet", "gpt", "vit"])
def test_input_factors_formed_in_the_pass_equal_the_whole_batch_ones(name: str, mode: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    model, data = _models()[name]
    lean = KroneckerEstimator(model, CrossEntropy(), "kfac", weight_sharing=mode, seed=0).update(data).factors()
    monkeypatch.setattr(estimators, "_BUDGET", 1)  # one sample per chunk
    monkeypatch.setattr(norm, "_BUDGET", 1)  # a norm layer's x_hat one sample at a time
    chunked = KroneckerEstimator(model, CrossEntropy(), "kfac", weight_sharing=mode, seed=0).update(data).factors()
    monkeypatch.undo()
    kept = KroneckerEstimator(model, CrossEntropy(), "kfac", weight_sharing=mode, seed=0,
                              keep_per_sample=True).update(data).factors()
    ref = _written_out_input_factors(model, data[0], mode)
    checked = 0
    for (n, G, A), (n2, G2, A2), (n3, G3, A3) in zip(lean, chunked, kept):
        assert n == n2 == n3
        assert _close(A, A3) and _close(G, G3) and _close(A2, A3) and _close(G2, G3), n
        if n in ref and A.shape == ref[n].shape:
            scale = float(ref[n].abs().max()) / float(A.abs().max())  # A at the operator's scale
            assert _close(A * scale, ref[n]), n
            checked += 1
    assert checked >= 2


def test_a_convolution_keeps_no_patches_after_its_layer_ran() -> None:
    """Inside the estimator's capture a convolution's site holds an empty (B, 0) input once its statistic
    is formed: the patches are never kept for the backward pass."""
    model, (X, _) = _models()["resnet"]
    est = KroneckerEstimator(model, CrossEntropy(), "kfac")
    with est.capture() as cap, torch.enable_grad():
        model(X)
    convs = [site for (lp, spec), site in zip(est.blocks, cap.sites()) if isinstance(lp.module, nn.Conv2d)]
    assert convs and all(tuple(s.inputs.shape) == (X.shape[0], 0) for s in convs)
    assert all(cap.taken[i] is not None for i, (_, spec) in enumerate(est.blocks) if spec.form == "kron")


@pytest.mark.parametrize("conv, shape", [
    (nn.Conv2d(3, 4, 3, padding=1), (5, 3, 9, 11)),
    (nn.Conv2d(3, 4, (3, 2), stride=(2, 1), dilation=(1, 2), padding=(2, 1)), (5, 3, 9, 11)),
    (nn.Conv2d(3, 4, 3, padding="same", padding_mode="reflect"), (5, 3, 9, 11)),
    (nn.Conv2d(3, 4, 4, stride=3, padding=2, padding_mode="circular"), (5, 3, 9, 11)),
    (nn.Conv2d(3, 6, 3, groups=3), (5, 3, 9, 11)),
    (nn.Conv1d(3, 4, 5, stride=2, padding=3, dilation=2), (5, 3, 17)),
    (nn.Conv3d(2, 4, (2, 3, 2), stride=(1, 2, 1), padding=(1, 0, 1)), (5, 2, 6, 7, 5)),
])
def test_mean_patch_without_unfolding_equals_the_unfolded_mean(conv: nn.Module, shape: tuple[int, ...]) -> None:
    """KFAC-reduce's input of a convolution (the mean patch of every sample) from strided sums of the input
    equals the mean of the unfolded patches: any padding mode, stride, dilation, 1-, 2- and 3-D."""
    from curvkit.layerkinds.conv import conv_patch_means

    conv = conv.double()
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    ref = conv_patches(conv, x).mean(1)
    got = conv_patch_means(conv, x)
    assert got.shape == ref.shape
    assert float((got - ref).abs().max()) <= TOL * float(ref.abs().max())


def test_reduce_factors_from_mean_patches_equal_those_from_chunked_patches(monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimator's reduce input factors of a ResNet's convolutions from the mean patches (no unfolding)
    equal those of the chunked unfolded patches (the route without the shortcut)."""
    from curvkit.layerkinds._base import UnfoldedSite

    model, data = _models()["resnet"]
    calls = []
    real = UnfoldedSite.position_means

    def counted(self: UnfoldedSite) -> torch.Tensor | None:
        out = real(self)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(UnfoldedSite, "position_means", counted)
    fast = KroneckerEstimator(model, CrossEntropy(), "kfac", weight_sharing="reduce", seed=0).update(data).factors()
    assert calls and all(calls)
    monkeypatch.setattr(UnfoldedSite, "position_means", lambda self: None)
    slow = KroneckerEstimator(model, CrossEntropy(), "kfac", weight_sharing="reduce", seed=0).update(data).factors()
    for (n, G, A), (n2, G2, A2) in zip(fast, slow):
        assert n == n2 and _close(A, A2) and _close(G, G2), n


@pytest.mark.parametrize("mode", ["expand", "reduce"])
@pytest.mark.parametrize("name", ["resnet", "gpt", "vit"])
def test_outputs_the_pass_drops_are_freed_and_the_factors_unchanged(name: str, mode: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimator's capture keeps a layer's output only by its place in the graph (SiteOutput): outputs no
    backward formula saves (eval-mode BatchNorm's, LayerNorm's) are freed during the forward pass, and the
    factors (G read by the producing node's hook, or from autograd.grad for the lowest outputs) equal those
    of a capture that holds every output, to 1e-12 in float64."""
    import curvkit.curvature.capture as capture

    model, data = _models()[name]
    est = KroneckerEstimator(model, CrossEntropy(), "kfac", weight_sharing=mode, seed=0)
    with est.capture() as cap, torch.enable_grad():
        est.forward(cap, data[0])  # raw parameters (the ViT's class token) run as per-sample copies
    sites = [s for s in cap.sites() if s is not None]
    freed = [s for s in sites if isinstance(s.output, capture.SiteOutput) and s.output.tensor() is None]
    if name == "resnet":  # BatchNorm in eval mode: its output is saved by nothing
        assert freed
    # the sites hold no output (a raw parameter's per-sample copies are a leaf: an expanded view of it)
    assert all(isinstance(s.output, capture.SiteOutput) or s.shared or s.output.grad_fn is None for s in sites)
    lean = KroneckerEstimator(model, CrossEntropy(), "kfac", weight_sharing=mode, seed=0).update(data).factors()

    class Holding(capture.BlockCapture):
        def __init__(self, *args: object, **kwargs: object) -> None:
            kwargs["lean"] = False
            super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(estimators, "BlockCapture", Holding)
    held = KroneckerEstimator(model, CrossEntropy(), "kfac", weight_sharing=mode, seed=0).update(data).factors()
    for (n, G, A), (n2, G2, A2) in zip(lean, held, strict=True):
        assert n == n2 and _close(A, A2) and _close(G, G2), n


def test_the_statistics_pass_lets_go_of_each_layer_input_after_its_last_read() -> None:
    """A plain training pass frees a layer's saved input once the backward pass has gone through the layer;
    the estimator's own pass does too (Site.release after the last vector's read): when the backward pass
    reaches the stem's BatchNorm, the inputs of the BatchNorm layers above it are gone (the sites held them
    until the end of the pass before: a ResNet's reduce peak 182 -> 151 MiB, docs/benchmarks.md)."""
    import weakref

    model, data = _models()["resnet"]
    est = KroneckerEstimator(model, CrossEntropy(), "kfac", weight_sharing="reduce", seed=0)
    est.update(data)  # its layout traced (once, on two samples): the pass below is the statistics pass alone
    inputs: dict[str, weakref.ref] = {}
    alive: list[list[str]] = []
    norms = {name: m for name, m in model.named_modules() if isinstance(m, nn.BatchNorm2d)}

    def record(name: str):
        def hook(m: nn.Module, inp: tuple[torch.Tensor, ...], out: torch.Tensor) -> None:
            inputs[name] = weakref.ref(inp[0])
            if name == "stem.1":  # the lowest BatchNorm: look at the others when its gradient arrives
                out.register_hook(lambda g: alive.append([n for n, r in inputs.items() if n != name and r() is not None]))
        return hook

    handles = [m.register_forward_hook(record(name)) for name, m in norms.items()]
    try:
        est.update(data)
    finally:
        for h in handles:
            h.remove()
    assert len(norms) >= 4 and alive == [[]]
