"""Pipeline plans for the runtime tests: compiled from a recipe's ``pipeline`` section, as a
user's are (:func:`pipeline_plan`); and one made by hand that also shards a parameter over a
``tp`` dim the runtime has no tensor-parallel model for (:func:`_handmade_plan`)."""

from __future__ import annotations

from typing import Any

from torch import nn

from hyperrecipe.placement import NamedPlacement, Shard
from hyperrecipe.plan import (
    MeshDim,
    ParamPlan,
    PipelinePlan,
    PipelineStagePlan,
    Plan,
    Provenance,
    TiedAcrossStages,
)

V_SHAPED = frozenset({"ZBVZeroBubble", "DualPipeV"})
_PROV = Provenance(file="tests/support/pipeline_plans.py", line=1, column=1, rule_index=-1,
                   reason="test plan")


def _holders(model: nn.Module, layers: str) -> tuple[list[str], list[str]]:
    first: list[str] = []
    last: list[str] = []
    seen_layers = False
    for fqn, mod in model.named_modules():
        if fqn == layers:
            seen_layers = True
        elif fqn.startswith(layers + ".") or not any(True for _ in mod.parameters(recurse=False)):
            continue
        else:
            (last if seen_layers else first).append(fqn)
    return first, last


def pipeline_plan(model: nn.Module, *, layers: str = "model.layers", pp: int = 2,
                  schedule: str = "GPipe", stages_per_rank: int = 1, microbatches: int = 4,
                  tp_split: str | None = None) -> Plan:
    """The plan ``hyperrecipe compile`` makes of a recipe whose only section is ``pipeline``
    (the split balanced by parameter bytes, the resolver's default); ``tp_split`` names a
    parameter a hand-made plan also shards over ``tp`` (for a refusal test)."""
    if tp_split is not None:
        return _handmade_plan(model, layers=layers, pp=pp, schedule=schedule,
                              stages_per_rank=stages_per_rank, microbatches=microbatches,
                              tp_split=tp_split)
    import tempfile
    from pathlib import Path

    from tests.support.recipe_text import resolve_only

    per_rank = f"  stages_per_rank: {stages_per_rank}\n" if stages_per_rank > 1 else ""
    text = (f"recipe: test-pp\nversion: 1\nmesh: [pp]\npipeline:\n  layers: {layers}\n"
            f"  schedule: {schedule}\n  microbatches: {microbatches}\n{per_rank}rules: []\n")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "pp.yaml"
        path.write_text(text, encoding="utf-8")
        return resolve_only(str(path), model, {"pp": pp})


def _handmade_plan(model: nn.Module, *, layers: str, pp: int, schedule: str,
                   stages_per_rank: int, microbatches: int, tp_split: str) -> Plan:
    num_layers = len(model.get_submodule(layers))  # type: ignore[arg-type]
    first, last = _holders(model, layers)
    n = pp * stages_per_rank
    per = num_layers // n
    named = list(model.named_parameters(remove_duplicate=False))

    def owned_by(i: int, fqn: str) -> bool:
        inside = [f"{layers}.{j}." for j in range(i * per, (i + 1) * per)]
        mods = [*(first if i == 0 else []), *(last if i == n - 1 else [])]
        return any(fqn.startswith(p) for p in inside) or any(fqn.startswith(m + ".") for m in mods)

    stages = []
    for i in range(n):
        rank = (i if i < pp else 2 * pp - 1 - i) if schedule in V_SHAPED else i % pp
        params = tuple(f for f, _ in named if owned_by(i, f))
        mods = (*(first if i == 0 else ()), *(last if i == n - 1 else ()))
        stages.append(PipelineStagePlan(index=i, rank=rank, start=i * per, stop=(i + 1) * per,
                                        modules=tuple(mods), params=params, param_bytes=0))
    by_tensor: dict[int, list[str]] = {}
    for fqn, p in named:
        by_tensor.setdefault(id(p), []).append(fqn)
    tied = []
    for fqns in by_tensor.values():
        users = sorted({s.index for s in stages for f in fqns if f in s.params})
        if len(fqns) > 1 and len(users) > 1:
            tied.append(TiedAcrossStages(params=tuple(fqns), stages=tuple(users)))
    pipeline = PipelinePlan(mesh_dim="pp", schedule=schedule, microbatches=microbatches,
                            stages_per_rank=stages_per_rank, layers=layers,
                            num_layers=num_layers, first=tuple(first), last=tuple(last),
                            stages=tuple(stages), tied=tuple(tied), provenance=_PROV)
    params: tuple[ParamPlan, ...] = ()
    mesh = (MeshDim(name="pp", size=pp),)
    if tp_split is not None:
        p = dict(named)[tp_split]
        params = (ParamPlan(fqn=tp_split, module=tp_split.rpartition(".")[0],
                            name=tp_split.rpartition(".")[2], shape=tuple(p.shape),
                            dtype="float32", placement=NamedPlacement.of({"tp": Shard(dim=0)}),
                            local_shape=tuple(p.shape)),)
        mesh = (*mesh, MeshDim(name="tp", size=1))
    empty: Any = ()
    return Plan(format=1, recipe="test", recipe_files=(), recipe_digest="", model_digest="",
                mesh=mesh, fingerprint="", rules=empty, params=params, boundaries=empty,
                head_counts=empty, manifest=empty, pipeline=pipeline)
