"""That the ranks of a model-parallel group draw the same random numbers, where dropout draws.

Every rank of a tensor-parallel group computes the replicated parts of the model (embeddings,
norms, the residual stream) on the same values; dropout there must draw the same mask on
each, or the "replicated" activations differ between ranks, the gradients of replicated
weights differ, and those weights drift apart from the first optimizer step, with nothing
refused (GPT-2's default dropout 0.1 at tp=2 with a seed per rank, as
``accelerate.utils.set_seed(seed, device_specific=True)`` gives: the embedding's dropout output
and the final norm's gradient differed between the ranks, in both modes). Validate mode cannot
see it either: its DTensors marked ``Replicate`` hold whatever each rank drew.

So at the first forward in training mode of a model that has dropout (an ``nn.Dropout`` with
``p > 0``, or a ``*dropout*`` / ``*pdrop*`` setting above 0 in its config, which attention
applies through ``F.dropout`` or SDPA's ``dropout_p``), the ranks of each dim the plan splits
the model over compare a digest of their torch generator states (the CPU's, and the current
accelerator's where the model is on one), once per installation; a difference is refused by
name. Ranks that differ only over data-parallel dims are not compared: they may (and should)
draw differently.

This module says what is digested and what the refusal says; the hook, and the one exchange
it shares with the check that the same ranks were handed the same batch, are
:mod:`.first_forward`'s.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["dropout_settings", "generator_digest", "randomness_refusal"]


def dropout_settings(model: nn.Module) -> list[str]:
    """Where ``model`` draws dropout: ``nn.Dropout`` modules with ``p > 0`` and config fields
    named ``*dropout*`` or ``*pdrop*`` above 0, as ``name=value`` (at most a few)."""
    found: list[str] = []
    to_dict = getattr(getattr(model, "config", None), "to_dict", None)
    values: dict[str, Any] = to_dict() if callable(to_dict) else {}
    for key, value in sorted(values.items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, (int, float)) \
                and not isinstance(value, bool) and value > 0:
            found.append(f"config.{key}={value}")
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            found.append(f"{name or '<root>'}: {type(module).__name__}(p={module.p})")
    return found


def generator_digest(model: nn.Module) -> str:
    """A hex digest of the generator states ``model``'s dropout draws from: the CPU's, and the
    accelerator's where the model lives on one (dropout on a GPU draws from the GPU's)."""
    digest = hashlib.sha256(torch.random.get_rng_state().numpy().tobytes())
    device = next((p.device for p in model.parameters() if p.device.type != "cpu"), None)
    if device is not None:
        accelerator = getattr(torch, device.type, None)
        get_state = getattr(accelerator, "get_rng_state", None)
        if callable(get_state):
            digest.update(get_state(device).numpy().tobytes())
    return digest.hexdigest()


def randomness_refusal(dim: str, ranks: Sequence[int], settings: Sequence[str]) -> str:
    """The message for the ranks ``ranks`` of mesh dim ``dim`` whose generator states differ,
    in a model with dropout at ``settings``."""
    shown = ", ".join(settings[:3]) + (" and more" if len(settings) > 3 else "")
    return (f"the ranks {list(ranks)} of mesh dim {dim!r} draw different random numbers "
            f"(their torch generator states differ: a seed per rank?), and the "
            f"model has dropout ({shown}): replicated activations would differ "
            f"between these ranks and the replicated weights drift apart, silently. "
            f"Seed every rank of a model-parallel group alike (torch.manual_seed(s) "
            f"or transformers.set_seed(s) on every rank, not device-specific), or "
            f"set dropout to 0")
