"""The model's own default forward and ``generate()`` under a shipped recipe, against one process.

No forward argument is overridden: ``model(input_ids=ids)`` runs with the config's defaults
(``use_cache=True``, so every attention grows a KV cache inside its boundary), and
``model.generate(ids, max_new_tokens=8, do_sample=False)`` decodes greedily, feeding the cache
back in one token at a time, on transformers' default ``sdpa`` attention in both modes
(validate mode registers a DTensor rule for the CPU kernel). Only what torch 2.13 forces is set:
for Mixtral's experts on DTensors, ``batched_mm`` (``grouped_mm`` has no fp32 DTensor path); the
single-process reference is built the same way.
"""

from __future__ import annotations

from typing import Any

import torch

from hyperrecipe import apply, compile_recipe
from tests.support.family_harness import build

PROMPT_SHAPE = (2, 6)
NEW_TOKENS = 8


def prompt(vocab: int = 128) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, vocab, PROMPT_SHAPE, generator=g)


def overrides_for(family: str, mode: str, recipe: str) -> dict[str, Any]:
    """The config fields validate mode needs on the CPU (none in production)."""
    if mode != "validate":
        return {}
    out: dict[str, Any] = {}
    if family == "mixtral" and not recipe.endswith("-ep.yaml"):
        out["experts_implementation"] = "batched_mm"
    return out


def default_forward_and_generate(model: torch.nn.Module, generate: bool = True
                                 ) -> dict[str, torch.Tensor]:
    """Logits of a default forward, the cache length it left, and (``generate``) 8 greedy
    tokens."""
    ids = prompt()
    out = model(input_ids=ids)
    result = {"logits": out.logits.detach(),
              "cached": torch.tensor(out.cache.get_seq_length())}
    if generate:
        with torch.no_grad():
            result["tokens"] = model.generate(  # type: ignore[operator]
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                do_sample=False)
    return result


def reference(family: str, overrides: dict[str, Any]) -> dict[str, torch.Tensor]:
    return default_forward_and_generate(build(family, **overrides))


def generate_worker(rank: int, world: int, family: str, recipe: str, mesh: dict[str, int],
                    mode: str, overrides: dict[str, Any], generate: bool = True
                    ) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh

    model = build(family, **overrides)
    plan = compile_recipe(recipe, build(family, "meta", **overrides), mesh)
    device_mesh = init_device_mesh("cpu", tuple(mesh.values()), mesh_dim_names=tuple(mesh))
    apply(model, plan, device_mesh, mode=mode)  # type: ignore[arg-type]
    return default_forward_and_generate(model, generate)
