from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

WriteTree = Callable[[dict[str, str | bytes]], Path]


@pytest.fixture
def write_tree(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> WriteTree:
    """Write files (dedented text or raw bytes) under a fresh folder and chdir into it."""

    def write(files: dict[str, str | bytes]) -> Path:
        for name, content in files.items():
            path = tmp_path / name
            path.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(content, bytes):
                path.write_bytes(content)
            else:
                path.write_text(textwrap.dedent(content), encoding="utf-8")
        monkeypatch.chdir(tmp_path)
        return tmp_path

    return write
