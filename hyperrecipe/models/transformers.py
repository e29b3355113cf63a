"""What the runtime needs to know about transformers, behind one small interface.

The runtime proper names no transformers class, function or private attribute: it asks these
functions, which read transformers' objects only once the user has imported transformers (each
looks the module up in ``sys.modules`` and answers "not a transformers model" otherwise), so a
plain PyTorch model never pays transformers' import and the runtime never pins its internals.

What lives here: attention dispatch (``config._attn_implementation`` and the
``AttentionInterface`` registry), the causal-LM loss the vocab-sharded loss replaces, the
per-module initializer that recomputes buffers after a meta apply, ``Conv1D`` (GPT-2's
transposed linear), ``save_pretrained``'s size strings, the checkpoint conventions of a model
class (tied weights, the base-model prefix, keys it ignores) and the experts kernels' flag. Checkpoint key conversions are in
:mod:`hyperrecipe.models.hf_conversion`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, MutableMapping
from typing import Any

from torch import nn

__all__ = [
    "attention_implementation",
    "attention_registry",
    "base_model_prefix",
    "causal_lm_loss_name",
    "expert_kernel_flags",
    "ignored_checkpoint_keys",
    "is_causal_lm_loss",
    "is_conv1d",
    "model_initializer",
    "size_to_bytes",
    "tied_weight_keys",
]

#: The loss class name :func:`is_causal_lm_loss` accepts, for messages.
causal_lm_loss_name = "transformers' ForCausalLMLoss"


def attention_implementation(module: nn.Module) -> str | None:
    """The attention implementation a transformers attention module dispatches to (``"sdpa"``,
    ``"eager"``, ...), or ``None`` for a module without a transformers config."""
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
    return impl if isinstance(impl, str) else None


def attention_registry() -> tuple[MutableMapping[str, Any], MutableMapping[str, Any]] | None:
    """transformers' global attention registry and the mapping a hook must write to (its
    per-instance overrides when it keeps them), or ``None`` before transformers is imported."""
    utils = sys.modules.get("transformers.modeling_utils")
    registry = getattr(utils, "ALL_ATTENTION_FUNCTIONS", None)
    if not isinstance(registry, MutableMapping):
        return None
    local = getattr(registry, "_local_mapping", None)
    return registry, (local if isinstance(local, dict) else registry)


def is_causal_lm_loss(fn: object) -> bool:
    """Whether ``fn`` is transformers' causal-LM cross entropy (``ForCausalLMLoss``), the only
    model loss whose steps the vocab-sharded loss reproduces."""
    return (getattr(fn, "__name__", None) == "ForCausalLMLoss"
            and getattr(fn, "__module__", "").startswith("transformers."))


def model_initializer(model: nn.Module) -> Callable[[nn.Module], object] | None:
    """A transformers model's per-module initializer (``_init_weights``), which recomputes
    non-persistent buffers such as rotary ``inv_freq``; ``None`` for other models."""
    init = getattr(model, "_init_weights", None)
    return init if callable(init) else None


def is_conv1d(module: nn.Module) -> bool:
    """Whether ``module`` is exactly transformers' ``Conv1D`` (GPT-2's linear with a transposed
    weight). An instance exists only once its module is imported, so nothing is imported here."""
    utils = sys.modules.get("transformers.pytorch_utils")
    conv1d = getattr(utils, "Conv1D", None)
    return conv1d is not None and type(module) is conv1d


def size_to_bytes(size: int | str) -> int:
    """``save_pretrained``'s ``max_shard_size`` (``"5GB"`` or bytes) in bytes, as transformers
    reads it."""
    from transformers.utils.hub import convert_file_size_to_int

    return int(convert_file_size_to_int(size))


def tied_weight_keys(model: nn.Module) -> dict[str, str]:
    """The parameters transformers ties (target name -> source name), empty for other models."""
    tied = getattr(model, "_tied_weights_keys", None)
    if not isinstance(tied, dict):
        return {}
    return {t: s for t, s in tied.items() if isinstance(t, str) and isinstance(s, str)}


def base_model_prefix(model: nn.Module) -> str | None:
    """The attribute a transformers head model keeps its base model under (``"model"``);
    checkpoints saved from the base model carry keys without it."""
    prefix = getattr(model, "base_model_prefix", None)
    return prefix if isinstance(prefix, str) and prefix else None


def ignored_checkpoint_keys(model: nn.Module) -> tuple[str, ...]:
    """Regexes of checkpoint keys the model deliberately does not load
    (``_keys_to_ignore_on_load_unexpected``)."""
    return tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())


def expert_kernel_flags(module: nn.Module) -> dict[str, object]:
    """Attributes an experts module needs set when it holds a slice of the experts: transformers'
    ``batched_mm`` / ``grouped_mm`` kernels mask expert ids outside the slice only when the
    module's ``_is_expert_parallel`` flag is set."""
    return {"_is_expert_parallel": True} if hasattr(module, "_is_expert_parallel") else {}
