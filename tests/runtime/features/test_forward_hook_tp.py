"""A ``hook="forward"`` inner wrapper around a tensor-parallel MLP, on gloo ranks, both modes.

The wrapper runs the MLP's own forward on local tensors: ``up`` is column-sharded inside the
boundary and ``down`` is a nested row-wise boundary (all-reduce, deferred bias). The MLP's
replicated input is consumed by sharded parameters, so each rank's input gradient is a partial
sum that must be reduced (production lowers that all-reduce; validate mode must unwrap the input
with a partial gradient placement), and the nested boundary is called from local code, so it
must take and hand back local tensors. Compared with one process: the output and every
parameter's gradient, atol 1e-6 / rtol 1e-5 (fp32).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe.check.launcher import run_ranks

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)

RECIPE = """\
recipe: tp-forward-hook
version: 1
mesh: [tp]
rules:
  - {match: layers.*.mlp, boundary: true, in_src: {x: replicate}, out_src: {0: replicate},
     inner_wrapper: tests.support.cp_chain:tp_passthrough, inner_out_src: {0: replicate}}
  - {match: layers.*.mlp.up, style: colwise, boundary: false}
  - {match: layers.*.mlp.down, style: rowwise}
"""


def _tokens() -> torch.Tensor:
    return torch.arange(8).reshape(2, 4) % 32


def _worker(rank: int, world: int, recipe: str, mode: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrecipe import apply, compile_recipe
    from tests.support.toy_models import Toy

    torch.manual_seed(0)
    model = Toy()
    with torch.device("meta"):
        meta = Toy()
    # The recipe names a test wrapper (tests.support.cp_chain): trusted explicitly, as a user would.
    plan = compile_recipe(recipe, meta, {"tp": world}, trust_code=["tests"])
    inst = apply(model, plan, init_device_mesh("cpu", (world,), mesh_dim_names=("tp",)),
                 mode=mode, trust_code=["tests"])  # type: ignore[arg-type]
    out = model(_tokens())
    out.pow(2).mean().backward()
    rows = [(r.fqn, r.state) for r in inst.state.status() if r.what.startswith("inner wrapper")]
    return {"out": out.detach(), "grads": inst.full_grads(), "rows": rows}


@pytest.mark.parametrize("mode", ["production", "validate"])
def test_forward_hook_wrapper_over_sharded_parameters_keeps_every_gradient(
        tmp_path: Path, mode: str) -> None:
    from tests.support.toy_models import Toy

    path = tmp_path / "tp-forward-hook.yaml"
    path.write_text(RECIPE)
    torch.manual_seed(0)
    ref = Toy()
    ref_out = ref(_tokens())
    ref_out.pow(2).mean().backward()
    for res in run_ranks(_worker, 2, str(path), mode, timeout_s=120):
        torch.testing.assert_close(res["out"], ref_out.detach(), atol=1e-6, rtol=1e-5)
        assert set(res["grads"]) == {n for n, _ in ref.named_parameters()}
        wrong = []
        for name, p in ref.named_parameters():
            assert p.grad is not None
            if not torch.allclose(res["grads"][name], p.grad, atol=1e-6, rtol=1e-5):
                wrong.append(name)
        assert not wrong, f"{len(wrong)} of {len(res['grads'])} gradients differ: {wrong}"
        assert [state for _, state in res["rows"]] == ["installed", "installed"]
