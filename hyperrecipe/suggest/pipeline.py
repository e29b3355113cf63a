"""The ``pipeline`` section ``suggest`` proposes for a mesh with a ``pp`` dim: which
``nn.ModuleList`` the stages split, under which schedule, with how many microbatches.

The split list is the model's list of repeated blocks, read as transformers declares it where it
can: the keys of the config class's ``base_model_pp_plan`` whose inputs include
``hidden_states`` and whose module (under the base model's prefix, ``model.layers``,
``transformer.h``) is a non-empty ``nn.ModuleList``. A family without a pipeline plan (GPT-2) and a
model of one's own get the list of repeated blocks (:class:`~hyperrecipe.suggest.folding.Folding`:
siblings that fold to ``*``) holding the most parameter bytes. Nothing else is decided here:
the split itself (balanced by parameter bytes), the outer modules' stages and the schedule's
rules are the resolver's (:mod:`hyperrecipe.resolve.pipeline`), and the proposal goes through
``check`` at the pipelined mesh like every suggested rule.

Refused by name: a model with no list of repeated blocks, and a list shorter than the stages.
One failure of ``check`` is corrected rather than given up: a module registered after the list
(so the last stage's by default) that the model calls before it is moved to ``first``, as the
runtime's message says (:func:`called_before_the_layers`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import attrs
from torch import nn

from hyperrecipe.errors import SuggestError
from hyperrecipe.suggest.folding import Folding

__all__ = ["PP_DIM", "PipelineProposal", "called_before_the_layers", "propose_pipeline"]

PP_DIM = "pp"
"""The mesh dim ``suggest`` lays pipeline stages over (the recipe's default ``mesh_dim``)."""

SCHEDULE = "1F1B"
"""The schedule proposed: one stage per rank, activations of at most ``pp`` microbatches in
flight on the first rank (docs/pipeline.md)."""


@attrs.frozen(kw_only=True)
class PipelineProposal:
    """A ``pipeline`` section as ``suggest`` writes it.

    Attributes:
        layers: FQN of the split list in the live model (``model.layers``).
        schedule: the schedule's name.
        microbatches: the batch is cut into this many.
        num_layers: the list's length in the model it was read from.
        source: where ``layers`` came from, for the comment above the section.
        first: modules registered after ``layers`` that the model calls before them, moved to
            the first stage because ``check`` said so (:func:`called_before_the_layers`).
    """

    layers: str
    schedule: str
    microbatches: int
    num_layers: int
    source: str
    first: tuple[str, ...] = ()

    def fields(self) -> dict[str, Any]:
        """The section's keys, in the order the recipe writes them."""
        out: dict[str, Any] = {"layers": self.layers, "schedule": self.schedule,
                               "microbatches": self.microbatches}
        if self.first:
            out["first"] = list(self.first)
        return out


_CALLED_EARLY = re.compile(r"(\S+) belongs to pipeline stage \d+ \(pipeline\.last\) but was "
                           r"called on stage \d+, which stops after its last layer")


def called_before_the_layers(reason: str, proposal: PipelineProposal) -> str | None:
    """The module a failed check says the model calls before the layers although it is
    registered after them (the runtime's ``StageBoundaryError``: Phi-4-multimodal's
    ``embed_tokens_extend``), when it is not in ``first`` yet: the fix the message names,
    ``pipeline.first``. ``None`` for any other failure."""
    found = _CALLED_EARLY.search(reason)
    if found is None or found.group(1) in proposal.first:
        return None
    return found.group(1)


def _is_list(module: nn.Module | None) -> bool:
    return isinstance(module, nn.ModuleList) and len(module) > 0


def _from_pp_plan(model: nn.Module, modules: Mapping[str, nn.Module]) -> tuple[str, str] | None:
    """``(fqn, source)`` from transformers' ``base_model_pp_plan``, or ``None``."""
    config = getattr(model, "config", None)
    config_cls = type(config)
    plan = getattr(config_cls, "base_model_pp_plan", None) or getattr(
        config, "base_model_pp_plan", None)
    if not isinstance(plan, Mapping):
        return None
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    for key, value in plan.items():
        inputs = value[0] if isinstance(value, (tuple, list)) and value else ()
        if "hidden_states" not in tuple(inputs or ()):
            continue
        candidates = [f"{prefix}.{key}" if prefix else str(key), str(key)]
        # a composite model holds the text model's list deeper (model.language_model.layers)
        candidates += sorted((f for f in modules if f.endswith(f".{key}")), key=len)
        for fqn in candidates:
            if _is_list(modules.get(fqn)):
                return fqn, (f"{config_cls.__name__}.base_model_pp_plan[{key!r}] (inputs "
                             f"{list(inputs)})")
    return None


def _param_bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def _from_structure(model: nn.Module, modules: Mapping[str, nn.Module]
                    ) -> tuple[str, str] | None:
    """``(fqn, source)``: the list of repeated blocks (every child folds to ``*`` and holds
    parameters) with the most parameter bytes, or ``None``."""
    fold = Folding.of_module(model)
    lists = []
    for fqn, module in modules.items():
        if not _is_list(module) or not fqn:
            continue
        children = [f"{fqn}.{name}" for name, _ in module.named_children()]
        if all(fold(c).endswith("*") for c in children) and all(
                any(True for _ in modules[c].parameters()) for c in children):
            lists.append((_param_bytes(module), fqn))
    if not lists:
        return None
    lists.sort(key=lambda t: -t[0])  # stable: of equal lists the first registered
    fqn = lists[0][1]
    others = f"; other lists: {', '.join(f for _, f in lists[1:4])}" if len(lists) > 1 else ""
    return fqn, (f"the model's structure (its list of repeated blocks holding the most "
                 f"parameter bytes{others})")


def _lists_named(modules: Mapping[str, nn.Module]) -> str:
    lists = [f for f, m in modules.items() if _is_list(m) and f]
    return ", ".join(lists[:6]) or "none"


def propose_pipeline(model: nn.Module, spec: str, pp: int,
                     microbatches: int | None = None) -> PipelineProposal:
    """The ``pipeline`` section for ``model`` over ``pp`` ranks (see the module doc).

    Args:
        model: the model (on the meta device) the check builds.
        spec: the model spec as the user gave it, for messages.
        pp: the pipeline mesh dim's size.
        microbatches: as given (``--microbatches``); default ``2 * pp``.

    Raises:
        SuggestError: the model has no list of repeated blocks, or fewer blocks than stages.
    """
    modules = dict(model.named_modules())
    found = _from_pp_plan(model, modules) or _from_structure(model, modules)
    if found is None:
        msg = (f"{spec} ({type(model).__name__}) has no list of repeated blocks to split into "
               f"pipeline stages: its config declares no base_model_pp_plan naming an "
               f"nn.ModuleList, and no nn.ModuleList of it holds repeated blocks with parameters "
               f"(nn.ModuleLists: {_lists_named(modules)}); give a mesh without {PP_DIM}, or "
               f"write the pipeline section by hand (docs/pipeline.md)")
        raise SuggestError(msg)
    fqn, source = found
    count = sum(1 for _ in modules[fqn].children())
    if count < pp:
        msg = (f"{spec}: {fqn} holds {count} layers, fewer than the {pp} pipeline stages of "
               f"{PP_DIM}={pp} ({SCHEDULE}: one stage per rank, each needs at least one layer); "
               f"give a config with at least {pp} layers (--check-config for the check's) or a "
               f"smaller {PP_DIM}")
        raise SuggestError(msg)
    chosen = microbatches if microbatches is not None else 2 * pp
    if chosen < pp:
        msg = (f"{SCHEDULE} runs at least as many microbatches as stages: declared "
               f"--microbatches {chosen}; required: at least {pp} at {PP_DIM}={pp}")
        raise SuggestError(msg)
    return PipelineProposal(layers=fqn, schedule=SCHEDULE, microbatches=chosen,
                            num_layers=count, source=source)
