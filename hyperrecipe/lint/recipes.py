"""Recipe files in a lint run: recognising them, and checking them against the schema (HR100).

A ``.yaml``/``.yml``/``.toml`` file is a recipe when it has a top-level ``recipe`` key. Checking
needs no model: :func:`hyperrecipe.recipe.check_recipe_file` validates the document, its styles,
rules and ``extends`` chain, and each error it returns becomes one ``HR100`` finding at the
error's line and column. The recipe package is imported only when a recipe file is linted.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Final

from hyperrecipe.lint.codes import by_code
from hyperrecipe.lint.findings import Finding

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.10 only
    import tomli as tomllib

__all__ = ["RECIPE_SUFFIXES", "check_recipe", "is_recipe_file"]

RECIPE_SUFFIXES: Final = (".yaml", ".yml", ".toml")
# A top-level mapping key starts in column 0; quoted spellings are keys too.
_YAML_RECIPE_KEY: Final = re.compile(rb"""^(?:recipe|"recipe"|'recipe')[ \t]*:""", re.MULTILINE)
_TOML_RECIPE_KEY: Final = re.compile(
    rb"""^[ \t]*(?:(?:recipe|"recipe"|'recipe')[ \t]*="""
    rb"""|\[[ \t]*(?:recipe|"recipe"|'recipe')[ \t]*[\].])""",
    re.MULTILINE,
)


def is_recipe_file(path: Path) -> bool:
    """Whether ``path`` looks like a recipe: a YAML or TOML document with a top-level ``recipe``.

    TOML is parsed (it is cheap and exact); a TOML file that does not parse counts as a recipe
    when a ``recipe`` key is visible, so its syntax error is reported rather than ignored. YAML
    is recognised by a ``recipe:`` key in column 0, which is what a top-level key looks like, or
    else (flow style, explicit keys) by the top-level keys of its event stream.
    """
    if path.suffix not in RECIPE_SUFFIXES:
        return False
    try:
        data = path.read_bytes()
    except OSError:
        return False
    # A byte order mark (Windows editors write one) hid the `recipe` key from both checks, so a
    # recipe that compile loads was skipped by the lint without a word.
    data = data.removeprefix(b"\xef\xbb\xbf")
    if path.suffix == ".toml":
        try:
            return "recipe" in tomllib.loads(data.decode("utf-8"))
        except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
            # (RecursionError: nested too deeply for tomllib; the check reports it, bounded.)
            return _TOML_RECIPE_KEY.search(data) is not None
    if _YAML_RECIPE_KEY.search(data) is not None:
        return True
    # Flow style (`{recipe: x, ...}`, what a JSON-converted recipe looks like) and explicit keys
    # (`? recipe`) load as recipes too: when the word is there, read the top-level keys.
    return b"recipe" in data and _yaml_has_top_level_recipe(data)


def _yaml_has_top_level_recipe(data: bytes) -> bool:
    """Whether the first YAML document is a mapping with a ``recipe`` key, from the event
    stream: no objects are constructed and nothing recurses, so this is bounded by the size."""
    import yaml

    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    stack: list[list[bool]] = []  # per open collection: [is a mapping, next node is a key]

    def advance() -> None:
        if stack and stack[-1][0]:
            stack[-1][1] = not stack[-1][1]

    try:
        for event in yaml.parse(data, Loader=loader):
            if isinstance(event, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
                stack.append([isinstance(event, yaml.MappingStartEvent), True])
            elif isinstance(event, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
                stack.pop()
                advance()
            elif isinstance(event, (yaml.ScalarEvent, yaml.AliasEvent)):
                if (len(stack) == 1 and stack[0] == [True, True]
                        and isinstance(event, yaml.ScalarEvent) and event.value == "recipe"):
                    return True
                advance()
            elif isinstance(event, yaml.DocumentEndEvent):
                return False
    except yaml.YAMLError:
        return False
    return False


def check_recipe(path: Path, display: str) -> list[Finding]:
    """Check one recipe file; every schema error is an ``HR100`` finding.

    An unexpected failure of the checker becomes an ``HR999`` error (exit 2) rather than a
    traceback.
    """
    info = by_code("HR100")
    try:
        from hyperrecipe.recipe import check_recipe_file
    except ImportError as exc:
        internal = by_code("HR999")
        return [
            Finding(path=display, line=1, column=1, code=internal.code, name=internal.name,
                    message=f"recipe checks are unavailable: {exc}", severity="error")
        ]
    try:
        errors = check_recipe_file(path)
    except RecursionError:
        unchecked = by_code("HR998")
        return [
            Finding(path=display, line=1, column=1, code=unchecked.code, name=unchecked.name,
                    message="not checked: it is nested too deeply to load (RecursionError)",
                    severity="error")
        ]
    except Exception as exc:  # noqa: BLE001 - a checker bug must not become a traceback
        internal = by_code("HR999")
        return [
            Finding(path=display, line=1, column=1, code=internal.code, name=internal.name,
                    message=f"checking the recipe failed: {type(exc).__name__}: {exc}",
                    severity="error")
        ]
    findings = []
    for error in errors:
        span = error.span
        # The error's own message, without the location the finding already carries.
        message = str(error)
        if span is not None:
            message = message.removeprefix(f"{span}: ")
        findings.append(
            Finding(
                path=display,
                line=span.line if span is not None else 1,
                column=span.column if span is not None else 1,
                code=info.code,
                name=info.name,
                message=message,
            )
        )
    return findings
