"""``is_committed``: what a trainer resuming from its newest checkpoint asks of a folder, read
from the commit record ``save_checkpoint`` writes last (hyperrecipe/runtime/state/integrity.py).
"""

from __future__ import annotations

from pathlib import Path

from hyperrecipe.runtime import is_committed
from hyperrecipe.runtime.state.integrity import COMMIT


def test_only_a_folder_whose_record_says_committed_is_committed(tmp_path: Path) -> None:
    assert not is_committed(tmp_path)  # no record: another tool's folder, or a save not begun
    (tmp_path / COMMIT).write_text('{"state": "writing"}')
    assert not is_committed(tmp_path)  # a save killed halfway
    (tmp_path / COMMIT).write_text('{"state": "committed", "files": {}}')
    assert is_committed(tmp_path)
    assert is_committed(str(tmp_path))


def test_a_malformed_record_is_not_committed(tmp_path: Path) -> None:
    for text in ("{", "[]", '{"files": {}}', '"committed"'):
        (tmp_path / COMMIT).write_text(text)
        assert not is_committed(tmp_path), text
