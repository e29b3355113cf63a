"""How many guards dynamo installs on the boundary forwards ``apply`` puts on a model.

Under ``torch.compile`` every guard runs before each compiled call; the boundary forwards'
closures (the converters, the bound transitions and their ops) were most of what a compiled
production step spends there beyond a hand-written Megatron step (docs/benchmarks.md, "Where
the compiled gap is"). A bound transition now reads its shared op pair from a module-level
table by index under compile (:func:`~hyperrecipe.runtime.comm.collectives.bind_transition`),
and a boundary that only converts its inputs, or only its first output, gets a body that reads
its compute method and one int, the index of its slots in a table shared with every boundary
that has the same ones (:func:`~hyperrecipe.runtime.forward.boundary.make_boundary_forward`), so
what dynamo guards per boundary is a few cells, not a chain of closures: this pins it, by
count, without a clock.
"""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from tests.support.runtime_harness import ROOT, llama, llama_batch, mesh_1d

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)

RECIPE = str(ROOT / "recipes/llama.yaml")
# Guards reached through one installed forward's closure, on average over the boundaries.
# Measured (tiny Llama, recipes/llama.yaml, tp=2): 28.0 on main 524b1c8, where each guard
# chain went on through the bound transition's pair and op closures; 20.2 with the pairs read
# from the table; 16.4 with the boundary bodies that read only the cells their shape needs;
# 12.7 with those bodies' slots read from a shared table too (the embedding's and lm_head's
# general bodies are most of what is left: 7 per block boundary).
PER_BOUNDARY_BOUND = 14


def _boundary_guards(rank: int, world: int) -> dict[str, Any]:
    model = llama()
    plan = compile_recipe(RECIPE, llama("meta"), {"tp": world})
    apply(model, plan, mesh_1d(world))
    # the first training forward runs its one-time check (same batch, same dropout across the
    # group: an exchange, eagerly) and removes it; what is compiled is every step after it
    model(input_ids=llama_batch())
    boundaries = [n for n, m in model.named_modules() if "forward" in vars(m)]
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model)(input_ids=llama_batch())
    names = [g.name for g in explained.out_guards]
    through = [n for n in names if ".forward.__closure__" in n]
    deepest = max((len(re.findall(r"__closure__", n)) for n in through), default=0)
    return {"graphs": explained.graph_count, "breaks": explained.graph_break_count,
            "boundaries": len(boundaries), "through": len(through), "all": len(names),
            "deepest": deepest}


def test_a_compiled_production_model_has_few_guards_per_boundary() -> None:
    for rank, res in enumerate(run_ranks(_boundary_guards, 2, timeout_s=300)):
        assert res["graphs"] == 1 and res["breaks"] == 0, f"rank {rank}: {res}"
        assert res["boundaries"] > 0, f"rank {rank}: no installed forward found: {res}"
        per_boundary = res["through"] / res["boundaries"]
        assert per_boundary <= PER_BOUNDARY_BOUND, (
            f"rank {rank}: {per_boundary:.1f} guards per boundary forward (bound "
            f"{PER_BOUNDARY_BOUND}): {res}")
        # boundary forward -> converter -> bound transition, and no deeper: the transition's
        # pair and op closures are read through the module-level table, once per graph.
        assert res["deepest"] <= 3, f"rank {rank}: guards reach {res['deepest']} closures deep"


def _table_sizes(rank: int, world: int) -> list[tuple[int, int, int]]:
    """The shared tables' sizes (collective pairs, input slots, first outputs) with no
    installation, with one, after restoring it and after dropping a second one without
    restoring."""
    import gc

    from hyperrecipe.runtime.comm import collectives
    from hyperrecipe.runtime.forward import boundary

    def sizes() -> tuple[int, int, int]:
        return (len(collectives._PAIRS), len(boundary._INPUT_SLOTS),
                len(boundary._FIRST_OUTPUTS))

    plan = compile_recipe(RECIPE, llama("meta"), {"tp": world})
    seen = [sizes()]
    inst = apply(llama(), plan, mesh_1d(world))
    seen.append(sizes())
    inst.restore()
    del inst
    gc.collect()
    seen.append(sizes())
    model = llama()
    apply(model, plan, mesh_1d(world))
    seen.append(sizes())
    del model
    gc.collect()
    seen.append(sizes())
    return seen


def test_the_shared_tables_keep_nothing_past_their_installations() -> None:
    # the tables must not keep a process group (and gloo's worker threads) alive after every
    # installation bound to it is gone: such a group outlives destroy_process_group. The
    # layers' attentions share one slot entry and their MLPs another (the argument is named
    # hidden_states in one, x in the other); every o_proj and down_proj one output entry.
    for sizes in run_ranks(_table_sizes, 2, timeout_s=300):
        empty, installed, restored, again, dropped = sizes
        assert empty == (0, 0, 0) and again == installed, sizes
        assert all(n > 0 for n in installed), sizes
        assert installed[1] == 2 and installed[2] == 1, sizes
        assert restored == (0, 0, 0) and dropped == (0, 0, 0), sizes
