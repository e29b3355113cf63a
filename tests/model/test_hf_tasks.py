"""``--model hf:<model_type>/<task>``: which transformers class each task builds, the errors a
wrong spelling gets, and the batch ``check`` makes for each kind of model.

The models are built from tiny configs on the meta device (the sample tests on the CPU), with
transformers' own defaults; the cookbook's BERT, ViT and T5 recipes run through ``check`` in
tests/check/test_cookbook.py.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe.verify.sample import make_sample
from hyperrecipe.errors import ModelSpecError
from hyperrecipe.model_tree import HF_TASKS, build_model, shipped_tiny_config, snapshot

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests/recipes/cookbook/models"
BERT = str(MODELS / "tiny-bert.json")
VIT = str(MODELS / "tiny-vit.json")
T5 = str(MODELS / "tiny-t5.json")


@pytest.mark.parametrize(("spec", "config", "cls"), [
    ("hf:llama", "tiny-llama", "LlamaForCausalLM"),
    ("hf:llama/causal-lm", "tiny-llama", "LlamaForCausalLM"),
    ("hf:llama/sequence-classification", "tiny-llama", "LlamaForSequenceClassification"),
    ("hf:bert/base", BERT, "BertModel"),
    ("hf:bert/masked-lm", BERT, "BertForMaskedLM"),
    ("hf:bert/sequence-classification", BERT, "BertForSequenceClassification"),
    ("hf:bert/token-classification", BERT, "BertForTokenClassification"),
    ("hf:bert/question-answering", BERT, "BertForQuestionAnswering"),
    ("hf:t5/seq2seq-lm", T5, "T5ForConditionalGeneration"),
    ("hf:vit/image-classification", VIT, "ViTForImageClassification"),
])
def test_the_task_after_the_slash_picks_the_auto_class(spec: str, config: str, cls: str) -> None:
    model = build_model(spec, config)
    assert type(model).__name__ == cls
    assert next(model.parameters()).device.type == "meta"


def test_every_task_is_built_by_the_auto_class_it_names() -> None:
    import transformers

    for task, (auto, _) in HF_TASKS.items():
        assert hasattr(transformers, auto), (task, auto)
    assert list(HF_TASKS)[0] == "causal-lm"


def test_plain_hf_type_builds_what_it_always_built() -> None:
    """No task is causal-lm: the structure, hence every plan's fingerprint, is unchanged."""
    plain = snapshot(build_model("hf:llama", "tiny-llama"))
    spelled = snapshot(build_model("hf:llama/causal-lm", "tiny-llama"))
    assert plain.digest() == spelled.digest()


@pytest.mark.parametrize(("spec", "message"), [
    ("hf:bert/sequence-clasification",
     "--model hf:bert/sequence-clasification: no task 'sequence-clasification'; did you mean "
     "'sequence-classification'? (hf:<model_type>/<task> takes one of: causal-lm, base, "
     "masked-lm, sequence-classification, token-classification, question-answering, "
     "seq2seq-lm, image-classification; hf:bert alone means causal-lm)"),
    ("hf:bert/AutoModelForMaskedLM",
     "--model hf:bert/AutoModelForMaskedLM: no task 'AutoModelForMaskedLM'; spell "
     "AutoModelForMaskedLM as hf:bert/masked-lm (hf:<model_type>/<task> takes one of: "
     "causal-lm, base, masked-lm, sequence-classification, token-classification, "
     "question-answering, seq2seq-lm, image-classification; hf:bert alone means causal-lm)"),
    ("hf:bert/",
     "--model hf:bert/: no task '' (hf:<model_type>/<task> takes one of: causal-lm, base, "
     "masked-lm, sequence-classification, token-classification, question-answering, "
     "seq2seq-lm, image-classification; hf:bert alone means causal-lm)"),
    ("hf:llama/image-classification",
     "--model hf:llama/image-classification: transformers has no image-classification model "
     "for 'llama' (AutoModelForImageClassification does not list it); llama has: "
     "hf:llama/causal-lm, hf:llama/base, hf:llama/sequence-classification, "
     "hf:llama/token-classification, hf:llama/question-answering"),
    # before: "building 'hf:vit' failed: ValueError: Unrecognized configuration class ..."
    ("hf:vit",
     "--model hf:vit: transformers has no causal-lm model for 'vit' (AutoModelForCausalLM does "
     "not list it); vit has: hf:vit/base, hf:vit/image-classification"),
])
def test_a_task_the_model_type_lacks_is_refused_naming_what_it_has(spec: str,
                                                                    message: str) -> None:
    with pytest.raises(ModelSpecError) as err:
        build_model(spec, VIT if "vit" in spec else BERT if "bert" in spec else "tiny-llama")
    assert str(err.value) == message


def test_a_config_for_another_family_names_the_whole_spec() -> None:
    with pytest.raises(ModelSpecError) as err:
        build_model("hf:llama/sequence-classification", {"model_type": "bert"})
    assert str(err.value) == (
        "--model hf:llama/sequence-classification with a 'bert' config (its model_type); use "
        "--model hf:bert/sequence-classification, or a config for llama")


def test_a_config_sized_by_the_familys_own_field_names_builds() -> None:
    """T5 names its sizes d_model and num_layers (attribute_map aliases of hidden_size and
    num_hidden_layers); a T5 config with a field T5Config does not list was refused as a
    config for another family."""
    model = build_model("hf:t5/seq2seq-lm", T5)
    assert model.config.d_model == 64 and model.config.num_layers == 2


def test_the_shipped_tiny_config_is_found_whatever_the_task() -> None:
    assert shipped_tiny_config("hf:llama/sequence-classification") == shipped_tiny_config("hf:llama")
    assert shipped_tiny_config("hf:llama") is not None


def _sample(spec: str, config: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = build_model(spec, config, device="cpu")
    return model, make_sample(model, spec, batch=2, seq=8, seed=0)


def test_an_encoder_gets_token_ids_only() -> None:
    model, sample = _sample("hf:bert/sequence-classification", BERT)
    assert sample.args == () and list(sample.kwargs) == ["input_ids"]
    assert sample.kwargs["input_ids"].shape == (2, 8)
    assert sample.description == "token ids [2, 8] < 128"
    assert model(**sample.kwargs).logits.shape == (2, 2)


def test_an_encoder_decoder_gets_decoder_ids_as_well() -> None:
    model, sample = _sample("hf:t5/seq2seq-lm", T5)
    assert list(sample.kwargs) == ["input_ids", "decoder_input_ids"]
    ids, decoder_ids = sample.kwargs["input_ids"], sample.kwargs["decoder_input_ids"]
    assert ids.shape == decoder_ids.shape == (2, 8) and not torch.equal(ids, decoder_ids)
    assert int(decoder_ids.max()) < 128
    assert sample.description == "token ids [2, 8] < 128, decoder token ids [2, 8]"
    assert model(**sample.kwargs).logits.shape == (2, 8, 128)


def test_a_vision_model_gets_pixel_values_of_its_image_size() -> None:
    model, sample = _sample("hf:vit/image-classification", VIT)
    pixels = sample.kwargs["pixel_values"]
    assert list(sample.kwargs) == ["pixel_values"]
    assert pixels.shape == (2, 3, 16, 16) and pixels.dtype == torch.float32
    assert sample.description == "pixel values [2, 3, 16, 16] ~ N(0, 1)"
    assert model(**sample.kwargs).logits.shape == (2, 2)
    again = make_sample(model, "hf:vit/image-classification", batch=2, seq=8, seed=0)
    assert torch.equal(again.kwargs["pixel_values"], pixels)


def test_a_causal_lm_sample_is_unchanged() -> None:
    _, sample = _sample("hf:llama", "tiny-llama")
    assert list(sample.kwargs) == ["input_ids"]
    assert sample.description.startswith("token ids [2, 8] < ")


def test_a_model_that_reads_another_input_first_is_told_to_pass_inputs() -> None:
    model = build_model("hf:whisper/base", {
        "d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2,
        "decoder_attention_heads": 2, "vocab_size": 64, "decoder_start_token_id": 1,
        "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2})
    with pytest.raises(ModelSpecError) as err:
        make_sample(model, "hf:whisper/base", batch=2, seq=8, seed=0)
    assert str(err.value) == (
        "cannot make a sample batch for 'hf:whisper/base': it reads 'input_features' "
        "first and check makes input_ids and pixel_values only; pass --inputs "
        "pkg.module:make_inputs (called as make_inputs(model, batch=B, seq=L, generator=g), "
        "returning (args, kwargs))")
