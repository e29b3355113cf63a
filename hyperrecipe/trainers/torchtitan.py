"""A hyperrecipe plan as torchtitan's parallelize step, for torchtitan's own Llama 3, Qwen3 and
DeepSeek-V3.

torchtitan (0.3) builds its model on the meta device and hands it to the model spec's
``parallelize_fn(model, *, parallel_dims, training, parallelism, compile_config, ac_config,
dump_folder)``. :func:`parallelize` (also named :func:`parallelize_llama`) has that signature:
it compiles a recipe written for torchtitan's module names (by default the shipped one for the
model's class, :data:`RECIPES_BY_MODEL`) against the model and the ``tp`` mesh torchtitan
built, and applies it in production mode (plain local shards, every collective lowered at
compile time). The logits leave ``lm_head`` on vocab shards, so the
trainer's loss must be :func:`cross_entropy_loss` (torchtitan's signature and reduction); the
stock one is refused on them by name.

With ``dp_shard > 1`` (Llama 3 only) it compiles ``recipes/torchtitan-llama3-dp-tp.yaml`` for
torchtitan's ``[fsdp, tp]`` mesh instead and applies FSDP2 (``fully_shard``) over ``fsdp`` after the plan:
that recipe is neither sequence parallel nor loss-on-shards, because FSDP2 composes with
neither yet (the sequence-parallel norms reduce their gradients through hooks that
``fully_shard`` would leave behind, and FSDP2's root hook touches the output, which
vocab-sharded logits refuse: docs/training.md#torchtitan).

What torchtitan's parallelize step also does and this one does not (each refused loudly, never
skipped): replicated data parallel (HSDP), context and pipeline parallel, and ``torch.compile``
(activation checkpointing is applied after the plan, as torchtitan applies it after its TP).
At ``dp_shard > 1`` the FSDP2 route needs torchtitan's ``spmd_backend="partial_dtensor"``
(its 0.3 default ``"spmd_types"`` builds no ``fsdp`` mesh dim) and refuses the others by name;
tensor parallel alone runs under either backend (the plan uses none of torchtitan's DTensor
helpers).
torchtitan's Trainer clips with ``dist_utils.clip_grad_norm_``, which takes its norm from
torch's ``get_total_norm``: while the installation lives that gives the full norm on every rank
(:mod:`hyperrecipe.runtime.grads.torch_clip_guard`), so ``training.max_norm`` clips as one
process clips.
:func:`hf_state_dict` exports the full weights in Hugging Face names through torchtitan's own
state-dict adapters.
torchtitan is imported only when one of these functions runs; nothing of hyperrecipe imports
this module. ``restore()`` puts the forwards and parameters back but leaves the modules' own
initializer tables (:func:`_initialize_through_the_plan`) in place.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import Tensor, nn

from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.trainers.trainer_mesh import PIPELINE_ROUTE

if TYPE_CHECKING:
    from torch.distributed.device_mesh import DeviceMesh

    from hyperrecipe.plan import ParamPlan, Plan
    from hyperrecipe.runtime import Installation

__all__ = ["RECIPE", "RECIPES_BY_MODEL", "RECIPE_DEEPSEEK_V3", "RECIPE_DP_TP", "RECIPE_QWEN3", "cross_entropy_loss",
           "hf_state_dict", "installation_of", "parallelize", "parallelize_llama",
           "shipped_recipe_for"]

#: The shipped recipe :func:`parallelize` compiles for ``Llama3Model`` when given none (tp only).
RECIPE = "torchtitan-llama3"
#: ... and with a data-parallel shard dim (``dp_shard > 1``: FSDP2 over torchtitan's ``fsdp``).
RECIPE_DP_TP = "torchtitan-llama3-dp-tp"
#: ... for torchtitan's dense ``Qwen3Model`` (tp only: its per-head ``q_norm``/``k_norm``
#: reduce their gradients through the same hooks as sequence-parallel norms, which FSDP2's
#: ``fully_shard`` would leave behind, so there is no dp x tp variant and ``dp_shard > 1`` is
#: refused for it by name).
RECIPE_QWEN3 = "torchtitan-qwen3"
#: ... for torchtitan's ``DeepSeekV3Model`` (MLA by heads, routed experts tensor parallel along
#: their hidden dim; tp only, for the same reason as Qwen3: its shared low-rank projections and
#: router reduce their gradients through those hooks).
RECIPE_DEEPSEEK_V3 = "torchtitan-deepseek-v3"

#: The shipped recipes by torchtitan model class (module and qualified name, the exact
#: class): (tp only, with ``dp_shard > 1`` or ``None`` where none composes with FSDP2). A recipe
#: for one model often compiles on another whose module names it shares and trains it wrong
#: (torchtitan-llama3 compiles on torchtitan's ``Qwen3Model``, whose per-head
#: ``q_norm``/``k_norm`` gradients it leaves partial), so :func:`parallelize` without
#: ``recipe=`` refuses any other class.
RECIPES_BY_MODEL: dict[str, tuple[str, str | None]] = {
    "torchtitan.models.llama3.model.Llama3Model": (RECIPE, RECIPE_DP_TP),
    "torchtitan.models.qwen3.model.Qwen3Model": (RECIPE_QWEN3, None),
    "torchtitan.models.deepseek_v3.model.DeepSeekV3Model": (RECIPE_DEEPSEEK_V3, None),
}

IGNORE_INDEX = -100

_INSTALLATIONS: weakref.WeakKeyDictionary[nn.Module, Installation] = (
    weakref.WeakKeyDictionary())


def _refuse_unsupported(parallel_dims: Any, training: Any, parallelism: Any,
                        compile_config: Any) -> None:
    pp = int(getattr(parallel_dims, "pp", 1))
    if pp not in (1, -1):
        msg = (f"hyperrecipe's torchtitan parallelize: the job asks for pp={pp}; this step "
               f"applies a plan's tensor (and FSDP2) parallelism to one model, and torchtitan's "
               f"pipelining splits the model before parallelize_fn runs, outside the plan. "
               f"Pipeline parallelism is not supported through torchtitan with hyperrecipe: "
               f"{PIPELINE_ROUTE}, or torchtitan's own parallelize function")
        raise PlanMismatchError(msg)
    asked = []
    for name in ("dp_replicate", "cp", "ep"):
        size = int(getattr(parallel_dims, name, 1))
        if size not in (1, -1):
            asked.append(f"{name}={size}")
    if compile_config is not None and getattr(compile_config, "enable", False):
        asked.append("compile.enable=True")
    fsdp = int(getattr(parallel_dims, "dp_shard", 1)) > 1
    sp = parallelism is None or getattr(parallelism, "enable_sequence_parallel", True)
    if not fsdp and not sp:
        asked.append("enable_sequence_parallel=False at dp_shard=1 (that recipe is sequence "
                     "parallel)")
    if fsdp and parallelism is not None and sp:
        asked.append(f"enable_sequence_parallel=True at dp_shard={parallel_dims.dp_shard} (the "
                     f"dp x tp recipe is not: set it False)")
    backend = getattr(parallel_dims, "spmd_backend", "partial_dtensor")
    if fsdp and backend != "partial_dtensor":
        # torchtitan 0.3's default ("spmd_types") and "full_dtensor" build no 'fsdp' mesh dim
        # (their data-parallel storage axis is 'dp_shard'): refused here, before any mesh
        # lookup fails with torchtitan's bare "Invalid mesh dim: 'fsdp'"
        asked.append(f"spmd_backend={backend!r} at dp_shard={parallel_dims.dp_shard} (its mesh "
                     f"has no 'fsdp' dim: set spmd_backend=\"partial_dtensor\" in "
                     f"ParallelismConfig, or in ParallelDims and with "
                     f"torchtitan.distributed.utils.set_spmd_backend)")
    param_dtype = getattr(training, "mixed_precision_param", "float32")
    if fsdp and param_dtype != "float32":
        asked.append(f"mixed_precision_param={param_dtype!r} under FSDP2 (tested in fp32 only: "
                     f"set 'float32')")
    if asked:
        msg = (f"hyperrecipe's torchtitan parallelize applies tensor parallel, with "
               f"sequence parallel at dp_shard=1 or FSDP2 on dp_shard > 1; the job asks for "
               f"{', '.join(asked)}. Declared: tp={getattr(parallel_dims, 'tp', '?')}, "
               f"dp_shard={getattr(parallel_dims, 'dp_shard', '?')}; supported: tp, dp_shard, "
               f"activation checkpointing, compile off. Use torchtitan's own parallelize function "
               f"for the others (docs/training.md#torchtitan).")
        raise PlanMismatchError(msg)


def parallelize(model: nn.Module, *, parallel_dims: Any, training: Any = None,
                parallelism: Any = None, compile_config: Any = None, ac_config: Any = None,
                dump_folder: str = "", recipe: str | None = None) -> nn.Module:
    """torchtitan's ``parallelize_fn`` for its ``Llama3Model``, ``Qwen3Model`` and
    ``DeepSeekV3Model``, from a hyperrecipe plan chosen by the model's class
    (:func:`parallelize_llama` is the same function, under the name torchtitan's Llama 3 spec
    uses).

    Args:
        model: torchtitan's ``Llama3Model``, dense ``Qwen3Model`` or ``DeepSeekV3Model`` (on
            meta, as torchtitan's trainer builds it, or materialized: each rank then keeps only
            its shards of the given weights).
        parallel_dims: torchtitan's ``ParallelDims`` with its mesh built; only ``tp`` and
            ``dp_shard`` may exceed 1.
        training, parallelism, compile_config, dump_folder: torchtitan's; read only to refuse
            what this step does not do (``training.max_norm`` clips right: see the module).
        ac_config: torchtitan's activation checkpointing policy, applied after the plan.
        recipe: a recipe file or shipped recipe name for the model's module names; by default
            the shipped one for the model's class (:data:`RECIPES_BY_MODEL`): for
            ``Llama3Model`` :data:`RECIPE` (tp, sequence parallel, loss on vocab shards) or,
            with ``dp_shard > 1``, :data:`RECIPE_DP_TP` (its mesh is ``[fsdp, tp]``; FSDP2 is
            applied over ``fsdp`` after the plan, per block and on the root); for
            ``Qwen3Model`` :data:`RECIPE_QWEN3`, for ``DeepSeekV3Model``
            :data:`RECIPE_DEEPSEEK_V3` (tp only).

    Returns:
        ``model``, applied in production mode; :func:`installation_of` gives its installation
        (``clip_grad_norm_``, ``state_dict`` for DCP, ``restore``).

    Raises:
        PlanMismatchError: no ``recipe`` is given and no shipped recipe is for the model's
            class (or, at ``dp_shard > 1``, none that composes with FSDP2); the job asks for
            replicated data, context or pipeline parallel, sequence parallel under FSDP2 (or
            not without it), non-fp32 FSDP2, FSDP2 under an ``spmd_backend`` other than
            ``"partial_dtensor"``, or compile (see the module docstring).
        RecipeError: the recipe does not fit the model or the tp size.
    """
    _refuse_unsupported(parallel_dims, training, parallelism, compile_config)
    from hyperrecipe import apply, compile_recipe, load_recipe

    fsdp = int(parallel_dims.dp_shard) > 1
    chosen = recipe if recipe is not None else shipped_recipe_for(model, fsdp=fsdp)
    if recipe is not None and load_recipe(recipe).pipeline is not None:
        msg = (f"hyperrecipe's torchtitan parallelize: recipe {recipe!r} has a pipeline "
               f"section; torchtitan's parallelize_fn parallelizes one model per rank, not a "
               f"pipeline schedule. Pipeline parallelism is not supported through torchtitan "
               f"with hyperrecipe: {PIPELINE_ROUTE}")
        raise PlanMismatchError(msg)
    if recipe is None and getattr(model, "mtp_layers", None) is not None:
        msg = (f"hyperrecipe's torchtitan parallelize: {type(model).__qualname__} has "
               f"multi-token-prediction layers (mtp_layers), which the shipped {chosen} has no "
               f"rules for (nothing says how they compose with its shards; it is tested without "
               f"them). "
               f"Build it with num_mtp_layers=0, pass recipe= with rules for mtp_layers, or "
               f"use torchtitan's own parallelize_deepseekv3")
        raise PlanMismatchError(msg)
    if fsdp:
        mesh = parallel_dims.get_mesh(["fsdp", "tp"])
        shape = {"fsdp": mesh["fsdp"].size(), "tp": mesh["tp"].size()}
    else:
        # include_singleton_axes: at tp=1 the plan still applies (a checkpoint resumed on one
        # rank)
        mesh = parallel_dims.get_optional_mesh("tp", include_singleton_axes=True)
        shape = {"tp": mesh.size()}
    plan = compile_recipe(chosen, model, shape)
    _compute_meta_buffers(model, mesh.device_type)
    _INSTALLATIONS[model] = apply(model, plan, mesh, mode="production")
    _initialize_through_the_plan(model, plan, mesh)
    if ac_config is not None:  # after apply, as torchtitan does after its TP
        ac_config.build(dump_folder=dump_folder).apply(model)
    if fsdp:  # after apply and AC, as torchtitan's apply_fsdp_to_decoder: each block, the root
        from torch.distributed.fsdp import fully_shard

        layers: Any = model.get_submodule("layers")
        for block in layers.values():
            fully_shard(block, mesh=mesh["fsdp"])
        fully_shard(model, mesh=mesh["fsdp"])
    return model


parallelize_llama = parallelize


def shipped_recipe_for(model: nn.Module, *, fsdp: bool) -> str:
    """The shipped recipe for ``model``'s class (:data:`RECIPES_BY_MODEL`), with or without
    FSDP2 on ``fsdp``.

    Raises:
        PlanMismatchError: no shipped recipe is for that class, or none with FSDP2 (the
            message names the classes there are recipes for and what to do).
    """
    cls = type(model)
    name = f"{cls.__module__}.{cls.__qualname__}"
    recipes = RECIPES_BY_MODEL.get(name)
    if recipes is None:
        covered = ", ".join(f"{k.rsplit('.', 1)[1]} ({', '.join(r for r in v if r)})"
                            for k, v in RECIPES_BY_MODEL.items())
        msg = (f"hyperrecipe's torchtitan parallelize has no shipped recipe for "
               f"{cls.__qualname__} ({name}); shipped: {covered}. A recipe for another model "
               f"compiles on one that shares its module names and trains it wrong (Llama's on "
               f"torchtitan's Qwen3 leaves the q_norm/k_norm gradients partial), so none is "
               f"guessed: write a recipe for {cls.__qualname__}'s module names and pass "
               f"recipe=, or use torchtitan's own parallelize function for it")
        raise PlanMismatchError(msg)
    if not fsdp:
        return recipes[0]
    if recipes[1] is None:
        msg = (f"hyperrecipe's torchtitan parallelize has no dp x tp recipe for "
               f"{cls.__qualname__}: its shipped {recipes[0]} reduces gradients over tp "
               f"through hooks (replicated weights applied to this rank's heads or experts, "
               f"such as per-head q/k norms, and sequence-parallel norms) that FSDP2's "
               f"fully_shard would leave behind, so it does not compose with dp_shard > 1. "
               f"Run it with dp_shard=1, or use torchtitan's own parallelize function for "
               f"{cls.__qualname__} (docs/training.md#torchtitan)")
        raise PlanMismatchError(msg)
    return recipes[1]


def _compute_meta_buffers(model: nn.Module, device_type: str) -> None:
    """Compute the non-persistent buffers (RoPE caches) of a model built on meta.

    torchtitan's trainer builds on meta and recomputes buffers in ``init_weights`` after the
    parallelize step, but apply must place every buffer first and refuses a meta buffer that no
    checkpoint holds. torchtitan's modules recompute their own (``_init_self_buffers``, what
    ``init_states`` calls), on the device apply allocates shards on.
    """
    import torch

    if device_type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device(device_type)
    for module in model.modules():
        on_meta = any(b is not None and b.is_meta for b in module.buffers(recurse=False))
        recompute = getattr(module, "_init_self_buffers", None)
        if on_meta and callable(recompute):
            recompute(buffer_device=device)


def _initialize_through_the_plan(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> None:
    """Make torchtitan's ``init_weights`` after the parallelize step initialize the shards.

    torchtitan's trainer calls ``model.to_empty()`` and ``model.init_weights()`` after its
    ``parallelize_fn``; each module initializes its parameters with the functions in its
    ``_param_init``. On a DTensor those draw the full tensor's values; on a plain local shard
    they would draw a shard-sized tensor from the same seed on every rank (every rank's rows of
    ``lm_head`` equal, a fused ``wqkv``'s initializer failing on the shape). Each module gets its
    own copy of ``_param_init`` (the config's dict is shared by all layers) whose functions
    draw the full tensor, exactly as one process would, and keep this rank's part: through
    ``load_state_dict`` (whose production hook keeps the shard and marks the weight set), or,
    under FSDP2, as FSDP's piece of the rank's shard (``inst.state.status()`` then still lists the
    weights as unset: the installation cannot see that write).
    """
    import torch

    params = {p.fqn: p for p in plan.params}
    for prefix, module in model.named_modules():
        inits = getattr(module, "_param_init", None)
        if not isinstance(inits, dict):
            continue
        own = dict(inits)
        for name, _ in module.named_parameters(recurse=False):
            fqn = f"{prefix}.{name}" if prefix else name
            if name in own and fqn in params:
                own[name] = _full_then_shard(model, params[fqn], plan.mesh_dims, mesh,
                                             own[name], torch)
        module._param_init = own  # noqa: SLF001  (torchtitan's per-module init table)


def _full_then_shard(root: nn.Module, param_plan: ParamPlan, mesh_dims: tuple[str, ...],
                     mesh: DeviceMesh, init: Callable[[Tensor], Any],
                     torch: Any) -> Callable[[Tensor], None]:
    def initialize(param: Tensor) -> None:
        from torch.distributed.tensor import DTensor, distribute_tensor

        full = torch.empty(param_plan.shape, dtype=param.dtype, device=param.device)
        init(full)
        if not isinstance(param, DTensor):
            root.load_state_dict({param_plan.fqn: full}, strict=False)
            return
        from hyperrecipe.runtime import local_shard

        # FSDP2's piece of this rank's tp shard: every rank drew the same full tensor, so
        # each slices its own (src_data_rank=None: no scatter)
        shard = local_shard(full, param_plan.placement, mesh, mesh_dims)
        piece = distribute_tensor(shard, param.device_mesh, param.placements,
                                  src_data_rank=None)
        param.copy_(piece)

    return initialize


def installation_of(model: nn.Module) -> Installation:
    """The installation :func:`parallelize` made on ``model``.

    Raises:
        PlanMismatchError: ``model`` was not parallelized by :func:`parallelize`.
    """
    inst = _INSTALLATIONS.get(model)
    if inst is None:
        msg = (f"{type(model).__name__} was not parallelized by "
               f"hyperrecipe.trainers.torchtitan.parallelize; no installation")
        raise PlanMismatchError(msg)
    return inst


def hf_state_dict(model: nn.Module, adapter: Any) -> dict[str, Tensor]:
    """The model's full weights in Hugging Face names, through torchtitan's own state-dict
    adapter (``Qwen3StateDictAdapter``, ``DeepSeekV3StateDictAdapter``, ...: its ``to_hf``).

    A collective: every rank must call it (each gets the whole). The full tensors come from the
    installation (:meth:`~hyperrecipe.runtime.state.front.StateFront.full_state_dict`), under
    the plan's names, which are torchtitan's module names; torchtitan's own ``model.state_dict()``
    splits a fused ``qkv_linear.wqkv`` into ``wq``/``wk``/``wv`` in a state-dict hook before its
    adapter sees it (the adapter maps only the split names and skips the rest without a word),
    so the same split (the module's own ``_split_qkv_on_save``) is applied here first, and the
    non-persistent buffers (RoPE caches), which ``state_dict()`` leaves out, are left out.

    Args:
        model: a model :func:`parallelize` applied a plan to.
        adapter: torchtitan's state-dict adapter for the model's config, e.g.
            ``Qwen3StateDictAdapter(model.config, None)``.

    Raises:
        PlanMismatchError: ``model`` was not parallelized by :func:`parallelize`.
    """
    full = installation_of(model).state.full_state_dict()
    for prefix, module in model.named_modules():
        for name in module._non_persistent_buffers_set:  # noqa: SLF001  (not in state_dict())
            full.pop(f"{prefix}.{name}" if prefix else name, None)
        split = getattr(type(module), "_split_qkv_on_save", None)
        if callable(split):
            split(module, full, f"{prefix}." if prefix else "", None)
    converted: dict[str, Tensor] = adapter.to_hf(full)
    return converted


def cross_entropy_loss(pred: Tensor, labels: Tensor, **kwargs: Any) -> Tensor:
    """torchtitan's ``cross_entropy_loss`` (sum over tokens, ``ignore_index=-100``) that also
    takes the vocab-sharded logits of a plan with ``loss_parallel``.

    torchtitan's own function flattens and casts the logits, which the vocab slice refuses;
    this one hands the slice to :func:`hyperrecipe.vocab_parallel_cross_entropy`, full logits
    (``recipes/torchtitan-llama3-dp-tp.yaml`` gathers them) to ``F.cross_entropy`` as
    torchtitan's plain-tensor branch does, and DTensor logits (torchtitan's own
    parallelization) to torchtitan's function with ``kwargs`` (its ``global_vocab_size``).
    Full logits do not go through torchtitan's function: under its default ``spmd_types``
    backend with a tp mesh it takes any plain tensor for a vocab shard.
    """
    import torch.nn.functional as F
    from torch.distributed.tensor import DTensor

    from hyperrecipe import vocab_parallel_cross_entropy
    from hyperrecipe.runtime import VocabShardedLogits

    if isinstance(pred, VocabShardedLogits):
        return vocab_parallel_cross_entropy(pred, labels, ignore_index=IGNORE_INDEX,
                                            reduction="sum")
    if isinstance(pred, DTensor):
        from torchtitan.components.loss import cross_entropy_loss as titan_loss

        loss: Callable[..., Tensor] = titan_loss
        return loss(pred, labels, **kwargs)
    return F.cross_entropy(pred.flatten(0, 1).float(), labels.flatten(0, 1), reduction="sum",
                           ignore_index=IGNORE_INDEX)
