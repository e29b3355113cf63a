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

import pytest

from hyperrecipe.check.report import render_text, report_json
from hyperrecipe.check.run import CheckOptions, run_check

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)

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


BERT_RELU6_RECIPE = """recipe: bert-relu6
version: 1
mesh: [tp]
rules:
  - match: bert.embeddings.word_embeddings
    style: vocab_parallel
  - match: bert.encoder.layer.*.attention.self
    boundary: true
    in_src: {hidden_states: replicate}
    out_names: [attn_output, attn_weights]
    out_src: {attn_output: {tp: shard(-1)}, attn_weights: {tp: shard(1)}}
  - match: bert.encoder.layer.*.attention.self.{query,key,value}
    style: colwise
    boundary: false
  - match: bert.encoder.layer.*.attention.output.dense
    style: rowwise
  - match: bert.encoder.layer.*.intermediate
    boundary: true
    in_src: {hidden_states: replicate}
    out_src: {0: {tp: shard(-1)}}
  - match: bert.encoder.layer.*.intermediate.dense
    style: colwise
    boundary: false
  - match: bert.encoder.layer.*.output.dense
    style: rowwise
"""
"""tests/recipes/cookbook/bert.yaml with the MLP's boundary on ``intermediate``, so that its
activation runs inside it on the column-wise DTensor output."""


def test_an_op_without_a_dtensor_rule_only_in_backward_is_named_with_its_boundary(
        tmp_path: Path) -> None:
    """BERT with ``hidden_act: relu6``: ``F.hardtanh`` runs forward on a sharded DTensor, and
    ``aten.hardtanh_backward`` has no DTensor rule (torch 2.13). DTensor's bare error used to
    come out of ``loss.backward()``; the rank now raises hyperrecipe's, naming the boundary whose
    backward ran it. Production mode agrees with one process."""
    recipe = tmp_path / "bert-relu6.yaml"
    recipe.write_text(BERT_RELU6_RECIPE, encoding="utf-8")
    config = {**json.loads((ROOT / "tests/recipes/cookbook/models/tiny-bert.json").read_text()),
              "hidden_act": "relu6"}
    report = run_check(CheckOptions(recipe=str(recipe), model="hf:bert/sequence-classification",
                                    model_config=config, mesh={"tp": 2}))
    production, validate = report.modes
    assert production.agree and production.error is None
    assert production.comparison is not None and len(production.comparison.gradients) == 41
    assert validate.error is not None and report.exit_code == 2
    assert ("ValidateUnsupportedError: bert.encoder.layer.1.intermediate: validate mode cannot "
            "run aten.hardtanh_backward.default in the backward of this boundary's compute: "
            "DTensor (torch ") in validate.error, validate.error
    assert "sharding strategy" not in validate.error
