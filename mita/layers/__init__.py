"""Attention layers. Importing this package registers every layer module found in it."""

import importlib
import pkgutil

from mita.layers.base import AttentionBase

for _info in pkgutil.iter_modules(__path__):
    if _info.name != "base" and not _info.name.startswith("_"):
        importlib.import_module(f"{__name__}.{_info.name}")

__all__ = ["AttentionBase"]
