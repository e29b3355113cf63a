"""Method adapters (``adapters:``): recipe fields, the plan entry, install and restore through the
rewriter, the ``wrap``/``marshal`` bodies on real DTensors, and two real uses on gloo ranks
compared with a single-process run: a tensor-parallel MLP whose helpers mix plain buffers into
DTensor activations, and transformers' Llama rotary embedding run sequence-parallel."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import torch

from hyperrecipe import PlanMismatchError, RecipeError, RewriteError, compile_recipe, load_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.placement import parse_named_text
from hyperrecipe.plan import AdapterPlan, Plan, Provenance
from hyperrecipe.plan_report import explain, summary
from hyperrecipe.refs import TRUST_ENV
from hyperrecipe.rewriter import Rewrite
from hyperrecipe.runtime.features.adapters import install_adapters, make_method_adapter
from tests.support import adapter_models
from tests.support.adapter_models import DerivedHelpers, Helpers, make_positional_toy
from tests.support.runtime_harness import ROOT, assert_close, grads_of, llama, llama_batch, llama_step

TOY_RECIPE = str(ROOT / "tests/recipes/toy-adapters.yaml")
ROTARY_RECIPE = str(ROOT / "tests/recipes/llama-rotary-sp.yaml")
ROTARY = "transformers.models.llama.modeling_llama:LlamaRotaryEmbedding.forward"
HELPERS = "tests.support.adapter_models:Helpers"
HEADER = "recipe: demo\nversion: 1\nmesh: [tp]\nrules: []\nadapters:\n"


def _load(tmp_path: Path, adapters: str) -> Any:
    path = tmp_path / "demo.yaml"
    path.write_text(HEADER + adapters, encoding="utf-8")
    return load_recipe(str(path))


def _load_error(tmp_path: Path, adapters: str) -> str:
    with pytest.raises(RecipeError) as info:
        _load(tmp_path, adapters)
    return str(info.value).replace(str(tmp_path), "/path/to")


def _adapter(target: str, mode: str = "wrap", out_src: str | None = None,
             line: int = 7) -> AdapterPlan:
    return AdapterPlan(target=target, mode=mode,  # type: ignore[arg-type]
                       out_src=parse_named_text(out_src) if out_src else None,
                       provenance=Provenance(file="demo.yaml", line=line, column=5,
                                             rule_index=-1, reason=f"adapter {mode}"))


# ----------------------------------------------------------------------------- recipe fields


def test_adapter_out_src_is_parsed_as_a_named_placement(tmp_path: Path) -> None:
    recipe = _load(tmp_path, f'  - {{target: "{HELPERS}.plain", mode: marshal, '
                             f'out_src: {{tp: shard(1)}}}}\n'
                             f'  - {{target: "{HELPERS}.static"}}\n')
    first, second = recipe.adapters
    assert (first.mode, str(first.out_src), first.line, first.column) == (
        "marshal", "{tp: shard(1)}", 6, 5)
    assert (second.mode, second.out_src) == ("wrap", None)


@pytest.mark.parametrize(("adapters", "message"), [
    (f'  - {{target: "{HELPERS}.plain", out_src: replicate}}\n',
     "/path/to/demo.yaml:6:60: out_src applies to mode 'marshal' only (a 'wrap' adapter returns "
     "the method's outputs as they are) @ $.adapters[0].out_src"),
    (f'  - {{target: "{HELPERS}.plain", mode: marshal, out_src: {{cp: shard(1)}}}}\n',
     "/path/to/demo.yaml:6:85: placement names mesh dim 'cp', which the recipe does not declare"
     "; did you mean 'tp'? @ $.adapters[0].out_src.cp; declared mesh dims: [tp]"),
    (f'  - {{target: "{HELPERS}.plain", mode: marshal, out_src: {{tp: shard(x)}}}}\n',
     None),
    (f'  - {{target: "{HELPERS}.plain", mode: marshal, out_src: {{tp: "shard(0, chunks=2)"}}}}\n',
     "/path/to/demo.yaml:6:84: adapter out_src {tp: shard(0, chunks=2)} is a chunked shard, "
     "which has no DTensor placement @ $.adapters[0].out_src"),
    (f'  - {{target: "{HELPERS}.plain", mode: marshal}}\n'
     f'  - {{target: "{HELPERS}.plain"}}\n',
     f"/path/to/demo.yaml:7:14: adapter target '{HELPERS}.plain' is listed twice (first at line "
     f"6); one method takes one adapter @ $.adapters[1].target"),
    (f'  - {{target: "{HELPERS}.plain", out: replicate}}\n',
     "/path/to/demo.yaml:6:60: unknown key 'out' in an adapter; did you mean 'out_src'? "
     "@ $.adapters[0].out; expected one of: target, mode, out_src, within"),
])
def test_adapter_field_errors_name_file_line_and_column(tmp_path: Path, adapters: str,
                                                        message: str | None) -> None:
    actual = _load_error(tmp_path, adapters)
    if message is None:  # the placement grammar's own message, pointing at the entry
        assert actual.startswith("/path/to/demo.yaml:6:")
        assert actual.endswith("@ $.adapters[0].out_src.tp")
    else:
        assert actual == message


def test_the_json_schema_accepts_out_src_and_refuses_unknown_adapter_keys() -> None:
    jsonschema = pytest.importorskip("jsonschema")
    from hyperrecipe.recipe.jsonschema import recipe_json_schema

    validator = jsonschema.Draft202012Validator(recipe_json_schema())
    base = {"recipe": "demo", "version": 1, "mesh": ["tp"], "rules": []}
    good = {"target": f"{HELPERS}.plain", "mode": "marshal", "out_src": {"tp": "shard(1)"}}
    assert not list(validator.iter_errors({**base, "adapters": [good]}))
    for bad in ({**good, "out_src": {"tp": "shard(x)"}}, {**good, "out": "replicate"}):
        assert list(validator.iter_errors({**base, "adapters": [bad]}))


# ----------------------------------------------------------------------------- the plan


def _toy_plan() -> Plan:
    with torch.device("meta"):
        model = make_positional_toy()
    return compile_recipe(TOY_RECIPE, model, {"tp": 2})


def test_plan_lists_adapters_with_their_recipe_lines_and_round_trips(tmp_path: Path) -> None:
    plan = _toy_plan()
    assert [(a.target, a.mode, a.out_src, a.provenance.line) for a in plan.adapters] == [
        ("tests.support.adapter_models:PositionalMLP.add_positions", "wrap", None, 20),
        ("tests.support.adapter_models:PositionalMLP.rescale", "marshal", None, 22)]
    assert Plan.from_json(plan.to_json()) == plan
    with_out = attrs.evolve(plan, adapters=(
        *plan.adapters, _adapter(f"{HELPERS}.plain", "marshal", "{tp: shard(-1)}"))).sealed()
    assert Plan.from_json(with_out.to_json()) == with_out
    path = tmp_path / "plan.json"
    with_out.save(path)
    assert Plan.load(path) == with_out
    assert '"out_src": "{tp: shard(-1)}"' in path.read_text()


def test_summary_and_explain_list_the_adapters() -> None:
    plan = _toy_plan()
    text = summary(plan)
    assert ("method adapters: tests.support.adapter_models:PositionalMLP.add_positions wrap, "
            "tests.support.adapter_models:PositionalMLP.rescale marshal\n") in text
    why = explain(plan, "PositionalMLP.rescale")
    assert why == ("tests.support.adapter_models:PositionalMLP.rescale: method adapter marshal, outputs "
                   "placed like the first DTensor argument\n"
                   f"  {plan.adapters[1].provenance.file}:22:5 (no rule): adapter marshal\n")


def test_an_extending_recipe_re_declares_its_base_adapter(tmp_path: Path) -> None:
    child = tmp_path / "child.yaml"
    child.write_text(f"recipe: child\nversion: 1\nmesh: [tp]\nextends: {TOY_RECIPE}\nrules: []\n"
                     "adapters:\n  - {target: \"tests.support.adapter_models:PositionalMLP.add_positions\","
                     " mode: marshal, out_src: replicate}\n", encoding="utf-8")
    with torch.device("meta"):
        plan = compile_recipe(str(child), make_positional_toy(), {"tp": 2})
    assert [(a.target.rsplit(".", 1)[1], a.mode) for a in plan.adapters] == [
        ("rescale", "marshal"), ("add_positions", "marshal")]
    reason = plan.adapters[1].provenance.reason
    assert reason.startswith("adapter marshal (output placement replicate); overrides ")
    assert reason.endswith("tests/recipes/toy-adapters.yaml:20")
    assert plan.adapters[1].provenance.file == str(child)


def test_a_misspelt_method_of_an_imported_module_fails_at_compile_time(tmp_path: Path) -> None:
    path = tmp_path / "demo.yaml"
    path.write_text(HEADER + '  - {target: "tests.support.adapter_models:PositionalMLP.rescal"}\n',
                    encoding="utf-8")
    with torch.device("meta"), pytest.raises(RecipeError) as info:
        compile_recipe(str(path), make_positional_toy(), {"tp": 2})
    assert str(info.value).replace(str(tmp_path), "/path/to") == (
        "/path/to/demo.yaml:6:5: adapter target 'tests.support.adapter_models:PositionalMLP.rescal': "
        "tests.support.adapter_models:PositionalMLP has no attribute 'rescal'; did you mean 'rescale'? "
        "@ $.adapters[0].target")


def test_a_target_whose_module_is_not_imported_is_found_by_apply(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TRUST_ENV, "no_such_pkg")  # trusted, so the import is tried and fails
    path = tmp_path / "demo.yaml"
    path.write_text(HEADER + '  - {target: "no_such_pkg.attn:Kernel.run"}\n', encoding="utf-8")
    with torch.device("meta"):
        plan = compile_recipe(str(path), make_positional_toy(), {"tp": 2}, verify=False)
    with Rewrite(label="test") as tx, pytest.raises(PlanMismatchError) as info:
        install_adapters(tx, plan.adapters, ("tp",))
    assert str(info.value).replace(str(tmp_path), "/path/to").startswith(
        "adapter 'no_such_pkg.attn:Kernel.run' (/path/to/demo.yaml:6:5): cannot import "
        "'no_such_pkg.attn': No module named 'no_such_pkg'")


@pytest.mark.parametrize(("target", "problem"), [
    ("tests.support.adapter_models:Nope.plain", "tests.support.adapter_models has no attribute 'Nope'"),
    ("tests.support.adapter_models:make_positional_toy.x", "tests.support.adapter_models:make_positional_toy is "
                                                   "a function, not a class"),
    (f"{HELPERS}.nope", "Helpers has no method 'nope'"),
])
def test_apply_names_the_adapter_whose_target_does_not_exist(target: str, problem: str) -> None:
    with Rewrite(label="test") as tx, pytest.raises(PlanMismatchError) as info:
        install_adapters(tx, (_adapter(target),), ("tp",))
    assert str(info.value) == f"adapter {target!r} (demo.yaml:7:5): {problem}"


# ----------------------------------------------------------------------------- install, restore

KINDS = ("plain", "static", "klass", "pair")


def test_adapters_install_and_restore_the_exact_class_attributes() -> None:
    before = {name: vars(Helpers)[name] for name in KINDS}
    adapters = (*(_adapter(f"{HELPERS}.{n}", "marshal" if i % 2 else "wrap")
                  for i, n in enumerate(KINDS)),
                _adapter("tests.support.adapter_models:DerivedHelpers.plain", "marshal"))
    with Rewrite(label="adapters test") as tx:
        install_adapters(tx, adapters, ("tp",))
    try:
        for name in KINDS:
            installed = vars(Helpers)[name]
            assert installed is not before[name]
            assert type(installed) is type(before[name])  # staticmethod stays staticmethod...
            assert inspect.signature(getattr(Helpers, name)) == inspect.signature(
                before[name].__get__(None, Helpers))
        assert "plain" in vars(DerivedHelpers)
        # no DTensor argument: every adapter passes the call through
        x = torch.arange(3.0)
        h = Helpers()
        assert torch.equal(h.plain(x, scale=2.0), x * 2)
        assert torch.equal(Helpers.static(x), x + 1) and torch.equal(Helpers.klass(x), x - 1)
        assert torch.equal(DerivedHelpers().plain(x, 3.0), x * 3)
        assert torch.equal(h.pair(x, {"y": x})[1], x + 1)
        assert [(r.fqn, r.kind, r.state) for r in tx.result.records] == [
            (a.target, "method", "installed") for a in adapters]
    finally:
        tx.result.restore()
    for name in KINDS:
        assert vars(Helpers)[name] is before[name]
    assert "plain" not in vars(DerivedHelpers)


def test_a_failing_adapter_rolls_back_the_ones_before_it() -> None:
    original = vars(Helpers)["plain"]
    tx = Rewrite(label="rollback test")
    with pytest.raises(PlanMismatchError, match="Helpers has no method 'missing'"), tx:
        install_adapters(tx, (_adapter(f"{HELPERS}.plain"), _adapter(f"{HELPERS}.missing")),
                         ("tp",))
    assert vars(Helpers)["plain"] is original
    assert [r.state for r in tx.records] == ["restored"]


def test_a_second_live_installation_adapting_the_same_method_is_refused() -> None:
    with Rewrite(label="first plan") as first:
        install_adapters(first, (_adapter(f"{HELPERS}.plain"),), ("tp",))
    try:
        second = Rewrite(label="second plan")
        with pytest.raises(RewriteError) as info, second:
            install_adapters(second, (_adapter(f"{HELPERS}.plain", line=9),), ("tp",))
        assert str(info.value) == (
            f"{HELPERS}.plain: Helpers.plain from rewrite 'first plan' is already installed; "
            f"restore it before installing another (adapter declared at demo.yaml:9:5)")
    finally:
        first.result.restore()
    assert vars(Helpers)["plain"] is Helpers.__dict__["plain"]


def test_two_adapters_reaching_one_method_through_a_re_export_are_refused() -> None:
    tx = Rewrite(label="alias test")
    with pytest.raises(PlanMismatchError) as info, tx:
        install_adapters(tx, (_adapter(f"{HELPERS}.static"),
                              _adapter("tests.support.adapter_models:HelpersAlias.static", line=8)),
                         ("tp",))
    assert str(info.value) == (
        "adapter 'tests.support.adapter_models:HelpersAlias.static' (demo.yaml:8:5) and adapter "
        f"'{HELPERS}.static' (demo.yaml:7:5) adapt the same method Helpers.static; keep one")
    assert isinstance(vars(Helpers)["static"], staticmethod)
    assert vars(Helpers)["static"].__func__.__name__ == "static"
    assert adapter_models.HelpersAlias is Helpers


# ----------------------------------------------------------------------------- on real DTensors


def _semantics_worker(rank: int, world: int) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

    from tests.support.runtime_harness import mesh_1d

    mesh = mesh_1d(world)
    seen: list[str] = []

    class Probe:
        freq = torch.tensor([1.0, 0.5, 0.25])

        def pair(self, x: torch.Tensor, extra: dict[str, torch.Tensor]) -> Any:
            seen.append(f"{type(x).__name__},{type(extra['y']).__name__}")
            return x * 2, {"y": extra["y"] + 1}

        def angles(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
            seen.append(f"{type(x).__name__},{type(pos).__name__}")
            return (pos[..., None].float() * self.freq).to(x.dtype)

    def adapted(name: str, mode: str, out_src: str | None = None) -> Any:
        fn = make_method_adapter(vars(Probe)[name], _adapter(f"x:Probe.{name}", mode, out_src),
                                 ("tp",))
        return fn.__get__(Probe())  # type: ignore[attr-defined]

    torch.manual_seed(0)
    full_x = torch.randn(4, 6)
    full_y = torch.randn(4, 3)
    out: dict[str, Any] = {}

    # marshal: nested DTensor arguments arrive local; outputs leave placed like x
    x = DTensor.from_local(full_x.detach().chunk(world)[rank], mesh, [Shard(0)]).requires_grad_()
    y = DTensor.from_local(full_y.chunk(world)[rank], mesh, [Shard(0)])
    twice, extra = adapted("pair", "marshal")(x, {"y": y})
    out["marshal_seen"] = seen.pop()
    out["marshal_types"] = (type(twice).__name__, tuple(twice.placements), tuple(
        extra["y"].placements))
    out["marshal_values"] = (twice.full_tensor(), extra["y"].full_tensor())
    twice.sum().backward()
    grad: Any = x.grad
    out["marshal_grad"] = (type(grad).__name__, tuple(grad.placements), grad.full_tensor())

    # out_src: cos/sin-like angles follow the positions' sharding, not x's
    xr = DTensor.from_local(full_x, mesh, [Replicate()])
    pos = torch.arange(8).view(1, 8)
    pos_d = DTensor.from_local(pos.chunk(world, dim=1)[rank], mesh, [Shard(1)])
    ang = adapted("angles", "marshal", "{tp: shard(1)}")(xr, pos_d)
    out["out_src"] = (tuple(ang.placements), ang.full_tensor(), Probe().angles(full_x, pos))
    seen.clear()

    # a partial argument is refused: its local values are summands
    part = DTensor.from_local(full_y, mesh, [Partial()])
    try:
        adapted("pair", "marshal")(part, {"y": part})
    except PlanMismatchError as exc:
        out["partial"] = str(exc)

    # wrap: the plain argument becomes a replicated DTensor; the output is what the method made
    twice, extra = adapted("pair", "wrap")(x, {"y": full_y})
    out["wrap_seen"] = seen.pop()
    out["wrap_types"] = (type(twice).__name__, type(extra["y"]).__name__,
                         tuple(extra["y"].placements))
    out["wrap_values"] = (twice.full_tensor(), extra["y"].full_tensor())

    # no DTensor argument: both pass through
    for mode in ("marshal", "wrap"):
        twice, extra = adapted("pair", mode)(full_y, {"y": full_y})
        out[f"{mode}_plain"] = (seen.pop(), type(twice).__name__, torch.equal(twice, full_y * 2))
    out["reference"] = (full_x * 2, full_y + 1)
    return out


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_wrap_and_marshal_on_real_dtensors() -> None:
    from torch.distributed.tensor import Replicate, Shard

    for r in run_ranks(_semantics_worker, 2):
        ref_x2, ref_y1 = r["reference"]
        assert r["marshal_seen"] == "Tensor,Tensor"
        assert r["marshal_types"] == ("DTensor", (Shard(0),), (Shard(0),))
        assert_close(r["marshal_values"][0], ref_x2, "marshal x*2")
        assert_close(r["marshal_values"][1], ref_y1, "marshal y+1")
        kind, placements, grad = r["marshal_grad"]
        assert (kind, placements) == ("DTensor", (Shard(0),))
        assert_close(grad, torch.full_like(ref_x2, 2.0), "gradient through marshal")
        placements, angles, expected = r["out_src"]
        assert placements == (Shard(1),)
        assert_close(angles, expected, "angles placed by out_src")
        assert r["partial"].startswith("adapter 'x:Probe.pair' (demo.yaml:7:5): marshal runs "
                                       "the method on local tensors, but an argument is partial")
        assert r["wrap_seen"] == "DTensor,DTensor"
        assert r["wrap_types"] == ("DTensor", "DTensor", (Replicate(),))
        assert_close(r["wrap_values"][0], ref_x2, "wrap x*2")
        assert_close(r["wrap_values"][1], ref_y1, "wrap y+1")
        assert r["marshal_plain"] == r["wrap_plain"] == ("Tensor,Tensor", "Tensor", True)


# ----------------------------------------------------------------------------- real uses


def _toy_step(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.arange(12).view(2, 6) % 32
    logits: torch.Tensor = model(ids)
    logits.pow(2).mean().backward()  # type: ignore[no-untyped-call]
    return logits.detach()


def _apply_and_step(model: torch.nn.Module, plan: Plan, mode: str,
                    step: Callable[[torch.nn.Module], torch.Tensor]) -> dict[str, Any]:
    from hyperrecipe import apply
    from tests.support.runtime_harness import mesh_1d

    inst = apply(model, plan, mesh_1d(2), mode=mode)  # type: ignore[arg-type]
    try:
        logits = step(model)
    except Exception as exc:  # noqa: BLE001 - reported to the test
        inst.restore()
        return {"error": f"{type(exc).__name__}: {exc}"}
    rows = [(s.fqn, s.what, s.state) for s in inst.state.status() if s.what.startswith("adapter")]
    grads = inst.full_grads()
    inst.restore()
    restored = [(s.fqn, s.state) for s in inst.state.status() if s.what.startswith("adapter")]
    return {"logits": logits, "grads": grads, "rows": rows, "restored": restored}


def _toy_worker(rank: int, world: int) -> dict[str, Any]:
    originals = {n: vars(adapter_models.PositionalMLP)[n] for n in ("add_positions", "rescale")}
    plan = _toy_plan()
    out: dict[str, Any] = {"bare": _apply_and_step(make_positional_toy(), attrs.evolve(plan, adapters=()),
                                   "validate", _toy_step)}
    for mode in ("validate", "production"):
        out[mode] = _apply_and_step(make_positional_toy(), plan, mode, _toy_step)
    out["class_restored"] = all(vars(adapter_models.PositionalMLP)[n] is f
                                for n, f in originals.items())
    return out


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_toy_helpers_mixing_plain_buffers_run_in_validate_mode_with_adapters() -> None:
    reference = make_positional_toy()
    ref_logits = _toy_step(reference)
    ref_grads = grads_of(reference)
    res = run_ranks(_toy_worker, 2)
    for r in res:
        # without the adapters validate mode runs too: the plain buffer broadcasts over the
        # sharded dim and is taken as replicated (hyperrecipe/runtime/forward/plain_tensors.py)
        for mode in ("bare", "validate", "production"):
            got = r[mode]
            assert "error" not in got, got.get("error")
            assert_close(got["logits"], ref_logits, f"{mode} logits")
            assert set(got["grads"]) == set(ref_grads)
            for name, g in ref_grads.items():
                assert_close(got["grads"][name], g, f"{mode} grad {name}")
            if mode == "bare":
                continue
            assert got["rows"] == [
                ("tests.support.adapter_models:PositionalMLP.add_positions", "adapter wrap", "installed"),
                ("tests.support.adapter_models:PositionalMLP.rescale", "adapter marshal", "installed")]
            assert [state for _, state in got["restored"]] == ["restored", "restored"]
        assert r["class_restored"]


def _rotary_worker(rank: int, world: int) -> dict[str, Any]:
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    original = vars(LlamaRotaryEmbedding)["forward"]
    plan = compile_recipe(ROTARY_RECIPE, llama("meta"), {"tp": world})
    out: dict[str, Any] = {"bare": _apply_and_step(llama(), attrs.evolve(plan, adapters=()), "validate",
                                   _llama_step)}
    for mode in ("validate", "production"):
        out[mode] = _apply_and_step(llama(), plan, mode, _llama_step)
    out["class_restored"] = vars(LlamaRotaryEmbedding)["forward"] is original
    return out




def _llama_step(model: torch.nn.Module) -> torch.Tensor:
    return llama_step(model, llama_batch())


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_llama_rotary_embedding_runs_sequence_parallel_in_validate_mode_with_marshal() -> None:
    """The rotary module multiplies DTensor position_ids by its plain inv_freq buffer; marshal
    runs it on each rank's positions and wraps cos/sin {tp: shard(1)}, like x."""
    reference = llama()
    ref_logits = llama_step(reference, llama_batch())
    ref_grads = grads_of(reference)
    for r in run_ranks(_rotary_worker, 2, timeout_s=300):
        # without the adapter validate mode runs too: inv_freq broadcasts over the sequence the
        # positions are sharded on and is taken as replicated (forward/plain_tensors.py)
        for mode in ("bare", "validate", "production"):
            got = r[mode]
            assert "error" not in got, got.get("error")
            assert_close(got["logits"], ref_logits, f"{mode} logits")
            for name, g in ref_grads.items():
                assert_close(got["grads"][name], g, f"{mode} grad {name}")
            if mode != "bare":
                assert got["rows"] == [(ROTARY, "adapter marshal", "installed")]
        assert r["class_restored"]
