"""OmegaConf resolvers the configs use (registered by tasks/run.py and by scripts that compose configs)."""

from __future__ import annotations

import hashlib
from pathlib import Path

from omegaconf import OmegaConf

REPO_ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = REPO_ROOT / "configs"


def short_dirname(name: str, limit: int = 120) -> str:
    """A folder name for a run's overrides: as is when short, else its start plus a hash (names stay unique and
    below the 255-byte limit of file systems)."""
    name = name.replace("/", "_")
    if len(name) <= limit:
        return name
    return f"{name[: limit - 9]}-{hashlib.sha1(name.encode()).hexdigest()[:8]}"


def register_resolvers() -> None:
    """``${mita_root:}``: the repository root (the folder holding configs/), whatever the working directory;
    ``${short_dirname:...}``: see :func:`short_dirname`."""
    if not OmegaConf.has_resolver("mita_root"):
        OmegaConf.register_new_resolver("mita_root", lambda: str(REPO_ROOT))
    if not OmegaConf.has_resolver("short_dirname"):
        OmegaConf.register_new_resolver("short_dirname", lambda name: short_dirname(str(name)))


def compose(overrides: list[str] | None = None, config_name: str = "train", hydra_config: bool = False):
    """Compose the training config outside ``tasks.run`` (scripts, tests).

    Args:
        overrides: command-line style overrides (``["experiment=imagenet/deit_s-mita"]``).
        config_name: the primary config.
        hydra_config: also return the ``hydra`` node (needed to resolve ``${hydra:...}``), and register it.

    Returns:
        The composed DictConfig.
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.hydra_config import HydraConfig

    register_resolvers()
    GlobalHydra.instance().clear()
    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base="1.3"):
        cfg = hydra_compose(config_name=config_name, overrides=overrides or [], return_hydra_config=hydra_config)
    if hydra_config:
        HydraConfig.instance().set_config(cfg)
    return cfg
