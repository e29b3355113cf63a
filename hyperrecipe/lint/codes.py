"""Every code ``hyperrecipe lint`` can report, with its name — importable without libcst.

The registry is data so that ``--select``/``--ignore``, configuration and suppression comments
are validated (and the clean fast path runs) without importing the libcst rules. Each rule class
under ``hyperrecipe/lint/rules/`` carries the same code and name; a test keeps the two in step.

Codes are stable: a code is never reused for a different check.

* ``HR000`` syntax-error, ``HR997`` path-not-read, ``HR998`` file-not-checked, ``HR999``
  internal-error — a file (or a folder's files) could not be linted (errors, exit 2).
* ``HR001``-``HR099`` — Python rules. Those marked *gated* are the rewriter's gate (forwards,
  and process-wide patches): they are switched off in the ``rewriter`` paths of the
  configuration. Those marked *opt-in* (``HR005``) are reported only where selected by their
  exact code or name, never by default nor through a prefix such as ``HR0`` (as ruff treats
  its preview rules).
* ``HR100``-``HR199`` — recipe files.
* ``HR900``-``HR999`` — about suppression comments themselves.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Final, Literal

import attrs

from hyperrecipe.errors import SelectorError, did_you_mean

__all__ = [
    "ALWAYS_ON",
    "CODES",
    "DEFAULT_SELECTION",
    "CodeInfo",
    "SelectorError",
    "by_code",
    "resolve_selection",
    "resolve_selectors",
]

CodeKind = Literal["rule", "recipe", "suppression", "error"]


@attrs.frozen(kw_only=True)
class CodeInfo:
    """A code's identity.

    Args:
        code: ``HR001``.
        name: ``forward-assignment``; accepted wherever a code is.
        summary: one line for listings.
        kind: which family it belongs to.
        gated: part of the forward gate, so allowed in the configured rewriter paths.
        opt_in: reported only where selected by this exact code or name (``--select HR005``,
            ``select = [..., "process-patch"]``): not in the default selection, and not
            matched by a prefix such as ``HR0`` (an ``ignore`` prefix does match it). For a
            rule that serves one project's own discipline and would flood anyone else's code
            with findings that are legitimate there.
    """

    code: str
    name: str
    summary: str
    kind: CodeKind
    gated: bool = False
    opt_in: bool = False


CODES: Final[tuple[CodeInfo, ...]] = (
    CodeInfo(code="HR000", name="syntax-error", kind="error",
             summary="the file could not be parsed, so it was not checked"),
    CodeInfo(code="HR001", name="forward-assignment", kind="rule", gated=True,
             summary="`x.forward = ...` (any assignment form, or `del x.forward`)"),
    CodeInfo(code="HR002", name="forward-setattr", kind="rule", gated=True,
             summary='`setattr(x, "forward", ...)` and the other setattr spellings'),
    CodeInfo(code="HR003", name="forward-dict", kind="rule", gated=True,
             summary='`x.__dict__["forward"] = ...`, `vars(x)["forward"] = ...` and dict updates'),
    CodeInfo(code="HR004", name="class-swap", kind="rule", gated=True,
             summary="`x.__class__ = Other` replaces every method, forward included"),
    CodeInfo(code="HR005", name="process-patch", kind="rule", gated=True, opt_in=True,
             summary="`torch.nn.utils.clip_grad_norm_ = f`: an imported module's or class's "
                     "attribute (or a module's `_apply`) replaced outside the rewriter"),
    CodeInfo(code="HR100", name="recipe-schema", kind="recipe",
             summary="a recipe file does not match the recipe schema"),
    CodeInfo(code="HR900", name="unused-suppression", kind="suppression",
             summary="a suppression comment silences nothing"),
    CodeInfo(code="HR901", name="invalid-suppression", kind="suppression",
             summary="a suppression comment without codes or reason, or with an unknown code"),
    CodeInfo(code="HR997", name="path-not-read", kind="error",
             summary="a folder or file under the named paths could not be read (permissions, "
                     "a path longer than the OS allows, a symlink loop, removed while walked), "
                     "so nothing below it was checked"),
    CodeInfo(code="HR998", name="file-not-checked", kind="error",
             summary="the file was not checked: it ran over its time or memory budget, or "
                     "crashed the parser"),
    CodeInfo(code="HR999", name="internal-error", kind="error",
             summary="the lint itself failed on this file (please report it)"),
)

_BY_CODE: Final[Mapping[str, CodeInfo]] = {info.code: info for info in CODES}
_BY_NAME: Final[Mapping[str, CodeInfo]] = {info.name: info for info in CODES}

#: Reported whatever the selection: silencing them would hide files that were never checked.
ALWAYS_ON: Final[frozenset[str]] = frozenset({"HR000", "HR997", "HR998", "HR999"})
SELECTABLE: Final[tuple[str, ...]] = tuple(i.code for i in CODES if i.code not in ALWAYS_ON)
#: What is reported without a ``select``: every selectable code but the opt-in ones.
DEFAULT_SELECTION: Final[frozenset[str]] = frozenset(
    code for code in SELECTABLE if not _BY_CODE[code].opt_in
)


def by_code(code: str) -> CodeInfo:
    """The registry entry for ``code`` (``KeyError`` if unknown)."""
    return _BY_CODE[code]


def resolve_selectors(
    selectors: Iterable[str], *, where: str, prefixes_reach_opt_in: bool = False
) -> frozenset[str]:
    """Turn codes (``HR001``), names (``forward-setattr``) and prefixes (``HR00``) into codes.

    Args:
        selectors: as written by the user.
        where: where they were written, for the message (``"--select"``, ``"pyproject.toml"``).
        prefixes_reach_opt_in: whether a prefix also matches the opt-in codes. ``False`` for a
            selection (an opt-in rule is chosen by its exact code or name only); ``True`` for
            ``ignore``, where ``HR0`` means every ``HR0`` code.

    Raises:
        SelectorError: for a selector that matches no code; the message suggests the nearest.
    """
    chosen: set[str] = set()
    for raw in selectors:
        token = raw.strip()
        if not token:
            continue
        if token in _BY_NAME:
            chosen.add(_BY_NAME[token].code)
            continue
        upper = token.upper()
        if upper in _BY_CODE and upper in SELECTABLE:
            chosen.add(upper)  # an exact code, opt-in or not
            continue
        matches = [
            c for c in SELECTABLE
            if c.startswith(upper) and (prefixes_reach_opt_in or not _BY_CODE[c].opt_in)
        ] if upper.startswith("HR") else []
        if not matches:
            known = [*SELECTABLE, *(_BY_CODE[c].name for c in SELECTABLE)]
            msg = f"{where}: unknown rule code or name {token!r}{did_you_mean(token, known)}"
            raise SelectorError(msg)
        chosen.update(matches)
    return frozenset(chosen)


def resolve_selection(
    *,
    select: Iterable[str] | None,
    ignore: Iterable[str],
    where: str,
) -> frozenset[str]:
    """The codes to report: ``select`` (:data:`DEFAULT_SELECTION` when ``None``) minus
    ``ignore``.

    ``HR000``, ``HR997``, ``HR998`` and ``HR999`` are always added: a file that could not be
    checked is never silent.
    """
    base = DEFAULT_SELECTION if select is None else resolve_selectors(select, where=where)
    ignored = resolve_selectors(ignore, where=where, prefixes_reach_opt_in=True)
    return (base - ignored) | ALWAYS_ON
