"""Sequence parallelism in `hyperrecipe suggest` around blocks the layer hands more than the
hidden states, and attention regions with a parameter per head.

- A block with replicated parameters whose forward takes inputs beside the hidden states (an
  attention's mask and rotary ``cos``/``sin``) was proposed token-local: on this rank's tokens
  it met a mask for the whole sequence (``size of tensor a (4) must match ... b (8) at
  non-singleton dimension 2``) and sequence parallelism was given up. It is gathered now.
- An attention region read off the structure left its attention sinks (one value per head)
  whole beside this rank's heads, and one whose sinks only some layers hold (MiMo-V2-Flash's
  sliding layers) was not matched at all: the region failed, and sequence parallelism with it.

The translation tests build the model on the meta device only; the end-to-end ones run the real
check (two gloo ranks, production and validate mode, compared with one process, the model's
defaults) and check the written file again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hyperrecipe.models.hf_plans import read_plans
from hyperrecipe.models.hf_tiny import tiny_config
from hyperrecipe.model_tree import build_model, snapshot
from hyperrecipe.suggest.sequence import GATHERED_GROUP, SEQUENCE_GROUP
from hyperrecipe.suggest.structure import blocks_the_plan_leaves_out, structural_entries
from hyperrecipe.suggest.translate import Translation, translate
from tests.support.suggest_harness import TP2, suggest_and_recheck

SEQ = {"tp": "shard(1)"}
HEADS = {"tp": "shard(0)"}


def _translate(family: str) -> Translation:
    model = build_model(f"hf:{family}", tiny_config(family))
    entries = read_plans(model)
    entries = (*entries, *blocks_the_plan_leaves_out(entries, structural_entries(model)))
    return translate(entries, snapshot(model), TP2)




def _fields(t: Translation, match: str, group: str) -> dict[str, Any]:
    return next(dict(r.fields) for r in t.rules if r.match == match and r.group == group)


def test_a_replicated_attention_given_a_mask_and_positions_is_gathered_not_token_local() -> None:
    # Youtu's MLA attention: the plan shards only the MLP, so the attention's parameters are
    # all replicated. Its forward takes position_embeddings and attention_mask beside the
    # hidden states, both made by the model for the whole sequence
    t = _translate("youtu")
    attn = _fields(t, "model.layers.*.self_attn", GATHERED_GROUP)
    assert attn == {"boundary": True, "in_src": {"hidden_states": SEQ},
                    "in_dst": {"hidden_states": "replicate"}, "out_src": {0: "replicate"},
                    "out_dst": {0: SEQ}}
    source = next(r.sources[0] for r in t.rules if r.group == GATHERED_GROUP)
    assert "takes position_embeddings, attention_mask" in source
    assert not any(dict(r.fields).get("local_region") for r in t.rules)


def test_a_moe_block_given_the_hidden_states_alone_stays_token_local() -> None:
    # the rule is about other inputs, not parameters: Mixtral's block runs on this rank's tokens
    t = _translate("mixtral")
    assert _fields(t, "model.layers.*.mlp", SEQUENCE_GROUP)["local_region"] is True


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_youtu_with_its_attention_gathered_passes_check_with_sequence_parallelism(
        tmp_path: Path) -> None:
    s = suggest_and_recheck("youtu", tiny_config("youtu"), tmp_path)
    assert GATHERED_GROUP in {r.group for r in s.rules}
    assert s.narrowed == ()


def test_attention_sinks_read_off_the_structure_are_sharded_with_the_heads() -> None:
    # GPT-OSS's plan shards only the embedding; its attention is read off the structure, and
    # its sinks (num_attention_heads values) go with the heads
    t = _translate("gpt_oss")
    region = next(dict(r.fields) for r in t.rules if r.match == "model.layers.*.self_attn"
                  and not r.deeper)
    assert region["params"] == {"sinks": HEADS}
    assert SEQUENCE_GROUP not in {n.what for n in t.narrowed}


def test_sinks_only_some_layers_hold_are_sharded_in_those_layers() -> None:
    # MiMo-V2-Flash: its sliding-window layers hold sinks, its full-attention ones do not; the
    # plan's `sinks: colwise` matched no module of layer 0 and the attention was left replicated
    t = _translate("mimo_v2_flash")
    types = tiny_config("mimo_v2_flash")["layer_types"]
    sliding = [f"model.layers.{i}.self_attn" for i, k in enumerate(types)
               if k == "sliding_attention"]
    match = sliding[0] if len(sliding) == 1 else "{" + ",".join(sliding) + "}"
    assert _fields(t, match, "model.layers.*.self_attn") == {"params": {"sinks": HEADS}}
    assert "params" not in _fields(t, "model.layers.*.self_attn", "model.layers.*.self_attn")
    assert not any(n.what.startswith("model.layers.*.self_attn") for n in t.narrowed)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_gpt_oss_with_its_sinks_sharded_passes_check_with_sequence_parallelism(
        tmp_path: Path) -> None:
    s = suggest_and_recheck("gpt_oss", tiny_config("gpt_oss"), tmp_path)
    assert "sinks: {tp: shard(0)}" in s.text
