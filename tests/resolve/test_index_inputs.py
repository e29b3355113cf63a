"""Integer-index inputs are known by what a module is, not by its exact class.

An ``nn.Embedding`` subclass (transformers' ``GemmaTextScaledWordEmbedding`` scales the lookup and
names its ids ``input_ids``) takes indices as its first argument just as ``nn.Embedding`` does:
they carry no gradient, so a vocab-parallel boundary around it plans no backward collective for
them, and the manifest counts only what runs.
"""

from __future__ import annotations

import torch
from torch import nn

from tests.support.recipe_text import resolve_only as compile_recipe
from hyperrecipe.model_tree import snapshot
from tests.support.runtime_harness import ROOT
from tests.support.toy_models import Toy

TOY = str(ROOT / "tests/recipes/toy.yaml")


class IdsEmbedding(nn.Embedding):
    """Scales the lookup and names its ids ``input_ids``, as Gemma's embedding does."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return super().forward(input_ids) * 2.0


def _toy(subclass: bool) -> Toy:
    with torch.device("meta"):
        model = Toy()
        if subclass:
            model.embed = IdsEmbedding(32, 8)
    return model


def test_embedding_and_its_subclasses_list_their_ids_as_index_inputs() -> None:
    assert snapshot(_toy(False)).module("embed").index_inputs == ("input",)
    assert snapshot(_toy(True)).module("embed").index_inputs == ("input_ids",)
    assert snapshot(nn.EmbeddingBag(4, 2)).module("").index_inputs == (
        "input", "offsets", "per_sample_weights")
    assert snapshot(_toy(True)).module("layers.0.mlp").index_inputs == ()


def test_a_vocab_parallel_embedding_subclass_plans_no_backward_collective_for_its_ids() -> None:
    for subclass in (False, True):
        plan = compile_recipe(TOY, _toy(subclass), {"tp": 2})
        embed = plan.boundary("embed")
        assert embed.no_grad == (("input_ids",) if subclass else ("input",))
        assert [(e.stage, e.direction) for e in plan.manifest if e.boundary == "embed"] == [
            ("output", "forward")]
