"""Inner wrappers for the tests: for the fallback chain, one never eligible and one that fails
half way through installing (after changing an attribute, which must be rolled back); for the
resolver, one declaring no output layout and one declaring a different one; and a pass-through
over a tensor-parallel MLP."""

from __future__ import annotations

from typing import Any

from hyperrecipe.wrappers import WrapperContext, inner_wrapper, requires_backend


SEQUENCE = {0: {"cp": "shard(1)"}}


@inner_wrapper(hook="attention", mesh_dims=("cp",), requires=(requires_backend("nccl"),),
               inner_out_src=SEQUENCE)
def needs_nccl(ctx: WrapperContext) -> Any:
    raise AssertionError("an ineligible wrapper must not be built")


@inner_wrapper(hook="attention", mesh_dims=("cp",), inner_out_src=SEQUENCE)
def fails_midway(ctx: WrapperContext) -> Any:
    ctx.set_attribute(ctx.module, "scaling", -1.0)
    raise RuntimeError("kernel not available")


@inner_wrapper(hook="forward", mesh_dims=("cp",))
def undeclared(ctx: WrapperContext) -> Any:
    """Declares no output layout: a rule naming it must give inner_out_src."""
    return lambda compute, *args, **kwargs: compute(*args, **kwargs)


@inner_wrapper(hook="forward", mesh_dims=("cp",), inner_out_src={0: "replicate"})
def replicated_out(ctx: WrapperContext) -> Any:
    """Declares a whole output, unlike the sequence-sharded wrappers above."""
    return lambda compute, *args, **kwargs: compute(*args, **kwargs)


@inner_wrapper(hook="forward", mesh_dims=("tp",))
def tp_passthrough(ctx: WrapperContext) -> Any:
    """Runs a tensor-parallel MLP's own compute on local tensors: column-sharded ``up``, and
    ``down`` as a nested row-wise boundary that reduces, so the result is whole."""
    return lambda compute, *args, **kwargs: compute(*args, **kwargs)
