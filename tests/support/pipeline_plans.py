"""Pipeline plans for the runtime tests, compiled from a recipe's ``pipeline`` section as a
user's are."""

from __future__ import annotations

from torch import nn

from hyperrecipe.plan import Plan


def pipeline_plan(model: nn.Module, *, layers: str = "model.layers", pp: int = 2,
                  schedule: str = "GPipe", stages_per_rank: int = 1,
                  microbatches: int = 4) -> Plan:
    """The plan ``hyperrecipe compile`` makes of a recipe whose only section is ``pipeline``
    (the split balanced by parameter bytes, the resolver's default)."""
    import tempfile
    from pathlib import Path

    from tests.support.recipe_text import resolve_only

    per_rank = f"  stages_per_rank: {stages_per_rank}\n" if stages_per_rank > 1 else ""
    text = (f"recipe: test-pp\nversion: 1\nmesh: [pp]\npipeline:\n  layers: {layers}\n"
            f"  schedule: {schedule}\n  microbatches: {microbatches}\n{per_rank}rules: []\n")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "pp.yaml"
        path.write_text(text, encoding="utf-8")
        return resolve_only(str(path), model, {"pp": pp})
