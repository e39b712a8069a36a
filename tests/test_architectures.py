"""The modern architectures of curvkit.architectures: shapes, seeds without side effects, LoRA adapters."""

import pytest
import torch
from torch import nn

from curvkit.architectures import LoRALinear, add_lora, causal_lm, conv1d_tagger, resnet, vit

BUILDERS = [
    (lambda **kw: vit(**kw), lambda: torch.randn(3, 1, 28, 28), (3, 10)),
    (lambda **kw: causal_lm(**kw), lambda: torch.randint(0, 64, (3, 7)), (3, 7, 64)),
    (lambda **kw: resnet(**kw), lambda: torch.randn(3, 1, 12, 12), (3, 10)),
    (lambda **kw: conv1d_tagger(**kw), lambda: torch.randn(3, 3, 9), (3, 9, 5)),
]


@pytest.mark.parametrize("build,inputs,shape", BUILDERS)
def test_builders_are_seeded_without_touching_the_global_rng(build, inputs, shape):
    state = torch.get_rng_state()
    a, b, c = build(seed=1), build(seed=1), build(seed=2)
    assert torch.equal(state, torch.get_rng_state())
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert any(not torch.equal(p, q) for p, q in zip(a.parameters(), c.parameters()))
    assert tuple(a(inputs()).shape) == shape
    assert next(build(seed=0, dtype=torch.float64).parameters()).dtype == torch.float64


def test_builders_refuse_bad_arguments():
    with pytest.raises(ValueError, match="multiple of patch_size"):
        vit(image_size=28, patch_size=5)
    with pytest.raises(ValueError, match="depth must be an integer >= 1"):
        vit(depth=0)
    with pytest.raises(ValueError, match="integer token ids"):
        causal_lm()(torch.randn(2, 3))
    with pytest.raises(ValueError, match="kernel_size must be odd"):
        conv1d_tagger(kernel_size=4)


def test_tied_causal_lm_shares_the_embedding():
    m = causal_lm(tie_weights=True)
    assert m.lm_head.weight is m.tok_embed.weight


def test_add_lora_copies_freezes_and_starts_at_the_base():
    base = causal_lm(seed=3)
    before = {n: p.clone() for n, p in base.named_parameters()}
    adapted = add_lora(base, rank=2)
    assert all(p.requires_grad for p in base.parameters())  # the user's model is untouched
    assert all(torch.equal(p, before[n]) for n, p in base.named_parameters())
    trainable = [n for n, p in adapted.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    assert not any(isinstance(m, LoRALinear) for m in base.modules())
    assert all(not isinstance(m.out_proj, LoRALinear) for m in adapted.modules() if isinstance(m, nn.MultiheadAttention))
    ids = torch.randint(0, 64, (2, 5))
    torch.testing.assert_close(adapted(ids), base(ids))  # lora_B starts at zero
    nonzero = add_lora(base, rank=2, init_b="normal")
    assert not torch.allclose(nonzero(ids), base(ids))
    with pytest.raises(ValueError, match=r"no nn\.Linear"):
        add_lora(base, rank=2, targets=lambda name, m: False)


def test_curvature_kernels_restore_the_users_settings():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from curvkit.structure import curvature_kernels

    torch.backends.mha.set_fastpath_enabled(True)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]):
        flags = (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled(),
                 torch.backends.cuda.mem_efficient_sdp_enabled())
        with pytest.raises(RuntimeError, match="boom"), curvature_kernels():
            assert not torch.backends.mha.get_fastpath_enabled()
            assert not torch.backends.cuda.flash_sdp_enabled() and torch.backends.cuda.math_sdp_enabled()
            raise RuntimeError("boom")
        assert torch.backends.mha.get_fastpath_enabled()
        assert flags == (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled(),
                         torch.backends.cuda.mem_efficient_sdp_enabled())


def test_lora_inside_an_encoder_layer_under_the_fused_inference_path():
    """In eval mode without gradients PyTorch's fused nn.TransformerEncoderLayer path reads linear1.weight /
    linear2.weight instead of calling the modules: with LoRA adapters there it computes the ADAPTED layer (the
    same output as the unfused math path), not the base and not an AttributeError."""
    from curvkit.architectures import add_lora, vit
    from curvkit.structure import curvature_kernels

    model = vit(image_size=8, patch_size=4, dim=8, depth=1, heads=2, mlp_dim=8, num_classes=3, seed=0,
                dtype=torch.float64).eval()
    lora = add_lora(model, 2, init_b="normal", seed=1)
    X = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    with torch.no_grad():
        fused = lora(X)
        with curvature_kernels():
            unfused = lora(X)
        base = model(X)
    torch.testing.assert_close(fused, unfused, atol=1e-12, rtol=0)
    assert (fused - base).abs().max() > 1e-3
    layer = lora.blocks[0].linear1
    torch.testing.assert_close(layer.weight, layer.base.weight + layer.scaling * layer.lora_B.weight @ layer.lora_A.weight)
