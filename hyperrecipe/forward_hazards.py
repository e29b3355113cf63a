"""Attentions whose heads cannot be divided between ranks, read off a live module's forward.

Tensor parallelism shards an attention by heads: each rank holds whole heads of q, k and v and
its forward must shape them by what it holds. Three ways of writing an attention defeat that,
whatever the recipe says, and they are told apart here, once, for both rooms that need them:
``suggest`` leaves such an attention replicated (with the reason), and ``check`` names the
hazard as the likely cause when a plan that shards one diverges (docs/verification.md).

- the width read off the input (nanoGPT: ``B, T, C = x.size()`` ... ``C // self.n_head``): the
  input is the whole hidden size on every rank, so a rank holding half the heads views its half
  of q, k, v by the whole width; dividing the head count (``head_counts``) does not help, the
  width is still the global one;
- heads fixed in einops (``Rearrange('b n (h d) -> b h n d', h=heads)`` as a child, or
  ``rearrange(t, ..., h=self.heads)`` in ``forward``): a rank holding half the width still
  splits it into all the heads, each half as wide, and computes the wrong attention without a
  shape error;
- ``nn.MultiheadAttention``: ``F.multi_head_attention_forward`` reads ``in_proj_weight`` and
  ``out_proj.weight`` itself (``out_proj`` is never called, so a boundary on it never runs)
  and ``head_dim`` off the input's width.

Everything here reads source text and module attributes only: no forward runs, no process
group, no plan. What lives elsewhere: which blocks a recipe would shard (``suggest.structure``),
what a divergence measured (``check.diagnose``).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from typing import Literal

import attrs
from torch import nn

__all__ = ["HEAD_COUNT_NAMES", "HazardKind", "ForwardHazard", "einops_count_attrs",
           "forward_hazard", "forward_hazards", "heads_fixed_in_einops",
           "width_read_off_the_input"]

HazardKind = Literal["width", "einops", "mha"]

HEAD_COUNT_NAMES = ("num_heads", "num_attention_heads", "n_heads", "n_head", "heads")
"""Integer attributes that count an attention's heads (``heads``: lucidrains' models)."""


@attrs.frozen(kw_only=True)
class ForwardHazard:
    """One attention whose heads cannot be divided between ranks.

    Attributes:
        kind: ``"width"`` (width read off the input), ``"einops"`` (heads fixed in an einops
            pattern) or ``"mha"`` (``nn.MultiheadAttention``).
        why: what its forward does, in a sentence that names the line or pattern
            (``"its forward reads the width off its input (B, T, C = x.size()) ..."``).
        seen: the source line or einops pattern itself, as read.
        count_attr: for an einops call in ``forward`` whose head count is ``h=self.<attr>``, that
            attribute (``head_counts`` can divide it); ``None`` otherwise.
    """

    kind: HazardKind
    why: str
    seen: str
    count_attr: str | None = None


_UNPACKED_WIDTH = r"^\s*(?:[\w\s,]*,\s*)?(\w+)\s*=\s*{arg}\.(?:size\(\)|shape)\s*$"
_LAST_WIDTH = r"^\s*(\w+)\s*=\s*{arg}\.(?:size\(-1\)|shape\[-1\])\s*$"


def _forward_source(block: nn.Module) -> tuple[str, list[str]]:
    """The source of ``block``'s ``forward`` and its parameter names (``("", [])`` where there
    is no source to read: a builtin, a class defined in a REPL)."""
    try:
        return (inspect.getsource(type(block).forward),
                list(inspect.signature(type(block).forward).parameters))
    except (OSError, TypeError, ValueError):
        return "", []


def width_read_off_the_input(block: nn.Module) -> ForwardHazard | None:
    """``block``'s ``forward`` reads the width off its input and shapes by it (nanoGPT: ``B, T,
    C = x.size()`` ... ``C // self.n_head``). Only for a block that counts heads (an attention);
    ``None`` for every other."""
    if not any(type(getattr(block, k, None)) is int for k in HEAD_COUNT_NAMES):
        return None
    source, params = _forward_source(block)
    if len(params) < 2:
        return None
    arg = re.escape(params[1])
    for pattern in (_UNPACKED_WIDTH, _LAST_WIDTH):
        bound = re.search(pattern.format(arg=arg), source, re.MULTILINE)
        if bound is None or bound.group(1) == "_":
            continue
        width = bound.group(1)
        # a comment, an attribute (`.dim()`) or a keyword (`dim=-1`) of the same name is no use
        after = re.sub(r"#.*", "", source[bound.end():])
        if re.search(rf"(?<![\w.]){re.escape(width)}\b(?!\s*=(?!=))", after):
            line = " ".join(bound.group(0).split())
            return ForwardHazard(kind="width", seen=line, why=(
                f"its forward reads the width off its input ({line}) and shapes its heads by "
                f"it"))
    return None


_EINOPS_CALL = re.compile(r"\b(?:rearrange|repeat|reduce)\(\s*(?:[^,()]|\([^()]*\))+,\s*"
                          r"(['\"])(.+?)\1"
                          r"((?:\s*,\s*\w+\s*=\s*[^,()]+(?:\([^()]*\))?)*)\s*\)")


def _fixed_counts(pattern: str, axes: Sequence[str]) -> list[str]:
    """The axes of an einops ``pattern`` that fix the count of a split (``h`` in ``(h d)``
    given as ``h=``); fixing the per-head size instead (``d=``) holds on a shard."""
    return [first for first, _ in re.findall(r"\((\w+)\s+(\w+)\)", pattern) if first in axes]


def heads_fixed_in_einops(block: nn.Module) -> ForwardHazard | None:
    """An einops pattern in ``block`` fixes the head count (``Rearrange('b n (h d) -> b h n
    d', h=heads)`` as a child, or ``rearrange(t, ..., h=self.heads)`` in its forward)."""
    for name, child in block.named_children():
        lengths = getattr(child, "axes_lengths", None)
        pattern = getattr(child, "pattern", None)
        if (type(child).__module__.startswith("einops") and isinstance(pattern, str)
                and lengths and _fixed_counts(pattern, list(dict(lengths)))):
            seen = f"{type(child).__name__} {pattern!r}, {dict(lengths)}"
            return ForwardHazard(kind="einops", seen=seen, why=(
                f"its {name} ({seen}) fixes the head count in an einops pattern"))
    source, _ = _forward_source(block)
    for call in _EINOPS_CALL.finditer(source):
        given = dict(re.findall(r"(\w+)\s*=\s*([^,()]+)", call.group(3)))
        fixed = _fixed_counts(call.group(2), list(given))
        if fixed:
            seen = " ".join(call.group(0).split())
            attr = re.fullmatch(r"\s*self\.(\w+)\s*", given[fixed[0]])
            return ForwardHazard(kind="einops", seen=seen,
                                 count_attr=attr.group(1) if attr else None,
                                 why=f"its forward fixes the head count in an einops pattern "
                                     f"({seen})")
    return None


def einops_count_attrs(block: nn.Module) -> frozenset[str] | None:
    """The attributes every head count fixed in ``block``'s einops patterns is read from, where
    each is ``h=self.<attr>`` in a call in its ``forward`` (vit-pytorch's ``rearrange(t, 'b n
    (h d) -> b h n d', h=self.heads)``): dividing those (``head_counts``) makes the pattern
    split what the rank holds. ``None`` where some count is fixed otherwise (a literal, a
    local, an einops layer built with it), which no recipe can divide."""
    for child in block.children():
        lengths = getattr(child, "axes_lengths", None)
        pattern = getattr(child, "pattern", None)
        if (type(child).__module__.startswith("einops") and isinstance(pattern, str)
                and lengths and _fixed_counts(pattern, list(dict(lengths)))):
            return None
    source, _ = _forward_source(block)
    found: set[str] = set()
    for call in _EINOPS_CALL.finditer(source):
        given = dict(re.findall(r"(\w+)\s*=\s*([^,()]+)", call.group(3)))
        for axis in _fixed_counts(call.group(2), list(given)):
            attr = re.fullmatch(r"\s*self\.(\w+)\s*", given[axis])
            if attr is None or type(getattr(block, attr.group(1), None)) is not int:
                return None
            found.add(attr.group(1))
    return frozenset(found)


_MHA_SEEN = "F.multi_head_attention_forward"
_MHA_WHY = ("its q, k and v are one in_proj_weight of its own, and its forward reads head_dim "
            "off the input's width and never calls out_proj")


def forward_hazard(block: nn.Module) -> ForwardHazard | None:
    """Why ``block``'s heads cannot be divided between ranks (see the module doc), or ``None``."""
    if isinstance(block, nn.MultiheadAttention):
        return ForwardHazard(kind="mha", seen=_MHA_SEEN, why=_MHA_WHY)
    return width_read_off_the_input(block) or heads_fixed_in_einops(block)


def forward_hazards(model: nn.Module) -> dict[str, ForwardHazard]:
    """Every module of ``model`` with a :func:`forward_hazard`, by FQN (what ``check`` consults
    at a divergence)."""
    out: dict[str, ForwardHazard] = {}
    for fqn, module in model.named_modules():
        found = forward_hazard(module)
        if found is not None:
            out[fqn] = found
    return out
