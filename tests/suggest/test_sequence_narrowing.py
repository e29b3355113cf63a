"""Sequence parallelism kept where a block of it fails, instead of given up as a whole: a block
that reads the whole sequence is gathered, not run on this rank's tokens (MiniMax's lightning
attention); a region whose sharding fails is computed whole on the gathered sequence
(DiffLlama's head-pairing attention); a module no rule places that the check names runs on
this rank's tokens (HY-V4's hyper-connection head).

The rule tests build the model on the meta device only; the end-to-end one runs the real check
(two gloo ranks, production and validate mode, compared with one process, the model's
defaults) and checks the written file again.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from hyperrecipe.models.hf_plans import read_plans
from hyperrecipe.models.hf_tiny import tiny_config
from hyperrecipe.model_tree import build_model, snapshot
from hyperrecipe.suggest.gathered import GATHERED_INSTEAD, gather_instead
from hyperrecipe.suggest.sequence import GATHERED_GROUP, SEQUENCE_GROUP
from hyperrecipe.suggest.structure import blocks_the_plan_leaves_out, structural_entries
from hyperrecipe.suggest.translate import Translation, translate
from hyperrecipe.suggest.unplaced import token_local_unplaced
from hyperrecipe.suggest.verify import _owner
from tests.support.suggest_harness import TP2, suggest_and_recheck

SEQ = {"tp": "shard(1)"}


def _translate(family: str) -> tuple[Translation, Any]:
    model = build_model(f"hf:{family}", tiny_config(family))
    entries = read_plans(model)
    entries = (*entries, *blocks_the_plan_leaves_out(entries, structural_entries(model)))
    tree = snapshot(model)
    return translate(entries, tree, TP2), tree


def _fields(t: Translation | list[Any], match: str, group: str) -> dict[str, Any]:
    rules = t.rules if isinstance(t, Translation) else t
    return next(dict(r.fields) for r in rules if r.match == match and r.group == group)


def test_a_block_whose_forward_takes_a_mask_beside_its_input_is_gathered() -> None:
    # MiniMax's lightning attention (layer 1) holds only replicated parameters; it ran on this
    # rank's tokens as a local region, and its decay across the sequence came out wrong in
    # both modes. Its forward takes position embeddings, a mask and a cache: it reads the
    # sequence as a whole. The MoE block beside it (hidden states only) stays token-local.
    t, _ = _translate("minimax")
    attn = _fields(t, "model.layers.1.self_attn", GATHERED_GROUP)
    assert attn == {"boundary": True, "in_src": {"hidden_states": SEQ},
                    "in_dst": {"hidden_states": "replicate"}, "out_src": {0: "replicate"},
                    "out_dst": {0: SEQ}}
    assert _fields(t, "model.layers.*.mlp", SEQUENCE_GROUP)["local_region"] is True


def test_a_region_blamed_under_sequence_parallelism_is_gathered_instead() -> None:
    # DiffLlama pairs head i with head i + heads/2 (chunk on the head dim): no sharding of its
    # q/k/v is right, and the check blames the attention region. Sequence parallelism was
    # given up first, then the region: now the region alone is computed whole on the gathered
    # sequence, and its own rules are handed back to restore if sequence parallelism goes.
    t, _ = _translate("diffllama")
    attn = "model.layers.*.self_attn"
    culprit, _ = _owner("model.layers.0.self_attn", t.rules)
    assert culprit is not None and culprit.group == SEQUENCE_GROUP
    out = gather_instead(t.rules, culprit)
    assert out is not None
    rules, own, what = out
    assert what == attn + GATHERED_INSTEAD
    assert {r.match for r in own} == {attn, f"{attn}.{{q_proj,k_proj,v_proj}}", f"{attn}.o_proj"}
    assert not any(r.match.startswith(attn + ".") for r in rules)  # no reduce-scatter left
    assert _fields(rules, attn, GATHERED_GROUP) == {
        "boundary": True, "in_src": {"hidden_states": SEQ},
        "in_dst": {"hidden_states": "replicate"}, "out_src": {0: "replicate"},
        "out_dst": {0: SEQ}}
    assert _fields(rules, "model.layers.*.mlp", SEQUENCE_GROUP)["in_dst"] == {"x": "replicate"}
    # a rule beyond sequence parallelism is not a region's layout
    loss = next(r for r in t.rules if dict(r.fields).get("loss_parallel"))
    assert gather_instead(t.rules, loss) is None


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_diffllama_keeps_sequence_parallelism_with_its_attention_gathered(
        tmp_path: Path) -> None:
    s = suggest_and_recheck("diffllama", tiny_config("diffllama"), tmp_path)
    assert [n.what for n in s.narrowed] == ["model.layers.*.self_attn" + GATHERED_INSTEAD]
    assert len(s.attempts) == 2
    assert "model.layers.*.mlp.down_proj" in {r.match for r in s.rules}  # the MLP still sharded


def test_a_module_no_rule_places_that_check_names_runs_on_this_ranks_tokens() -> None:
    # HY-V4's hyper-connection head folds the residual streams between the last layer and the
    # final norm; outside every boundary its parameters' gradients were partial, and check
    # named model.hc_head.hc_base, which no rule owns: "no module to blame"
    t, tree = _translate("hy_v4")
    rule = token_local_unplaced("model.hc_head.hc_base", t.rules, tree.modules)
    assert rule is not None and rule.match == "model.hc_head"
    assert rule.group == SEQUENCE_GROUP
    assert dict(rule.fields) == {"boundary": True, "local_region": True, "in_src": {"x": SEQ},
                                 "in_dst": {"x": SEQ}, "out_src": {0: SEQ}}
    # a module a rule reaches into, or one without sequence parallelism, is not taken
    assert token_local_unplaced("model.layers.1.mlp.gate.weight", t.rules, tree.modules) is None
    plain = [r for r in t.rules if r.group != SEQUENCE_GROUP]
    assert token_local_unplaced("model.hc_head.hc_base", plain, tree.modules) is None
