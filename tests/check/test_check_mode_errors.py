"""``hyperrecipe check`` reports every mode, even when another could not run.

Tiny Mixtral with transformers' ``eager`` experts, chosen explicitly (``check`` keeps what the
config names): production agrees with one process; validate mode cannot run the loop's
``nonzero`` on a DTensor (an op DTensor cannot shard, outside anything the recipe decides), and
the rank refuses it with hyperrecipe's error naming the boundary and the op, not DTensor's bare
text. The report keeps production's verdict and gives validate its own ERROR line; the exit
code is 2.
"""

from __future__ import annotations

import json
from pathlib import Path

from hyperrecipe.check.report import render_text, report_json
from hyperrecipe.check.run import CheckOptions, run_check

ROOT = Path(__file__).resolve().parents[2]
EAGER_EXPERTS = {**json.loads((ROOT / "recipes/models/tiny-mixtral.json").read_text()),
                 "experts_implementation": "eager"}
NO_STRATEGY = ("ValidateUnsupportedError: model.layers.0.mlp: validate mode cannot run "
               "aten.nonzero.default here: DTensor (torch ")
NONZERO = "cannot shard it: its output's shape depends on the data"


def test_a_mode_that_cannot_run_keeps_the_other_modes_verdict() -> None:
    report = run_check(CheckOptions(recipe=str(ROOT / "recipes/mixtral.yaml"), model="hf:mixtral",
                                    model_config=EAGER_EXPERTS, mesh={"tp": 2}))
    production, validate = report.modes
    assert (production.mode, validate.mode) == ("production", "validate")
    assert production.agree and production.error is None
    assert not validate.agree and validate.comparison is None
    assert validate.error is not None and NO_STRATEGY in validate.error
    assert NONZERO in validate.error and "sharding strategy" not in validate.error
    assert "Sharding propagation failed" not in validate.error
    assert report.exit_code == 2 and [m.mode for m in report.errors] == ["validate"]

    lines = render_text(report).splitlines()
    assert lines[1].startswith("production  agree  ")
    assert lines[2].startswith("validate    ERROR  rank ") and lines[2].endswith(" s")
    assert NO_STRATEGY in lines[2] and "Traceback" not in "\n".join(lines)
    assert lines[3].startswith("could not run: validate (")

    data = report_json(report)
    assert data["agree"] is False
    assert data["modes"]["production"]["agree"] is True
    assert data["modes"]["production"]["error"] is None
    assert data["modes"]["validate"]["agree"] is False
    assert NO_STRATEGY in data["modes"]["validate"]["error"]
    assert data["modes"]["validate"]["first_divergent"] is None
