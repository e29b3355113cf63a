"""torch's own ``clip_grad_norm_`` over an applied model's shards (``torch_clip_guard``), on
real gloo ranks against one process: tiny Llama, ``recipes/llama.yaml`` at tp=2, the model's
own ``labels=`` loss, AdamW.

- A plain loop calling ``torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)`` (every
  step clips: the norms are above 2) gets one process's norm on every rank (rtol 1e-5) and
  one process's losses over five steps (rtol 1e-5, atol 1e-6), in production and validate mode.
  Without the guard each rank clipped by its own shards' norm (measured 2.65 / 2.97 where one
  process has 3.98) and the losses drift.
- A subset of the parameters gets the norm one process computes over the same subset.
- Mixing in another installation's gradients, a foreign tensor or a parameter added after
  apply is refused by name before anything is scaled; an unrelated model's gradients get torch's own function's answer; the
  last installation restored puts torch's function back.
- On a torch without ``_get_total_norm`` the fallback (``clip_grad_norm_`` itself replaced)
  clips as one process does.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import ShardedGradNormError
from tests.support.runtime_harness import ROOT, TINY_LLAMA, llama, mesh_1d

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)

LLAMA = str(ROOT / "recipes/llama.yaml")
MAX_NORM = 0.5
STEPS = 5
NORM_RTOL = 1e-5
LOSS_TOL = {"rel": 1e-5, "abs": 1e-6}


def _batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, TINY_LLAMA["vocab_size"], (2, 8), generator=g) for _ in range(STEPS)]


def _extra(mode: str) -> dict[str, Any]:
    return {}  # the model's defaults (sdpa) in both modes


def _loop(model: nn.Module, clip: Any) -> list[tuple[float, float]]:
    """Five AdamW steps clipped by ``clip(model)``; (loss, norm) per step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
    out = []
    for ids in _batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = clip(model)
        opt.step()
        opt.zero_grad()
        out.append((float(loss.detach()), float(norm)))
    return out


def _torch_clip(model: nn.Module) -> torch.Tensor:
    return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)


def _reference(mode: str) -> list[tuple[float, float]]:
    return _loop(llama(**_extra(mode)), _torch_clip)


def _applied(world: int, mode: str) -> tuple[nn.Module, Any]:
    model = llama(**_extra(mode))
    plan = compile_recipe(LLAMA, llama("meta", **_extra(mode)), {"tp": world})
    return model, apply(model, plan, mesh_1d(world), mode=mode)  # type: ignore[arg-type]


def _loop_worker(rank: int, world: int, mode: str) -> list[tuple[float, float]]:
    model, _inst = _applied(world, mode)
    return _loop(model, _torch_clip)


def _check_loop(results: list[list[tuple[float, float]]], ref: list[tuple[float, float]]) -> None:
    assert all(norm > 4 * MAX_NORM for _, norm in ref)  # every step clips
    for rank, steps in enumerate(results):
        norms, losses = [n for _, n in steps], [v for v, _ in steps]
        assert norms == pytest.approx([n for _, n in ref], rel=NORM_RTOL), f"rank {rank}"
        assert losses == pytest.approx([v for v, _ in ref], **LOSS_TOL), f"rank {rank}"


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_torch_clip_grad_norm_in_a_plain_loop_clips_like_one_process(mode: str) -> None:
    """Fails without the guard: production ranks clip by their own shards' norms, validate
    mode raises DTensor's mixed-tensor error."""
    ref = _reference(mode)
    _check_loop(run_ranks(_loop_worker, 2, mode, timeout_s=600), ref)


def _fallback_worker(rank: int, world: int) -> list[tuple[float, float]]:
    """A torch without ``_get_total_norm`` (a release that renames it): the guard replaces
    ``clip_grad_norm_`` itself, as the first apply finds torch."""
    from torch.nn.utils import clip_grad

    helper = clip_grad._get_total_norm
    del clip_grad._get_total_norm
    try:
        model, inst = _applied(world, "production")
        assert torch.nn.utils.clip_grad_norm_.__name__ == "_guarded_clip_grad_norm"
        out = _loop(model, _torch_clip)
        inst.restore()
    finally:
        clip_grad._get_total_norm = helper
    return out


def test_the_fallback_for_a_torch_without_get_total_norm_clips_like_one_process() -> None:
    ref = _reference("production")
    _check_loop(run_ranks(_fallback_worker, 2, timeout_s=600), ref)


def _subset_and_refusals_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.nn.utils import clip_grad

    original = clip_grad._get_total_norm
    out: dict[str, Any] = {}
    model, inst = _applied(world, "production")
    other, second = _applied(world, "production")
    assert clip_grad._get_total_norm is not original
    for m in (model, other):
        ids = _batches()[0]
        m(input_ids=ids, labels=ids).loss.backward()
    layers = [p for n, p in model.named_parameters() if n.startswith("model.layers.0.")]
    out["subset"] = float(torch.nn.utils.get_total_norm([p.grad for p in layers]))
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    for name, params in (("two", [*model.parameters(), *other.parameters()]),
                         ("foreign", [*model.parameters(), nn.Parameter(torch.ones(3))])):
        if name == "foreign":
            params[-1].grad = torch.ones(3)
        try:
            torch.nn.utils.clip_grad_norm_(params, MAX_NORM)
            out[name] = "clipped"
        except ShardedGradNormError as exc:
            out[name] = str(exc)
    out["untouched"] = all(torch.equal(before[n], p.grad) for n, p in model.named_parameters())
    model.extra = nn.Linear(4, 4)  # added after apply: the plan has no layout for it
    model.extra(torch.ones(1, 4)).sum().backward()
    try:
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        out["added"] = "clipped"
    except ShardedGradNormError as exc:
        out["added"] = str(exc)
    del model.extra
    # an unrelated model's gradients: torch's own answer
    plain = nn.Linear(4, 3)
    plain(torch.ones(2, 4)).sum().backward()
    grads = [p.grad for p in plain.parameters()]
    out["plain"] = (float(torch.nn.utils.clip_grad_norm_(plain.parameters(), 1e9)),
                    float(original(grads)))
    inst.restore()
    out["after_one"] = clip_grad._get_total_norm is not original
    second.restore()
    out["after_all"] = (clip_grad._get_total_norm is original
                        and torch.nn.utils.get_total_norm is original)
    return out


def test_a_subset_is_normed_right_mixtures_are_refused_and_torch_comes_back() -> None:
    ref = llama()
    ids = _batches()[0]
    ref(input_ids=ids, labels=ids).loss.backward()
    subset = float(torch.nn.utils.get_total_norm(
        [p.grad for n, p in ref.named_parameters() if n.startswith("model.layers.0.")]))
    for res in run_ranks(_subset_and_refusals_worker, 2, timeout_s=600):
        assert res["subset"] == pytest.approx(subset, rel=NORM_RTOL)
        assert res["two"].startswith(
            "torch.nn.utils.clip_grad_norm_ / get_total_norm got the gradients of 2 applied "
            "models at once (LlamaForCausalLM (")
        assert res["foreign"].startswith(
            "torch.nn.utils.clip_grad_norm_ / get_total_norm got ")
        assert "together with a Tensor of shape [3], whose layout on the mesh is unknown" in (
            res["foreign"])
        assert ("together with the gradient of extra.weight (not in the plan: added after "
                "apply?), the gradient of extra.bias (not in the plan: added after apply?), "
                "whose layout on the mesh is unknown") in res["added"]
        for message in (res["two"], res["foreign"], res["added"]):
            assert "use inst.clip_grad_norm_(max_norm)" in message
        assert res["untouched"]  # refused before anything was scaled
        assert res["plain"][0] == res["plain"][1]
        assert res["after_one"] and res["after_all"]
