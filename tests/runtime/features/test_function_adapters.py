"""Function adapters: a module-level function replaced while chosen modules run.

``tests/support/sdpa_models.py:SdpaTransformer`` calls ``F.scaled_dot_product_attention`` inline, as the
test Transformer of torch's distributed tests does; ``tests/recipes/sdpa-toy-tp.yaml``'s function
adapter runs it on each rank's local heads. torch 2.13 has no DTensor strategy for the CPU kernel;
validate mode registers hyperrecipe's own (:mod:`hyperrecipe.runtime.comm.dtensor_rules`), so the
recipe without the adapter agrees too. Compared with one process on two gloo ranks, both modes:
the logits and every parameter's gradient, atol 1e-6 / rtol 1e-5 (fp32). The rewriter's scoped swap is tested on a
plain Python module: in only while a scoped module runs, out again when it raises, once for
nested calls, refused twice, gone after restore.
"""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hyperrecipe import compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.errors import RecipeError, RewriteError
from hyperrecipe.plan import Plan
from hyperrecipe.recipe import load_recipe
from hyperrecipe.rewriter import Rewrite
from tests.support.sdpa_models import SdpaTransformer

ROOT = Path(__file__).resolve().parents[3]
RECIPE = str(ROOT / "tests/recipes/sdpa-toy-tp.yaml")
SDPA = "torch.nn.functional:scaled_dot_product_attention"


def _tokens() -> torch.Tensor:
    return torch.arange(12).reshape(2, 6) % 32


def _meta() -> SdpaTransformer:
    with torch.device("meta"):
        return SdpaTransformer()


def _without_adapters(tmp_path: Path) -> str:
    text = Path(RECIPE).read_text()
    path = tmp_path / "no-adapter.yaml"
    path.write_text(text[:text.index("adapters:")])
    return str(path)


def _worker(rank: int, world: int, recipe: str, bare: str, mode: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrecipe import apply

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    model = SdpaTransformer()
    bare_run: dict[str, Any] = {}
    if mode == "validate":  # without the adapter, DTensor runs the CPU kernel on its own rule
        inst = apply(model, compile_recipe(bare, _meta(), {"tp": world}), mesh, mode="validate")
        bare_out = model(_tokens())
        bare_out.pow(2).mean().backward()
        bare_run = {"out": bare_out.detach(), "grads": inst.full_grads()}
        inst.restore()
        model.zero_grad(set_to_none=True)
    inst = apply(model, compile_recipe(recipe, _meta(), {"tp": world}), mesh,
                 mode=mode)  # type: ignore[arg-type]
    out = model(_tokens())
    out.pow(2).mean().backward()
    rows = [(r.fqn, r.what, r.state) for r in inst.state.status() if r.what.startswith("adapter")]
    grads = inst.full_grads()
    inst.restore()
    return {"out": out.detach(), "grads": grads, "rows": rows, "bare": bare_run,
            "restored": F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention}


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
@pytest.mark.parametrize("mode", ["production", "validate"])
def test_sdpa_called_by_the_model_itself_runs_in_both_modes_with_a_function_adapter(
        tmp_path: Path, mode: str) -> None:
    torch.manual_seed(0)
    ref = SdpaTransformer()
    ref_out = ref(_tokens())
    ref_out.pow(2).mean().backward()
    for res in run_ranks(_worker, 2, RECIPE, _without_adapters(tmp_path), mode, timeout_s=180):
        torch.testing.assert_close(res["out"], ref_out.detach(), atol=1e-6, rtol=1e-5)
        for name, p in ref.named_parameters():
            assert p.grad is not None
            torch.testing.assert_close(res["grads"][name], p.grad, atol=1e-6, rtol=1e-5,
                                       msg=lambda m, name=name: f"grad {name}: {m}")
        assert res["rows"] == [(f"layers.{i}.attention", f"adapter marshal {SDPA}", "installed")
                               for i in range(2)]
        assert res["restored"], "restore() puts torch's own SDPA back"
        if mode == "validate":  # and without the adapter, on the DTensor rule for CPU SDPA
            torch.testing.assert_close(res["bare"]["out"], ref_out.detach(), atol=1e-6, rtol=1e-5)
            for name, p in ref.named_parameters():
                assert p.grad is not None
                torch.testing.assert_close(res["bare"]["grads"][name], p.grad, atol=1e-6,
                                           rtol=1e-5, msg=lambda m, name=name: f"grad {name}: {m}")


def test_function_adapters_are_in_the_plan_json_and_the_summary() -> None:
    from hyperrecipe.plan_report import explain, summary

    plan = compile_recipe(RECIPE, _meta(), {"tp": 2})
    (adapter,) = plan.adapters
    assert adapter.is_function and adapter.method_name == "scaled_dot_product_attention"
    assert adapter.within == ("layers.0.attention", "layers.1.attention")
    assert Plan.from_json(plan.to_json()) == plan
    assert '"within": [\n' in plan.to_json() or '"within":["layers.0.attention"' in plan.to_json()
    assert f"function adapters: {SDPA} marshal within 2 modules" in summary(plan)
    text = explain(plan, SDPA)
    assert text.splitlines()[:2] == [
        f"{SDPA}: function adapter marshal, outputs placed like the first DTensor argument",
        "  replaced while these run: layers.0.attention, layers.1.attention"]


@pytest.mark.parametrize(("entry", "message"), [
    (f'  - {{target: "{SDPA}", mode: marshal}}\n',
     f"/path/to/demo.yaml:6:5: adapter target '{SDPA}' is a function: give `within`, the "
     f"modules whose forward calls it (a pattern, as in `match`) @ $.adapters[0]"),
    ('  - {target: "tests.support.adapter_models:Helpers.plain", within: layers.*}\n',
     "/path/to/demo.yaml:6:60: within applies to a function target (`pkg.mod:function`); a "
     "method adapter patches its class @ $.adapters[0].within"),
])
def test_function_adapter_field_errors_name_file_line_and_column(tmp_path: Path, entry: str,
                                                                 message: str) -> None:
    path = tmp_path / "demo.yaml"
    path.write_text(f"recipe: demo\nversion: 1\nmesh: [tp]\nrules: []\nadapters:\n{entry}")
    with pytest.raises(RecipeError) as info:
        load_recipe(str(path))
    assert str(info.value).replace(str(tmp_path), "/path/to") == message


def test_a_within_pattern_matching_no_module_fails_at_compile_time(tmp_path: Path) -> None:
    text = Path(RECIPE).read_text().replace("within: layers.*.attention",
                                            "within: layers.*.atention")
    path = tmp_path / "typo.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as info:
        compile_recipe(str(path), _meta(), {"tp": 2})
    line = text.splitlines().index(f'  - target: "{SDPA}"') + 1
    assert str(info.value).replace(str(tmp_path), "/path/to") == (
        f"/path/to/typo.yaml:{line}:5: adapter '{SDPA}': within 'layers.*.atention' matches no "
        f"module of the model; did you mean 'layers.*.attention'? @ $.adapters[0].within")


# ----------------------------------------------------------------------------- the rewriter


class _Caller(nn.Module):
    def __init__(self, namespace: types.ModuleType, inner: nn.Module | None = None) -> None:
        super().__init__()
        self.namespace, self.inner = namespace, inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.inner is not None:
            x = self.inner(x)
        if x.sum() < 0:
            raise ValueError("negative")
        return self.namespace.double(x)  # type: ignore[no-any-return]


@pytest.fixture
def namespace() -> Any:
    ns = types.ModuleType("hyperrecipe_test_namespace")
    ns.double = lambda x: x * 2  # type: ignore[attr-defined]
    sys.modules[ns.__name__] = ns
    yield ns
    del sys.modules[ns.__name__]


def test_a_function_is_replaced_only_while_its_modules_run(namespace: Any) -> None:
    original = namespace.double
    seen: list[object] = []

    def triple(x: torch.Tensor) -> torch.Tensor:
        seen.append(namespace.double)
        return x * 3

    inner = _Caller(namespace)
    outer = _Caller(namespace, inner)
    with Rewrite(label="first") as tx:
        tx.replace_function_during(outer, namespace, "double", triple, fqn="outer")
        tx.replace_function_during(inner, namespace, "double", triple, fqn="inner")
    assert namespace.double is original, "nothing changes until a scoped module runs"
    one = torch.ones(1)
    assert outer(one).item() == 9.0 and seen == [triple, triple]
    assert namespace.double is original, "nested calls swap once and put back once"
    with pytest.raises(ValueError, match="negative"):
        outer(-one)
    assert namespace.double is original, "put back when the forward raises"
    with pytest.raises(RewriteError, match="already replaced"), Rewrite(label="second") as again:
        again.replace_function_during(outer, namespace, "double", lambda x: x, fqn="outer")
    tx.result.restore()
    assert outer(one).item() == 4.0 and namespace.double is original
    assert [r.kind for r in tx.result.records] == ["function", "function"]


def test_a_replacement_must_take_what_the_function_takes(namespace: Any) -> None:
    with pytest.raises(RewriteError, match="double"), Rewrite(label="bad") as tx:
        tx.replace_function_during(_Caller(namespace), namespace, "double",
                                   lambda y, z: y, fqn="m")
    with pytest.raises(RewriteError, match=r"replacement must take \(\*args, \*\*kwargs\)"), \
            Rewrite(label="builtin") as tx:
        tx.replace_function_during(_Caller(namespace), F, "scaled_dot_product_attention",
                                   lambda q, k, v: q, fqn="m")
