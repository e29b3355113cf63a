"""The ranks of a model-parallel group must be handed the same batch
(``hyperrecipe/runtime/preflight/batches.py``, checked by ``first_forward.py``'s one hook).

A ``DistributedSampler`` over the whole world (the usual torchrun pattern) hands the tp ranks
of one replica different batches: before this check, tiny Llama at tp=2 ran and the ranks
reported losses 4.810 and 4.820 where one process gives 4.883 and 4.858 on their batches
(measured with the hook removed; the same in both modes), with nothing refused. Now the first
training forward compares a digest of the model's inputs across every model-parallel group and
refuses a difference on every rank, naming the dim, the ranks, the inputs and the sampler to
use. Data-parallel ranks are not compared; cp ranks are (the plans feed them the whole
sequence); forwards in ``eval()`` or under ``no_grad`` are not checked; a rank that never comes
is not waited for past ``collective_timeout_s``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import BatchMismatchError, PlanMismatchError
from hyperrecipe.runtime.preflight.batches import WHOLE_ELEMENTS, input_digests
from hyperrecipe.runtime.preflight.first_forward import (
    ROW_BYTES,
    SLOTS,
    _judge,
    _read_slots,
    _slots,
)
from tests.support.runtime_harness import ROOT, llama, llama_batch, mesh_1d

LLAMA = str(ROOT / "recipes/llama.yaml")
TP_FIX = ("Fix: every rank of this mesh belongs to one model replica, so every rank must be "
          "handed the same batch: use no DistributedSampler over the world (or "
          "DistributedSampler(dataset, num_replicas=1, rank=0)), the same shuffle seed on every "
          "rank; the trainer integrations (hyperrecipe.trainers: the Hugging Face Trainer, "
          "accelerate, Lightning, torchtitan) split batches this way")
WHY = ("The ranks along a model-parallel dim hold one model replica between them and must see "
       "the same batch: with different ones each rank's shards compute on other data, the "
       "ranks' losses differ and every gradient is silently wrong. ")


def _own_batch(key: int) -> torch.Tensor:
    """What a sampler over the world hands rank ``key``: another batch of the same shape."""
    g = torch.Generator().manual_seed(10 + key)
    return torch.randint(0, 128, (2, 8), generator=g)


def _forward(model: nn.Module, ids: torch.Tensor) -> dict[str, Any]:
    """One training forward and backward with labels and a mask: its loss, or the refusal."""
    try:
        out = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids)
    except PlanMismatchError as exc:
        return {"error": str(exc), "type": type(exc).__name__,
                "fields": (getattr(exc, "dim", None), getattr(exc, "ranks", None),
                           getattr(exc, "inputs", None))}
    out.loss.backward()
    return {"error": None, "loss": out.loss.detach()}


def _checks_installed(model: nn.Module) -> int:
    return sum(getattr(h, "__name__", "") == "check_first_training_forward"
               for h in model._forward_pre_hooks.values())


def _tp_worker(rank: int, world: int, mode: str, same: bool) -> dict[str, Any]:
    model = llama()
    plan = compile_recipe(LLAMA, llama("meta"), {"tp": world})
    inst = apply(model, plan, mesh_1d(world), mode=mode)  # type: ignore[arg-type]
    model.train()
    ids = llama_batch() if same else _own_batch(rank)
    first = _forward(model, ids)
    res = {"first": first, "hooked_after_first": _checks_installed(model)}
    if not same:  # the hook stays after a refusal: catching it does not let the step through
        res["second"] = _forward(model, ids)
        inst.restore()  # and restore() takes it away
        res["hooked_after_restore"] = _checks_installed(model)
        res["after_restore"] = _forward(model, ids)["error"]
    return res


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_the_same_batch_on_the_tp_ranks_passes_and_the_check_leaves(mode: str) -> None:
    first, second = run_ranks(_tp_worker, 2, mode, True, timeout_s=300)
    assert first["first"]["error"] is None and second["first"]["error"] is None
    torch.testing.assert_close(first["first"]["loss"], second["first"]["loss"], atol=0, rtol=0)
    assert first["hooked_after_first"] == second["hooked_after_first"] == 0, \
        "checked once: nothing is left on the step's path"


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_different_batches_on_the_tp_ranks_are_refused_on_every_rank(mode: str) -> None:
    for res in run_ranks(_tp_worker, 2, mode, False, timeout_s=300):
        for attempt in ("first", "second"):
            assert res[attempt]["type"] == "BatchMismatchError", res
            assert res[attempt]["error"] == (
                "the ranks [0, 1] of mesh dim 'tp' were handed different inputs at the first "
                "training forward: 'input_ids' differs (ranks [0] vs [1]); 'labels' differs "
                "(ranks [0] vs [1]). " + WHY + TP_FIX), res
            assert res[attempt]["fields"] == ("tp", (0, 1), ("input_ids", "labels"))
        assert res["hooked_after_first"] == 1 and res["hooked_after_restore"] == 0
        assert res["after_restore"] is None


def _unchecked_worker(rank: int, world: int) -> dict[str, Any]:
    model = llama()
    apply(model, compile_recipe(LLAMA, llama("meta"), {"tp": world}), mesh_1d(world))
    ids = _own_batch(rank)
    model.eval()
    with torch.no_grad():
        model(input_ids=ids)
    model.train()
    with torch.no_grad():
        model(input_ids=ids)
    hooked = _checks_installed(model)
    return {"hooked": hooked, "then": _forward(model, ids)["error"]}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_eval_and_no_grad_forwards_are_not_checked_and_the_first_training_one_is() -> None:
    for res in run_ranks(_unchecked_worker, 2, timeout_s=300):
        assert res["hooked"] == 1, "the check still waits for the first training forward"
        assert res["then"] is not None and res["then"].startswith(
            "the ranks [0, 1] of mesh dim 'tp' were handed different inputs"), res


def _absent_worker(rank: int, world: int, folder: str) -> dict[str, Any]:
    """Rank 1 never runs a training forward; rank 0 must come back within the installation's
    ``collective_timeout_s`` with an error naming the check, not wait for the group's timeout."""
    import time
    from pathlib import Path

    model = llama()
    inst = apply(model, compile_recipe(LLAMA, llama("meta"), {"tp": world}), mesh_1d(world))
    inst.collective_timeout_s = 1.0
    done = Path(folder) / "rank0-done"
    if rank == 1:
        deadline = time.monotonic() + 60
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        return {"error": "did not call"}
    model.train()
    start = time.monotonic()
    res = _forward(model, llama_batch())
    res["waited_s"] = time.monotonic() - start
    res["hooked"] = _checks_installed(model)
    done.touch()
    return res


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_rank_that_never_comes_is_not_waited_for_past_collective_timeout_s(
        tmp_path: Any) -> None:
    first, second = run_ranks(_absent_worker, 2, str(tmp_path), timeout_s=300)
    assert second["error"] == "did not call"
    assert first["error"] == (
        "rank 0: not every rank reached the check at the first training forward (the same batch "
        "and dropout across each model-parallel group) within 1 s: a rank stopped, hangs, runs "
        "other code or starts training later (raise Installation.collective_timeout_s if it is "
        "slow on purpose); destroy the process group before reusing it"), first
    assert first["waited_s"] < 30 and first["hooked"] == 0


def _dp_tp_worker(rank: int, world: int, split: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = llama()
    apply(model, compile_recipe(str(ROOT / "recipes/llama-dp.yaml"), llama("meta"),
                                {"dp": 2, "tp": 2}), mesh)
    model.train()
    key = {"dp": mesh.get_local_rank("dp"), "world": rank,
           "rank 3": 99 if rank == 3 else mesh.get_local_rank("dp")}[split]
    return _forward(model, _own_batch(key))


@pytest.mark.slow  # four ranks (docs/benchmarks.md#test-suite)
def test_dp_by_tp_batches_may_differ_over_dp_and_not_over_tp() -> None:
    over_dp = run_ranks(_dp_tp_worker, 4, "dp", timeout_s=400)
    assert [r["error"] for r in over_dp] == [None] * 4
    # a sampler over the world: each tp group is handed two batches, refused on all four ranks
    for res in run_ranks(_dp_tp_worker, 4, "world", timeout_s=400):
        assert res["error"] == (
            "the ranks [0, 1] of mesh dim 'tp' were handed different inputs at the first "
            "training forward: 'input_ids' differs (ranks [0] vs [1]); 'labels' differs (ranks "
            "[0] vs [1]); so were ranks [2, 3] of 'tp' ('input_ids', 'labels'). " + WHY +
            "Fix: split batches over the data dim 'dp' only: DistributedSampler(dataset, "
            "num_replicas=mesh['dp'].size() (= 2), rank=mesh.get_local_rank('dp')), the same "
            "shuffle seed on every rank, instead of a sampler over the world; the trainer "
            "integrations (hyperrecipe.trainers: the Hugging Face Trainer, accelerate, "
            "Lightning, torchtitan) split batches this way"), res
    # one replica's ranks differ: the other replica's ranks, whose group agrees, raise too
    # (they would otherwise wait in the step's first collective for peers that left)
    for res in run_ranks(_dp_tp_worker, 4, "rank 3", timeout_s=400):
        assert res["error"] is not None and res["error"].startswith(
            "the ranks [2, 3] of mesh dim 'tp' were handed different inputs at the first "
            "training forward: 'input_ids' differs (ranks [2] vs [3]); 'labels' differs "
            "(ranks [2] vs [3]). The ranks"), res


def _cp_worker(rank: int, world: int, shards: bool) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    model = llama()
    plan = compile_recipe(str(ROOT / "recipes/llama-cp.yaml"), llama("meta"), {"cp": world})
    apply(model, plan, init_device_mesh("cpu", (world,), mesh_dim_names=("cp",)))
    model.train()
    ids = llama_batch()
    return _forward(model, ids.chunk(world, dim=1)[rank] if shards else ids)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_cp_ranks_take_the_whole_sequence_and_a_rank_s_shard_is_refused() -> None:
    """The cp plans slice the sequence themselves (at the first decoder layer, after the model
    derived positions and the mask from the whole of it), so every cp rank is handed the whole
    sequence and they are compared like tp ranks; a rank fed its own shard is refused."""
    whole = run_ranks(_cp_worker, 2, False, timeout_s=300)
    assert [r["error"] for r in whole] == [None, None]
    torch.testing.assert_close(whole[0]["loss"], whole[1]["loss"], atol=0, rtol=0)
    for res in run_ranks(_cp_worker, 2, True, timeout_s=300):
        assert res["error"] is not None and res["error"].startswith(
            "the ranks [0, 1] of mesh dim 'cp' were handed different inputs at the first "
            "training forward: 'input_ids' differs (ranks [0] vs [1]); 'labels' differs"), res


# The digest and the table, in one process.

class _Echo(nn.Module):
    def forward(self, input_ids: torch.Tensor, mask: Any = None, **kwargs: Any) -> None:
        return None


def test_the_digest_sees_every_tensor_argument_by_name_and_every_difference() -> None:
    ids = torch.arange(12).reshape(3, 4)
    base = input_digests(_Echo(), (ids,), {"labels": ids, "flag": True,
                                           "pixel_values": [torch.ones(2), {"b": torch.zeros(1)}]})
    assert sorted(base) == ["input_ids", "labels", "pixel_values"]  # non-tensors are not inputs
    assert all(len(d) == 15 for d in base.values())
    same = input_digests(_Echo(), (), {"input_ids": ids.clone()})
    assert same["input_ids"] == base["input_ids"], "by value and name, not by object or position"
    for other in (ids.flip(0), ids.reshape(4, 3), ids.to(torch.int32), ids + (ids == 11)):
        assert input_digests(_Echo(), (other,), {})["input_ids"] != base["input_ids"], other
    # past WHOLE_ELEMENTS a strided sample: rows in another order still differ
    big = torch.arange(4 * WHOLE_ELEMENTS, dtype=torch.float32).reshape(4, -1)
    assert input_digests(_Echo(), (big,), {}) != input_digests(_Echo(), (big.flip(0),), {})
    bf16 = torch.randn(3, 5).to(torch.bfloat16)
    assert input_digests(_Echo(), (bf16,), {}) == input_digests(_Echo(), (bf16.clone(),), {})
    # a nested (ragged) tensor is compared component by component
    def ragged(last: float) -> torch.Tensor:
        return torch.nested.nested_tensor([torch.ones(2), torch.tensor([1.0, 1.0, last])],
                                          layout=torch.jagged)

    assert input_digests(_Echo(), (ragged(1.0),), {}) == input_digests(_Echo(), (ragged(1.0),), {})
    assert input_digests(_Echo(), (ragged(1.0),), {}) != input_digests(_Echo(), (ragged(2.0),), {})


def test_the_row_keeps_each_input_by_name_and_folds_the_seventeenth() -> None:
    digests = {f"input_{i:02d}": bytes([i]) * 15 for i in range(SLOTS + 3)}
    row = [0, 0, *_slots(digests)]
    assert 8 * len(row) == ROW_BYTES == 656
    read = _read_slots(row)
    assert len(read) == SLOTS and "..." in read
    assert {n for n in read if n != "..."} == {f"input_{i:02d}" for i in range(SLOTS - 1)}
    changed = {**digests, f"input_{SLOTS + 2:02d}": b"\x01" * 15}  # one folded input differs
    assert _read_slots([0, 0, *_slots(changed)])["..."] != read["..."]


def test_the_verdict_names_the_dims_groups_and_both_checks() -> None:
    ids = {"input_ids": b"a" * 15}
    rows = [[1, 1, *_slots(ids)], [2, 2, *_slots({"input_ids": b"b" * 15})],
            [1, 1, *_slots(ids)], [1, 1, *_slots(ids)]]
    groups = [("dp", [0, 2]), ("dp", [1, 3]), ("tp", [0, 1]), ("tp", [2, 3])]
    error = _judge(rows, groups, ["config.attention_dropout=0.1"], "FIX")
    assert isinstance(error, BatchMismatchError)
    assert (error.dim, error.ranks, error.inputs) == ("dp", (1, 3), ("input_ids",))
    assert str(error).startswith(
        "the ranks [1, 3] of mesh dim 'dp' were handed different inputs at the first training "
        "forward: 'input_ids' differs (ranks [1] vs [3]); so were ranks [0, 1] of 'tp' "
        "('input_ids'). ")
    assert str(error).endswith("Fix: FIX. Also: the ranks [1, 3] of mesh dim 'dp' draw "
                               "different random numbers (their torch generator states differ: "
                               "a seed per rank?), and the model has dropout "
                               "(config.attention_dropout=0.1): replicated activations would "
                               "differ between these ranks and the replicated weights drift "
                               "apart, silently. Seed every rank of a model-parallel group "
                               "alike (torch.manual_seed(s) or transformers.set_seed(s) on "
                               "every rank, not device-specific), or set dropout to 0")
    missing = [[0, 0, *_slots(ids)], [0, 0, *_slots({**ids, "labels": b"c" * 15})]]
    refusal = _judge(missing, [("tp", [0, 1])], [], "FIX")
    assert refusal is not None and "'labels' is passed on rank(s) [1] only" in str(refusal)
    assert _judge(rows[2:], [("tp", [0, 1])], [], "FIX") is None
    # without dropout the generator words are not compared
    assert _judge([[1, 1, *_slots(ids)], [2, 2, *_slots(ids)]], [("tp", [0, 1])], [], "") is None
