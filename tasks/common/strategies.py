"""Strategy factories that need Python objects a YAML file cannot name directly."""

from __future__ import annotations

from typing import Any

from hydra.utils import get_class


def fsdp(wrap: list[str], **kwargs: Any):
    """Lightning's FSDPStrategy wrapping each module of the classes named in ``wrap`` as one FSDP unit.

    Args:
        wrap: dotted class paths, e.g. ``["mita.models.vit.AttentionBlock"]``.
        **kwargs: further ``FSDPStrategy`` arguments (``sharding_strategy``, ...).
    """
    from lightning.pytorch.strategies import FSDPStrategy

    return FSDPStrategy(auto_wrap_policy={get_class(name) for name in wrap}, **kwargs)
