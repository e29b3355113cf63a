"""The pipeline split: which layers and modules each stage owns, on which rank, under which
schedule; every refusal names the recipe's ``pipeline`` line.

Stages own contiguous runs of one ``nn.ModuleList`` (the repeated blocks). What lies outside
it is cut into *units*, the largest subtrees that do not contain the list: a unit with
parameters belongs to the first stage when it runs before the blocks and to the last stage
when it runs after (by default, its registration order), and a unit without parameters (rotary
tables, dropout) runs on every stage. So only the hidden states cross a stage boundary; the
model's inputs are given to every stage, which recomputes masks and positions from them.
"""

from __future__ import annotations

from collections.abc import Iterable

from hyperrecipe.errors import RecipeError, did_you_mean
from hyperrecipe.model_tree import ModelTree, ModuleInfo
from hyperrecipe.pipeline.schedule import SCHEDULES, check_schedule, stage_ranks
from hyperrecipe.plan import (
    ParamPlan,
    PipelinePlan,
    PipelineStagePlan,
    Provenance,
    TiedAcrossStages,
)
from hyperrecipe.recipe.pipeline import PipelineSpec
from hyperrecipe.resolve.context import ResolveInput
from hyperrecipe.resolve.grad_buckets import dtype_itemsize

__all__ = ["plan_pipeline"]

_MODULE_LIST = "torch.nn.modules.container.ModuleList"


def plan_pipeline(inp: ResolveInput, params: tuple[ParamPlan, ...],
                  boundaries: Iterable[str] = ()) -> PipelinePlan | None:
    """The plan's pipeline, or ``None`` when the recipe has none or its mesh dim has size 1.

    Raises:
        RecipeError: at the ``pipeline`` key concerned: a ``layers`` FQN that is not an
            ``nn.ModuleList`` of the model, an unknown schedule, stages per rank the schedule
            cannot run, more stages than layers, a split that does not fit, a ``first``/``last``
            module that is not a unit outside the blocks, microbatches the schedule cannot run
            with, a boundary across stages, or a data-parallel mesh dim beside the pipeline (not
            supported yet).
    """
    spec = inp.recipe.pipeline
    if spec is None:
        return None
    pp = inp.mesh_shape.get(spec.mesh_dim, 1)
    if pp == 1:
        return None
    _refuse_other_parallel_dims(spec, inp, params)
    boundaries = tuple(boundaries)
    tree = inp.tree
    layers = _layers_module(spec, tree)
    num_layers = len(layers.children)
    schedule = _schedule_name(spec)
    virtual = _stages_per_rank(spec, schedule)
    stages = pp * virtual
    if stages > num_layers:
        raise RecipeError(
            f"pipeline: {pp} ranks x {virtual} stages per rank = {stages} stages, but "
            f"{spec.layers} holds {num_layers} layers; every stage needs at least one",
            span=spec.span("layers"), path=spec.json_path("layers"),
            hint=f"declared: {spec.mesh_dim}={pp}, stages_per_rank={virtual}; required: at most "
                 f"{num_layers} stages")
    problem = check_schedule(schedule, pp, spec.microbatches, virtual)
    if problem is not None:
        raise RecipeError(f"pipeline: {problem}", span=spec.span("microbatches"),
                          path=spec.json_path("microbatches"))
    first, last = _outer_units(spec, tree, layers)
    _refuse_boundaries_across_units(spec, boundaries, layers.fqn, (*first, *last))
    layer_bytes = [_subtree_bytes(tree, child) for child in layers.children]
    first_bytes = sum(_subtree_bytes(tree, tree.module(u)) for u in first)
    last_bytes = sum(_subtree_bytes(tree, tree.module(u)) for u in last)
    starts, how = _split(spec, layer_bytes, stages, first_bytes, last_bytes)
    ranks = stage_ranks(schedule, pp, virtual)
    bounds = (*starts, num_layers)
    stage_plans: list[PipelineStagePlan] = []
    for index in range(stages):
        lo, hi = bounds[index], bounds[index + 1]
        owned: list[str] = list(layers.children[lo:hi])
        if index == 0:
            owned = [*first, *owned]
        if index == stages - 1:
            owned = [*owned, *last]
        fqns = tuple(p.fqn for unit in owned for m in tree.subtree(unit) for p in m.params)
        stage_plans.append(PipelineStagePlan(
            index=index, rank=ranks[index], start=lo, stop=hi,
            modules=tuple(u for u in owned if u not in layers.children), params=fqns,
            param_bytes=sum(_param_bytes(tree, f) for f in fqns)))
    _refuse_boundaries_on_stage_edges(spec, boundaries, layers.fqn, stage_plans)
    tied = _tied_across_stages(tree, stage_plans)
    width = _hidden_width(tree, layers)
    return PipelinePlan(
        mesh_dim=spec.mesh_dim, schedule=schedule, microbatches=spec.microbatches,
        stages_per_rank=virtual, layers=spec.layers, num_layers=num_layers,
        first=first, last=last, stages=tuple(stage_plans), tied=tied,
        sends=(f"the hidden states {layers.children[0].rsplit('.', 1)[0]}[k-1] -> [k] "
               f"(the first positional argument of the stage's first layer"
               + (f", width {width}" if width else "") + "); the model's inputs go to every "
               "stage, which recomputes masks and positions"),
        split=how,
        provenance=Provenance(file=spec.file, line=spec.span().line,
                              column=spec.span().column, rule_index=-1,
                              reason=f"pipeline: {spec.layers} over {spec.mesh_dim}={pp}, "
                                     f"{schedule}, {spec.microbatches} microbatches"))


def _refuse_other_parallel_dims(spec: PipelineSpec, inp: ResolveInput,
                                params: tuple[ParamPlan, ...]) -> None:
    placed = {d for p in params for d in p.placement.mesh_dims}
    if spec.mesh_dim in placed:
        raise RecipeError(
            f"pipeline mesh dim {spec.mesh_dim!r} also places parameters; a pipeline dim holds "
            f"whole stages, so rules may not shard or replicate over it",
            span=spec.span("mesh_dim") if spec.mesh_dim != "pp" else spec.span(),
            path=spec.json_path("mesh_dim"))
    data = [f"{d.name}={d.size}" for d in inp.mesh
            if d.name != spec.mesh_dim and d.size > 1 and d.name not in placed]
    if data:
        raise RecipeError(
            f"pipeline over {spec.mesh_dim} beside the data-parallel dim(s) {', '.join(data)} "
            f"is not supported yet: the pipeline runtime does not reduce stage gradients over "
            f"data-parallel ranks",
            span=spec.span(), path=spec.json_path(),
            hint=f"compile with {', '.join(d.split('=')[0] + '=1' for d in data)}; pipeline "
                 f"beside tensor parallel (dims the rules place parameters over) is supported")


def _refuse_boundaries_across_units(spec: PipelineSpec, boundaries: Iterable[str],
                                    layers: str, units: Iterable[str]) -> None:
    """Every boundary must lie inside one layer or one outer unit: a stage applies only the
    boundaries of what it owns."""
    units = tuple(units)
    for fqn in boundaries:
        inside = fqn.startswith(layers + ".") or any(fqn == u or fqn.startswith(u + ".")
                                                     for u in units)
        if not inside:
            raise RecipeError(
                f"pipeline: boundary {fqn!r} spans modules of several stages (it is not inside "
                f"one layer of {layers} or one module outside it), so no stage can run it",
                span=spec.span("layers"), path=spec.json_path("layers"),
                hint="declare boundaries on modules inside the layers (attention, MLP) or on "
                     "the modules before and after them")


def _refuse_boundaries_on_stage_edges(spec: PipelineSpec, boundaries: Iterable[str],
                                      layers: str, stages: list[PipelineStagePlan]) -> None:
    """A stage's first layer takes the hidden states received from the stage before (the first
    stage's marks where the stage's own layers begin) and its last hands them on: the pipeline
    installs those edges on the layers themselves, so neither may be a boundary (sequence
    parallel's entry on ``layers.0`` is one)."""
    edges = {f"{layers}.{s.start}": s.index for s in stages}
    edges.update({f"{layers}.{s.stop - 1}": s.index for s in stages[:-1]})
    for fqn in boundaries:
        if fqn in edges:
            first = fqn == f"{layers}.0"
            hint = ("the first layer always starts stage 0: a recipe whose boundary sits on it "
                    "(sequence parallel's entry) cannot be pipelined yet; pipeline a recipe "
                    "without it (plain tensor parallel)" if first else
                    "move the boundary inside the layer (its attention or MLP), or choose a "
                    "split (pipeline.split) whose stages do not start or end at it")
            raise RecipeError(
                f"pipeline: boundary {fqn!r} is the first or last layer of stage {edges[fqn]}, "
                f"where the pipeline installs the stage's edge; a stage edge cannot be a "
                f"boundary yet",
                span=spec.span("split") if isinstance(spec.split, tuple) else spec.span(),
                path=spec.json_path("split"), hint=hint)


def _layers_module(spec: PipelineSpec, tree: ModelTree) -> ModuleInfo:
    module = tree.get(spec.layers)
    lists = [m.fqn for m in tree.modules if m.is_a(_MODULE_LIST) and m.children]
    if module is None:
        raise RecipeError(
            f"pipeline layers {spec.layers!r} is not a module of the model"
            f"{did_you_mean(spec.layers, lists)}", span=spec.span("layers"),
            path=spec.json_path("layers"),
            hint=f"the model's nn.ModuleLists: {', '.join(lists[:8]) or 'none'}")
    if not module.is_a(_MODULE_LIST) or not module.children:
        raise RecipeError(
            f"pipeline layers {spec.layers!r} is a {module.cls.rsplit('.', 1)[-1]}, not a "
            f"non-empty nn.ModuleList; stages split a list of repeated blocks",
            span=spec.span("layers"), path=spec.json_path("layers"),
            hint=f"the model's nn.ModuleLists: {', '.join(lists[:8]) or 'none'}")
    return module


def _schedule_name(spec: PipelineSpec) -> str:
    if spec.schedule in SCHEDULES:
        return spec.schedule
    folded = {k.lower(): k for k in SCHEDULES}
    if spec.schedule.lower() in folded:
        return folded[spec.schedule.lower()]
    raise RecipeError(
        f"pipeline schedule {spec.schedule!r} is not one of torch.distributed.pipelining's"
        f"{did_you_mean(spec.schedule, SCHEDULES)}", span=spec.span("schedule"),
        path=spec.json_path("schedule"), hint=f"schedules: {', '.join(SCHEDULES)}")


def _stages_per_rank(spec: PipelineSpec, schedule: str) -> int:
    rule = SCHEDULES[schedule].stages_per_rank
    if spec.stages_per_rank is None:
        return rule.least
    v = spec.stages_per_rank
    if v < rule.least or (rule.most is not None and v > rule.most):
        required = (f"exactly {rule.least}" if rule.most == rule.least else
                    f"{rule.least} or more" if rule.most is None else
                    f"{rule.least} to {rule.most}")
        raise RecipeError(
            f"pipeline schedule {schedule} runs {required} stage(s) per rank; declared "
            f"stages_per_rank: {v}", span=spec.span("stages_per_rank"),
            path=spec.json_path("stages_per_rank"),
            hint="Interleaved1F1B, LoopedBFS and InterleavedZeroBubble take 2 or more; "
                 "ZBVZeroBubble and DualPipeV exactly 2; GPipe and 1F1B one")
    return v


def _outer_units(spec: PipelineSpec, tree: ModelTree, layers: ModuleInfo
                 ) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The parameter-holding units outside the blocks, split into first and last."""
    units: list[str] = []
    _collect_units(spec, tree, tree.modules[0], layers.fqn, units)
    order = {m.fqn: i for i, m in enumerate(tree.modules)}
    pivot = order[layers.fqn]
    first = [u for u in units if order[u] < pivot]
    last = [u for u in units if order[u] > pivot]
    for key, declared in (("first", spec.first), ("last", spec.last)):
        for i, fqn in enumerate(declared or ()):
            if fqn not in units:
                inside = fqn == layers.fqn or fqn.startswith(layers.fqn + ".")
                why = (f"is inside {layers.fqn}, which the stages split" if inside else
                       "is not a parameter-holding module outside the split list"
                       f"{did_you_mean(fqn, units)}")
                raise RecipeError(f"pipeline {key}: {fqn!r} {why}", span=spec.span(key, i),
                                  path=spec.json_path(key, i),
                                  hint=f"units outside {layers.fqn}: {', '.join(units) or 'none'}")
            other = last if key == "first" else first
            mine = first if key == "first" else last
            if fqn in other:
                other.remove(fqn)
            if fqn not in mine:
                mine.append(fqn)
    if spec.first is not None and spec.last is not None:
        both = set(spec.first) & set(spec.last)
        if both:
            name = sorted(both)[0]
            raise RecipeError(f"pipeline: {name!r} is listed in both first and last",
                              span=spec.span("last", spec.last.index(name)),
                              path=spec.json_path("last", spec.last.index(name)))
    return (tuple(sorted(first, key=order.__getitem__)),
            tuple(sorted(last, key=order.__getitem__)))


def _collect_units(spec: PipelineSpec, tree: ModelTree, module: ModuleInfo, layers: str,
                   out: list[str]) -> None:
    if module.fqn == layers:
        return
    contains = layers.startswith(module.fqn + ".") or module.fqn == ""
    if not contains:
        if any(m.params for m in tree.subtree(module.fqn)):
            out.append(module.fqn)
        return
    if module.params:
        raise RecipeError(
            f"pipeline: {module.fqn or 'the model'} holds parameters directly "
            f"({', '.join(p.name for p in module.params)}) beside the split list {layers}; "
            f"no stage can own them alone", span=spec.span("layers"),
            path=spec.json_path("layers"),
            hint="split a list whose parent holds no parameters of its own")
    for child in module.children:
        _collect_units(spec, tree, tree.module(child), layers, out)


def _split(spec: PipelineSpec, layer_bytes: list[int], stages: int, first_bytes: int,
           last_bytes: int) -> tuple[tuple[int, ...], str]:
    n = len(layer_bytes)
    if spec.split == "even":
        if n % stages:
            raise RecipeError(
                f"pipeline split 'even': {n} layers do not divide into {stages} stages",
                span=spec.span("split"), path=spec.json_path("split"),
                hint=f"use split: balanced, or list where each stage starts "
                     f"(e.g. {list(_even_starts(n, stages))[1:]})")
        return tuple(range(0, n, n // stages)), f"even: {n // stages} layers per stage"
    if isinstance(spec.split, tuple):
        if len(spec.split) != stages - 1:
            raise RecipeError(
                f"pipeline split lists {len(spec.split)} start(s); {stages} stages need "
                f"{stages - 1} (where each stage after the first starts)",
                span=spec.span("split"), path=spec.json_path("split"))
        for i, start in enumerate(spec.split):
            if start >= n:
                raise RecipeError(f"pipeline split: stage {i + 1} starts at layer {start}, but "
                                  f"{spec.layers} holds {n} layers",
                                  span=spec.span("split", i), path=spec.json_path("split", i))
        return (0, *spec.split), f"recipe: {list(spec.split)}"
    return _balanced(layer_bytes, stages, first_bytes, last_bytes)


def _even_starts(n: int, stages: int) -> Iterable[int]:
    return (round(i * n / stages) for i in range(stages))


def _balanced(layer_bytes: list[int], stages: int, first_bytes: int, last_bytes: int
              ) -> tuple[tuple[int, ...], str]:
    """Contiguous runs minimising the largest stage's bytes (first and last units included);
    ties go to the split closest to even, so equal layers split evenly."""
    n = len(layer_bytes)
    prefix = [0]
    for b in layer_bytes:
        prefix.append(prefix[-1] + b)

    def cost(stage: int, lo: int, hi: int) -> int:
        extra = (first_bytes if stage == 0 else 0) + (last_bytes if stage == stages - 1 else 0)
        return prefix[hi] - prefix[lo] + extra

    inf = float("inf")
    # best[s][i]: (largest stage, distance from even) placing layers[:i] on stages[:s]
    best: list[list[tuple[float, float]]] = [[(inf, inf)] * (n + 1) for _ in range(stages + 1)]
    back = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = (0, 0)
    even = list(_even_starts(n, stages))
    for s in range(1, stages + 1):
        for i in range(s, n - (stages - s) + 1):
            for j in range(s - 1, i):
                prev = best[s - 1][j]
                if prev[0] == inf:
                    continue
                cand = (max(prev[0], cost(s - 1, j, i)), prev[1] + abs(j - even[s - 1]))
                if cand < best[s][i]:
                    best[s][i] = cand
                    back[s][i] = j
    starts: list[int] = []
    i = n
    for s in range(stages, 0, -1):
        j = back[s][i]
        starts.append(j)
        i = j
    starts.reverse()
    return tuple(starts), (f"balanced by parameter bytes (largest stage "
                           f"{_mib(best[stages][n][0])})")


def _mib(value: float) -> str:
    return f"{value / 2**20:.2f} MiB"


def _param_bytes(tree: ModelTree, fqn: str) -> int:
    owner, _, name = fqn.rpartition(".")
    info = tree.module(owner).param(name)
    assert info is not None
    return info.numel * dtype_itemsize(info.dtype)


def _subtree_bytes(tree: ModelTree, module: ModuleInfo | str) -> int:
    fqn = module if isinstance(module, str) else module.fqn
    return sum(p.numel * dtype_itemsize(p.dtype)
               for m in tree.subtree(fqn) for p in m.params if p.tied_to is None)


def _tied_across_stages(tree: ModelTree, stages: list[PipelineStagePlan]
                        ) -> tuple[TiedAcrossStages, ...]:
    stage_of: dict[str, set[int]] = {}
    for st in stages:
        for f in st.params:
            stage_of.setdefault(f, set()).add(st.index)
    groups: dict[str, list[str]] = {}
    for p in tree.params():
        root = p.tied_to or p.fqn
        groups.setdefault(root, []).append(p.fqn)
    out: list[TiedAcrossStages] = []
    for members in groups.values():
        if len(members) < 2:
            continue
        where = sorted({s for f in members for s in stage_of.get(f, ())})
        if len(where) > 1:
            out.append(TiedAcrossStages(params=tuple(members), stages=tuple(where)))
    return tuple(out)


def _hidden_width(tree: ModelTree, layers: ModuleInfo) -> int | None:
    block = tree.module(layers.children[0])
    for m in tree.subtree(block.fqn):
        for p in m.params:
            if p.name == "weight" and len(p.shape) == 1:
                return p.shape[0]
    return None
