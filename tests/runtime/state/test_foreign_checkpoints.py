"""Checkpoints and trainer calls we did not write, on real gloo ranks at tp=2.

Each case is what another tool writes or calls: transformers' ``save_pretrained`` (tied
embeddings stored under one name or both, a base model's keys without ``model.``), the hub's
GPT-2 key style with its legacy buffers, extra tensors, ``model.load_state_dict`` as a trainer
calls it (``strict=False``, ``assign=True``, a one-process state dict), and torch's
``set_model_state_dict``. Every case is either right (weights equal the reference exactly:
``from_pretrained`` of the same folder, or the one-process model) or refused with a message
naming the tensor and what to do. Checkpoints are real files in ``tmp_path``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from hyperrecipe import apply, compile_recipe
from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.runtime.state.weights import WeightLoadError
from hyperrecipe.model_tree import build_model
from tests.support.runtime_harness import ROOT, TINY_LLAMA, llama, mesh_1d

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)

TINY_GPT2 = json.loads((ROOT / "recipes/models/tiny-gpt2.json").read_text())
RECIPES = {"llama": ROOT / "recipes/llama.yaml", "gpt2": ROOT / "recipes/gpt2.yaml"}


def _model(family: str, device: str, mode: str, **overrides: Any) -> nn.Module:
    if family == "llama":  # the model's own defaults (sdpa) in both modes
        return llama(device, **overrides)
    torch.manual_seed(0)
    return build_model("hf:gpt2", {**TINY_GPT2, **overrides}, device=device)


def _applied(family: str, world: int, mode: str, **overrides: Any) -> tuple[nn.Module, Any]:
    meta = _model(family, "meta", mode, **overrides)
    plan = compile_recipe(str(RECIPES[family]), meta, {"tp": world})
    return meta, apply(meta, plan, mesh_1d(world), mode=mode)  # type: ignore[arg-type]


def _load_worker(rank: int, world: int, family: str, mode: str, source: str,
                 overrides: dict[str, Any], ignore: tuple[str, ...] = ()) -> dict[str, Any]:
    model, inst = _applied(family, world, mode, **overrides)
    try:
        inst.state.load_weights(source, **({"ignore_unexpected": ignore} if ignore else {}))
    except WeightLoadError as exc:
        return {"error": str(exc), "unset": [r.state for r in inst.state.status() if r.what == "weights"]}
    rows = {r.what: (r.state, r.note) for r in inst.state.status() if r.what.startswith("weights")}
    return {"error": None, "full": inst.state.full_state_dict(), "rows": rows}


def _one_file(folder: Path, tensors: dict[str, torch.Tensor]) -> Path:
    from safetensors.torch import save_file

    folder.mkdir()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def _assert_equals_from_pretrained(full: dict[str, torch.Tensor], folder: Path,
                                   **overrides: Any) -> None:
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32, **overrides)
    state = ref.state_dict()
    assert set(state) <= set(full)
    for name, value in state.items():
        torch.testing.assert_close(full[name], value, atol=0, rtol=0, msg=name)


# -- tied embeddings stored under both names ----------------------------------------------


def _dcp_of(model: nn.Module, folder: Path) -> str:
    import torch.distributed.checkpoint as dcp

    dcp.save(model.state_dict(), checkpoint_id=str(folder))  # plain one-process torch code
    return str(folder)


@pytest.mark.parametrize("strategy", ["safetensors", "dcp"])
def test_tied_names_holding_different_values_are_refused_not_one_silently_dropped(
        tmp_path: Path, strategy: str) -> None:
    """A tied model (``tie_word_embeddings=True``) and a checkpoint that stores both
    ``model.embed_tokens.weight`` and ``lm_head.weight``: when they are equal (older
    checkpoints store both) it loads; when they differ, ``from_pretrained`` unties them and
    loads both, so loading one of them into the plan's single tensor would silently drop the
    other. Before the check, the embedding's values were loaded and the head's ignored."""
    untied = llama(tie_word_embeddings=False)
    state = {k: v.contiguous() for k, v in untied.state_dict().items()}
    same = {**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()}
    if strategy == "safetensors":
        differ_src = str(_one_file(tmp_path / "differ", state))
        same_src = str(_one_file(tmp_path / "same", same))
    else:
        differ_src = _dcp_of(untied, tmp_path / "differ")
        with torch.no_grad():
            untied.lm_head.weight.copy_(untied.model.embed_tokens.weight)
        same_src = _dcp_of(untied, tmp_path / "same")
    tied = {"tie_word_embeddings": True}
    res = run_ranks(_load_worker, 2, "llama", "production", differ_src, tied)
    for r in res:  # every rank refuses (they agree before raising), and nothing was written
        assert r["error"] is not None, "a differing tied pair must not load"
        assert ("'model.embed_tokens.weight' (" in r["error"]
                and "'lm_head.weight' (" in r["error"]
                and "hold different values, but the model ties them into one parameter"
                in r["error"] and "tie_word_embeddings=False" in r["error"])
        assert r["unset"] == ["unset"]
    ok = run_ranks(_load_worker, 2, "llama", "production", same_src, tied)[0]
    assert ok["error"] is None
    torch.testing.assert_close(ok["full"]["lm_head.weight"], same["lm_head.weight"],
                               atol=0, rtol=0)


def test_a_tied_checkpoint_into_an_untied_model_names_the_tie(tmp_path: Path) -> None:
    """``save_pretrained`` of a tied model writes the embedding once; a model built untied
    misses ``lm_head.weight`` (``from_pretrained`` would initialize it randomly). The refusal
    says why and what to build instead."""
    llama(tie_word_embeddings=True).save_pretrained(tmp_path / "tied")
    res = run_ranks(_load_worker, 2, "llama", "production", str(tmp_path / "tied"), {})[0]
    assert res["error"] is not None
    assert ("missing 'lm_head.weight' (shape [128, 64]): the checkpoint stores it tied to "
            "'model.embed_tokens.weight' (saved with tie_word_embeddings=True, which writes "
            "the tensor once), and this model is built untied") in res["error"]


# -- key styles transformers accepts ----------------------------------------------------------


def _gpt2_hub_style(folder: Path) -> Path:
    """Tiny GPT-2 with the hub's key style: no ``transformer.`` prefix, no ``lm_head`` (tied),
    and the ``attn.bias`` / ``attn.masked_bias`` buffers older transformers saved."""
    source = _model("gpt2", "cpu", "production")
    n = TINY_GPT2["n_positions"]
    tensors = {k.removeprefix("transformer."): v.contiguous()
               for k, v in source.state_dict().items() if k != "lm_head.weight"}
    for i in range(TINY_GPT2["n_layer"]):
        tensors[f"h.{i}.attn.bias"] = torch.tril(torch.ones(n, n)).view(1, 1, n, n)
        tensors[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    folder = _one_file(folder, tensors)
    source.config.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_gpt2_checkpoint_in_the_hubs_key_style_loads_like_from_pretrained(
        tmp_path: Path, mode: str) -> None:
    """Keys without ``transformer.`` (read as ``from_pretrained`` reads them, through the base
    model prefix), ``attn.bias`` (GPT-2's own ignore list) and ``attn.masked_bias`` (a buffer
    transformers 5 no longer has; before, it was refused as unexpected while
    ``from_pretrained`` loads the checkpoint)."""
    folder = _gpt2_hub_style(tmp_path / "gpt2")
    res = run_ranks(_load_worker, 2, "gpt2", mode, str(folder), {})[0]
    assert res["error"] is None, res["error"]
    state, note = res["rows"]["weights safetensors"]
    assert state == "loaded"
    assert "read from keys of other names" in note
    assert "4 checkpoint tensors not used (h.0.attn.bias, h.0.attn.masked_bias" in note
    _assert_equals_from_pretrained(res["full"], folder)


def test_a_base_model_checkpoint_loads_into_the_causal_lm_or_names_the_missing_head(
        tmp_path: Path) -> None:
    """``LlamaModel.save_pretrained`` (keys without ``model.``) into ``LlamaForCausalLM``:
    ``from_pretrained`` adds the prefix, and so does ``load_weights``. With tied embeddings
    that is the whole model (weights equal ``from_pretrained``'s); without, the checkpoint has
    no ``lm_head``, which ``from_pretrained`` initializes randomly and ``load_weights``
    refuses, saying that the checkpoint is a base model's."""
    from transformers import LlamaConfig, LlamaModel

    for tie in (True, False):
        torch.manual_seed(0)
        base = LlamaModel(LlamaConfig(**TINY_LLAMA, tie_word_embeddings=tie))
        base.save_pretrained(tmp_path / f"base-{tie}", max_shard_size="20KB")
    tied = run_ranks(_load_worker, 2, "llama", "production", str(tmp_path / "base-True"),
                     {"tie_word_embeddings": True})[0]
    assert tied["error"] is None, tied["error"]
    _assert_equals_from_pretrained(tied["full"], tmp_path / "base-True")
    untied = run_ranks(_load_worker, 2, "llama", "production", str(tmp_path / "base-False"),
                       {})[0]
    assert untied["error"] is not None
    assert ("missing 'lm_head.weight' (shape [128, 64]): the checkpoint was saved from the "
            "base model (LlamaModel, keys without 'model.'), which has no such tensor"
            in untied["error"])
    assert "from_pretrained would initialize it randomly" in untied["error"]


def test_unexpected_tensors_are_refused_naming_the_option_and_load_when_named(
        tmp_path: Path) -> None:
    """An extra head (``mtp.*``) is refused by name with its file and the option that skips
    it; an old per-layer ``rotary_emb.inv_freq`` buffer (Llama checkpoints before
    transformers 4.31 hold one per layer) is skipped as ``from_pretrained`` skips it. With
    ``ignore_unexpected`` the checkpoint loads exactly."""
    source = llama()
    tensors = {k: v.contiguous() for k, v in source.state_dict().items()}
    tensors["mtp.0.proj.weight"] = torch.ones(4, 4)
    tensors["mtp.0.norm.weight"] = torch.ones(4)
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    folder = _one_file(tmp_path / "extra", tensors)
    refused = run_ranks(_load_worker, 2, "llama", "production", str(folder), {})[0]
    err = refused["error"]
    assert err is not None and "does not fit the model (2 problems)" in err
    assert "unexpected 'mtp.0.norm.weight' in model.safetensors" in err
    assert "inv_freq" not in err
    assert ("name them in load_weights(..., ignore_unexpected=[...]) (regular expressions "
            "searched in each key, e.g. '^mtp\\\\.0\\\\.')") in err
    loaded = run_ranks(_load_worker, 2, "llama", "production", str(folder), {},
                       (r"^mtp\.0\.",))[0]
    assert loaded["error"] is None
    note = loaded["rows"]["weights safetensors"][1]
    assert note == ("3 checkpoint tensors not used (model.layers.0.self_attn.rotary_emb."
                    "inv_freq, mtp.0.norm.weight, mtp.0.proj.weight)")
    for name, value in source.state_dict().items():
        torch.testing.assert_close(loaded["full"][name], value, atol=0, rtol=0, msg=name)


# -- model.load_state_dict as trainers call it ------------------------------------------------


def _load_state_dict_worker(rank: int, world: int, family: str, mode: str,
                            how: str) -> dict[str, Any]:
    from tests.support.family_harness import batch

    model, inst = _applied(family, world, mode)
    state = _model(family, "cpu", mode).state_dict()  # one process's full tensors
    try:
        if how == "assign":
            model.load_state_dict(state, assign=True)
        else:
            model.load_state_dict(state, strict=how == "strict")
    except PlanMismatchError as exc:
        return {"error": str(exc), "unset": [r.state for r in inst.state.status() if r.what == "weights"]}
    logits = model(input_ids=batch()).logits
    logits.float().pow(2).mean().backward()
    return {"error": None, "full": inst.state.full_state_dict(), "logits": logits.detach(),
            "grads": inst.full_grads(),
            "unset": [r.state for r in inst.state.status() if r.what == "weights"]}


@pytest.mark.parametrize("mode", ["production", "validate"])
@pytest.mark.parametrize("how", ["strict", "strict=False"])
def test_load_state_dict_of_a_one_process_state_dict_loads_in_both_modes(
        mode: str, how: str) -> None:
    """Full tensors from one process into an applied tied GPT-2 (fused c_attn, deferred
    biases): weights equal exactly, logits and every gradient equal one process (fp32, atol
    2e-6 / rtol 1e-5), and the installation no longer reports its weights unset. Before,
    validate mode failed in ``copy_`` (a plain tensor into a DTensor) and production mode kept
    saying ``weights unset`` after the load."""
    from tests.support.family_harness import batch
    from tests.support.runtime_harness import assert_close, grads_of

    ref = _model("gpt2", "cpu", mode)
    ref_logits = ref(input_ids=batch()).logits
    ref_logits.float().pow(2).mean().backward()
    for res in run_ranks(_load_state_dict_worker, 2, "gpt2", mode, how):
        assert res["error"] is None, res["error"]
        assert res["unset"] == []
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(res["full"][name], value, atol=0, rtol=0, msg=name)
        assert_close(res["logits"], ref_logits.detach(), "logits")
        for name, g in grads_of(ref).items():
            assert_close(res["grads"][name], g, f"grad {name}")


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_load_state_dict_with_assign_is_refused_before_anything_changes(mode: str) -> None:
    """``assign=True`` puts new parameter objects in place of the installed shards. On GPT-2
    in production mode that loaded without a word and then computed wrong logits (the
    rowwise c_proj's deferred bias stays the old object, the tie splits); in validate mode it
    failed later inside a forward. Now it is refused before a value changes."""
    for res in run_ranks(_load_state_dict_worker, 2, "gpt2", mode, "assign"):
        assert res["error"] is not None, "assign=True must not load"
        assert res["error"].startswith("load_state_dict(..., assign=True) on a model with an "
                                       "applied plan would replace the installed shards")
        assert "call load_state_dict without assign=True" in res["error"]
        assert res["unset"] == ["unset"]


def _broadcast_worker(rank: int, world: int, mode: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    model, inst = _applied("gpt2", world, mode)
    full = _model("gpt2", "cpu", mode).state_dict() if rank == 0 else {}
    try:
        set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True,
                                                                   broadcast_from_rank0=True))
    except PlanMismatchError as exc:
        return {"error": str(exc)}
    return {"error": None, "full": inst.state.full_state_dict()}


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_set_model_state_dict_broadcast_from_rank0_is_right_or_refused(mode: str) -> None:
    """torch's ``set_model_state_dict(full_state_dict=True, broadcast_from_rank0=True)`` (how
    torchtitan-style trainers load full weights read on rank 0). Production mode: exact.
    Validate mode: torch copies one contiguous slice into each ``_StridedShard`` parameter
    (GPT-2's fused c_attn), which is wrong; before, it loaded those values silently, now
    ``load_state_dict`` refuses, naming the parameter and the ways that are right."""
    expected = _model("gpt2", "cpu", mode).state_dict()
    for res in run_ranks(_broadcast_worker, 2, mode):
        if mode == "production":
            assert res["error"] is None, res["error"]
            for name, value in expected.items():
                torch.testing.assert_close(res["full"][name], value, atol=0, rtol=0, msg=name)
        else:
            assert res["error"] is not None, "wrong values must not load silently"
            assert res["error"].startswith("load_state_dict: transformer.h.0.attn.c_attn.weight "
                                           "is a fused (chunked) parameter")
            assert "broadcast_from_rank0=True" in res["error"]


# -- file layouts from_pretrained reads ------------------------------------------------------


def _bin_checkpoint(folder: Path, state: dict[str, torch.Tensor], config: Any,
                    files: int) -> Path:
    """``pytorch_model.bin`` as transformers 4 wrote it (``safe_serialization=False``): one
    file, or ``pytorch_model-0000i-of-0000n.bin`` with ``pytorch_model.bin.index.json``."""
    folder.mkdir()
    config.save_pretrained(folder)
    keys = sorted(state)
    if files == 1:
        torch.save({k: state[k].contiguous() for k in keys}, folder / "pytorch_model.bin")
        return folder
    weight_map = {}
    for i in range(files):
        name = f"pytorch_model-{i + 1:05d}-of-{files:05d}.bin"
        part = keys[i::files]
        torch.save({k: state[k].contiguous() for k in part}, folder / name)
        weight_map.update(dict.fromkeys(part, name))
    (folder / "pytorch_model.bin.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": weight_map}))
    return folder


@pytest.mark.parametrize(("family", "mode", "files"), [
    ("gpt2", "production", 3), ("gpt2", "validate", 3), ("llama", "production", 1)])
def test_pytorch_model_bin_checkpoints_load_like_from_pretrained(
        tmp_path: Path, family: str, mode: str, files: int) -> None:
    """Many hub repositories hold only ``pytorch_model.bin`` (sharded or not); before, such a
    folder was refused ("no loading strategy can read"). The ``torch`` strategy maps each
    file (``torch.load(mmap=True, weights_only=True)``) and reads the rank's slices like
    safetensors: GPT-2 (tied, fused c_attn) from three files, Llama from one."""
    source = _model(family, "cpu", mode)
    folder = _bin_checkpoint(tmp_path / "bin", source.state_dict(), source.config, files)
    res = run_ranks(_load_worker, 2, family, mode, str(folder), {})[0]
    assert res["error"] is None, res["error"]
    assert res["rows"]["weights torch"][0] == "loaded"
    assert res["rows"]["weights safetensors"][0] == "ineligible"
    _assert_equals_from_pretrained(res["full"], folder)


def test_a_folder_with_model_safetensors_ignores_other_tools_files(tmp_path: Path) -> None:
    """Mistral's repositories hold ``consolidated.safetensors`` (mistral's own key names)
    beside the transformers files; ``from_pretrained`` reads ``model.safetensors`` (or the
    index) only. Before, every ``*.safetensors`` was read and the other file's keys refused
    as unexpected."""
    from safetensors.torch import save_file

    folder = tmp_path / "mistral"
    llama().save_pretrained(folder)
    save_file({"layers.0.attention.wq.weight": torch.ones(4, 4),
               "tok_embeddings.weight": torch.ones(4, 4)},
              str(folder / "consolidated.safetensors"))
    res = run_ranks(_load_worker, 2, "llama", "production", str(folder), {})[0]
    assert res["error"] is None, res["error"]
    _assert_equals_from_pretrained(res["full"], folder)


# -- torch's own checkpoint APIs, one process on the other side -----------------------------


def _dcp_worker(rank: int, world: int, mode: str, plain_ckpt: str, out: str) -> dict[str, Any]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    model, inst = _applied("gpt2", world, mode)
    inst.state.load_weights(plain_ckpt)  # a DCP folder plain torch code wrote in one process
    by_load_weights = inst.state.full_state_dict()
    other, other_inst = _applied("gpt2", world, mode)
    state = other_inst.state.state_dict()
    dcp.load(state["model"], checkpoint_id=plain_ckpt)  # its keys are the model's FQNs
    other_inst.state.load_state_dict(state)
    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                cpu_offload=True))
    dcp.save(inst.state.state_dict(), checkpoint_id=out)
    return {"load_weights": by_load_weights, "load_state_dict": other_inst.state.full_state_dict(),
            "get_model_state_dict": full}


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_dcp_checkpoints_cross_between_one_process_and_an_applied_model(
        tmp_path: Path, mode: str) -> None:
    """Tied GPT-2 with a fused c_attn: ``dcp.save(model.state_dict())`` of the unapplied model
    in one process loads into the applied model through ``load_weights`` and through
    ``TrainingState.load_state_dict``; torch's ``get_model_state_dict(full_state_dict=True,
    cpu_offload=True)`` gives rank 0 the full weights; and the applied model's
    ``inst.state.state_dict()`` checkpoint, read by ``dcp.load`` into a plain one-process model's
    state dict, gives the full weights back. All exact."""
    import torch.distributed.checkpoint as dcp

    source = _model("gpt2", "cpu", mode)
    plain = _dcp_of(source, tmp_path / "plain")
    res = run_ranks(_dcp_worker, 2, mode, plain, str(tmp_path / "applied"))[0]
    expected = source.state_dict()
    for how in ("load_weights", "load_state_dict", "get_model_state_dict"):
        for name, value in expected.items():
            torch.testing.assert_close(res[how][name], value, atol=0, rtol=0,
                                       msg=lambda m, how=how, name=name: f"{how} {name}: {m}")
    reader = _model("gpt2", "cpu", mode)
    with torch.no_grad():
        for p in reader.parameters():
            p.zero_()
    state = reader.state_dict()
    dcp.load({"model": state}, checkpoint_id=str(tmp_path / "applied"))
    reader.load_state_dict(state)
    for name, value in expected.items():
        torch.testing.assert_close(reader.state_dict()[name], value, atol=0, rtol=0, msg=name)


# -- export ------------------------------------------------------------------------------------


def _export_worker(rank: int, world: int, family: str, recipe: str, dim: str, folder: str,
                   out: str, dtype: torch.dtype | None) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from tests.support.family_harness import batch, build

    meta = build(family, "meta")
    if dtype is not None:
        meta = meta.to(dtype)
    plan = compile_recipe(str(ROOT / "recipes" / recipe), meta, {dim: world})
    inst = apply(meta, plan, init_device_mesh("cpu", (world,), mesh_dim_names=(dim,)))
    inst.state.load_weights(folder)
    opt = torch.optim.AdamW(meta.parameters(), lr=1e-2)
    meta(input_ids=batch()).logits.float().pow(2).mean().backward()
    opt.step()
    inst.state.save_pretrained(out, max_shard_bytes=30_000)
    return {"full": inst.state.full_state_dict()}


@pytest.mark.parametrize(("family", "recipe", "dim", "dtype"), [
    ("gpt2", "gpt2.yaml", "tp", None),          # tied, fused c_attn (chunks=3)
    ("gpt2", "gpt2.yaml", "tp", torch.bfloat16),
    ("phi3", "phi3.yaml", "tp", None),          # fused qkv_proj and gate_up_proj
    ("mixtral", "mixtral-ep.yaml", "ep", None),  # experts split whole over ep
])
def test_export_after_a_step_loads_with_from_pretrained_as_the_trained_model(
        tmp_path: Path, family: str, recipe: str, dim: str, dtype: torch.dtype | None) -> None:
    """One AdamW step at 2 ranks, then ``inst.state.save_pretrained`` (split into many files);
    ``AutoModelForCausalLM.from_pretrained(out)`` with its defaults has the trained weights
    bit for bit, in the trained dtype, and its logits equal exactly those of a one-process
    model of the same construction given those weights."""
    from transformers import AutoModelForCausalLM

    from tests.support.family_harness import batch, build

    source = build(family)
    source.save_pretrained(tmp_path / "in")
    out = tmp_path / "out"
    res = run_ranks(_export_worker, 2, family, recipe, dim, str(tmp_path / "in"), str(out),
                    dtype)[0]
    assert len(list(out.glob("*.safetensors"))) > 2
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert loaded.dtype == (dtype or torch.float32)
    state = loaded.state_dict()
    for name, value in state.items():
        torch.testing.assert_close(value, res["full"][name], atol=0, rtol=0, msg=name)
    moved = [n for n, v in source.state_dict().items() if not torch.equal(v.to(state[n].dtype),
                                                                          state[n])]
    assert moved, "the export holds the trained weights"
    trained = build(family)
    if dtype is not None:
        trained = trained.to(dtype)
    trained.load_state_dict({k: v for k, v in res["full"].items() if k in state})
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=batch()).logits, trained(input_ids=batch()).logits)


def _model_save_worker(rank: int, world: int, mode: str, folder: str, out: str,
                       how: str) -> dict[str, Any]:
    model, inst = _applied("gpt2", world, mode)
    inst.state.load_weights(folder)
    try:
        if how == "plain":
            model.save_pretrained(out, max_shard_size="20KB")  # what a script calls
        else:
            model.save_pretrained(out, state_dict=model.state_dict())  # Trainer's _save
    except PlanMismatchError as exc:
        return {"error": str(exc)}
    full = inst.state.full_state_dict()
    inst.restore()
    return {"error": None, "full": full,
            "restored": "save_pretrained" not in vars(model)}


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_the_models_own_save_pretrained_gathers_the_shards_while_applied(
        tmp_path: Path, mode: str) -> None:
    """transformers' ``save_pretrained`` writes ``model.state_dict()`` from rank 0; on an
    applied model that failed inside safetensors ("Attempted to access the data pointer on
    an invalid python storage"). While the plan is applied it is the installation's export
    (every rank gathers, rank 0 writes), removed by ``restore()``; a ``state_dict=`` argument,
    which it cannot honour, is refused by name."""
    source = _model("gpt2", "cpu", mode)
    source.save_pretrained(tmp_path / "in")
    out = tmp_path / "out"
    res = run_ranks(_model_save_worker, 2, mode, str(tmp_path / "in"), str(out), "plain")
    assert all(r["error"] is None and r["restored"] for r in res), res[0]["error"]
    assert (out / "model.safetensors.index.json").is_file()
    _assert_equals_from_pretrained(res[0]["full"], out)
    refused = run_ranks(_model_save_worker, 2, mode, str(tmp_path / "in"), str(tmp_path / "x"),
                        "state_dict")[0]
    assert refused["error"] is not None and refused["error"].startswith(
        "model.save_pretrained(state_dict) on a model with an applied plan")
    assert "call inst.state.save_pretrained(folder) on every rank" in refused["error"]


# -- DistributedDataParallel, as Trainer/accelerate wrap a model under torchrun --------------


def _ddp_worker(rank: int, world: int, folder: str, dp_tp: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.nn.parallel import DistributedDataParallel

    from tests.support.family_harness import batch

    if dp_tp:
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        model = llama("meta")
        plan = compile_recipe(str(ROOT / "recipes/llama-dp.yaml"), model,
                              {"dp": 2, "tp": 2})
        inst = apply(model, plan, mesh)
        group = mesh["dp"].get_group()
        dp = mesh.get_local_rank("dp")
    else:
        model, inst = _applied("llama", world, "production")
        group, dp = None, 0
    inst.state.load_weights(folder)
    ddp = DistributedDataParallel(model, process_group=group)  # the world group by default
    ids = batch()[2 * dp:2 * dp + 2] if dp_tp else batch()
    try:
        ddp(input_ids=ids).logits.float().pow(2).mean().backward()
    except PlanMismatchError as exc:
        return {"error": str(exc)}
    return {"error": None, "grads": inst.full_grads()}


def test_ddp_over_ranks_holding_different_shards_is_refused_at_the_first_forward(
        tmp_path: Path) -> None:
    """``DistributedDataParallel(model)`` over the tp ranks (what Trainer does under torchrun
    with two processes): DDP broadcast rank 0's shards to rank 1 and then averaged gradients
    of different shards. Production shards share names and shapes, so DDP's checks passed and
    the run trained silently wrong (measured: every sharded tensor overwritten, 21 of 21
    gradients wrong). Now the first forward under DDP refuses, naming the ranks and the dim."""
    llama().save_pretrained(tmp_path / "in")
    for res in run_ranks(_ddp_worker, 2, str(tmp_path / "in"), False):
        assert res["error"] is not None, "DDP across tp shards must not run"
        assert res["error"].startswith("DistributedDataParallel over ranks [0, 1], which hold "
                                       "different shards of this plan (mesh dim(s) ['tp']")
        assert "DDP(model, process_group=mesh['dp'].get_group())" in res["error"]


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
def test_ddp_over_the_dp_dim_of_a_dp_tp_mesh_matches_one_process(tmp_path: Path) -> None:
    """DDP over the dp group of a dp=2 x tp=2 mesh is right and left alone: the gradients of
    one step (each dp rank half of the batch) equal one process on the whole batch (fp32,
    atol 2e-6 / rtol 1e-5)."""
    from tests.support.family_harness import batch
    from tests.support.runtime_harness import assert_close, grads_of

    ref = llama()
    ref.save_pretrained(tmp_path / "in")
    ids = batch()
    loss = (ref(input_ids=ids[:2]).logits.float().pow(2).mean()
            + ref(input_ids=ids[2:]).logits.float().pow(2).mean()) / 2
    loss.backward()
    for res in run_ranks(_ddp_worker, 4, str(tmp_path / "in"), True, timeout_s=300):
        assert res["error"] is None, res["error"]
        for name, g in grads_of(ref).items():
            assert_close(res["grads"][name], g, f"grad {name}")


def _tied_state_worker(rank: int, world: int, mode: str, state: dict[str, torch.Tensor]
                       ) -> dict[str, str | None]:
    model, inst = _applied("llama", world, mode, tie_word_embeddings=True)
    out: dict[str, str | None] = {}
    for how, call in (("model.load_state_dict", lambda: model.load_state_dict(state)),
                      ("inst.state.load_state_dict", lambda: inst.state.load_state_dict({"model": state})),
                      ("inst.state.load_full_state_dict", lambda: inst.state.load_full_state_dict(state))):
        try:
            call()
            out[how] = None
        except PlanMismatchError as exc:
            out[how] = str(exc)
    return out


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_a_state_dict_with_different_tied_values_is_refused_by_every_load(mode: str) -> None:
    """A one-process *untied* state dict into a tied applied model: ``embed_tokens`` and
    ``lm_head`` are copied into the one shared tensor, the last silently winning (before:
    every one of these loads did that). Refused now; the same values under both names load."""
    state = llama(tie_word_embeddings=False).state_dict()
    for res in run_ranks(_tied_state_worker, 2, mode, state):
        for how, msg in res.items():
            assert msg is not None, f"{how} must refuse differing tied values"
            assert ("holds different values for 'model.embed_tokens.weight' and "
                    "'lm_head.weight', which the model ties into one parameter") in msg, how
    same = {**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()}
    for res in run_ranks(_tied_state_worker, 2, mode, same):
        assert res == dict.fromkeys(res), res
