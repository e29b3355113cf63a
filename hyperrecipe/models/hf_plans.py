"""transformers' own parallel plans, read off a built model as data.

A transformers model class carries a tensor-parallel plan (``base_model_tp_plan`` on its config
class, ``_tp_plan`` on the head class, merged and prefixed by ``post_init`` into the instance's
``tp_plan``) and, for MoE families, an expert-parallel plan (``base_model_ep_plan`` /
``ep_plan``). ``hyperrecipe suggest`` starts from them; this module only reads them and says
where each entry came from, so the suggestion's comments can cite the source. It imports no
transformers module: everything is read from the model object it is given.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
from torch import nn

__all__ = ["PlanEntry", "read_plans"]


@attrs.frozen(kw_only=True)
class PlanEntry:
    """One entry of a transformers plan.

    Attributes:
        pattern: the module (or parameter) FQN pattern in the whole model, ``*`` for one segment
            (``model.layers.*.self_attn.q_proj``), as the instance's plan spells it.
        style: transformers' style name (``colwise``, ``rowwise``, ``embedding_rowwise``, ...).
        plan: ``"tp"`` or ``"ep"``.
        source: where the entry is declared, for a comment (``LlamaConfig.base_model_tp_plan``).
        chunks: for ``packed_colwise``, how many packed parts (``0``: transformers' two, gate
            and up); a fused q/k/v read off the structure has three.
        head: the entry is the model's output embedding (the head class's own plan says so by
            where it is declared; an entry read off the structure says so here).
        transposed: the projection stores its weight ``[in, out]`` (transformers' ``Conv1D``),
            the transpose of ``nn.Linear``'s: column-wise shards weight dim 1, row-wise dim 0.
            Only an entry read off the structure sets it (transformers' plans name no such
            module).
        sizes: integer attributes of the projection that hold its global output width (the
            forward shapes its output with them, as ``Conv1D`` does with ``nf``): each rank
            holds its share.
        split_sizes: integer attributes of the enclosing block that its forward splits this
            (packed) projection's output by (GPT-2's ``split_size``): each rank holds its share.
        chunk_sizes: for a ``packed_colwise`` entry read off the structure whose parts differ
            in width (grouped-query q, k, v: ``n_head`` query heads beside ``n_query_groups``
            key and value heads), each part's global width, in order; ``()``: ``chunks``
            equal parts.
        region: for an entry read off the structure, the block (pattern) whose boundary holds
            the projection, where it is not the projection's parent (a Linear inside the
            block's plain ``nn.Sequential``: ``ff.0.0``); ``""``: the parent.
    """

    pattern: str
    style: str
    plan: str
    source: str
    chunks: int = 0
    head: bool = False
    transposed: bool = False
    sizes: tuple[str, ...] = ()
    split_sizes: tuple[str, ...] = ()
    chunk_sizes: tuple[int, ...] = ()
    region: str = ""


def _as_plan(value: object) -> dict[str, str]:
    if not isinstance(value, Mapping):
        return {}
    return {str(k): str(v) for k, v in value.items() if isinstance(v, str)}


def _source(key: str, prefix: str, head: dict[str, str], base: dict[str, str], head_name: str,
            base_name: str, instance_name: str) -> str:
    if key in head:
        return head_name
    short = key[len(prefix) + 1:] if prefix and key.startswith(prefix + ".") else key
    if short in base:
        return base_name
    return instance_name


def read_plans(model: nn.Module) -> tuple[PlanEntry, ...]:
    """The tensor- and expert-parallel plan entries of a transformers model, in plan order.

    Returns ``()`` for a model that is not a transformers ``PreTrainedModel`` or whose family
    declares no plan.
    """
    config = getattr(model, "config", None)
    cls = type(model)
    config_cls = type(config)
    prefix = str(getattr(model, "base_model_prefix", "") or "")
    out: list[PlanEntry] = []
    for kind in ("tp", "ep"):
        instance = _as_plan(getattr(model, f"{kind}_plan", None))
        head = _as_plan(vars(cls).get(f"_{kind}_plan") or getattr(cls, f"_{kind}_plan", None))
        base = _as_plan(getattr(config_cls, f"base_model_{kind}_plan", None))
        if not instance:  # older layouts: merge the class and config plans ourselves
            instance = dict(head)
            instance.update({f"{prefix}.{k}" if prefix else k: v for k, v in base.items()})
        for key, style in instance.items():
            src = _source(key, prefix, head, base, f"{cls.__name__}._{kind}_plan",
                          f"{config_cls.__name__}.base_model_{kind}_plan",
                          f"{cls.__name__}.{kind}_plan (transformers' post_init default)")
            out.append(PlanEntry(pattern=key, style=style, plan=kind, source=src))
    return tuple(out)
