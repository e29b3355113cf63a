"""What the runtime asks of transformers, answered for transformers' models only.

Every answer reads transformers' objects only once the user has imported transformers (it looks
the module up in ``sys.modules`` and answers "not mine" otherwise), so a plain PyTorch model
never pays transformers' import and the runtime never pins its internals: this module is the one
place that names them.

What lives here: attention dispatch (``config._attn_implementation`` and the
``AttentionInterface`` registry), the causal-LM loss the vocab-sharded loss replaces
(``loss_function`` kept as ``_loss_function``), the MoE router loss
(``load_balancing_loss_func`` over the ``router_logits`` a model records through
``_can_record_outputs``), the per-module initializer that recomputes buffers after a meta apply,
``Conv1D`` (GPT-2's transposed linear), ``save_pretrained``'s size strings, the checkpoint
conventions of a model class (tied weights, the base-model prefix, keys it ignores) and the
experts kernels' flag. Checkpoint key conversions are in
:mod:`hyperrecipe.models.hf_conversion`, the kernels validate mode cannot run in
:mod:`hyperrecipe.models.hf_kernels`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from typing import TYPE_CHECKING, Any

from hyperrecipe.models.library import LossSeat, PlainTorch, RouterLoss

if TYPE_CHECKING:  # pragma: no cover
    from torch import nn

    from hyperrecipe.models.hf_conversion import Conversion
    from hyperrecipe.plan import Plan

__all__ = ["Transformers"]

#: The module-level function transformers' MoE families compute the router loss with.
ROUTER_LOSS_FUNCTION = "load_balancing_loss_func"


class Transformers(PlainTorch):
    """transformers' answers (module docstring)."""

    name = "transformers"

    def attention_implementation(self, module: nn.Module) -> str | None:
        impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
        return impl if isinstance(impl, str) else None

    def attention_registry(self) -> tuple[MutableMapping[str, Any],
                                          MutableMapping[str, Any]] | None:
        """The global registry and its per-instance overrides when it keeps them."""
        utils = sys.modules.get("transformers.modeling_utils")
        registry = getattr(utils, "ALL_ATTENTION_FUNCTIONS", None)
        if not isinstance(registry, MutableMapping):
            return None
        local = getattr(registry, "_local_mapping", None)
        return registry, (local if isinstance(local, dict) else registry)

    def loss_seat(self, owner: nn.Module) -> LossSeat | None:
        """``ForCausalLMLoss``, the only model loss whose steps the vocab-sharded loss
        reproduces; ``loss_function`` is a property over ``_loss_function``."""
        fn = getattr(owner, "loss_function", None)
        if (getattr(fn, "__name__", None) == "ForCausalLMLoss"
                and getattr(fn, "__module__", "").startswith("transformers.")):
            assert fn is not None
            return LossSeat(function=fn, attribute="_loss_function")
        return None

    def causal_lm_loss_name(self) -> str | None:
        return "transformers' ForCausalLMLoss"

    def router_loss(self, model: nn.Module) -> RouterLoss | None:
        """The router class a model records ``router_logits`` from (``_can_record_outputs``)
        and its modeling module's ``load_balancing_loss_func``."""
        recorder = (getattr(type(model), "_can_record_outputs", None) or {}).get("router_logits")
        router_class = getattr(recorder, "target_class", None)
        if not isinstance(router_class, type):
            return None
        namespace = sys.modules.get(type(model).__module__)
        if not callable(getattr(namespace, ROUTER_LOSS_FUNCTION, None)):
            namespace = None
        return RouterLoss(router_class=router_class, namespace=namespace,
                          name=ROUTER_LOSS_FUNCTION)

    def initializer(self, model: nn.Module) -> Callable[[nn.Module], object] | None:
        """``_init_weights``, which recomputes non-persistent buffers such as rotary
        ``inv_freq``."""
        init = getattr(model, "_init_weights", None)
        return init if callable(init) else None

    def is_transposed_linear(self, module: nn.Module) -> bool:
        """Exactly ``Conv1D``: an instance exists only once its module is imported, so nothing
        is imported here."""
        utils = sys.modules.get("transformers.pytorch_utils")
        conv1d = getattr(utils, "Conv1D", None)
        return conv1d is not None and type(module) is conv1d

    def size_to_bytes(self, size: int | str) -> int | None:
        """``max_shard_size`` (``"5GB"`` or bytes), as transformers reads it."""
        try:
            from transformers.utils.hub import convert_file_size_to_int
        except ImportError:
            return None
        return int(convert_file_size_to_int(size))

    def tied_weight_keys(self, model: nn.Module) -> Mapping[str, str]:
        tied = getattr(model, "_tied_weights_keys", None)
        if not isinstance(tied, dict):
            return {}
        return {t: s for t, s in tied.items() if isinstance(t, str) and isinstance(s, str)}

    def base_model_prefix(self, model: nn.Module) -> str | None:
        prefix = getattr(model, "base_model_prefix", None)
        return prefix if isinstance(prefix, str) and prefix else None

    def ignored_checkpoint_keys(self, model: nn.Module) -> Sequence[str]:
        """``_keys_to_ignore_on_load_unexpected``."""
        return tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())

    def expert_kernel_flags(self, module: nn.Module) -> Mapping[str, object]:
        """The ``batched_mm`` / ``grouped_mm`` kernels mask expert ids outside the slice only
        when the module's ``_is_expert_parallel`` flag is set."""
        return {"_is_expert_parallel": True} if hasattr(module, "_is_expert_parallel") else {}

    def checkpoint_conversion(self, model: nn.Module, shapes: Mapping[str, tuple[int, ...]],
                              model_keys: Sequence[str]) -> Conversion | None:
        from hyperrecipe.models.hf_conversion import conversion_for

        return conversion_for(model, shapes, model_keys)

    def validate_refusal(self, model: nn.Module, plan: Plan) -> str | None:
        from hyperrecipe.models.hf_kernels import validate_experts_refusal

        return validate_experts_refusal(model, plan)
