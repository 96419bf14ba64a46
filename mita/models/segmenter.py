"""Segmenter (Strudel et al., ICCV 2021) with any registered attention in the ViT encoder, for Table C (ADE20K).

The encoder is a timm ``VisionTransformer`` (:class:`SegmenterEncoder`) whose blocks take their attention from
:mod:`mita.registry`; it runs on any patch grid (the position embedding is resampled and every attention layer is
told the grid of the current input, so MiTA pools its landmarks on a 32 x 32 grid for a 512 crop, 40 x 40 for 640,
4 x 6 for a 64 x 96 test image). Three decoders turn the patch tokens into per-class masks:

- ``"linear"``: Segmenter's linear decoder (one ``Linear(dim, classes)`` per patch).
- ``"mask_transformer"``: Segmenter's mask transformer (class embeddings appended to the patch tokens, standard
  transformer blocks, masks = cosine similarity of projected patch and class features, LayerNorm over classes).
- ``"cbt"``: the Contract-and-Broadcast Transformer decoder the MiTA reference trains (CBSA, arXiv 2509.16875):
  attention-only blocks that contract all tokens into 10 x 10 pooled representatives and broadcast back.

Masks are upsampled bilinearly to the input size. See ``docs/segmentation.md`` for the math and the assumptions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.layers import resample_abs_pos_embed, trunc_normal_
from timm.models._manipulate import checkpoint_seq
from timm.models.vision_transformer import Block

from mita.models.vit import AttentionVisionTransformer, split_attention_spec
from mita.utils.flops import model_gmacs

# Backbone name -> (width, heads); all are patch 16, depth 12, CLS token, qkv bias (timm AugReg ViT-T/S/B).
BACKBONES: dict[str, tuple[int, int]] = {"vit_tiny": (192, 3), "vit_small": (384, 6), "vit_base": (768, 12)}
DECODERS = ("linear", "mask_transformer", "cbt")
# Table C's MiTA: m = k = 49 (7 x 7 landmarks) with the reference's CLS-shifted landmark grid.
MITA_TABLE_C_DEFAULTS: dict[str, Any] = {"m": 49, "k": 49, "landmark_layout": "official"}
PATCH_SIZE = 16


def _resize_pos_embed(pos_embed: torch.Tensor, new_grid: tuple[int, int], old_grid: tuple[int, int]) -> torch.Tensor:
    """[1, 1 + h w, C] -> [1, 1 + h' w', C]: the patch part resampled bilinearly (as Segmenter does), CLS kept."""
    if tuple(new_grid) == tuple(old_grid):
        return pos_embed
    return resample_abs_pos_embed(
        pos_embed, new_size=list(new_grid), old_size=list(old_grid), num_prefix_tokens=1,
        interpolation="bilinear", antialias=False,
    )  # fmt: skip


class SegmenterEncoder(AttentionVisionTransformer):
    """ViT encoder of Segmenter: a timm ``VisionTransformer`` (no head) that runs on any patch grid.

    Parameter names are timm's, so a full-attention timm ViT state dict (AugReg ViT-T/S/B) loads with
    ``load_state_dict(strict=False)``; only its ``head.*`` is left out. A checkpoint's ``pos_embed`` of another
    grid (224: 14 x 14) is resampled to this encoder's grid while loading.

    Args:
        attention: registered name or ``{"name": ..., **options}``.
        attention_kwargs: the attention's own options.
        **kwargs: ``VisionTransformer`` arguments (``img_size``, ``embed_dim``, ``depth``, ``num_heads``, ...).
    """

    def __init__(
        self,
        attention: str | Mapping[str, Any] = "full",
        attention_kwargs: Mapping[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        kwargs.setdefault("num_classes", 0)
        super().__init__(attention=attention, attention_kwargs=attention_kwargs, **kwargs)
        if self.num_prefix_tokens != 1 or self.no_embed_class:
            raise ValueError("SegmenterEncoder: expects exactly one CLS token with a position embedding")
        # Inputs of any grid: the position embedding is resampled per input in forward_tokens.
        self.patch_embed.strict_img_size = False

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs) -> None:
        key = prefix + "pos_embed"
        pos = state_dict.get(key)
        if pos is not None and pos.shape != self.pos_embed.shape:
            n_patches = pos.shape[1] - self.num_prefix_tokens
            side = int(round(n_patches**0.5))
            if side * side != n_patches:
                raise ValueError(f"pos_embed: checkpoint has {n_patches} patch positions, not a square grid")
            state_dict[key] = _resize_pos_embed(pos, tuple(self.patch_embed.grid_size), (side, side))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def position_embedding(self, grid: tuple[int, int]) -> torch.Tensor:
        """[1, 1 + h w, C] position embedding for patch grid ``grid`` = (h, w) (resampled if not the native one)."""
        return _resize_pos_embed(self.pos_embed, grid, tuple(self.patch_embed.grid_size))

    def forward_tokens(self, images: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        """Encode images whose sides are multiples of the patch size.

        Args:
            images: [B, 3, H, W].

        Returns:
            (tokens [B, 1 + h w, C] after the final norm, CLS first; grid (h, w) = (H / 16, W / 16)).
        """
        ph, pw = self.patch_embed.patch_size
        H, W = images.shape[-2:]
        if H % ph or W % pw:
            raise ValueError(f"forward_tokens: image sides must be multiples of the patch size, got {H}x{W}")
        grid = (H // ph, W // pw)
        x = self.patch_embed(images)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)
        x = self.pos_drop(x + self.position_embedding(grid))
        x = self.norm_pre(self.patch_drop(x))
        # MiTA pools its landmarks on the patch grid: every layer gets the grid of this input.
        for block in self.blocks:
            block.attn.grid_size = grid
            block.attn.num_prefix_tokens = self.num_prefix_tokens
        if self.grad_checkpointing and not torch.jit.is_scripting():
            x = checkpoint_seq(self.blocks, x)
        else:
            x = self.blocks(x)
        return self.norm(x), grid

    def forward_features(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        """timm's ``forward_features`` on any grid: [B, 3, H, W] -> [B, 1 + h w, C]."""
        if args or kwargs.get("attn_mask") is not None or kwargs.get("is_causal"):
            raise ValueError("SegmenterEncoder.forward_features: attn_mask / is_causal are not supported")
        return self.forward_tokens(x)[0]


def _init_decoder_weights(module: nn.Module) -> None:
    # Segmenter's decoder init: truncated normal 0.02 for linear weights, zero biases, unit LayerNorms.
    if isinstance(module, nn.Linear):
        trunc_normal_(module.weight, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.LayerNorm):
        nn.init.ones_(module.weight)
        nn.init.zeros_(module.bias)


def _tokens_to_masks(masks: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
    """[B, h w, K] -> [B, K, h, w]."""
    return masks.transpose(1, 2).unflatten(2, grid)


class LinearDecoder(nn.Module):
    """Segmenter's linear decoder: one linear map from each patch token to the class logits.

    Args:
        dim: encoder width C.
        num_classes: K.
    """

    def __init__(self, dim: int, num_classes: int) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.head = nn.Linear(dim, num_classes)
        self.apply(_init_decoder_weights)

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Args: x [B, h w, C] patch tokens; grid (h, w). Returns [B, K, h, w] logits on the patch grid."""
        return _tokens_to_masks(self.head(x), grid)


class _ClassMaskHead(nn.Module):
    """Class embeddings and the mask read-out shared by the mask transformer and CBT decoders.

    masks = LayerNorm_K( normalize(patches P) . normalize(classes Q)^T ), with P, Q optional projections
    (Segmenter's mask transformer has them; the reference CBT decoder uses identities).
    """

    def __init__(self, d_model: int, num_classes: int, project: bool) -> None:
        super().__init__()
        self.num_classes = num_classes
        self.cls_emb = nn.Parameter(torch.randn(1, num_classes, d_model))
        self.decoder_norm = nn.LayerNorm(d_model)
        self.mask_norm = nn.LayerNorm(num_classes)
        self.proj_patch = self.proj_classes = None
        if project:
            scale = d_model**-0.5
            self.proj_patch = nn.Parameter(scale * torch.randn(d_model, d_model))
            self.proj_classes = nn.Parameter(scale * torch.randn(d_model, d_model))

    def append_classes(self, x: torch.Tensor) -> torch.Tensor:
        """[B, P, D] -> [B, P + K, D]: the class embeddings after the patch tokens."""
        return torch.cat([x, self.cls_emb.expand(x.shape[0], -1, -1)], dim=1)

    def masks(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """[B, P + K, D] decoded tokens -> [B, K, h, w] masks."""
        x = self.decoder_norm(x)
        patches, classes = x[:, : -self.num_classes], x[:, -self.num_classes :]
        if self.proj_patch is not None:
            patches, classes = patches @ self.proj_patch, classes @ self.proj_classes
        patches = F.normalize(patches, dim=-1, eps=1e-12)
        classes = F.normalize(classes, dim=-1, eps=1e-12)
        return _tokens_to_masks(self.mask_norm(patches @ classes.transpose(1, 2)), grid)


class MaskTransformerDecoder(nn.Module):
    """Segmenter's mask transformer: K class embeddings appended to the projected patch tokens, ``n_layers``
    standard pre-norm transformer blocks, masks = LayerNorm over classes of the cosine similarity between
    projected patch and class features.

    Args:
        dim: encoder width C.
        num_classes: K.
        n_layers: transformer blocks (Segmenter: 2).
        d_model: decoder width (default C).
        n_heads: heads (default d_model / 64, Segmenter's choice).
        mlp_ratio: MLP hidden width / d_model.
        dropout: dropout on attention probabilities, projections and MLP (Segmenter: 0.1).
        drop_path_rate: stochastic depth, linearly increasing over the blocks (Segmenter: 0).
    """

    def __init__(
        self,
        dim: int,
        num_classes: int,
        n_layers: int = 2,
        d_model: int | None = None,
        n_heads: int | None = None,
        mlp_ratio: float = 4.0,
        dropout: float = 0.1,
        drop_path_rate: float = 0.0,
    ) -> None:
        super().__init__()
        d_model = d_model or dim
        n_heads = n_heads or max(d_model // 64, 1)
        self.proj_dec = nn.Linear(dim, d_model)
        rates = [drop_path_rate * i / max(n_layers - 1, 1) for i in range(n_layers)]
        self.blocks = nn.ModuleList(
            Block(d_model, n_heads, mlp_ratio, qkv_bias=True, proj_drop=dropout, attn_drop=dropout, drop_path=r)
            for r in rates
        )
        self.head = _ClassMaskHead(d_model, num_classes, project=True)
        self.apply(_init_decoder_weights)
        trunc_normal_(self.head.cls_emb, std=0.02)

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Args: x [B, h w, C] patch tokens; grid (h, w). Returns [B, K, h, w] masks on the patch grid."""
        x = self.head.append_classes(self.proj_dec(x))
        for block in self.blocks:
            x = block(x)
        return self.head.masks(x, grid)


class ContractBroadcastAttention(nn.Module):
    """One CBSA attention (Contract-and-Broadcast Self-Attention) of the CBT decoder.

    With W = x U (U: one bias-free projection serving as queries, keys and values; per head d_h columns) and
    R the representatives (the patch part of W average-pooled to ``rep_grid`` on the patch grid):
        A = softmax(R W^T / sqrt(d_h))              [r, N] contraction attention over all N tokens
        R <- R + gamma_rep * A W                     contract
        x_delta = A^T softmax(R R^T / sqrt(d_h)) R   broadcast (with the contracted R)
        out = Linear(concat_heads(gamma_x * x_delta))
    gamma_rep, gamma_x: one scalar per head (random-normal init, as the reference).

    Args:
        dim: token width D.
        heads: heads (reference: 3).
        head_dim: d_h (reference: 100).
        rep_grid: (rh, rw) representatives grid (reference: 10 x 10).
    """

    def __init__(self, dim: int, heads: int = 3, head_dim: int = 100, rep_grid: tuple[int, int] = (10, 10)) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, head_dim
        self.rep_grid = (int(rep_grid[0]), int(rep_grid[1]))
        self.scale = head_dim**-0.5
        self.proj = nn.Linear(dim, heads * head_dim, bias=False)
        self.gamma_rep = nn.Parameter(torch.randn(heads, 1, 1))
        self.gamma_x = nn.Parameter(torch.randn(heads, 1, 1))
        self.to_out = nn.Linear(heads * head_dim, dim)

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Args: x [B, N, D] tokens whose first h w are the patches (row-major); grid (h, w).
        Returns: [B, N, D] update (the caller adds the residual)."""
        B, N, _ = x.shape
        h, w = grid
        w_all = self.proj(x)  # [B, N, H d]
        patch_map = w_all[:, : h * w].transpose(1, 2).reshape(B, -1, h, w)
        reps = F.adaptive_avg_pool2d(patch_map, self.rep_grid).flatten(2).transpose(1, 2)  # [B, r, H d]
        w_all = w_all.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)  # [B, H, N, d]
        reps = reps.unflatten(-1, (self.heads, self.head_dim)).transpose(1, 2)  # [B, H, r, d]
        contraction = torch.softmax((reps @ w_all.transpose(-1, -2)) * self.scale, dim=-1)  # [B, H, r, N]
        reps = reps + self.gamma_rep * (contraction @ w_all)
        mixed = torch.softmax((reps @ reps.transpose(-1, -2)) * self.scale, dim=-1) @ reps  # [B, H, r, d]
        x_delta = self.gamma_x * (contraction.transpose(-1, -2) @ mixed)  # [B, H, N, d]
        return self.to_out(x_delta.transpose(1, 2).reshape(B, N, -1))


class CBTDecoder(nn.Module):
    """Contract-and-Broadcast Transformer decoder (the MiTA reference's ADE20K decoder).

    K class embeddings are appended to the patch tokens (width C, no input projection); ``n_layers`` pre-norm
    residual CBSA blocks (no MLP); masks = LayerNorm over classes of the cosine similarity between the
    (LayerNormed) patch and class tokens.

    Args:
        dim: encoder width C (also the decoder width).
        num_classes: K.
        n_layers: blocks (reference: 3).
        heads: heads per block (reference: 3).
        head_dim: d_h (reference: 100; inner width heads * d_h = 300).
        rep_grid: representatives grid, an int (square) or (rh, rw) (reference: 10).
    """

    def __init__(
        self,
        dim: int,
        num_classes: int,
        n_layers: int = 3,
        heads: int = 3,
        head_dim: int = 100,
        rep_grid: int | tuple[int, int] = 10,
    ) -> None:
        super().__init__()
        rep_grid = (rep_grid, rep_grid) if isinstance(rep_grid, int) else tuple(rep_grid)
        self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(n_layers))
        self.layers = nn.ModuleList(ContractBroadcastAttention(dim, heads, head_dim, rep_grid) for _ in range(n_layers))
        self.head = _ClassMaskHead(dim, num_classes, project=False)
        self.apply(_init_decoder_weights)
        trunc_normal_(self.head.cls_emb, std=0.02)

    def forward(self, x: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        """Args: x [B, h w, C] patch tokens; grid (h, w). Returns [B, K, h, w] masks on the patch grid."""
        x = self.head.append_classes(x)
        for norm, layer in zip(self.norms, self.layers):
            x = x + layer(norm(x), grid)
        return self.head.masks(x, grid)


class Segmenter(nn.Module):
    """ViT encoder + mask decoder; per-pixel class logits at the input resolution.

    Args:
        encoder: :class:`SegmenterEncoder`.
        decoder: a decoder taking (patch tokens [B, h w, C], grid) and returning [B, K, h, w].
        num_classes: K.
    """

    # The encoder resamples a position embedding of another grid while loading (tasks.common.weights reads this).
    resamples_pos_embed = True

    def __init__(self, encoder: SegmenterEncoder, decoder: nn.Module, num_classes: int) -> None:
        super().__init__()
        self.encoder = encoder
        self.decoder = decoder
        self.num_classes = num_classes
        self.patch_size = int(encoder.patch_embed.patch_size[0])

    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Parameters Segmenter keeps out of weight decay (position embedding, CLS, class embeddings)."""
        names = {"encoder." + n for n in self.encoder.no_weight_decay()}
        return names | {n for n, _ in self.decoder.named_parameters(prefix="decoder") if n.endswith("cls_emb")}

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        """Args:
            images: [B, 3, H, W] (normalised with mean = std = 0.5 for AugReg weights). Sides that are not
                multiples of 16 are zero-padded at the bottom/right and the padding is cropped from the logits.

        Returns:
            [B, K, H, W] logits (masks upsampled bilinearly from the patch grid).
        """
        H, W = images.shape[-2:]
        p = self.patch_size
        x = F.pad(images, (0, (-W) % p, 0, (-H) % p))
        tokens, grid = self.encoder.forward_tokens(x)
        masks = self.decoder(tokens[:, self.encoder.num_prefix_tokens :], grid)
        masks = F.interpolate(masks, size=x.shape[-2:], mode="bilinear", align_corners=False)
        return masks[..., :H, :W]


def create_segmenter(
    backbone: str = "vit_small",
    num_classes: int = 150,
    img_size: int = 512,
    decoder: str = "cbt",
    attention: str | Mapping[str, Any] = "full",
    drop_path_rate: float = 0.1,
    encoder_kwargs: Mapping[str, Any] | None = None,
    depth: int | None = None,
    **decoder_kwargs: Any,
) -> Segmenter:
    """Build a Segmenter for Table C.

    Args:
        backbone: ``"vit_tiny"`` / ``"vit_small"`` / ``"vit_base"`` (patch 16, depth 12, CLS, qkv bias; the
            parameter names of timm's ``vit_{tiny,small,base}_patch16_224``).
        num_classes: K (ADE20K: 150).
        img_size: training crop (512 or 640); the native grid of the position embedding. Other input sizes work
            (the embedding is resampled).
        decoder: ``"linear"``, ``"mask_transformer"`` or ``"cbt"``.
        attention: encoder attention, a registered name or ``{"name": ..., **options}``. For ``"mita"`` the
            options default to Table C's ``m = k = 49`` with the ``"official"`` landmark layout.
        drop_path_rate: encoder stochastic depth (Table C: 0.1).
        encoder_kwargs: extra ``VisionTransformer`` arguments (e.g. ``{"depth": 2}`` for tests).
        depth: encoder blocks, if not 12 (the framework's ``debug=smoke`` sets ``model.depth=1``).
        **decoder_kwargs: the decoder's options (:class:`MaskTransformerDecoder`, :class:`CBTDecoder`).

    Returns:
        :class:`Segmenter`; ``model.encoder`` loads a timm ViT state dict with ``strict=False``.
    """
    if backbone not in BACKBONES:
        raise ValueError(f"backbone must be one of {sorted(BACKBONES)}, got {backbone!r}")
    if decoder not in DECODERS:
        raise ValueError(f"decoder must be one of {DECODERS}, got {decoder!r}")
    name, options = split_attention_spec(attention)
    if name == "mita":
        options = {**MITA_TABLE_C_DEFAULTS, **options}
    dim, heads = BACKBONES[backbone]
    args: dict[str, Any] = dict(
        img_size=img_size, patch_size=PATCH_SIZE, embed_dim=dim, depth=12, num_heads=heads, mlp_ratio=4.0,
        qkv_bias=True, drop_path_rate=drop_path_rate, num_classes=0,
    )  # fmt: skip
    args.update(encoder_kwargs or {})
    if depth is not None:
        args["depth"] = int(depth)
    encoder = SegmenterEncoder(attention=name, attention_kwargs=options, **args)
    width = encoder.embed_dim
    if decoder == "linear":
        if decoder_kwargs:
            raise ValueError(f"the linear decoder takes no options, got {sorted(decoder_kwargs)}")
        head: nn.Module = LinearDecoder(width, num_classes)
    elif decoder == "mask_transformer":
        head = MaskTransformerDecoder(width, num_classes, **decoder_kwargs)
    else:
        head = CBTDecoder(width, num_classes, **decoder_kwargs)
    return Segmenter(encoder, head, num_classes)


def _window_starts(size: int, window: int, stride: int) -> list[int]:
    """Window offsets along one axis: every ``stride`` while the window fits, then one aligned to the border."""
    starts = list(range(0, size - window, stride))
    return starts + [size - window]


@torch.no_grad()
def sliding_window_logits(
    model: nn.Module,
    images: torch.Tensor,
    window: int = 512,
    stride: int = 512,
    num_classes: int | None = None,
    batch_size: int | None = None,
) -> torch.Tensor:
    """Segmenter's sliding-window inference: averaged window logits at the image's resolution.

    An image whose shorter side is below ``window`` is first upscaled (bilinear) so that the shorter side equals
    ``window``; windows of ``window x window`` at ``stride`` cover it (the last one per axis aligned to the
    border); overlapping logits are averaged, and resized back (bilinear) if the image was upscaled. Softmax is
    the caller's step.

    Args:
        model: maps [b, 3, window, window] to [b, K, window, window] logits (a :class:`Segmenter`).
        images: [B, 3, H, W], any H, W >= 1.
        window: window side.
        stride: window stride (``stride > window`` leaves gaps only between the non-border windows; Table C uses
            stride = window).
        num_classes: K (default: ``model.num_classes``).
        batch_size: windows per forward (default: all windows of the batch at once).

    Returns:
        [B, K, H, W] float32 logits.
    """
    if window < 1 or stride < 1:
        raise ValueError(f"window and stride must be >= 1, got {window}, {stride}")
    num_classes = num_classes if num_classes is not None else model.num_classes
    B, _, H, W = images.shape
    x = images
    if min(H, W) < window:
        ratio = window / min(H, W)
        size = (window, max(window, round(W * ratio))) if H <= W else (max(window, round(H * ratio)), window)
        x = F.interpolate(x, size=size, mode="bilinear", align_corners=False)
    Hr, Wr = x.shape[-2:]
    boxes = [(t, s) for t in _window_starts(Hr, window, stride) for s in _window_starts(Wr, window, stride)]
    crops = torch.cat([x[:, :, t : t + window, s : s + window] for t, s in boxes])  # [n_boxes * B, 3, w, w]
    chunk = batch_size or crops.shape[0]
    logits = torch.cat([model(c) for c in crops.split(chunk)]).float()
    if logits.shape[1] != num_classes:
        raise ValueError(f"sliding_window_logits: model gave {logits.shape[1]} classes, expected {num_classes}")
    total = x.new_zeros(B, num_classes, Hr, Wr, dtype=torch.float32)
    count = x.new_zeros(1, 1, Hr, Wr, dtype=torch.float32)
    for (t, s), part in zip(boxes, logits.split(B)):
        total[:, :, t : t + window, s : s + window] += part
        count[:, :, t : t + window, s : s + window] += 1
    out = total / count.clamp_min(1)
    if (Hr, Wr) != (H, W):
        out = F.interpolate(out, size=(H, W), mode="bilinear", align_corners=False)
    return out


def segmenter_flops(model: Segmenter, img_size: int | tuple[int, int] = 512) -> float:
    """GMACs (10^9 multiply-accumulates; the paper calls them FLOPs) of one forward on one image.

    Counted by :func:`mita.utils.flops.count_macs`: every executed matmul (encoder, decoder, their
    projections), MiTA's attention core by its cost formula; element-wise work, pooling and the bilinear
    upsampling are not counted. A model built under ``torch.device("meta")`` is counted without computing.

    Args:
        model: a :class:`Segmenter`.
        img_size: input side, or (H, W).

    Returns:
        GMACs per image (float).
    """
    h, w = (img_size, img_size) if isinstance(img_size, int) else img_size
    return model_gmacs(model, (3, int(h), int(w)))
