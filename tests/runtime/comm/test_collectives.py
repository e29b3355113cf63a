# mypy: allow-untyped-calls
"""Production collectives on real gloo process groups (2 and 4 forked ranks) against plain torch.

Every check runs in one launch per world size (the ``ranks`` fixture), so the suite pays the
process start-up twice; each test then compares one entry of what the ranks returned with a
single-process reference computed here on the full tensors.

Objectives: where a transition's result is replicated and every rank computes the same loss from
it, that loss counts once (``L = (y * G).sum()``). Where each rank consumes the result with its
own weights (a rank-local contribution), the objective is the sum over ranks
(``L = sum_r (W_r * y_r).sum()``). Each rank backpropagates its own loss; the reference
backpropagates ``L``.

Tolerances (fp32): data movement (gather, slice, all-to-all) must be exact; anything that sums
across ranks is compared with ``atol=rtol=1e-6`` (summation order differs from the reference).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.device_mesh import init_device_mesh

from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.collective import IDENTITY, CollectiveOp
from hyperrecipe.errors import PlanMismatchError
from hyperrecipe.runtime.comm import collectives
from hyperrecipe.runtime.comm.collectives import (
    CollectiveRecord,
    CollectiveShapeError,
    bind_transition,
    count_collectives,
    execute,
    group_for,
    transition,
)



def _exact(actual: Tensor, expected: Tensor) -> None:
    """Data movement: bit-identical."""
    torch.testing.assert_close(actual, expected, atol=0.0, rtol=0.0)


def _summed(actual: Tensor, expected: Tensor) -> None:
    """Sums across ranks, in an order that differs from the reference's (fp32)."""
    torch.testing.assert_close(actual, expected, atol=1e-6, rtol=1e-6)


SHAPE = (4, 8, 12)  # every dim divides by 2 and 4


def _op(kind: str, **kw: Any) -> CollectiveOp:
    return CollectiveOp(kind=kind, mesh_dim="tp", **kw)  # type: ignore[arg-type]


def _randn(shape: tuple[int, ...], seed: int) -> Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _per_rank(ws: int, shape: tuple[int, ...], seed: int) -> Tensor:
    """One tensor per rank, stacked: ``[ws, *shape]``."""
    return _randn((ws, *shape), seed)


def _chunk(t: Tensor, dim: int, rank: int, ws: int) -> Tensor:
    return t.chunk(ws, dim=dim)[rank]


GATHER_DIMS = (0, 1, -1)
SCATTER_DIMS = (0, 2, -2)
ALL_TO_ALL_DIMS = ((0, 1), (1, 0), (2, -3), (-1, 1))


# ---------------------------------------------------------------------------------------------
# What every rank runs.


def _rank_checks(rank: int, ws: int) -> dict[str, Any]:
    world = dist.group.WORLD
    assert world is not None
    out: dict[str, Any] = {}

    def run(x: Tensor, op: CollectiveOp) -> Tensor:
        return execute(x, op, world, group_size=ws, group_rank=rank)

    def pair(x: Tensor, fwd: CollectiveOp, bwd: CollectiveOp) -> Tensor:
        return transition(x, fwd, bwd, world, group_size=ws, group_rank=rank)

    def through(
        x: Tensor, fwd: CollectiveOp, bwd: CollectiveOp, loss: Callable[[Tensor], Tensor]
    ) -> tuple[Tensor, Tensor]:
        x = x.clone().requires_grad_(True)
        y = pair(x, fwd, bwd)
        loss(y).backward()
        assert x.grad is not None
        return y.detach(), x.grad

    # -- execute, every kind ------------------------------------------------------------------
    mine = _per_rank(ws, SHAPE, 1)[rank]
    out["identity"] = run(mine, IDENTITY)
    out["all_reduce/sum"] = run(mine, _op("all_reduce"))
    out["all_reduce/avg"] = run(mine, _op("all_reduce", reduce="avg"))
    full = _randn(SHAPE, 2)
    for d in GATHER_DIMS:
        out[f"all_gather/{d}"] = run(_chunk(full, d, rank, ws), _op("all_gather", gather_dim=d))
    for d in SCATTER_DIMS:
        for red in ("sum", "avg"):
            op = _op("reduce_scatter", scatter_dim=d, reduce=red)
            out[f"reduce_scatter/{d}/{red}"] = run(mine, op)
        out[f"local_slice/{d}"] = run(full, _op("local_slice", scatter_dim=d))
    for g, s in ALL_TO_ALL_DIMS:
        op = _op("all_to_all", gather_dim=g, scatter_dim=s)
        out[f"all_to_all/{g}/{s}"] = run(_chunk(full, g, rank, ws), op)
    noncontig = full.transpose(0, 2)
    out["all_gather/noncontiguous"] = run(noncontig, _op("all_gather", gather_dim=1))

    # -- transition pairs ---------------------------------------------------------------------
    weights = _per_rank(ws, SHAPE, 3)
    w_mine = weights[rank]
    shared = _randn(SHAPE, 4)

    # Megatron f: replicated x, each rank applies its own weight (objective: sum over ranks).
    out["f"] = through(
        full, IDENTITY, _op("all_reduce"), lambda y: (w_mine * y).sum()
    )
    # Megatron g: partial sums become replicated, every rank computes the same loss (once).
    out["g"] = through(mine, _op("all_reduce"), IDENTITY, lambda y: (shared * y).sum())
    # Sequence parallel: gather the sequence dim, each rank consumes it with its own weight.
    for d in (1, -1):
        out[f"sp/{d}"] = through(
            _chunk(full, d, rank, ws),
            _op("all_gather", gather_dim=d),
            _op("reduce_scatter", scatter_dim=d),
            lambda y: (w_mine * y).sum(),
        )
    # Colwise with gathered output: the replicated output feeds one shared loss.
    out["colwise_gather"] = through(
        _chunk(full, -1, rank, ws),
        _op("all_gather", gather_dim=-1),
        _op("local_slice", scatter_dim=-1),
        lambda y: (shared * y).sum(),
    )
    # Reduce-scatter of partials, the local shard consumed with a rank-local weight.
    out["reduce_scatter_pair"] = through(
        mine,
        _op("reduce_scatter", scatter_dim=1),
        _op("all_gather", gather_dim=1),
        lambda y: (_chunk(w_mine, 1, rank, ws) * y).sum(),
    )
    # Replicate -> shard: a local slice whose gradient is gathered back.
    out["local_slice_pair"] = through(
        full,
        _op("local_slice", scatter_dim=0),
        _op("all_gather", gather_dim=0),
        lambda y: (_chunk(w_mine, 0, rank, ws) * y).sum(),
    )
    for g, s in ALL_TO_ALL_DIMS:
        out[f"a2a_pair/{g}/{s}"] = through(
            _chunk(full, g, rank, ws),
            _op("all_to_all", gather_dim=g, scatter_dim=s),
            _op("all_to_all", gather_dim=s, scatter_dim=g),
            lambda y: (_chunk(w_mine, s, rank, ws) * y).sum(),
        )
    out["identity_pair"] = through(mine, IDENTITY, IDENTITY, lambda y: (shared * y).sum())
    out["mlp"] = _megatron_mlp(rank, ws)

    # -- bind_transition: the same pairs, bound once, against transition ----------------------
    pairs = [(full, IDENTITY, _op("all_reduce")), (mine, _op("all_reduce"), IDENTITY),
             (_chunk(full, 1, rank, ws), _op("all_gather", gather_dim=1),
              _op("reduce_scatter", scatter_dim=1)),
             (_chunk(full, -1, rank, ws), _op("all_gather", gather_dim=-1),
              _op("local_slice", scatter_dim=-1)),
             (full, _op("local_slice", scatter_dim=0), _op("all_gather", gather_dim=0)),
             (_chunk(full, 0, rank, ws), _op("all_to_all", gather_dim=0, scatter_dim=2),
              _op("all_to_all", gather_dim=2, scatter_dim=0)),
             (mine, IDENTITY, IDENTITY)]
    bound_runs = []
    for x0, fwd, bwd in pairs:
        runs = []
        for fn in (lambda t, f=fwd, b=bwd: pair(t, f, b),
                   bind_transition(fwd, bwd, world, group_size=ws, group_rank=rank)):
            x = x0.clone().requires_grad_(True)
            with count_collectives() as log:
                y = fn(x)
                (_randn(tuple(y.shape), 5 + rank) * y).sum().backward()
            assert x.grad is not None
            runs.append((y.detach(), x.grad, list(log.records)))
        bound_runs.append(runs)
    out["bound"] = bound_runs
    # the same through Function.apply, as on a torch without the internals the shortcut needs
    import hyperrecipe.runtime.comm.collectives as collectives_module

    direct, collectives_module._DIRECT = collectives_module._DIRECT, None
    try:
        fallback = []
        for x0, fwd, bwd in pairs:
            x = x0.clone().requires_grad_(True)
            with count_collectives() as log:
                y = bind_transition(fwd, bwd, world, group_size=ws, group_rank=rank)(x)
                (_randn(tuple(y.shape), 5 + rank) * y).sum().backward()
            assert x.grad is not None
            fallback.append((y.detach(), x.grad, list(log.records)))
    finally:
        collectives_module._DIRECT = direct
    out["bound_fallback"] = fallback
    # under create_graph=True: the same first-order gradient, and a second backward refused
    twice = []
    for x0, fwd, bwd in pairs[:-1]:
        runs = []
        for fn in (lambda t, f=fwd, b=bwd: pair(t, f, b),
                   bind_transition(fwd, bwd, world, group_size=ws, group_rank=rank)):
            x = x0.clone().requires_grad_(True)
            y = fn(x)
            (grad,) = torch.autograd.grad((_randn(tuple(y.shape), 5 + rank) * y * y).sum(), x,
                                          create_graph=True)
            try:
                grad.sum().backward()
                refused = ""
            except RuntimeError as exc:
                refused = str(exc)
            runs.append((grad.detach(), refused))
        twice.append(runs)
    out["bound_twice"] = twice

    # -- errors -------------------------------------------------------------------------------
    out["errors"] = _errors(rank, ws)

    # -- counting -----------------------------------------------------------------------------
    sp = (_op("all_gather", gather_dim=1), _op("reduce_scatter", scatter_dim=1))
    with count_collectives() as outer:
        x = _chunk(full, 1, rank, ws).clone().requires_grad_(True)
        y = pair(x, *sp)
        z = pair(y, IDENTITY, _op("all_reduce"))
        z = pair(z, _op("local_slice", scatter_dim=0), _op("all_gather", gather_dim=0))
        with count_collectives() as inner:
            z.sum().backward()
    out["count/outer"] = list(outer.records)
    out["count/inner"] = list(inner.records)

    # -- fallbacks, as on a backend without reduce_scatter / all_to_all_single ----------------
    _reject_native_reduce_scatter_and_all_to_all()
    for d in SCATTER_DIMS:
        for red in ("sum", "avg"):
            op = _op("reduce_scatter", scatter_dim=d, reduce=red)
            out[f"fallback/reduce_scatter/{d}/{red}"] = run(mine, op)
    for g, s in ALL_TO_ALL_DIMS:
        op = _op("all_to_all", gather_dim=g, scatter_dim=s)
        out[f"fallback/all_to_all/{g}/{s}"] = run(_chunk(full, g, rank, ws), op)
    out["fallback/marked"] = sorted(collectives._unsupported)
    collectives._unsupported.clear()

    # -- group_for on a named 2-D mesh --------------------------------------------------------
    mesh = init_device_mesh("cpu", (ws // 2, 2), mesh_dim_names=("dp", "tp"))
    tp = group_for(mesh, "tp")
    dp = group_for(mesh, "dp")
    value = torch.tensor([float(rank)])
    summed = execute(value, _op("all_reduce"), tp.group, group_size=tp.size, group_rank=tp.rank)
    out["group_for"] = (tp.size, tp.rank, dp.size, dp.rank, summed.item())
    try:
        group_for(mesh, "pt")
    except PlanMismatchError as exc:
        out["group_for/unknown"] = str(exc)
    return out


def _reject_native_reduce_scatter_and_all_to_all() -> None:
    """In this rank only: make the native ops fail as an older gloo does."""

    def unsupported(*args: object, **kwargs: object) -> None:
        raise RuntimeError("ProcessGroupGloo does not support this collective")

    collectives._reduce_scatter_single = unsupported
    dist.all_to_all_single = unsupported


def _megatron_mlp(rank: int, ws: int) -> dict[str, Tensor]:
    """x -> f -> colwise A -> rowwise B -> g -> y; the loss is computed once on the result."""
    world = dist.group.WORLD
    assert world is not None
    x_full, a_full, b_full, target = _mlp_tensors()
    x = x_full.clone().requires_grad_(True)
    a = _chunk(a_full, 1, rank, ws).clone().requires_grad_(True)
    b = _chunk(b_full, 0, rank, ws).clone().requires_grad_(True)
    h = transition(x, IDENTITY, _op("all_reduce"), world, group_size=ws, group_rank=rank) @ a
    z = torch.tanh(h) @ b
    y = transition(z, _op("all_reduce"), IDENTITY, world, group_size=ws, group_rank=rank)
    ((y - target) ** 2).mean().backward()
    assert x.grad is not None and a.grad is not None and b.grad is not None
    return {"y": y.detach(), "x": x.grad, "a": a.grad, "b": b.grad}


def _mlp_tensors() -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _randn((5, 6), 10), _randn((6, 8), 11), _randn((8, 6), 12), _randn((5, 6), 13)


def _errors(rank: int, ws: int) -> dict[str, str]:
    world = dist.group.WORLD
    assert world is not None
    uneven = torch.zeros(2, ws + 1)

    def run(x: Tensor, op: CollectiveOp) -> Tensor:
        return execute(x, op, world, group_size=ws, group_rank=rank)

    def backward_through(bwd: CollectiveOp) -> None:
        x = uneven.clone().requires_grad_(True)
        transition(x, IDENTITY, bwd, world, group_size=ws, group_rank=rank).sum().backward()

    cases: dict[str, Callable[[], object]] = {
        "uneven": lambda: run(uneven, _op("reduce_scatter", scatter_dim=1)),
        "uneven_slice": lambda: run(uneven, _op("local_slice", scatter_dim=-1)),
        "missing": lambda: run(uneven, _op("all_gather")),
        "range": lambda: run(uneven, _op("all_gather", gather_dim=2)),
        "same_dims": lambda: run(
            torch.zeros(ws, ws), _op("all_to_all", gather_dim=0, scatter_dim=-2)
        ),
        "backward": lambda: backward_through(_op("reduce_scatter", scatter_dim=1)),
    }
    messages = {}
    for name, call in cases.items():
        try:
            call()
        except CollectiveShapeError as exc:
            messages[name] = str(exc)
        else:
            messages[name] = "no error"
    return messages


# ---------------------------------------------------------------------------------------------
# The parent: one launch per world size, then references.


@pytest.fixture(scope="module", params=[2, 4], ids=["ws2", "ws4"])
def ranks(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    ws: int = request.param
    return ws, run_ranks(_rank_checks, ws, timeout_s=60.0)


def _sum(terms: Iterable[Tensor]) -> Tensor:
    return torch.stack(list(terms)).sum()


def _grads_of(
    leaf: Tensor, loss: Callable[[Tensor], Tensor]
) -> tuple[Tensor, Tensor]:
    leaf = leaf.clone().requires_grad_(True)
    value = loss(leaf)
    value.backward()
    assert leaf.grad is not None
    return value.detach(), leaf.grad


def test_identity_returns_the_local_tensor(ranks: tuple[int, list[dict[str, Any]]]) -> None:
    ws, res = ranks
    per_rank = _per_rank(ws, SHAPE, 1)
    for r in range(ws):
        _exact(res[r]["identity"], per_rank[r])


@pytest.mark.parametrize("reduce", ["sum", "avg"])
def test_all_reduce_sums_or_averages_every_rank(
    ranks: tuple[int, list[dict[str, Any]]], reduce: str
) -> None:
    ws, res = ranks
    per_rank = _per_rank(ws, SHAPE, 1)
    expected = per_rank.sum(0) if reduce == "sum" else per_rank.mean(0)
    for r in range(ws):
        _summed(res[r][f"all_reduce/{reduce}"], expected)


@pytest.mark.parametrize("dim", GATHER_DIMS)
def test_all_gather_concatenates_in_rank_order(
    ranks: tuple[int, list[dict[str, Any]]], dim: int
) -> None:
    ws, res = ranks
    full = _randn(SHAPE, 2)
    for r in range(ws):
        _exact(res[r][f"all_gather/{dim}"], full)


def test_all_gather_accepts_a_non_contiguous_tensor(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    ws, res = ranks
    expected = torch.cat([_randn(SHAPE, 2).transpose(0, 2)] * ws, dim=1)
    for r in range(ws):
        _exact(res[r]["all_gather/noncontiguous"], expected)


@pytest.mark.parametrize("reduce", ["sum", "avg"])
@pytest.mark.parametrize("dim", SCATTER_DIMS)
def test_reduce_scatter_keeps_this_ranks_slice_of_the_reduction_natively_and_in_fallback(
    ranks: tuple[int, list[dict[str, Any]]], dim: int, reduce: str
) -> None:
    ws, res = ranks
    per_rank = _per_rank(ws, SHAPE, 1)
    reduced = per_rank.sum(0) if reduce == "sum" else per_rank.mean(0)
    for r in range(ws):
        got = res[r][f"reduce_scatter/{dim}/{reduce}"]
        _summed(got, _chunk(reduced, dim, r, ws))
        fallback = res[r][f"fallback/reduce_scatter/{dim}/{reduce}"]
        _summed(fallback, _chunk(reduced, dim, r, ws))


@pytest.mark.parametrize("dim", SCATTER_DIMS)
def test_local_slice_keeps_this_ranks_contiguous_chunk(
    ranks: tuple[int, list[dict[str, Any]]], dim: int
) -> None:
    ws, res = ranks
    full = _randn(SHAPE, 2)
    for r in range(ws):
        _exact(res[r][f"local_slice/{dim}"], _chunk(full, dim, r, ws))


@pytest.mark.parametrize(("gather", "scatter"), ALL_TO_ALL_DIMS)
def test_all_to_all_moves_the_shard_from_gather_dim_to_scatter_dim_natively_and_in_fallback(
    ranks: tuple[int, list[dict[str, Any]]], gather: int, scatter: int
) -> None:
    ws, res = ranks
    full = _randn(SHAPE, 2)
    for r in range(ws):
        got = res[r][f"all_to_all/{gather}/{scatter}"]
        _exact(got, _chunk(full, scatter, r, ws))
        fallback = res[r][f"fallback/all_to_all/{gather}/{scatter}"]
        _exact(fallback, _chunk(full, scatter, r, ws))


def test_unsupported_native_collectives_switch_the_backend_to_fallbacks(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    ws, res = ranks
    for r in range(ws):
        assert res[r]["fallback/marked"] == [("all_to_all", "gloo"), ("reduce_scatter", "gloo")]


def test_f_identity_forward_all_reduces_the_gradient(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    ws, res = ranks
    weights = _per_rank(ws, SHAPE, 3)
    full = _randn(SHAPE, 2)
    _, grad = _grads_of(full, lambda x: _sum((weights[r] * x).sum() for r in range(ws)))
    for r in range(ws):
        y, g = res[r]["f"]
        _exact(y, full)
        _summed(g, grad)


def test_g_all_reduce_forward_passes_the_gradient_through_not_times_world_size(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    ws, res = ranks
    per_rank = _per_rank(ws, SHAPE, 1)
    shared = _randn(SHAPE, 4)
    stacked = per_rank.clone().requires_grad_(True)
    (shared * stacked.sum(0)).sum().backward()
    assert stacked.grad is not None
    for r in range(ws):
        y, g = res[r]["g"]
        _summed(y, per_rank.sum(0))
        _exact(g, stacked.grad[r])
        assert not torch.allclose(g, ws * shared)


@pytest.mark.parametrize("dim", [1, -1])
def test_sequence_parallel_gather_reduce_scatters_the_gradient(
    ranks: tuple[int, list[dict[str, Any]]], dim: int
) -> None:
    ws, res = ranks
    weights = _per_rank(ws, SHAPE, 3)
    full = _randn(SHAPE, 2)
    _, grad = _grads_of(full, lambda x: _sum((weights[r] * x).sum() for r in range(ws)))
    for r in range(ws):
        y, g = res[r][f"sp/{dim}"]
        _exact(y, full)
        _summed(g, _chunk(grad, dim, r, ws))


def test_colwise_gathered_output_slices_the_gradient(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    ws, res = ranks
    full = _randn(SHAPE, 2)
    shared = _randn(SHAPE, 4)
    for r in range(ws):
        y, g = res[r]["colwise_gather"]
        _exact(y, full)
        _exact(g, _chunk(shared, -1, r, ws))


def test_reduce_scatter_forward_gathers_the_gradient(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    ws, res = ranks
    per_rank = _per_rank(ws, SHAPE, 1)
    weights = _per_rank(ws, SHAPE, 3)
    stacked = per_rank.clone().requires_grad_(True)
    reduced = stacked.sum(0)
    loss = _sum(
        (_chunk(weights[r], 1, r, ws) * _chunk(reduced, 1, r, ws)).sum() for r in range(ws)
    )
    loss.backward()
    assert stacked.grad is not None
    for r in range(ws):
        y, g = res[r]["reduce_scatter_pair"]
        _summed(y, _chunk(per_rank.sum(0), 1, r, ws))
        _exact(g, stacked.grad[r])


def test_local_slice_forward_gathers_the_gradient_on_every_rank(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    ws, res = ranks
    full = _randn(SHAPE, 2)
    weights = _per_rank(ws, SHAPE, 3)
    _, grad = _grads_of(
        full,
        lambda x: _sum(
            (_chunk(weights[r], 0, r, ws) * _chunk(x, 0, r, ws)).sum() for r in range(ws)
        ),
    )
    for r in range(ws):
        y, g = res[r]["local_slice_pair"]
        _exact(y, _chunk(full, 0, r, ws))
        _exact(g, grad)


@pytest.mark.parametrize(("gather", "scatter"), ALL_TO_ALL_DIMS)
def test_all_to_all_gradient_is_the_reverse_all_to_all(
    ranks: tuple[int, list[dict[str, Any]]], gather: int, scatter: int
) -> None:
    ws, res = ranks
    full = _randn(SHAPE, 2)
    weights = _per_rank(ws, SHAPE, 3)
    _, grad = _grads_of(
        full,
        lambda x: _sum(
            (_chunk(weights[r], scatter, r, ws) * _chunk(x, scatter, r, ws)).sum()
            for r in range(ws)
        ),
    )
    for r in range(ws):
        y, g = res[r][f"a2a_pair/{gather}/{scatter}"]
        _exact(y, _chunk(full, scatter, r, ws))
        _exact(g, _chunk(grad, gather, r, ws))


def test_identity_pair_passes_value_and_gradient_unchanged(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    ws, res = ranks
    per_rank = _per_rank(ws, SHAPE, 1)
    shared = _randn(SHAPE, 4)
    for r in range(ws):
        y, g = res[r]["identity_pair"]
        _exact(y, per_rank[r])
        _exact(g, shared)


def test_a_bound_transition_gives_what_transition_gives_value_gradient_and_counts(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    _, results = ranks
    for res in results:
        for (unbound, bound), fallback in zip(res["bound"], res["bound_fallback"], strict=True):
            for got in (bound, fallback):
                _exact(got[0], unbound[0])
                _exact(got[1], unbound[1])
                assert got[2] == unbound[2]


def test_a_bound_transition_refuses_a_second_backward_as_transition_does(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    _, results = ranks
    for res in results:
        for unbound, bound in res["bound_twice"]:
            _exact(bound[0], unbound[0])
            assert "differentiate twice a function that was marked with @once_differentiable" \
                in unbound[1]
            assert bound[1] == unbound[1]


def test_binding_an_unknown_collective_kind_fails_at_install_not_per_call() -> None:
    from hyperrecipe.errors import PlanFormatError

    bogus = CollectiveOp(kind="broadcast", mesh_dim="tp")  # type: ignore[arg-type]
    with pytest.raises(PlanFormatError, match="unknown collective kind 'broadcast'"):
        bind_transition(IDENTITY, bogus, None, group_size=2, group_rank=0)  # type: ignore[arg-type]


def test_megatron_mlp_matches_the_single_process_model(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    ws, res = ranks
    x, a, b, target = (t.clone().requires_grad_(True) for t in _mlp_tensors())
    y = torch.tanh(x @ a) @ b
    ((y - target) ** 2).mean().backward()
    assert x.grad is not None and a.grad is not None and b.grad is not None
    for r in range(ws):
        got = res[r]["mlp"]
        _summed(got["y"], y.detach())
        _summed(got["x"], x.grad)
        _summed(got["a"], _chunk(a.grad, 1, r, ws))
        _summed(got["b"], _chunk(b.grad, 0, r, ws))


def test_shape_errors_name_the_op_the_dim_and_the_sizes(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    ws, res = ranks
    shape = (2, ws + 1)
    assert res[0]["errors"] == {
        "uneven": (
            f"reduce_scatter[tp](scatter_dim=1, sum) (forward): scatter_dim=1 of a tensor of "
            f"shape {shape} has size {ws + 1}, which does not divide evenly into {ws} shards"
        ),
        "uneven_slice": (
            f"local_slice[tp](scatter_dim=-1) (forward): scatter_dim=-1 of a tensor of shape "
            f"{shape} has size {ws + 1}, which does not divide evenly into {ws} shards"
        ),
        "missing": "all_gather[tp]() (forward): all_gather needs gather_dim, which is not set",
        "range": (
            f"all_gather[tp](gather_dim=2) (forward): gather_dim=2 is out of range for a "
            f"tensor of shape {shape} (2 dims)"
        ),
        "same_dims": (
            f"all_to_all[tp](gather_dim=0, scatter_dim=-2) (forward): gather_dim and "
            f"scatter_dim are the same dim 0 of a tensor of shape {(ws, ws)}; an all_to_all "
            f"needs two different dims"
        ),
        "backward": (
            f"reduce_scatter[tp](scatter_dim=1, sum) (backward): scatter_dim=1 of a tensor of "
            f"shape {shape} has size {ws + 1}, which does not divide evenly into {ws} shards"
        ),
    }


def test_count_collectives_records_communicating_ops_by_direction(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    ws, res = ranks
    backward = [
        CollectiveRecord("all_gather", "tp", "backward"),  # the local slice's gradient
        CollectiveRecord("all_reduce", "tp", "backward"),  # f
        CollectiveRecord("reduce_scatter", "tp", "backward"),  # the sequence-parallel gather
    ]
    for r in range(ws):
        assert res[r]["count/inner"] == backward
        assert res[r]["count/outer"] == [CollectiveRecord("all_gather", "tp", "forward"), *backward]


def test_group_for_returns_the_group_size_and_rank_of_a_mesh_dim(
    ranks: tuple[int, list[dict[str, Any]]],
) -> None:
    ws, res = ranks
    for r in range(ws):
        # Mesh [[0, 1], [2, 3]]: tp groups are rows, dp groups are columns.
        tp_peers = [r - r % 2, r - r % 2 + 1]
        assert res[r]["group_for"] == (2, r % 2, ws // 2, r // 2, float(sum(tp_peers)))
        assert res[r]["group_for/unknown"] == (
            "the device mesh has no dim 'pt'. Declared: ['dp', 'tp']; required: 'pt'; "
            "did you mean 'tp'?"
        )
