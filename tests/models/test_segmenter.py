"""Segmenter (Table C): shapes and gradients of every decoder x attention, the encoder on any patch grid, timm
weights, sliding-window inference against independent references, the CBT layer against its formula, MACs."""

from __future__ import annotations

import math

import pytest
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F

from mita.models.segmenter import (
    DECODERS,
    CBTDecoder,
    ContractBroadcastAttention,
    create_segmenter,
    segmenter_flops,
    sliding_window_logits,
)

TINY_ENCODER = {"depth": 2}
# Width 48 (3 heads of 16), one block: for tests that need large grids (512 / 640 crops) on the CPU.
MINI_ENCODER = {"depth": 1, "embed_dim": 48, "num_heads": 3}
ATTENTIONS = ["full", {"name": "mita", "m": 4, "k": 4}]


def _tiny(decoder="linear", attention="full", img_size=64, num_classes=5, encoder=TINY_ENCODER, **kwargs):
    torch.manual_seed(0)
    return create_segmenter(
        "vit_tiny", num_classes=num_classes, img_size=img_size, decoder=decoder, attention=attention,
        drop_path_rate=0.0, encoder_kwargs=encoder, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize("attention", ATTENTIONS, ids=["full", "mita"])
@pytest.mark.parametrize("decoder", DECODERS)
def test_shapes_and_gradients_reach_every_parameter(decoder, attention):
    kwargs = {"dropout": 0.0} if decoder == "mask_transformer" else {}
    model = _tiny(decoder, attention, **kwargs)
    images = torch.randn(2, 3, 64, 64)
    logits = model(images)
    assert logits.shape == (2, 5, 64, 64)
    assert torch.isfinite(logits).all()
    (logits * torch.randn_like(logits)).sum().backward()
    no_grad = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not no_grad, f"parameters without gradient: {no_grad}"
    assert all(torch.isfinite(p.grad).all() for p in model.parameters())


@pytest.mark.parametrize("decoder", ["mask_transformer", "cbt"])
def test_mask_decoders_layer_normalise_over_classes(decoder):
    # LayerNorm over the classes (unit weight, zero bias at init): every pixel's logits have mean 0 and, without
    # the eps (cosines are small at init), variance 1 on the patch grid; mean 0 after the linear upsampling.
    model = _tiny(decoder).eval()
    model.decoder.head.mask_norm.eps = 0.0
    logits = model(torch.randn(1, 3, 64, 64))
    assert logits.mean(1).abs().max() < 1e-5
    tokens, grid = model.encoder.forward_tokens(torch.randn(1, 3, 64, 64))
    masks = model.decoder(tokens[:, 1:], grid)
    assert torch.allclose(masks.var(1, unbiased=False), torch.ones(1, *grid), atol=1e-4)


@pytest.mark.parametrize("decoder", DECODERS)
def test_mita_encoder_on_a_non_square_grid_then_a_square_one(decoder):
    model = _tiny(decoder, {"name": "mita", "m": 4, "k": 4}).eval()
    assert model(torch.randn(2, 3, 64, 96)).shape == (2, 5, 64, 96)
    assert all(block.attn.grid_size == (4, 6) for block in model.encoder.blocks)
    # The grid follows every input: a stale (4, 6) grid would not match 4 x 4 patches and raise.
    assert model(torch.randn(1, 3, 64, 64)).shape == (1, 5, 64, 64)
    assert all(block.attn.grid_size == (4, 4) for block in model.encoder.blocks)


@pytest.mark.parametrize("crop, grid", [(512, 32), (640, 40)])
def test_table_c_mita_runs_on_512_and_640_crops(crop, grid):
    # Table C's attention (m = k = 49, CLS-shifted landmarks) on the real token counts N = 1025 / 1601.
    model = _tiny("cbt", "mita", img_size=512, encoder=MINI_ENCODER).eval()
    attn = model.encoder.blocks[0].attn
    assert (attn.m, attn.topk, attn.landmark_layout) == (49, 49, "official")
    tokens, got_grid = model.encoder.forward_tokens(torch.randn(1, 3, crop, crop))
    assert got_grid == (grid, grid) and tokens.shape == (1, 1 + grid * grid, 48)
    assert attn.grid_size == (grid, grid)
    assert model(torch.randn(1, 3, crop, crop)).shape == (1, 5, crop, crop)


def test_input_sides_that_are_not_multiples_of_16_are_padded_and_cropped():
    model = _tiny("linear").eval()
    images = torch.randn(1, 3, 50, 70)
    padded = F.pad(images, (0, 10, 0, 14))
    assert torch.allclose(model(images), model(padded)[..., :50, :70], atol=1e-6)


def test_position_embedding_is_resampled_bilinearly_for_other_grids():
    enc = _tiny("linear").encoder
    native = enc.position_embedding((4, 4))
    assert native is enc.pos_embed
    pos = enc.position_embedding((6, 8))
    assert pos.shape == (1, 1 + 48, 192)
    assert torch.equal(pos[:, 0], enc.pos_embed[:, 0])
    grid = enc.pos_embed[:, 1:].reshape(1, 4, 4, 192).permute(0, 3, 1, 2)
    expected = F.interpolate(grid, size=(6, 8), mode="bilinear", align_corners=False)
    assert torch.allclose(pos[:, 1:], expected.flatten(2).transpose(1, 2), atol=1e-6)


def test_timm_vit_tiny_weights_load_into_the_encoder_and_give_timm_features():
    torch.manual_seed(0)
    reference = timm.create_model("vit_tiny_patch16_224", pretrained=False).eval()
    state = reference.state_dict()
    model = create_segmenter("vit_tiny", img_size=224, decoder="linear", drop_path_rate=0.0).eval()
    result = model.encoder.load_state_dict(state, strict=False)
    assert result.missing_keys == [] and sorted(result.unexpected_keys) == ["head.bias", "head.weight"]
    images = torch.randn(2, 3, 224, 224)
    with torch.no_grad():
        assert torch.allclose(model.encoder.forward_features(images), reference.forward_features(images), atol=1e-5)
    # A 512 model takes the same weights: the 14 x 14 position embedding is resampled to 32 x 32 on loading.
    big = create_segmenter("vit_tiny", img_size=512, decoder="cbt", attention="mita")
    result = big.encoder.load_state_dict(state, strict=False)
    assert result.missing_keys == []
    grid = state["pos_embed"][:, 1:].reshape(1, 14, 14, -1).permute(0, 3, 1, 2)
    expected = F.interpolate(grid, size=(32, 32), mode="bilinear", align_corners=False).flatten(2).transpose(1, 2)
    assert torch.allclose(big.encoder.pos_embed[:, 1:], expected, atol=1e-6)
    assert torch.equal(big.encoder.pos_embed[:, :1], state["pos_embed"][:, :1])
    assert torch.equal(big.encoder.blocks[3].attn.qkv.weight, state["blocks.3.attn.qkv.weight"])


def test_sliding_window_equals_a_direct_forward_when_the_image_is_the_window():
    model = _tiny("cbt", {"name": "mita", "m": 4, "k": 4}).eval()
    images = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        direct = model(images)
    assert torch.allclose(sliding_window_logits(model, images, window=64, stride=64), direct, atol=1e-6)


class _PixelModel(nn.Module):
    """A per-pixel model (1x1 conv): the logits of a pixel do not depend on the window, so averaging overlapping
    windows must give the model applied to the whole image."""

    num_classes = 4

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(1)
        self.conv = nn.Conv2d(3, 4, 1)
        self.calls: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.append(tuple(x.shape))
        return self.conv(x)


@pytest.mark.parametrize("size, stride", [((70, 150), 48), ((64, 64), 32), ((100, 64), 64), ((129, 200), 16)])
def test_sliding_window_of_a_per_pixel_model_is_the_model(size, stride):
    model = _PixelModel()
    images = torch.randn(2, 3, *size)
    out = sliding_window_logits(model, images, window=64, stride=stride, num_classes=4)
    with torch.no_grad():
        assert torch.allclose(out, model.conv(images), atol=1e-5)
    assert all(call[-2:] == (64, 64) for call in model.calls)
    n_windows = len(_reference_windows(size[0], 64, stride)) * len(_reference_windows(size[1], 64, stride))
    assert sum(call[0] for call in model.calls) == 2 * n_windows


@pytest.mark.parametrize("size", [(40, 50), (50, 40), (1, 1), (3, 200)])
def test_sliding_window_upscales_a_small_image_and_resizes_back(size):
    model = _PixelModel()
    images = torch.randn(1, 3, *size)
    out = sliding_window_logits(model, images, window=64, stride=64)
    assert out.shape == (1, 4, *size)
    short = min(size)
    up = tuple(64 if s == short else round(s * 64 / short) for s in size)
    big = F.interpolate(images, size=up, mode="bilinear", align_corners=False)
    with torch.no_grad():
        expected = F.interpolate(model.conv(big), size=size, mode="bilinear", align_corners=False)
    assert torch.allclose(out, expected, atol=1e-5)


def _reference_windows(size: int, window: int, stride: int) -> list[int]:
    # Offsets 0, stride, 2 stride, ... clipped to the border, deduplicated.
    n = math.ceil(max(size - window, 0) / stride) + 1
    return sorted({min(i * stride, size - window) for i in range(n)})


def test_sliding_window_averages_overlapping_windows_of_a_real_model():
    model = _tiny("linear").eval()
    images = torch.randn(1, 3, 80, 100)
    out = sliding_window_logits(model, images, window=64, stride=24, batch_size=3)
    total, count = torch.zeros(1, 5, 80, 100), torch.zeros(80, 100)
    with torch.no_grad():
        for t in _reference_windows(80, 64, 24):
            for s in _reference_windows(100, 64, 24):
                total[..., t : t + 64, s : s + 64] += model(images[..., t : t + 64, s : s + 64])
                count[t : t + 64, s : s + 64] += 1
    assert count.min() >= 1 and count.max() > 1
    assert torch.allclose(out, total / count, atol=1e-5)


def _adaptive_bins(length: int, bins: int) -> list[tuple[int, int]]:
    return [((i * length) // bins, -(-((i + 1) * length) // bins)) for i in range(bins)]


def test_cbsa_layer_matches_the_formula():
    # The spec's formula written out per batch and head, with explicit adaptive-average-pooling bins.
    torch.manual_seed(0)
    heads, d, dim, (h, w), (rh, rw), n_cls = 2, 5, 8, (4, 6), (2, 3), 3
    layer = ContractBroadcastAttention(dim, heads=heads, head_dim=d, rep_grid=(rh, rw)).double()
    x = torch.randn(2, h * w + n_cls, dim, dtype=torch.float64)
    out = layer(x, (h, w))
    U, Wo, bo = layer.proj.weight, layer.to_out.weight, layer.to_out.bias
    expected = torch.zeros_like(out)
    for b in range(x.shape[0]):
        heads_out = []
        for j in range(heads):
            Wj = x[b] @ U[j * d : (j + 1) * d].T  # [N, d]: queries, keys and values
            grid_w = Wj[: h * w].reshape(h, w, d)
            rep = torch.stack(
                [
                    grid_w[r0:r1, c0:c1].mean((0, 1))
                    for r0, r1 in _adaptive_bins(h, rh)
                    for c0, c1 in _adaptive_bins(w, rw)
                ]
            )  # [rh rw, d]
            A = torch.softmax(rep @ Wj.T / math.sqrt(d), dim=-1)
            rep = rep + layer.gamma_rep[j, 0, 0] * (A @ Wj)
            x_delta = A.T @ torch.softmax(rep @ rep.T / math.sqrt(d), dim=-1) @ rep
            heads_out.append(layer.gamma_x[j, 0, 0] * x_delta)
        expected[b] = torch.cat(heads_out, dim=-1) @ Wo.T + bo
    assert torch.allclose(out, expected, atol=1e-10)


def test_cbt_decoder_is_prenorm_residual_and_updates_the_class_tokens():
    torch.manual_seed(0)
    dec = CBTDecoder(16, num_classes=3, n_layers=2, heads=2, head_dim=4, rep_grid=2).double()
    patches = torch.randn(1, 12, 16, dtype=torch.float64)
    x = dec.head.append_classes(patches)
    for norm, layer in zip(dec.norms, dec.layers):
        x = x + layer(norm(x), (3, 4))
    assert torch.allclose(dec(patches, (3, 4)), dec.head.masks(x, (3, 4)))
    # Class tokens take part in the contraction attention, so the broadcast changes them.
    assert not torch.allclose(x[:, -3:], dec.head.cls_emb.double())


def test_table_c_macs():
    # Our counter's values (paper: ViT-S + CBT 33G full -> 25G MiTA at 512; ViT-T about -42%).
    with torch.device("meta"):
        full = create_segmenter("vit_small", decoder="cbt", attention="full")
        mita = create_segmenter("vit_small", decoder="cbt", attention="mita")
    assert round(segmenter_flops(full, 512), 2) == 32.95
    assert round(segmenter_flops(mita, 512), 2) == 25.13


@pytest.mark.gpu
def test_table_c_mita_segmenter_on_cuda_triton_against_torch_backend():
    # ViT-S + CBT with MiTA (m = k = 49) at a 512 crop under bf16 autocast: the Triton backend against the PyTorch
    # one on the same weights (top-k ties may route a few queries differently, hence the loose bounds).
    torch.manual_seed(0)
    model = create_segmenter("vit_small", decoder="cbt", attention="mita", drop_path_rate=0.0).cuda().eval()
    images = torch.randn(2, 3, 512, 512, device="cuda")
    outputs = {}
    for backend in ("torch", "triton"):
        for block in model.encoder.blocks:
            block.attn.backend = backend
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
            outputs[backend] = model(images).float()
    ref, fast = outputs["torch"], outputs["triton"]
    assert torch.isfinite(fast).all()
    assert (fast - ref).abs().mean() < 0.05 * ref.std()
    assert (fast.argmax(1) == ref.argmax(1)).float().mean() > 0.95
    with torch.autocast("cuda", dtype=torch.bfloat16):
        model.train()(images).float().square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())


def test_depth_argument_sets_the_encoder_blocks():
    """``depth`` (what the framework's debug=smoke sets as model.depth) reaches the encoder, not the decoder."""
    seg = create_segmenter("vit_tiny", num_classes=3, img_size=32, decoder="linear", depth=1)
    assert len(seg.encoder.blocks) == 1
    assert seg(torch.randn(1, 3, 32, 32)).shape == (1, 3, 32, 32)
