"""docs/guide.md: its final recipe (the yaml block starting `# guide: final recipe`) compiles."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
GUIDE = ROOT / "docs" / "guide.md"
CONFIG = ('{"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, '
          '"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, '
          '"vocab_size": 128, "max_position_embeddings": 128}')


def _final_recipe() -> str:
    blocks = re.findall(r"```yaml\n(.*?)```", GUIDE.read_text(), flags=re.S)
    final = [b for b in blocks if b.startswith("# guide: final recipe\n")]
    assert len(final) == 1, "docs/guide.md needs exactly one yaml block marked '# guide: final recipe'"
    return final[0]


def test_guide_final_recipe_compiles(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # in this process: `python -m hyperrecipe compile` as a process is tested in test_cli, and
    # a fresh interpreter cost this test most of its minute on a loaded machine
    from hyperrecipe.cli import main

    pytest.importorskip("transformers")
    recipe = tmp_path / "gemma.yaml"
    recipe.write_text(_final_recipe())
    code = main(["compile", str(recipe), "--model", "hf:gemma", "--model-config", CONFIG,
                 "--mesh", "tp=2"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    out = captured.out
    assert "plan 'gemma' for mesh tp=2" in out
    # the placements the guide explains: colwise q/k/v and gate/up, rowwise o/down, tied replicate
    assert re.search(r"model\.layers\.\*\.self_attn\.q_proj x2\s+params\s+weight \{tp: shard\(0\)\}", out)
    assert re.search(r"model\.layers\.\*\.mlp\.down_proj x2\s+boundary\s+weight \{tp: shard\(1\)\}", out)
    assert re.search(r"model\.embed_tokens\s+params\s+weight replicate", out)
    assert "collectives per step: 4 forward, 4 backward (all_reduce x8)" in out
