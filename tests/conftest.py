from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def in_root(monkeypatch: pytest.MonkeyPatch) -> Path:
    """Run from the repository root so recipe paths in messages are stable."""
    monkeypatch.chdir(ROOT)
    return ROOT


@pytest.fixture(scope="session")
def tiny_llama_tree():  # type: ignore[no-untyped-def]
    from hyperrecipe.model_tree import build_model, snapshot

    return snapshot(build_model("hf:llama", str(ROOT / "recipes/models/tiny-llama.json")))
