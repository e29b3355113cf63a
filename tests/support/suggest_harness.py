"""What the suggest tests share: suggest a recipe at tp=2 on a tiny config, require it verified
with sequence parallelism, then check the written file again as a user would run it (two gloo
ranks, both modes, the model's defaults)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hyperrecipe.check.run import CheckOptions, run_check
from hyperrecipe.suggest import SuggestOptions, Suggestion, suggest_recipe
from hyperrecipe.suggest.sequence import SEQUENCE_GROUP

TP2 = {"tp": 2}


def suggest_and_recheck(family: str, config: str | dict[str, Any], tmp_path: Path) -> Suggestion:
    s = suggest_recipe(f"hf:{family}", TP2, model_config=config,
                       options=SuggestOptions(timeout_s=120))
    assert s.verified, s.summary()
    assert SEQUENCE_GROUP in {r.group for r in s.rules}, s.summary()
    path = tmp_path / f"{family}.yaml"
    path.write_text(s.text)
    report = run_check(CheckOptions(recipe=str(path), model=f"hf:{family}",
                                    model_config=s.check_config, mesh=TP2, timeout_s=120))
    assert report.agree, [(m.mode, m.error, m.comparison and m.comparison.first)
                          for m in report.modes]
    return s
