"""``check``'s sample batch draws token ids from the text vocabulary, also of a composite model.

A vision-language model keeps ``vocab_size`` on its text config, and its first ``nn.Embedding``
is the vision tower's position table: ids were drawn from that table's size (16 for the Gemma 3
below, whose text vocabulary is 96), which under-samples the vocabulary or, where the tower's
table is the larger, overflows the text embedding.
"""

from __future__ import annotations

from pathlib import Path

import torch

from hyperrecipe.verify.sample import make_sample

ROOT = Path(__file__).resolve().parents[2]


def _tiny_gemma3_vlm() -> torch.nn.Module:
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config={"vocab_size": 96, "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 2,
                     "num_key_value_heads": 1, "head_dim": 16},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                       "num_attention_heads": 2, "image_size": 32, "patch_size": 8},
        mm_tokens_per_image=16)
    return Gemma3ForConditionalGeneration(config)


def test_a_composite_models_sample_uses_the_text_vocabulary() -> None:
    model = _tiny_gemma3_vlm()
    sample = make_sample(model, "hf:gemma3", batch=4, seq=64, seed=0)
    ids = next(v for v in (*sample.args, *sample.kwargs.values())
               if isinstance(v, torch.Tensor) and not v.is_floating_point())
    assert int(ids.max()) >= 16, "ids drawn from the vision tower's 16 positions"
    assert int(ids.max()) < 96


def test_the_loss_of_an_moe_output_is_its_logits_plus_its_router_loss() -> None:
    """An MoE model with ``output_router_logits`` returns ``aux_loss`` before ``logits``:
    check's first output is still the logits, and the router loss is added to their mean of
    squares (it was the only thing compared)."""
    import json

    from hyperrecipe.verify.sample import first_output, loss_of
    from hyperrecipe.model_tree import build_model

    config = json.loads((ROOT / "recipes/models/tiny-mixtral.json").read_text())
    model = build_model("hf:mixtral", {**config, "output_router_logits": True}).eval()
    model.set_experts_implementation("batched_mm")  # grouped_mm takes bf16 only on the CPU
    out = model(input_ids=torch.randint(0, config["vocab_size"], (2, 8)))
    assert list(out.keys())[0] == "aux_loss"
    assert first_output(out) is out.logits
    expected = out.logits.float().pow(2).mean() + out.aux_loss.float()
    torch.testing.assert_close(loss_of(out), expected, atol=0, rtol=0)
