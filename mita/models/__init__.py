"""Backbones. Importing this package registers the timm entrypoints (``mita_deit_*``)."""

from mita.models.vit import (
    AttentionBlock,
    AttentionVisionTransformer,
    Rope2D,
    ViT5,
    create_vit,
    mita_deit_base_patch16_224,
    mita_deit_small_patch16_224,
    mita_deit_tiny_patch16_224,
    mita_vit5_small_patch16_224,
)

__all__ = [
    "AttentionBlock",
    "AttentionVisionTransformer",
    "Rope2D",
    "ViT5",
    "create_vit",
    "mita_deit_base_patch16_224",
    "mita_deit_small_patch16_224",
    "mita_deit_tiny_patch16_224",
    "mita_vit5_small_patch16_224",
]
