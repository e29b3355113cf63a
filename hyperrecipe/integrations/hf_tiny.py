"""A tiny config of the same structure as a transformers config, for checking a recipe quickly.

``hyperrecipe suggest`` proves what it writes by running ``check`` on the model; a real config
(billions of parameters) cannot run on every rank of a laptop, so the check runs on a config of
the same family and shape *kind* — grouped or not, with the same layer types, experts and
latent ranks where the family has them — with every size field shrunk. Only fields the family
declares are set; the user's own fields come first and are shrunk where they are sizes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

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
_SMALL_HIDDEN = 256
_SMALL_LAYERS = 4


def is_tiny(fields: Mapping[str, Any]) -> bool:
    """Whether a config is already small enough to check as it is."""
    hidden = fields.get("hidden_size")
    layers = fields.get("num_hidden_layers")
    return (isinstance(hidden, int) and hidden <= _SMALL_HIDDEN
            and isinstance(layers, int) and layers <= _SMALL_LAYERS)


def _kv_heads(defaults: Mapping[str, Any]) -> int:
    heads, kv = defaults.get("num_attention_heads"), defaults.get("num_key_value_heads")
    if kv is None or kv == heads:
        return TINY_SIZES["num_attention_heads"]
    return 1 if kv == 1 else 2


def _layer_types(types: list[Any], layers: int) -> list[Any]:
    """Every distinct layer type, each at least once, in order of first appearance."""
    distinct = list(dict.fromkeys(types))
    return (distinct * layers)[:max(layers, len(distinct))]


def tiny_config(model_type: str, fields: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Config fields for a tiny ``model_type`` model of the same structure as ``fields``.

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
    given = dict(fields or {})
    defaults = dict(config_class().to_dict())
    defaults.update(given)
    out = dict(given)
    for key, value in TINY_SIZES.items():
        real = aliases.get(key, key)
        current = defaults.get(real)
        # a field the family leaves off (None: no q_lora_rank, no sliding window) stays off,
        # except the experts per token, which a family may leave to its checkpoints
        if (isinstance(current, int) and not isinstance(current, bool)) or (
                current is None and real in defaults and real in _ALWAYS):
            out[real] = value
    kv = aliases.get("num_key_value_heads", "num_key_value_heads")
    if isinstance(defaults.get(kv), int):
        heads = defaults.get(aliases.get("num_attention_heads", "num_attention_heads"))
        out[kv] = _kv_heads({"num_attention_heads": heads, "num_key_value_heads": defaults[kv]})
    for token in ("pad_token_id", "bos_token_id", "eos_token_id"):
        token_id = defaults.get(token)  # an id past the tiny vocabulary fails the embedding
        if isinstance(token_id, int) and token_id >= TINY_SIZES["vocab_size"]:
            out[token] = TINY_SIZES["vocab_size"] - 1
    layers_key = aliases.get("num_hidden_layers", "num_hidden_layers")
    types = defaults.get("layer_types")
    if isinstance(types, list) and types and layers_key in out:
        out["layer_types"] = _layer_types(types, int(out[layers_key]))
        out[layers_key] = len(out["layer_types"])
    return out
