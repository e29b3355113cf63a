"""Where the shipped recipes and tiny model configs are, in a checkout and in an installed wheel.

They live in the repository's top-level ``recipes/`` (recipes) and ``recipes/models/`` (tiny
``transformers`` configs, ``tiny-<family>.json``). A wheel carries the same files as package data
in ``hyperrecipe/_shipped/`` (``pyproject.toml`` maps that package to ``recipes/``), so
``load_recipe("llama")`` and ``--model-config tiny-llama`` work outside a checkout too. Nothing
here imports torch.
"""

from __future__ import annotations

from pathlib import Path

__all__ = ["model_config_file", "model_configs", "shipped_dir"]

_PACKAGE = Path(__file__).resolve().parent


def shipped_dir() -> Path:
    """The folder of shipped recipes: the installed package data, else the checkout's
    ``recipes/`` (a path that may not exist when neither is there)."""
    installed = _PACKAGE / "_shipped"
    if installed.is_dir():
        return installed
    return _PACKAGE.parent / "recipes"


def model_configs() -> dict[str, Path]:
    """Shipped tiny model config name (``tiny-llama``) → JSON file."""
    folder = shipped_dir() / "models"
    if not folder.is_dir():
        return {}
    return {p.stem: p for p in sorted(folder.iterdir()) if p.suffix == ".json"}


def model_config_file(name: str) -> Path | None:
    """The file of a shipped tiny model config (``tiny-llama`` or ``tiny-llama.json``), or
    ``None``."""
    return model_configs().get(name.removesuffix(".json"))
