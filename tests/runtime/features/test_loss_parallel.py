"""The loss on vocab shards (``loss_parallel``), on real gloo ranks, both modes, against one
process.

Tolerances: fp32; the loss within atol 2e-6 / rtol 1e-5, and every parameter's gradient within
the runtime tests' atol 2e-6 / rtol 1e-5 (tests/support/runtime_harness.py). The transformers cases run
tiny Llama (recipes/models/tiny-llama.json, vocab 128) with the shipped
``recipes/llama-sp-loss.yaml``; the plain-PyTorch cases a two-layer language model whose forward
takes no labels, with ``hyperrecipe.vocab_parallel_cross_entropy``. Both modes run each model's
own default attention (transformers' sdpa on the CPU; eager for Gemma 2, which has no sdpa).
"""

from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import hyperrecipe
from hyperrecipe import LossParallelError, RecipeError, apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.plan import Plan
from tests.support.runtime_harness import ROOT, assert_close, llama, llama_batch, mesh_1d

RECIPE = str(ROOT / "recipes/llama-sp-loss.yaml")


def llama_labels(ids: torch.Tensor) -> torch.Tensor:
    """The ids as labels, with a few positions ignored (-100)."""
    labels = ids.clone()
    labels[0, :3] = -100
    labels[1, 5] = -100
    return labels


# ------------------------------------------------------------------------------ transformers


LLAMA_LOSS = """\
recipe: llama-loss
version: 1
mesh: [tp]
extends: llama
rules:
  - match: lm_head
    style: colwise
    loss_parallel: true
"""


def _generate(model: nn.Module, ids: torch.Tensor, decode: bool) -> torch.Tensor | None:
    """Greedy decoding (one token at a time: the sequence-parallel recipes cannot split a
    one-token step, so it runs with the tensor-parallel recipe only)."""
    if not decode:
        return None
    out: torch.Tensor = model.generate(ids[:, :4], max_new_tokens=3, do_sample=False)  # type: ignore[operator]
    return out


def _llama_reference(overrides: dict[str, Any], decode: bool) -> dict[str, Any]:
    model = llama(**overrides)
    ids = llama_batch()
    out = model(input_ids=ids, labels=llama_labels(ids))
    out.loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    with torch.no_grad():
        summed = model(input_ids=ids, labels=llama_labels(ids), num_items_in_batch=torch.tensor(7))
        logits = model(input_ids=ids).logits
        generated = _generate(model, ids, decode)
    return {"loss": out.loss.detach(), "grads": grads, "summed": summed.loss, "logits": logits,
            "generated": generated}


def _llama_worker(rank: int, world: int, recipe: str, mode: str, overrides: dict[str, Any],
                  decode: bool) -> dict[str, Any]:
    from collections import Counter

    from hyperrecipe.runtime.comm.collectives import count_collectives

    model = llama(**overrides)
    plan = compile_recipe(recipe, llama("meta", **overrides), {"tp": world})
    inst = apply(model, plan, mesh_1d(world), mode=mode)  # type: ignore[arg-type]
    ids = llama_batch()
    with count_collectives() as log:
        out = model(input_ids=ids, labels=llama_labels(ids))
        out.loss.backward()
    counted = Counter((r.kind, r.mesh_dim, r.direction) for r in log.records)
    expected = Counter((e.op.kind, e.mesh_dim, e.direction) for e in plan.manifest)
    misuse: list[str] = []
    logits = out.logits
    for use in (lambda: F.cross_entropy(logits.flatten(0, 1), ids.flatten()),
                lambda: F.cross_entropy(logits.transpose(1, 2), ids),
                lambda: logits.argmax(-1), lambda: logits + 1, lambda: logits[:, -1],
                lambda: logits.float().softmax(-1), lambda: logits.detach(),
                lambda: torch.cat([logits, logits], dim=-1)):
        try:
            use()
            misuse.append("computed")
        except LossParallelError as exc:
            misuse.append(str(exc))
    grads = inst.full_grads()
    status = [(r.what, r.state, r.note) for r in inst.state.status() if r.fqn == "lm_head"]
    with torch.no_grad():
        summed = model(input_ids=ids, labels=llama_labels(ids), num_items_in_batch=torch.tensor(7))
        logits = model(input_ids=ids).logits
        generated = _generate(model, ids, decode)
    inst.restore()
    restored = not {"_loss_function", "forward"} & set(vars(model))
    return {"loss": out.loss.detach(), "grads": grads, "summed": summed.loss, "logits": logits,
            "generated": generated, "restored": restored, "status": status, "local_shape": tuple(out.logits.shape), "misuse": misuse,
            "marked": type(out.logits).__name__, "counted": dict(counted),
            "expected": dict(expected)}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize(("recipe", "mode", "overrides"), [
    ("llama-sp-loss", "production", {}),
    ("llama-sp-loss", "validate", {}),
    ("llama-loss", "production", {}),
    ("llama-loss", "validate", {}),
])
def test_the_models_own_labels_loss_runs_on_vocab_shards_and_matches_one_process(
        recipe: str, mode: str, overrides: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "llama-loss.yaml"
    path.write_text(LLAMA_LOSS)
    decode = recipe == "llama-loss"
    ref = _llama_reference(overrides, decode)
    results = run_ranks(_llama_worker, 2, RECIPE if recipe == "llama-sp-loss" else str(path),
                        mode, overrides, decode, timeout_s=300)
    for rank, res in enumerate(results):
        assert_close(res["loss"], ref["loss"], f"rank {rank} loss")
        assert set(res["grads"]) == set(ref["grads"]), "every parameter has a full gradient"
        for name, g in ref["grads"].items():
            assert_close(res["grads"][name], g, f"rank {rank} grad {name}")
        assert_close(res["summed"], ref["summed"], f"rank {rank} loss / num_items_in_batch")
        # with labels, the logits stay the rank's vocab slice and refuse torch ops
        assert res["local_shape"] == (2, 8, 64) and res["marked"] == "VocabShardedLogits"
        start = 64 * rank
        for message in res["misuse"]:  # every op on the slice is refused, naming what to do
            assert f"which are this rank's slice [{start}, {start + 64}) of the 128-entry " \
                   f"vocab" in message and "vocab_parallel_cross_entropy" in message, message
        # without labels (inference, generate()), the caller gets the full logits
        assert_close(res["logits"], ref["logits"], f"rank {rank} logits without labels")
        assert res["restored"], "restore() takes the loss function and the forward back"
        assert ("loss on vocab shards", "installed", "its logits are this rank's 64 of 128 vocab "
                "entries over tp and refuse torch ops; the model's labels= loss runs on them; a "
                "call without labels gets the full logits") in res["status"]
        if decode:
            assert torch.equal(res["generated"], ref["generated"]), "greedy generate() agrees"
    if mode == "production":
        assert results[0]["counted"] == results[0]["expected"], \
            "collectives issued in one step equal the plan's manifest"
        assert results[0]["expected"][("all_gather", "tp", "forward")] >= 1


def _family_step(model: nn.Module, inst: Any = None) -> dict[str, Any]:
    """The model's own labels= loss on the family batch, backward; the full gradients."""
    from tests.support.family_harness import batch

    ids = batch()
    out = model(input_ids=ids, labels=llama_labels(ids))
    out.loss.backward()
    grads = inst.full_grads() if inst is not None else {
        n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return {"loss": out.loss.detach(), "grads": grads}


def _family_worker(rank: int, world: int, family: str, recipe: str, mode: str,
                   overrides: dict[str, Any]) -> dict[str, Any]:
    from tests.support.family_harness import build

    model = build(family, **overrides)
    plan = compile_recipe(recipe, build(family, "meta", **overrides), {"tp": world})
    return _family_step(model, apply(model, plan, mesh_1d(world), mode=mode))  # type: ignore[arg-type]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
@pytest.mark.parametrize(("family", "recipe"), [
    ("qwen3", "qwen3-sp.yaml"),     # llama-sp plus qwen3's reduce_grads for q_norm/k_norm
    ("gpt2", "gpt2-sp-loss.yaml"),  # the stream gathered at ln_f (GPT2Model views it there)
])
def test_sequence_parallel_recipes_of_other_families_train_like_one_process(
        family: str, recipe: str, mode: str) -> None:
    """The labels= loss and every gradient at tp=2 (measured worst ~1e-7); tied GPT-2's
    lm_head gradient is its embedding's (one parameter, reported under the embedding's name)."""
    from tests.support.family_harness import build

    overrides: dict[str, Any] = {}
    ref = _family_step(build(family, **overrides))
    for rank, res in enumerate(run_ranks(_family_worker, 2, family,
                                         str(ROOT / "tests/recipes" / recipe), mode, overrides,
                                         timeout_s=300)):
        assert_close(res["loss"], ref["loss"], f"rank {rank} loss")
        assert set(ref["grads"]) <= set(res["grads"]), "every parameter has a full gradient"
        for name, g in ref["grads"].items():
            assert_close(res["grads"][name], g, f"rank {rank} grad {name}")


GEMMA2 = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128,
          "max_position_embeddings": 128, "sliding_window": 4, "tie_word_embeddings": False,
          "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}
"""Tiny Gemma 2 with the config's soft-capping (final_logit_softcapping 30, attention 50)."""


def _gemma2(device: str = "cpu", **overrides: Any) -> nn.Module:
    from hyperrecipe.model_tree import build_model

    torch.manual_seed(0)
    return build_model("hf:gemma2", {**GEMMA2, **overrides}, device=device)


def _softcap_step(model: nn.Module) -> dict[str, Any]:
    ids = llama_batch()
    out = model(input_ids=ids, labels=llama_labels(ids))
    out.loss.backward()
    with torch.no_grad():
        generated = model.generate(ids[:, :4], max_new_tokens=3, do_sample=False)  # type: ignore[operator]
    return {"loss": out.loss.detach(), "generated": generated}


def _softcap_worker(rank: int, world: int, mode: str, overrides: dict[str, Any]
                    ) -> dict[str, Any]:
    model = _gemma2(**overrides)
    plan = compile_recipe(str(ROOT / "tests/recipes/gemma2-softcap-loss.yaml"),
                          _gemma2("meta", **overrides), {"tp": world})
    inst = apply(model, plan, mesh_1d(world), mode=mode)  # type: ignore[arg-type]
    return {**_softcap_step(model), "grads": inst.full_grads()}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_a_final_logit_soft_capping_runs_on_the_vocab_shards_and_matches_one_process(
        mode: str) -> None:
    """Gemma 2 divides, tanh-es and multiplies its logits by a scalar between the lm_head and
    its loss: elementwise by scalars, the marked slice stays a slice (it used to be refused at
    the ``div``), and the model's labels= loss, every gradient and greedy decoding agree."""
    overrides: dict[str, Any] = {}  # Gemma 2's default attention is eager (no sdpa path)
    model = _gemma2(**overrides)
    ref = _softcap_step(model)
    ref_grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for rank, res in enumerate(run_ranks(_softcap_worker, 2, mode, overrides, timeout_s=300)):
        assert_close(res["loss"], ref["loss"], f"rank {rank} loss")
        assert set(res["grads"]) == set(ref_grads), "every parameter has a full gradient"
        for name, g in ref_grads.items():
            assert_close(res["grads"][name], g, f"rank {rank} grad {name}")
        assert torch.equal(res["generated"], ref["generated"]), "greedy generate() agrees"


# ------------------------------------------------------------------------------ plain PyTorch


class TinyLM(nn.Module):
    """A plain language model whose forward takes no labels: ids -> logits."""

    def __init__(self, vocab: int = 96, hidden: int = 16) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.lm_head(torch.tanh(self.proj(self.embed(ids))))  # type: ignore[no-any-return]


TINY_RECIPE = """\
recipe: tiny-lm-loss
version: 1
mesh: [tp]
rules:
  - match: lm_head
    style: colwise
    loss_parallel: true
"""


def tiny_lm(device: str = "cpu") -> TinyLM:
    torch.manual_seed(0)
    with torch.device(device):
        return TinyLM()


def tiny_batch(ignore_index: int = -100) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 96, (3, 5), generator=g)
    labels = torch.randint(0, 96, (3, 5), generator=g)
    labels[0, 1] = labels[2, 4] = ignore_index
    return ids, labels


HELPER_CASES: list[dict[str, Any]] = [
    {}, {"label_smoothing": 0.1}, {"reduction": "sum"}, {"reduction": "none"},
    {"ignore_index": 7},
]


def _helper_reference() -> list[dict[str, Any]]:
    out = []
    for kwargs in HELPER_CASES:
        model = tiny_lm()
        ids, labels = tiny_batch(kwargs.get("ignore_index", -100))
        logits = model(ids)
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), **kwargs)
        loss = loss.view(labels.shape) if kwargs.get("reduction") == "none" else loss
        (loss * torch.linspace(0.5, 1.5, loss.numel()).view(loss.shape)).sum().backward()
        out.append({"loss": loss.detach(), "grads": {n: p.grad.clone() for n, p in
                                                     model.named_parameters()}})
    return out


def _helper_worker(rank: int, world: int, mode: str, recipe: str) -> list[dict[str, Any]]:
    out = []
    for kwargs in HELPER_CASES:
        model = tiny_lm()
        plan = compile_recipe(recipe, tiny_lm("meta"), {"tp": world})
        inst = apply(model, plan, mesh_1d(world), mode=mode)  # type: ignore[arg-type]
        ids, labels = tiny_batch(kwargs.get("ignore_index", -100))
        logits = model(ids)
        loss = hyperrecipe.vocab_parallel_cross_entropy(logits, labels, **kwargs)
        (loss * torch.linspace(0.5, 1.5, loss.numel()).view(loss.shape)).sum().backward()
        out.append({"loss": loss.detach(), "grads": inst.full_grads(), "kind":
                    plan.loss_parallel.kind if plan.loss_parallel else None})
        inst.restore()
    return out


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_vocab_parallel_cross_entropy_matches_f_cross_entropy_of_one_process(
        mode: str, tmp_path: Path) -> None:
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_RECIPE)
    ref = _helper_reference()
    results = run_ranks(_helper_worker, 2, mode, str(recipe), timeout_s=300)
    for rank, cases in enumerate(results):
        for kwargs, res, want in zip(HELPER_CASES, cases, ref):
            what = f"rank {rank} {kwargs or 'defaults'}"
            assert res["kind"] == "helper"
            assert_close(res["loss"], want["loss"], f"{what} loss")
            for name, g in want["grads"].items():
                assert_close(res["grads"][name], g, f"{what} grad {name}")


def _all_ignored_worker(rank: int, world: int, mode: str, recipe: str) -> dict[str, Any]:
    model = tiny_lm()
    plan = compile_recipe(recipe, tiny_lm("meta"), {"tp": world})
    inst = apply(model, plan, mesh_1d(world), mode=mode)  # type: ignore[arg-type]
    ids, labels = tiny_batch()
    labels[:] = -100
    loss = hyperrecipe.vocab_parallel_cross_entropy(model(ids), labels)
    loss.backward()
    return {"loss": loss.detach(), "grads": inst.full_grads()}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_a_batch_whose_labels_are_all_ignored_adds_zero_gradients_as_in_one_process(
        mode: str, tmp_path: Path) -> None:
    """Every label ``-100`` (a micro-batch of prompt tokens only): the mean over no token is
    NaN, as ``F.cross_entropy``'s, but the gradients are zeros, as one process's. Production's
    kernel multiplied the ``inf`` arriving at each ignored token by 0 and put NaN in every
    gradient of the model, which gradient accumulation then kept."""
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(TINY_RECIPE)
    model = tiny_lm()
    ids, labels = tiny_batch()
    labels[:] = -100
    ref_loss = F.cross_entropy(model(ids).flatten(0, 1), labels.flatten())
    ref_loss.backward()
    for rank, res in enumerate(run_ranks(_all_ignored_worker, 2, mode, str(recipe),
                                         timeout_s=300)):
        assert torch.isnan(ref_loss) and torch.isnan(res["loss"])
        for name, p in model.named_parameters():
            assert p.grad is not None and not p.grad.any()
            assert_close(res["grads"][name], p.grad, f"rank {rank} grad {name}")


def test_plain_logits_are_refused_by_the_helper() -> None:
    with pytest.raises(LossParallelError, match=r"needs vocab-sharded logits .* found a plain "
                                                r"Tensor of shape \(4, 10\)"):
        hyperrecipe.vocab_parallel_cross_entropy(torch.randn(4, 10), torch.zeros(4,
                                                                                 dtype=torch.long))


# ------------------------------------------------------------------------------ compile time


def _compile(tmp_path: Path, rules: str) -> Plan:
    path = tmp_path / "r.yaml"
    path.write_text("recipe: r\nversion: 1\nmesh: [tp]\nrules:\n" + textwrap.indent(
        textwrap.dedent(rules), "  "))
    return compile_recipe(str(path), tiny_lm("meta"), {"tp": 2})


def test_the_plan_records_the_loss_and_round_trips(tmp_path: Path) -> None:
    plan = compile_recipe(RECIPE, llama("meta"), {"tp": 2})
    loss = plan.loss_parallel
    assert loss is not None
    assert (loss.boundary, loss.owner, loss.kind, loss.mesh_dim, loss.vocab, loss.local_vocab) \
        == ("lm_head", "", "model", "tp", 128, 64)
    assert [str(t.forward) for t in loss.gather] == ["all_gather[tp](gather_dim=-1)"]
    assert loss.provenance.file.endswith("llama-sp-loss.yaml") and loss.provenance.line == 20
    assert [(e.stage, e.direction, str(e.op)) for e in plan.manifest if e.stage == "loss"] == [
        ("loss", "forward", "all_gather[tp](gather_dim=-1)")]
    path = tmp_path / "plan.json"
    plan.save(path)
    assert Plan.load(path) == plan


@pytest.mark.parametrize(("rules", "problem", "line"), [
    ("""\
     - match: lm_head
       style: colwise_gather_output
       loss_parallel: true
     """, "the logits must leave sharded on the vocab dim (-1) over 'tp' alone; out_dst is "
         "replicate", 7),
    ("""\
     - match: proj
       style: colwise
       loss_parallel: true
     - match: lm_head
       style: colwise
       loss_parallel: true
     """, "loss_parallel is declared on 'proj' and 'lm_head'; a plan computes one loss", 10),
    ("""\
     - match: embed
       style: vocab_parallel
       loss_parallel: true
     """, "loss_parallel on 'embed' (Embedding): the logits must come from an nn.Linear", 7),
    ("""\
     - match: lm_head
       boundary: true
       params: {weight: {tp: shard(1)}}
       in_src: {0: {tp: shard(-1)}}
       out_src: {0: {tp: partial}}
       out_dst: {0: {tp: shard(-1)}}
       loss_parallel: true
     """, "loss_parallel on 'lm_head' needs its weight sharded on the vocab dim (0) over one "
         "mesh dim; found {tp: shard(1)}", 11),
])
def test_a_loss_parallel_that_cannot_be_right_is_refused_at_its_recipe_line(
        tmp_path: Path, rules: str, problem: str, line: int) -> None:
    with pytest.raises(RecipeError) as info:
        _compile(tmp_path, rules)
    assert problem in str(info.value)
    assert f"r.yaml:{line}:" in str(info.value)


def test_loss_parallel_with_boundary_false_is_refused(tmp_path: Path) -> None:
    with pytest.raises(RecipeError, match="loss_parallel has no effect with boundary: false"):
        _compile(tmp_path, """\
            - match: lm_head
              style: colwise
              boundary: false
              loss_parallel: true
            """)


def _other_loss_worker(rank: int, world: int) -> str:
    model = llama()
    model.loss_type = "ForMaskedLM"  # transformers picks ForMaskedLMLoss for it
    plan = compile_recipe(RECIPE, llama("meta"), {"tp": world})
    try:
        apply(model, plan, mesh_1d(world))
    except hyperrecipe.PlanMismatchError as exc:
        untouched = "forward" not in vars(model) and "_loss_function" not in vars(model)
        return f"{exc} | untouched={untouched}"
    return "applied"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_model_whose_loss_is_not_a_causal_lm_cross_entropy_is_refused_at_apply() -> None:
    message = run_ranks(_other_loss_worker, 1, timeout_s=120)[0]
    assert "<root> (LlamaForCausalLM) takes labels=, but its loss_function is ForMaskedLMLoss" \
        in message
    assert message.endswith("untouched=True"), "the rollback leaves the model as it was"



def test_sharded_logits_handed_to_a_labels_loss_without_loss_parallel_are_refused(
        tmp_path: Path) -> None:
    path = tmp_path / "r.yaml"
    path.write_text("recipe: r\nversion: 1\nmesh: [tp]\nextends: llama\nrules:\n"
                    "  - match: lm_head\n    out_dst: {0: {tp: shard(-1)}}\n")
    with pytest.raises(RecipeError) as info:
        compile_recipe(str(path), llama("meta"), {"tp": 2})
    text = str(info.value)
    assert f"{path}:7:" in text
    assert ("'lm_head' hands the model's forward, which computes the loss from labels, logits "
            "sharded on the vocab dim ({tp: shard(-1)})") in text
    assert "declare `loss_parallel: true`" in text


def _dtensor_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor import Shard, distribute_tensor

    torch.manual_seed(0)
    full = torch.randn(3, 4, 10)
    labels = torch.tensor([[1, 9, -100, 4], [0, 5, 5, 7], [-100, 2, 8, 3]])
    logits = distribute_tensor(full, mesh_1d(world), [Shard(2)]).requires_grad_()
    loss = hyperrecipe.vocab_parallel_cross_entropy(logits, labels, label_smoothing=0.2)
    loss.backward()
    return {"loss": loss.detach(), "grad": logits.grad.full_tensor()}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_dtensor_sharded_on_its_last_dim_takes_the_helper_too() -> None:
    torch.manual_seed(0)
    full = torch.randn(3, 4, 10, requires_grad=True)
    labels = torch.tensor([[1, 9, -100, 4], [0, 5, 5, 7], [-100, 2, 8, 3]])
    loss = F.cross_entropy(full.flatten(0, 1), labels.flatten(), label_smoothing=0.2)
    loss.backward()
    for rank, res in enumerate(run_ranks(_dtensor_worker, 2, timeout_s=120)):
        assert_close(res["loss"], loss.detach(), f"rank {rank} loss")
        assert full.grad is not None
        assert_close(res["grad"], full.grad, f"rank {rank} logits' gradient")


def _compiled_worker(rank: int, world: int) -> dict[str, Any]:
    model = llama()
    plan = compile_recipe(RECIPE, llama("meta"), {"tp": world})
    inst = apply(model, plan, mesh_1d(world))
    ids = llama_batch()
    out = torch.compile(model)(input_ids=ids, labels=llama_labels(ids))
    out.loss.backward()
    return {"loss": out.loss.detach(), "grads": inst.full_grads()}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_torch_compile_of_the_model_runs_the_loss_on_shards_eagerly_and_agrees() -> None:
    ref = _llama_reference({}, decode=False)
    for rank, res in enumerate(run_ranks(_compiled_worker, 2, timeout_s=300)):
        assert_close(res["loss"], ref["loss"], f"rank {rank} loss")
        for name, g in ref["grads"].items():
            assert_close(res["grads"][name], g, f"rank {rank} grad {name}")


def _marked_slice() -> Any:
    """A marked vocab slice without a process group: rank 1's half of an 8-entry vocab."""
    from types import SimpleNamespace

    from hyperrecipe.runtime.features.vocab_loss import VocabShard, mark_vocab_shard

    shard = VocabShard(mesh=None, mesh_dims=("tp",), mesh_dim="tp",  # type: ignore[arg-type]
                       group=SimpleNamespace(rank=1), vocab=8, local_vocab=4,  # type: ignore[arg-type]
                       loss_op=None, boundary="lm_head", dtensor=False)  # type: ignore[arg-type]
    return mark_vocab_shard(torch.randn(2, 3, 4, generator=torch.Generator().manual_seed(0)),
                            shard)


def test_scaling_the_marked_slice_by_scalars_keeps_it_marked_and_anything_else_is_refused() -> None:
    from hyperrecipe.runtime.features.vocab_loss import _LOSS_CALLS, VocabShardedLogits, plain_vocab_slice

    logits = _marked_slice()
    local = plain_vocab_slice(logits)
    capped = torch.tanh(logits / 30.0) * 30.0          # Gemma 2's final soft-capping
    assert type(capped) is VocabShardedLogits and type(logits.float() * 0.5) is VocabShardedLogits
    assert torch.equal(plain_vocab_slice(capped), torch.tanh(local / 30.0) * 30.0)
    # a learnable 0-dim scale would get only this rank's vocab share of its gradient
    learned = torch.tensor(1.3, requires_grad=True)
    for use in (lambda: logits + 1, lambda: logits * torch.ones(4), lambda: logits.softmax(-1),
                lambda: logits * logits, lambda: logits * learned):
        with pytest.raises(LossParallelError, match="call the model without labels"):
            use()
    token = _LOSS_CALLS.set([])  # inside the forward of the model that owns the loss
    try:
        with pytest.raises(LossParallelError) as info:
            logits.softmax(-1)
    finally:
        _LOSS_CALLS.reset(token)
    assert str(info.value).startswith(
        "softmax() on the logits of 'lm_head', which are this rank's slice [4, 8) of the 8-entry "
        "vocab (the plan declares loss_parallel), inside the model's forward before its loss: the "
        "model computes with its logits between the lm_head and the loss in a way that needs the "
        "whole vocab")
