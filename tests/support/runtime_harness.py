"""Shared pieces of the multi-rank runtime tests: models, reference steps, worker bodies.

Every comparison is against a single-process run of the same model with the same seed, in
fp32: logits and every parameter's gradient.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hyperrecipe import apply, compile_recipe
from hyperrecipe.model_tree import build_model

ROOT = Path(__file__).resolve().parents[2]
TINY_LLAMA = json.loads((ROOT / "recipes/models/tiny-llama.json").read_text())
ATOL = 2e-6  # fp32; measured max differences are ~2e-7 on logits and ~1e-8 on gradients
RTOL = 1e-5


def llama(device: str = "cpu", **overrides: Any) -> nn.Module:
    cfg = {**TINY_LLAMA, **overrides}
    torch.manual_seed(0)
    return build_model("hf:llama", cfg, device=device)


def llama_batch(vocab: int = 128) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, vocab, (2, 8), generator=g)


def llama_step(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(input_ids=ids).logits
    logits.float().pow(2).mean().backward()
    return logits.detach()


def grads_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)
            if p.grad is not None}


def reference(**overrides: Any) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = llama(**overrides)
    out = llama_step(model, llama_batch(overrides.get("vocab_size", 128)))
    return out, grads_of(model)


def mesh_1d(world: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))


def llama_worker(rank: int, world: int, recipe: str, mode: str,
                 overrides: dict[str, Any], verify: bool = True) -> dict[str, Any]:
    """Apply ``recipe`` to tiny Llama, run one step; return logits, full grads, counts.

    ``verify=False`` compiles and applies without the verification step, for the tests of
    what the runtime itself does with a plan that verification would refuse."""
    from collections import Counter

    from hyperrecipe.runtime.comm.collectives import count_collectives

    model = llama(**overrides)
    plan = compile_recipe(recipe, llama("meta", **overrides), {"tp": world}, verify=verify)
    inst = apply(model, plan, mesh_1d(world), mode=mode,  # type: ignore[arg-type]
                 verify=verify)
    with count_collectives() as log:
        out = llama_step(model, llama_batch(overrides.get("vocab_size", 128)))
    counted = Counter((r.kind, r.mesh_dim, r.direction) for r in log.records)
    expected = Counter((e.op.kind, e.mesh_dim, e.direction) for e in plan.manifest)
    return {"logits": out, "grads": inst.full_grads(), "counted": dict(counted),
            "expected": dict(expected)}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, atol=ATOL, rtol=RTOL, msg=lambda m: f"{what}: {m}")
