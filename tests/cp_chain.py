"""Inner wrappers for the fallback-chain test: one never eligible, one that fails half way
through installing (after changing an attribute, which must be rolled back)."""

from __future__ import annotations

from typing import Any

from hyperrecipe.wrappers import WrapperContext, inner_wrapper, requires_backend


@inner_wrapper(hook="attention", mesh_dims=("cp",), requires=(requires_backend("nccl"),))
def needs_nccl(ctx: WrapperContext) -> Any:
    raise AssertionError("an ineligible wrapper must not be built")


@inner_wrapper(hook="attention", mesh_dims=("cp",))
def fails_midway(ctx: WrapperContext) -> Any:
    ctx.set_attribute(ctx.module, "scaling", -1.0)
    raise RuntimeError("kernel not available")
