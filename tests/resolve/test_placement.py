from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hyperrecipe.placement import (
    NamedPlacement,
    Partial,
    PlacementSyntaxError,
    Replicate,
    Shard,
    parse_named_placement,
    parse_named_text,
    parse_placement,
    to_torch_placements,
)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("replicate", Replicate()),
        ("partial", Partial()),
        ("partial(sum)", Partial()),
        ("partial(avg)", Partial(reduce="avg")),
        ("shard(0)", Shard(dim=0)),
        ("shard(-1)", Shard(dim=-1)),
        (" shard( 2 ) ", Shard(dim=2)),
        ("shard(0, chunks=3)", Shard(dim=0, chunks=3)),
        ("shard(0, chunks=[64, 16, 16])", Shard(dim=0, chunks=3, chunk_sizes=(64, 16, 16))),
    ],
)
def test_placement_grammar_parses_every_documented_form(text: str, expected: object) -> None:
    assert parse_placement(text) == expected


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("shard", "unknown placement 'shard'; expected one of replicate, partial, partial(sum), "
                  "partial(avg), shard(D), shard(D, chunks=K), shard(D, chunks=[S1, S2, ...])"),
        ("partial(max)", "unknown reduce op 'max' in 'partial(max)'; expected partial(sum) or "
                         "partial(avg)"),
        ("shard(0, chunks=[4])", "chunks=[...] needs two or more positive sizes, found "
                                 "'shard(0, chunks=[4])'"),
        ("shard(0, chunks=0)", "chunks must be at least 1, found 'shard(0, chunks=0)'"),
    ],
)
def test_malformed_placements_say_what_is_valid(text: str, message: str) -> None:
    with pytest.raises(PlacementSyntaxError) as err:
        parse_placement(text)
    assert str(err.value) == message


def test_bare_shard_must_name_its_mesh_dim() -> None:
    with pytest.raises(PlacementSyntaxError) as err:
        parse_named_placement("shard(0)")
    assert str(err.value) == ("a placement other than replicate must name its mesh dim, e.g. "
                              "{tp: shard(0)}; found the bare string 'shard(0)'")


def test_named_placement_drops_replicate_entries_and_orders_by_mesh() -> None:
    p = parse_named_placement({"tp": "shard(0)", "dp": "replicate", "cp": "shard(1)"})
    assert p.dims == (("tp", Shard(dim=0)), ("cp", Shard(dim=1)))
    assert p.get("dp") == Replicate()
    assert str(p.canonical(["dp", "cp", "tp"])) == "{cp: shard(1), tp: shard(0)}"


_one = st.one_of(
    st.just(Replicate()),
    st.sampled_from([Partial(), Partial(reduce="avg")]),
    st.builds(lambda d: Shard(dim=d), st.integers(-4, 4)),
    st.builds(lambda d, k: Shard(dim=d, chunks=k), st.integers(-4, 4), st.integers(2, 5)),
    st.builds(lambda d, s: Shard(dim=d, chunks=len(s), chunk_sizes=tuple(s)), st.integers(-4, 4),
              st.lists(st.integers(1, 99), min_size=2, max_size=4)),
)


@given(st.dictionaries(st.sampled_from(["dp", "tp", "cp", "ep"]), _one, max_size=4))
def test_named_placement_text_round_trips(entries: dict[str, object]) -> None:
    p = NamedPlacement.of(entries)  # type: ignore[arg-type]
    assert parse_named_text(str(p)) == p


def test_torch_conversion_orders_by_mesh_and_refuses_chunked_shards() -> None:
    from torch.distributed.tensor import Partial as TP
    from torch.distributed.tensor import Replicate as TR
    from torch.distributed.tensor import Shard as TS

    p = parse_named_placement({"tp": "shard(0)", "dp": "partial"})
    assert to_torch_placements(p, ["dp", "tp", "cp"]) == (TP("sum"), TS(0), TR())
    with pytest.raises(ValueError, match="no torch placement"):
        to_torch_placements(parse_named_placement({"tp": "shard(0, chunks=3)"}), ["tp"])


@pytest.mark.parametrize(("text", "shape", "mesh", "want", "why"), [
    ("{tp: shard(-1)}", (8, 4), ("dp", "tp"), ("replicate", "shard(-1)"), None),
    ("{tp: shard(0, chunks=3)}", (12, 4), ("tp",), ("strided_shard(0, 3)",), None),
    ("{dp: shard(1), tp: shard(0, chunks=2)}", (8, 4), ("dp", "tp"),
     ("shard(1)", "strided_shard(0, 2)"), None),
    ("{tp: shard(0, chunks=[8, 4, 4])}", (16, 4), ("tp",), (), "unequal chunks"),
    ("{dp: shard(0), tp: shard(0, chunks=2)}", (8, 4), ("dp", "tp"), (),
     "tensor dim 0 is also sharded on dp"),
], ids=["plain", "equal-chunks", "chunks-and-another-dim", "unequal-chunks", "shared-dim"])
def test_dtensor_layout_names_the_placement_or_why_there_is_none(
        text: str, shape: tuple[int, ...], mesh: tuple[str, ...], want: tuple[str, ...],
        why: str | None) -> None:
    from hyperrecipe.placement import dtensor_layout, parse_named_text

    assert dtensor_layout(parse_named_text(text), shape, mesh) == (want, why)


@pytest.mark.parametrize(("text", "mesh", "want"), [
    ("{tp: shard(0, chunks=[8, 4, 4])}", ("tp",), ("chunk_parts(0, [8, 4, 4])",)),
    ("{dp: shard(1), tp: shard(0, chunks=[8, 4, 4])}", ("dp", "tp"),
     ("shard(1)", "chunk_parts(0, [8, 4, 4])")),
    ("{tp: shard(-2, chunks=[8, 4, 4])}", ("tp",), ("chunk_parts(0, [8, 4, 4])",)),
    ("{tp: shard(0, chunks=2)}", ("tp",), None),
    ("{dp: shard(0), tp: shard(0, chunks=[8, 4, 4])}", ("dp", "tp"), None),
], ids=["unequal", "with-another-dim", "negative-dim", "equal", "shared-dim"])
def test_unequal_chunks_of_one_dim_have_a_layout_of_parts(
        text: str, mesh: tuple[str, ...], want: tuple[str, ...] | None) -> None:
    from hyperrecipe.placement import chunk_parts_layout, parse_dtensor, parse_named_text

    got = chunk_parts_layout(parse_named_text(text), (16, 4), mesh)
    assert got == want
    if want is not None:
        assert parse_dtensor(want).parts == (mesh.index("tp"), 0, (8, 4, 4))
    assert parse_dtensor(("replicate", "strided_shard(0, 2)")).parts is None


def test_dtensor_texts_become_torch_placements() -> None:
    from torch.distributed.tensor import Replicate as TReplicate
    from torch.distributed.tensor import Shard as TShard
    from torch.distributed.tensor.placement_types import _StridedShard

    from hyperrecipe.errors import PlacementError
    from hyperrecipe.placement import parse_dtensor

    got = parse_dtensor(("replicate", "shard(-1)", "strided_shard(0, 3)")).torch_placements()
    assert got == (TReplicate(), TShard(-1), _StridedShard(0, split_factor=3))
    with pytest.raises(PlacementError) as info:
        parse_dtensor(("shard(x)",))
    assert str(info.value) == "'shard(x)' is not a DTensor placement of a plan"
    parts = parse_dtensor(("chunk_parts(0, [8, 4, 4])", "shard(1)"))
    assert parts.torch_placements(parts_as_shard=True) == (TShard(0), TShard(1))
    with pytest.raises(PlacementError, match="unequal chunks have no single DTensor placement"):
        parts.torch_placements()
