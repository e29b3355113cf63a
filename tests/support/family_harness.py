"""Shipped family recipes on tiny Hugging Face models: builders, the reference step, the worker.

Each family is built from ``recipes/models/tiny-<family>.json`` (no weights, seed 0), so the
single-process reference and every rank start from the same parameters. One step: logits for a
fixed batch, loss ``mean(logits**2)``, backward; compared are the logits and every parameter's
full gradient. Worker results carry the collectives one production step issued and the plan's
manifest, and for tied models whether the installed parameters are still one object.
"""

from __future__ import annotations

import json
from collections import Counter
from typing import Any

import torch
from torch import nn

from hyperrecipe import apply, compile_recipe
from hyperrecipe.model_tree import build_model
from tests.support.runtime_harness import ROOT, grads_of, mesh_1d

FAMILIES = ("qwen2", "qwen3", "mistral", "mixtral", "gpt2", "phi3")
VOCAB = 128
TIED_BY_DEFAULT = {"gpt2": ("transformer.wte.weight", "lm_head.weight")}
"""Families whose config ties the embedding and the LM head by default: (embedding, head)."""


def config(family: str, **overrides: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = json.loads((ROOT / f"recipes/models/tiny-{family}.json").read_text())
    return {**cfg, **overrides}


def recipe_path(family: str) -> str:
    return str(ROOT / f"recipes/{family}.yaml")


def build(family: str, device: str = "cpu", **overrides: Any) -> nn.Module:
    torch.manual_seed(0)
    return build_model(f"hf:{family}", config(family, **overrides), device=device)


def batch() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (4, 8), generator=g)


def step(model: nn.Module, aux_loss_divisor: int | None = None) -> torch.Tensor:
    """One forward and backward; with ``aux_loss_divisor`` the loss adds an MoE model's router
    load-balancing loss divided by it."""
    routed = aux_loss_divisor is not None
    out = model(input_ids=batch(), **({"output_router_logits": True} if routed else {}))
    logits: torch.Tensor = out.logits
    loss = logits.float().pow(2).mean()
    if aux_loss_divisor is not None:
        loss = loss + out.aux_loss / aux_loss_divisor
    loss.backward()  # type: ignore[no-untyped-call]
    return logits.detach()


def reference(family: str, aux_loss: bool = False, **overrides: Any
              ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Single-process logits, gradients, and the initial parameters (a step does not change
    them: there is no optimizer)."""
    model = build(family, **overrides)
    logits = step(model, 1 if aux_loss else None)
    params = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return logits, grads_of(model), params


def family_worker(rank: int, world: int, family: str, mode: str, overrides: dict[str, Any],
                  aux_loss_divisor: int | None = None) -> dict[str, Any]:
    """Apply the family's shipped recipe on this rank, run one step; return what to compare."""
    from hyperrecipe.runtime.comm.collectives import count_collectives

    model = build(family, **overrides)
    plan = compile_recipe(recipe_path(family), build(family, "meta", **overrides),
                          {"tp": world})
    inst = apply(model, plan, mesh_1d(world), mode=mode)  # type: ignore[arg-type]
    tied = _still_tied(model)
    with count_collectives() as log:
        out = step(model, aux_loss_divisor)
    counted = Counter((r.kind, r.mesh_dim, r.direction) for r in log.records)
    expected = Counter((e.op.kind, e.mesh_dim, e.direction) for e in plan.manifest)
    grads = inst.full_grads()
    inst.restore()
    restored = {n: p.detach().clone() for n, p in model.named_parameters(remove_duplicate=False)}
    return {"logits": out, "grads": grads, "counted": dict(counted), "expected": dict(expected),
            "tied": tied, "restored": restored, "tied_after_restore": _still_tied(model)}


def _still_tied(model: nn.Module) -> bool | None:
    """Whether the input embedding and the LM head are one parameter (None: not tied by config)."""
    if not model.config.tie_word_embeddings:  # type: ignore[union-attr]
        return None
    embedding = model.get_input_embeddings().weight  # type: ignore[operator]
    return embedding is model.get_output_embeddings().weight  # type: ignore[operator]
