"""A tiny config of the same structure as a transformers config, for checking a recipe quickly.

``hyperrecipe suggest`` proves what it writes by running ``check`` on the model; a real config
(billions of parameters) cannot run on every rank of a laptop, so the check runs on a config of
the same family and shape *kind* — grouped or not, with the same layer types, experts and
latent ranks where the family has them — with every size field shrunk. Only fields the family
declares are set; the user's own fields come first and are shrunk where they are sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypeGuard

__all__ = ["TINY_SIZES", "is_tiny", "tiny_config"]

TINY_SIZES: dict[str, int] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 128,
    "moe_intermediate_size": 64,
    "shared_expert_intermediate_size": 64,
    "num_local_experts": 4,
    "num_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 1,
    "topk_group": 1,
    "kv_lora_rank": 16,
    "q_lora_rank": 32,
    "qk_rope_head_dim": 16,
    "qk_nope_head_dim": 16,
    "v_head_dim": 16,
    "qk_head_dim": 32,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "sliding_window": 4,
    "vocab_size_per_layer_input": 128,
    "hidden_size_per_layer_input": 16,
    "intermediate_size_mlp": 128,
    "global_head_dim": 16,
    "num_global_key_value_heads": 2,
    "query_pre_attn_scalar": 16,
}
"""Size fields and their tiny values (hidden 64, 2 layers, 4 heads of 16, vocab 128, 4 experts)."""

_ALWAYS = frozenset({"num_experts_per_tok"})
_EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts", "n_shared_experts")
"""Expert counts (routed and shared) a MoE family (one that declares experts per token) may leave ``None`` to its
checkpoints; the tiny config sets them, as it sets the experts per token."""
_PER_HEAD = ("rotary_dim",)
"""Int fields measured within one head (the rotated part of it): scaled with the head."""
_SMALL_HIDDEN = 256
_SMALL_LAYERS = 4
_NOT_STRUCTURE = frozenset({"model_type", "transformers_version", "id2label", "label2id",
                            "architectures", "_name_or_path"})
_DEFAULT_ROPE: dict[str, Any] = {"rope_type": "default", "rope_theta": 10000.0}


def is_tiny(fields: Mapping[str, Any]) -> bool:
    """Whether a config is already small enough to check as it is."""
    hidden = fields.get("hidden_size")
    layers = fields.get("num_hidden_layers")
    return (isinstance(hidden, int) and hidden <= _SMALL_HIDDEN
            and isinstance(layers, int) and layers <= _SMALL_LAYERS)


def _is_int(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _kv_heads(defaults: Mapping[str, Any]) -> int:
    heads, kv = defaults.get("num_attention_heads"), defaults.get("num_key_value_heads")
    if kv is None or kv == heads:
        return TINY_SIZES["num_attention_heads"]
    return 1 if kv == 1 else 2


def _shrink_sizes(fields: Mapping[str, Any]) -> dict[str, Any]:
    """A per-layer override (``{"num_attention_heads": 64, ...}``) with its sizes tiny."""
    out = {k: (TINY_SIZES[k] if k in TINY_SIZES and _is_int(v) else v) for k, v in fields.items()}
    if _is_int(fields.get("num_key_value_heads")):
        out["num_key_value_heads"] = _kv_heads(fields)
    return out


def _size_base(key: str) -> str | None:
    """The size a per-layer list gives layer by layer: ``intermediate_size`` itself, or the size
    its name extends (``num_attention_heads_per_layer``); ``None`` for a list of kinds."""
    if key in TINY_SIZES:
        return key
    return max((size for size in TINY_SIZES if key.startswith(size + "_")), key=len, default=None)


def _layer_keyed(value: Any, layers: int) -> bool:
    """A mapping from layer index (``"02"``) to that layer's overrides."""
    return (isinstance(value, dict) and bool(value)
            and all(isinstance(k, str) and k.isdigit() and int(k) < layers for k in value))


def _pick_layers(defaults: Mapping[str, Any], layers: int,
                 tiny_layers: int) -> tuple[list[int], dict[str, Any]]:
    """Layers of the real stack that keep every distinct kind of layer, and the fields that
    describe the stack rewritten for those layers alone.

    A layer's kind is what the per-layer fields say of it: its entry in each list of one entry
    per layer (``layer_types``, ``mlp_layer_types``, ...), whether a list of layer indices
    (``mlp_only_layers``) names it, whether a layer-keyed mapping overrides it. The first layer
    of each kind is kept, in the real order, and the lists, indices and mappings are rewritten
    for the kept layers; per-layer sizes (``intermediate_size`` as a list,
    ``num_attention_heads_per_layer``) shrink like the size they give per layer.
    """
    # layer indices: increasing ints below the depth (all of them, for moe_layers, is still
    # a list of indices, not one entry per layer)
    indices = {k: v for k, v in defaults.items()
               if "layer" in k and isinstance(v, list) and v
               and all(_is_int(i) and 0 <= i < layers for i in v)
               and all(a < b for a, b in zip(v, v[1:]))}
    per_layer = {k: v for k, v in defaults.items()
                 if k not in indices and isinstance(v, list) and len(v) == layers}
    keyed = {k: v for k, v in defaults.items() if _layer_keyed(v, layers)}

    def kind(i: int) -> tuple[Any, ...]:
        own = tuple(repr(v[i]) for k, v in sorted(per_layer.items()) if _size_base(k) is None)
        named = tuple(i in v for _, v in sorted(indices.items()))
        overridden = tuple(any(int(key) == i for key in v) for _, v in sorted(keyed.items()))
        return own + named + overridden

    first: dict[tuple[Any, ...], int] = {}
    for i in range(layers):
        first.setdefault(kind(i), i)
    chosen = sorted(first.values())
    for i in range(layers):  # at least the tiny depth: the next layers in order
        if len(chosen) >= tiny_layers:
            break
        if i not in chosen:
            chosen = sorted([*chosen, i])
    out: dict[str, Any] = {}
    for k, v in per_layer.items():
        picked = [v[i] for i in chosen]
        base = _size_base(k)
        out[k] = [TINY_SIZES[base] if _is_int(x) else x for x in picked] if base else picked
    for k, v in indices.items():
        out[k] = [pos for pos, i in enumerate(chosen) if i in set(v)]
    for k, v in keyed.items():
        width = len(next(iter(v)))
        out[k] = {str(pos).zfill(width): _shrink_sizes(v[key])
                  for pos, i in enumerate(chosen) for key in v if int(key) == i
                  and isinstance(v[key], dict)}
    return chosen, out


def _periodic(defaults: Mapping[str, Any]) -> dict[str, Any]:
    """``X_period``/``X_offset`` pairs (every ``period``-th layer from ``offset`` is of kind X)
    at period 2, so that two layers hold one layer of each kind."""
    out: dict[str, Any] = {}
    for key, period in defaults.items():
        if not key.endswith("_period") or not _is_int(period) or period <= 1:
            continue
        offset_key = key[:-len("period")] + "offset"
        offset = defaults.get(offset_key)
        if _is_int(offset):
            out[key] = 2
            out[offset_key] = 0 if offset % period == 0 else 1
    return out


def _head_dim(defaults: Mapping[str, Any], hidden: str, heads: str) -> int | None:
    head = defaults.get("head_dim")
    if _is_int(head):
        return int(head)
    h, n = defaults.get(hidden), defaults.get(heads)
    return h // n if _is_int(h) and _is_int(n) and n else None


def _sub_configs(defaults: Mapping[str, Any]) -> dict[str, Any]:
    """Nested configs (a multimodal family's ``text_config``, ``vision_config``) shrunk by
    their own family's rules."""
    from transformers import CONFIG_MAPPING

    out: dict[str, Any] = {}
    for key, value in defaults.items():
        if (isinstance(value, dict) and isinstance(value.get("model_type"), str)
                and value["model_type"] in CONFIG_MAPPING):
            own = CONFIG_MAPPING[value["model_type"]]().to_dict()
            # what the nesting family sets differently from the nested family's defaults
            sub = {k: v for k, v in value.items()
                   if k not in _NOT_STRUCTURE and (k not in own or own[k] != v)}
            out[key] = {"model_type": value["model_type"],
                        **tiny_config(value["model_type"], sub)}
    return out


def tiny_config(model_type: str, fields: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Config fields for a tiny ``model_type`` model of the same structure as ``fields``.

    Beyond the sizes (:data:`TINY_SIZES`), the rules are about the config's structure, never a
    family's name: a field the family derives from others and leaves ``None`` (``head_dim``,
    ``num_key_value_heads``) is set to what it derives to, so the shrunk sizes stay
    consistent; expert counts a MoE family leaves ``None`` are set; a width within one head
    (``rotary_dim``) shrinks with the head; the per-layer fields keep one layer of every kind
    (:func:`_pick_layers`); periodic layer kinds get period 2; a hybrid stack with no attention
    layer in its defaults gets one; rope parameters keyed by layer type get an entry for every
    type the layers use; nested configs shrink by their own rules.

    Args:
        model_type: transformers' model type (``llama``).
        fields: the user's config fields (a real checkpoint's config); ``None``: the family's
            defaults.

    Returns:
        The fields to build with: the user's, with every size field shrunk.
    """
    from transformers import CONFIG_MAPPING

    config_class = CONFIG_MAPPING[model_type]
    aliases = dict(getattr(config_class, "attribute_map", {}) or {})  # hidden_size -> n_embd

    def name(key: str) -> str:
        return str(aliases.get(key, key))

    given = dict(fields or {})
    defaults = dict(config_class().to_dict())
    defaults.update(given)
    out = dict(given)
    moe = name("num_experts_per_tok") in defaults
    for key, value in TINY_SIZES.items():
        real = name(key)
        current = defaults.get(real)
        # a field the family leaves off (None: no q_lora_rank, no sliding window) stays off,
        # except the experts per token and the expert counts, which a MoE family may leave to
        # its checkpoints
        if _is_int(current) or (current is None and real in defaults and (
                real in _ALWAYS or (moe and key in _EXPERT_COUNTS))):
            # never more experts per token than the family routes (one, for some)
            out[real] = min(value, current) if key in _ALWAYS and _is_int(current) else value
    hidden, heads = name("hidden_size"), name("num_attention_heads")
    kv = name("num_key_value_heads")
    if _is_int(defaults.get(kv)):
        out[kv] = _kv_heads({"num_attention_heads": defaults.get(heads),
                             "num_key_value_heads": defaults[kv]})
    elif kv in defaults and defaults[kv] is None and kv not in given and heads in out:
        out[kv] = out[heads]  # None: one key/value head per query head
    if ("head_dim" in defaults and defaults["head_dim"] is None and "head_dim" not in given
            and _is_int(out.get(hidden)) and _is_int(out.get(heads))):
        out["head_dim"] = out[hidden] // out[heads]
    real_head = _head_dim(defaults, hidden, heads)
    tiny_head = _head_dim({**defaults, **out}, hidden, heads)
    for key in _PER_HEAD:
        width = defaults.get(key)
        if _is_int(width) and real_head and tiny_head and width > 0:
            out[key] = max(2, 2 * round(width * tiny_head / real_head / 2))
    for token in ("pad_token_id", "bos_token_id", "eos_token_id"):
        token_id = defaults.get(token)  # an id past the tiny vocabulary fails the embedding
        if _is_int(token_id) and token_id >= TINY_SIZES["vocab_size"]:
            out[token] = TINY_SIZES["vocab_size"] - 1
    out.update(_periodic(defaults))
    layers_key = name("num_hidden_layers")
    layers = defaults.get(layers_key)
    if layers_key in out and _is_int(layers) and layers > out[layers_key]:
        chosen, stack = _pick_layers(defaults, layers, int(out[layers_key]))
        if stack:
            out.update(stack)
            out[layers_key] = len(chosen)
    if ("layer_types" in defaults and defaults["layer_types"] is None
            and _is_int(out.get(layers_key))):
        # left to the checkpoints, and read per layer: transformers' default kind for each
        out["layer_types"] = ["full_attention"] * int(out[layers_key])
    _attention_in_hybrids(defaults, out, layers_key)
    _rope_per_layer_type(defaults, out)
    out.update(_sub_configs(defaults))
    return out


def _attention_in_hybrids(defaults: Mapping[str, Any], out: dict[str, Any],
                          layers_key: str) -> None:
    """A hybrid stack (recurrent layers beside attention) whose defaults hold no attention layer
    (its checkpoints place them) gets its last tiny layer as attention: a stack of recurrent
    layers alone fails in one process (transformers' masks need an attention layer)."""
    if not _is_int(out.get(layers_key)) or not _is_int(defaults.get("num_attention_heads")):
        return
    last = int(out[layers_key]) - 1
    types = out.get("layer_types", defaults.get("layer_types"))
    if isinstance(types, list) and types and set(types) == {"linear_attention"}:
        out["layer_types"] = [*types[:-1], "full_attention"]
        return
    for key, value in defaults.items():
        if ("attn" in key or "attention" in key) and key.endswith("_indices") and not value:
            if value is None or isinstance(value, list):
                out[key] = [last]


def _rope_per_layer_type(defaults: Mapping[str, Any], out: dict[str, Any]) -> None:
    """Rope parameters keyed by layer type (``{"full_attention": {...}}``) that lack a type the
    layers use get transformers' default rope for it (an empty mapping fails to build)."""
    rope = defaults.get("rope_parameters")
    types = out.get("layer_types", defaults.get("layer_types"))
    if not isinstance(rope, dict) or rope or not isinstance(types, list) or not types:
        return
    out["rope_parameters"] = {t: dict(_DEFAULT_ROPE) for t in dict.fromkeys(types)}
