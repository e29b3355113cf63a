"""Deciding, cheaply and soundly, which files cannot hold a finding and so need no libcst pass.

libcst is about ten times slower than the interpreter's own parser, and in a real tree almost
no file assigns ``forward``. So each file goes through two screens first; a file is handed to the
libcst rules unless a screen *proves* that no rule can fire in it. The screens look only for what
the selected rules can report: the parts marked *HR005* below apply only where that opt-in rule
is selected (``needs_libcst(..., patches=True)``); otherwise the screen is what it was before
HR005 existed, so a file that merely imports something is not even parsed with :mod:`ast`.

1. **Text.** Every finding needs one of a few spellings in the source: ``forward`` or
   ``__class__`` as an attribute that is not immediately called, as a quoted string or a keyword
   argument; a backslash escape of one of their letters; a string literal that is a proper
   prefix of one of them followed by another literal (``"for" "ward"``); the word ``__dict__``
   or ``vars`` (copying another object's attribute dict names no target); *HR005:* the word
   ``import`` (a patch of an imported module or class needs one), and ``_apply`` as a screened
   name like ``forward``; or a
   ``# hyperrecipe:`` comment. Non-ASCII sources are NFKC-normalised first, as the tokenizer
   normalises identifiers (``m.ｆorward`` *is* ``m.forward``). A file with none of these is only
   syntax-checked (``symtable``, which parses but builds no AST objects), so a broken file is
   still reported.
2. **AST.** A file that passes the text screen is parsed with :mod:`ast` and walked for the
   shapes the rules look for, more loosely than the rules (any callee, any receiver), so the
   screen is a superset of them: an attribute ``forward``/``__class__`` (``__call__`` on a
   receiver spelled as a class) in store or delete context; a subscript store/delete, call
   argument, keyword or dict key whose value is statically one of those names (string literals,
   concatenations, placeholder-free f-strings and names bound to such literals anywhere in the
   file); an ``update``/``dict`` call copying one possible attribute dict (``x.__dict__``, or a
   call of a plain name such as ``vars(x)``) into another; *HR005:* an attribute (other than
   ``__doc__``, ``__module__``, ``__name__``, ``__qualname__``) stored or deleted, or a
   ``setattr``/``delattr`` (also imported from ``builtins`` under another name),
   ``__setattr__`` or ``__delattr__`` call, on a chain starting from a name an import anywhere
   in the file binds.

A file that fails to parse either way goes to libcst, which reports the syntax error — or, when
libcst accepts syntax this interpreter does not, lints it. The test-suite checks that this path
and a full libcst pass give identical findings, on ``torch/distributed`` and on tricky cases.
"""

from __future__ import annotations

import ast
import io
import re
import symtable
import tokenize
import unicodedata
from collections.abc import Iterator
from typing import Final, cast

from hyperrecipe.errors import InterpreterLimit
from hyperrecipe.lint.targets import ENTRY_NAMES, METADATA_NAMES, SCREENED_NAMES, TARGET_NAMES

__all__ = [
    "SUPPRESSION_HINT",
    "InterpreterLimit",
    "check_interpreter_limits",
    "interpreter_limit",
    "needs_libcst",
]

_WORD_BYTES: Final = frozenset(
    b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_" + bytes(range(0x80, 0x100))
)
_QUOTES: Final = frozenset(b"\"'")
_INLINE_SPACE: Final = frozenset(b" \t\f")
_ANY_SPACE: Final = frozenset(b" \t\f\r\n\\")
_DOT: Final = ord(".")
_EQUALS: Final = ord("=")
_NEWLINE: Final = ord("\n")

# What may follow an attribute that is a store target: `=`, `+=`, `:`, `,`, `)`, `]`, `in`
# (for), a newline (del)... These cannot, so `.forward` followed by one of them is a read (a
# call, an attribute or item of the forward, a string or docs): "(", ".", "[", "{", "}", quotes
# and backticks; and any word other than `in` ("Module.forward where ...").
_NOT_A_TARGET_AFTER: Final = frozenset(b"(.[{}\"'`")
_IN: Final = b"in"
#: Where a suppression comment may be (a superset: the match may sit inside a string).
SUPPRESSION_HINT: Final = re.compile(rb"#[ \t]*hyperrecipe[ \t]*:")


def _letter_escape(names: frozenset[str]) -> re.Pattern[bytes]:
    """Any escape that can spell a letter of ``names`` (hex, ``\\u``/``\\U``, octal, ``\\N{}``).

    Starts with a literal backslash, so it is searched for in C at memory speed."""
    letters = sorted({ord(char) for name in names for char in name})
    hexes = [b"%x[%x%X]" % (v >> 4, v & 15, v & 15) if v & 15 > 9 else b"%02x" % v
             for v in letters]
    octals = [b"%03o" % v for v in letters]
    return re.compile(
        rb"\\(?:x|u00|U000000)(?:" + b"|".join(hexes) + rb")"
        + rb"|\\(?:" + b"|".join(octals) + rb")"
        + rb"|\\N\{"
    )


def _byte_class(values: set[int]) -> bytes:
    return b"[" + b"".join(re.escape(bytes([v])) for v in sorted(values)) + b"]"


def _split_candidates(prefixes: frozenset[bytes]) -> tuple[re.Pattern[bytes], ...]:
    """A literal that is a proper prefix of a screened name, followed by another literal: the
    start of a concatenation that may spell the name (``"for" "ward"``, ``"fo" + "rward"``,
    ``("__cl") "ass__"``).

    Every prefix is made of a few letters (``[f_][a-z_]*`` today), so a regex looks for that
    shape and the prefix is then looked up in a set. One regex per opening quote: a pattern
    that starts with a literal character is searched for in C at memory speed, one that starts
    with a class (``["']``) or an alternation of the 60-odd prefixes is tried at every position
    (that cost two thirds of the text screen)."""
    return tuple(
        re.compile(
            quote + b"(" + _byte_class({p[0] for p in prefixes})
            + _byte_class({c for p in prefixes for c in p})
            + b"{0,%d})" % (max(len(p) for p in prefixes) - 1) + rb"[\"']"
            + rb"(?:[ \t\f\r\n\\+()]|#[^\n]*\n)*[rRuUfFbB]{0,2}[\"']"
        )
        for quote in (b'"', b"'")
    )


class _Watch:
    """What the screen looks for under one selection: the names, and whether HR005's patches.

    Args:
        names: the attribute names a finding may be about.
        patches: HR005 is selected, so a store through an imported name is a possible finding.
    """

    def __init__(self, names: frozenset[str], *, patches: bool) -> None:
        self.names = names
        self.patches = patches
        self.words = tuple(sorted(name.encode() for name in names))
        self.letter_escape = _letter_escape(names)
        self.prefixes = frozenset(
            name[:end].encode() for name in names for end in range(1, len(name))
        )
        self.split_candidates = _split_candidates(self.prefixes)


#: The forward gate alone (HR001-HR004): the screen as it was before HR005.
_GATE: Final = _Watch(TARGET_NAMES, patches=False)
#: The gate and HR005's process patches (``_apply`` on any receiver, stores through imports).
_GATE_AND_PATCHES: Final = _Watch(SCREENED_NAMES, patches=True)


# Copying another object's attribute dict (`m.__dict__.update(o.__dict__)`,
# `mock.patch.dict(vars(m), vars(o))`) needs no target name at all, only one of these words
# (`vars` also when aliased: the import names it).
_DICT_WORD: Final = b"__dict__"
_VARS_WORD: Final = b"vars"
# A patch of an imported module or class (HR005) needs an import to name it.
_IMPORT_WORD: Final = b"import"


def _normalized(source: bytes) -> bytes:
    """The source as the tokenizer sees identifiers: decoded per PEP 263, NFKC-normalised."""
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(source).readline)
    except SyntaxError:
        encoding = "utf-8"
    if encoding == "utf-8":  # (a BOM gives "utf-8-sig": decoded below, so the BOM goes)
        try:
            text = source.decode("utf-8")
        except UnicodeDecodeError:
            pass
        else:
            if unicodedata.is_normalized("NFKC", text):
                return source  # what re-encoding the normalised text would give, for free
    try:
        text = source.decode(encoding, errors="replace")
    except LookupError:
        text = source.decode("utf-8", errors="replace")
    return unicodedata.normalize("NFKC", text).encode("utf-8", errors="replace")


def _followed_by_read(source: bytes, end: int) -> bool:
    """Whether what follows position ``end`` shows the name before it is not a store target."""
    size = len(source)
    j = end
    while j < size and source[j] in _INLINE_SPACE:
        j += 1
    if j >= size:
        return False
    char = source[j]
    if char in _NOT_A_TARGET_AFTER:
        return True
    if char in _WORD_BYTES:
        k = j
        while k < size and source[k] in _WORD_BYTES:
            k += 1
        return source[j:k] != _IN
    return False


def _mentions(source: bytes, word: bytes) -> bool:
    """Whether ``word`` occurs as a possible store target, a quoted string or a keyword."""
    size = len(source)
    start = source.find(word)
    while start != -1:
        begin, end = start, start + len(word)
        start = source.find(word, end)
        before = source[begin - 1] if begin else None
        after = source[end] if end < size else None
        if (before is not None and before in _WORD_BYTES) or (
            after is not None and after in _WORD_BYTES
        ):
            continue  # part of a longer identifier or word (`_pre_forward`, `forwarded`)
        if before in _QUOTES and after in _QUOTES:
            return True  # "forward"
        j = end
        while j < size and source[j] in _INLINE_SPACE:
            j += 1
        is_keyword = j + 1 < size and source[j] == _EQUALS and source[j + 1] != _EQUALS
        if word != b"__class__" and is_keyword:
            return True  # forward=... (keyword) or forward = ... (a plain name: cheap to include)
        k = begin - 1
        crossed_line = False
        while k >= 0 and source[k] in _ANY_SPACE:
            crossed_line = crossed_line or source[k] == _NEWLINE
            k -= 1
        if k >= 0 and source[k] == _DOT:
            if not _followed_by_read(source, end):
                return True
            continue
        if crossed_line:
            # `(m.  # comment` on the line before: a comment may sit between dot and name.
            line_start = source.rfind(b"\n", 0, k + 1) + 1
            if b"#" in source[line_start : k + 1]:
                return True
    return False


def _text_may_match(source: bytes, watch: _Watch = _GATE) -> bool:
    if b"hyperrecipe" in source and SUPPRESSION_HINT.search(source):
        return True
    for word in watch.words:
        if word in source and _mentions(source, word):
            return True
    if _DICT_WORD in source or (_VARS_WORD in source and _has_word(source, _VARS_WORD)):
        return True
    if b"\\" in source and watch.letter_escape.search(source):
        return True
    if watch.patches and _IMPORT_WORD in source and _has_word(source, _IMPORT_WORD):
        return True  # HR005: an imported module or class may be patched; the ast screen decides
    return _has_split_literal(source, watch)


def _has_word(source: bytes, word: bytes) -> bool:
    """Whether ``word`` occurs on its own, not as part of a longer identifier."""
    size = len(source)
    start = source.find(word)
    while start != -1:
        end = start + len(word)
        if (start == 0 or source[start - 1] not in _WORD_BYTES) and (
            end == size or source[end] not in _WORD_BYTES
        ):
            return True
        start = source.find(word, end)
    return False


def _has_split_literal(source: bytes, watch: _Watch) -> bool:
    """Whether a literal holding a proper prefix of a screened name is followed by another."""
    for candidate in watch.split_candidates:
        match = candidate.search(source)
        while match is not None:
            if match.group(1) in watch.prefixes:
                return True
            match = candidate.search(source, match.start() + 1)
    return False


def _literal_str(node: ast.expr) -> str | None:
    """The value of a string expression built only from literals, else ``None``."""
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else None
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if not (isinstance(value, ast.Constant) and isinstance(value.value, str)):
                return None
            parts.append(value.value)
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left = _literal_str(node.left)
        if left is None:
            return None
        right = _literal_str(node.right)
        return None if right is None else left + right
    return None


_CALLED_ATTRIBUTES: Final = frozenset(
    {
        "setattr", "delattr", "__setattr__", "__delattr__",  # HR002, HR004
        "update", "setdefault", "pop", "__setitem__", "__delitem__",  # HR003 on a namespace
        "setitem", "delitem",  # operator.setitem(vars(x), ...)
        "object", "dict", "multiple",  # patch.object, patch.dict, patch.multiple
    }
)
#: Builtins that set or delete an attribute by name, and the dunders that do on any receiver
#: (HR005 reports them on an imported receiver).
_SETATTR_NAMES: Final = frozenset({"setattr", "delattr"})
_DUNDER_SETATTR_NAMES: Final = frozenset({"__setattr__", "__delattr__"})
#: Calls whose keywords (``forward=f``) can write the key: ``ns.update``, ``mock.patch.dict``,
#: ``patch.multiple``.
_UPDATE_ATTRIBUTES: Final = frozenset({"update", "dict", "multiple"})
#: Calls that can copy another attribute dict: ``ns.update(o.__dict__)``, ``dict.update(ns,
#: **vars(o))``, ``mock.patch.dict(ns, o.__dict__)``.
_COPYING_ATTRIBUTES: Final = frozenset({"update", "dict"})


def _has_forward_keyword(node: ast.expr) -> bool:
    """``dict(forward=...)``-shaped: any call with a ``forward=`` (or other entry) keyword."""
    return isinstance(node, ast.Call) and any(k.arg in ENTRY_NAMES for k in node.keywords)


def _namespace_like(node: ast.expr) -> bool:
    """``x.__dict__``, or a call of a plain name (``vars(x)``, also aliased): may be an attribute
    dict. (The rules resolve the name; a method call such as ``d.setdefault(k, {})`` never is.)"""
    if type(node) is ast.Call:
        return type(node.func) is ast.Name
    return isinstance(node, ast.Attribute) and node.attr == "__dict__"


def _spelled_as_class(node: ast.expr) -> bool:
    """A superset of the rules' ``looks_like_class``: ``__call__`` counts only on a class
    (``Block``, ``nn.Linear``, ``cls``, ``type(m)``, ``m.__class__``), as the rules read it."""
    if isinstance(node, ast.Name):
        return node.id == "cls" or node.id[:1].isupper()
    if isinstance(node, ast.Attribute):
        return node.attr == "__class__" or node.attr[:1].isupper()
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and (
        node.func.id == "type"
    )


def _dict_with_target_key(node: ast.expr, names: frozenset[str]) -> bool:
    """A dict display with a key in ``names``: a name bound to it may feed ``ns.update(d)``."""
    return isinstance(node, ast.Dict) and any(
        key is not None and _literal_str(key) in names for key in node.keys
    )


#: Fields that only ever hold the shared, childless context and operator nodes (``Load()``,
#: ``Add()``): the walk does not visit them (the screen reads them where it needs them).
_LEAF_FIELDS: Final = frozenset({"ctx", "op", "ops"})
_CHILD_FIELDS: dict[type, tuple[str, ...]] = {}


def _nodes(tree: ast.AST) -> Iterator[ast.AST]:
    """Every node of ``tree``, in no particular order: ``ast.walk`` without its per-node
    generator of fields (half the cost of the ``ast`` screen was walking)."""
    stack: list[object] = [tree]
    pop, push, extend = stack.pop, stack.append, stack.extend
    fields_of = _CHILD_FIELDS
    while stack:
        node = pop()
        if not isinstance(node, ast.AST):
            continue  # None in ``Dict.keys``, names in ``Global.names``
        yield node
        kind = type(node)
        fields = fields_of.get(kind)
        if fields is None:
            fields = fields_of[kind] = tuple(f for f in kind._fields if f not in _LEAF_FIELDS)
        for name in fields:
            value = getattr(node, name, None)
            if type(value) is list:
                extend(value)
            elif isinstance(value, ast.AST):
                push(value)


class _Screen:
    """One walk over an AST, looking for anything a selected rule could report."""

    def __init__(self, watch: _Watch = _GATE) -> None:
        self.names = watch.names
        self.patches = watch.patches
        self.constant_names: set[str] = set()  # names bound to a target-name literal
        self.names_in_key_positions: set[str] = set()
        # HR005: names imports bind, and the names stored-through or set-by-name on
        self.imported: set[str] = set()
        self.setattr_names: set[str] = set(_SETATTR_NAMES)  # also `from builtins import ... as`
        self.patched_roots: set[str] = set()
        self.named_setattr_roots: dict[str, set[str]] = {}  # plain-name callee -> receiver roots

    def is_target(self, node: ast.expr | None) -> bool:
        if node is None:
            return False
        if isinstance(node, ast.Name):
            self.names_in_key_positions.add(node.id)
            return False
        return _literal_str(node) in self.names

    def dict_has_target_key(self, node: ast.expr) -> bool:
        return isinstance(node, ast.Dict) and any(self.is_target(key) for key in node.keys)

    def copies_namespace(self, call: ast.Call, func: ast.Attribute) -> bool:
        """``ns.update(other_ns)``, ``dict.update(ns, other_ns)`` or ``patch.dict(ns,
        other_ns)`` (the sources also as ``**other_ns``)."""
        sources = [*call.args, *(k.value for k in call.keywords if k.arg is None)]
        if _namespace_like(func.value) and any(_namespace_like(a) for a in sources):
            return True
        return sum(_namespace_like(a) for a in sources) >= 2

    def found(self, tree: ast.AST) -> bool:
        names, patches = self.names, self.patches
        for node in _nodes(tree):
            kind = type(node)
            if kind is ast.Attribute:
                assert isinstance(node, ast.Attribute)
                if type(node.ctx) is not ast.Load:
                    if node.attr in names:
                        if node.attr != "__call__" or _spelled_as_class(node.value):
                            return True  # an instance's `__call__` is never what `m(x)` calls
                    elif patches and node.attr not in METADATA_NAMES:
                        self.add_root(self.patched_roots, node.value)
            elif kind is ast.Import and patches:
                assert isinstance(node, ast.Import)
                self.imported.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif kind is ast.ImportFrom and patches:
                assert isinstance(node, ast.ImportFrom)
                for alias in node.names:
                    self.imported.add(alias.asname or alias.name)
                    if node.module == "builtins" and alias.name in _SETATTR_NAMES:
                        self.setattr_names.add(alias.asname or alias.name)
            elif kind is ast.Subscript:
                assert isinstance(node, ast.Subscript)
                if type(node.ctx) is not ast.Load and self.is_target(node.slice):
                    if _namespace_like(node.value):  # x.__dict__[...], vars(x)[...]
                        return True
            elif kind is ast.Call:
                assert isinstance(node, ast.Call)
                func = node.func
                attr = func.attr if isinstance(func, ast.Attribute) else None
                if patches:
                    self.note_set_by_name(node, func, attr)
                if type(func) is ast.Name or attr in _CALLED_ATTRIBUTES:
                    for arg in node.args:
                        if self.is_target(arg) or self.dict_has_target_key(arg):
                            return True
                        if attr in _UPDATE_ATTRIBUTES and _has_forward_keyword(arg):
                            return True  # ns.update(dict(forward=f))
                    for keyword in node.keywords:  # setattr(m, name="forward"), attribute=...
                        if self.is_target(keyword.value):
                            return True
                    if attr in _COPYING_ATTRIBUTES and isinstance(func, ast.Attribute):
                        if self.copies_namespace(node, func):
                            return True
                    if attr in _UPDATE_ATTRIBUTES:
                        for keyword in node.keywords:
                            if keyword.arg in ENTRY_NAMES or self.dict_has_target_key(
                                keyword.value
                            ):
                                return True
                            if keyword.arg is None and _has_forward_keyword(keyword.value):
                                return True  # ns.update(**dict(forward=f))
            elif kind is ast.AugAssign:
                assert isinstance(node, ast.AugAssign)
                if self.dict_has_target_key(node.value) or _has_forward_keyword(node.value):
                    return True
            elif kind is ast.Assign:
                assert isinstance(node, ast.Assign)
                if _literal_str(node.value) in names or _dict_with_target_key(node.value, names):
                    self.constant_names.update(
                        t.id for t in node.targets if isinstance(t, ast.Name)
                    )
            elif kind is ast.AnnAssign:
                assert isinstance(node, ast.AnnAssign)
                if (
                    node.value is not None
                    and isinstance(node.target, ast.Name)
                    and (
                        _literal_str(node.value) in names
                        or _dict_with_target_key(node.value, names)
                    )
                ):
                    self.constant_names.add(node.target.id)
        if not self.constant_names.isdisjoint(self.names_in_key_positions):
            return True
        if not patches:
            return False
        for name, roots in self.named_setattr_roots.items():
            if name in self.setattr_names:
                self.patched_roots |= roots
        return not self.imported.isdisjoint(self.patched_roots)

    @staticmethod
    def add_root(roots: set[str], node: ast.expr) -> None:
        """Record the name an attribute chain (``torch.nn.utils``) starts from."""
        while isinstance(node, ast.Attribute):
            node = node.value
        if isinstance(node, ast.Name):
            roots.add(node.id)

    def note_set_by_name(self, call: ast.Call, func: ast.expr, attr: str | None) -> None:
        """HR005's setattr-like calls, more loosely than the rule (any receiver position)."""
        if not call.args:
            return
        if isinstance(func, ast.Name):
            self.add_root(self.named_setattr_roots.setdefault(func.id, set()), call.args[0])
        elif attr in _SETATTR_NAMES:
            self.add_root(self.patched_roots, call.args[0])
        elif attr in _DUNDER_SETATTR_NAMES:
            assert isinstance(func, ast.Attribute)
            self.add_root(self.patched_roots, func.value)
            self.add_root(self.patched_roots, call.args[0])


#: The interpreter's messages for sources it refuses because of a limit, not the grammar.
_LIMIT_MESSAGES: Final = ("too many nested parentheses", "too many levels of indentation",
                          "too many statically nested blocks")


def interpreter_limit(error: BaseException) -> InterpreterLimit | None:
    """``error`` (from compiling a source) as an :class:`InterpreterLimit`, if it is one.

    A ``MemoryError`` is not one: the parser raises it both for a stack overflow (deep
    nesting) and for a real lack of memory, so it propagates and the worker reports the file
    as over its budget (``HR998``), naming both causes.
    """
    if isinstance(error, MemoryError):
        raise error
    if isinstance(error, RecursionError):
        return InterpreterLimit(f"too deeply nested for the interpreter ({error})", 1, 1)
    if isinstance(error, SyntaxError) and error.msg in _LIMIT_MESSAGES:
        return InterpreterLimit(error.msg, error.lineno or 1, error.offset or 1)
    return None


def check_interpreter_limits(source: bytes, filename: str) -> None:
    """Raise :class:`InterpreterLimit` if the interpreter refuses ``source`` for a limit."""
    _syntax_ok(source, filename)


def _syntax_ok(source: bytes, filename: str) -> bool:
    """Whether the interpreter parses ``source``; cheaper than ``ast.parse`` (no AST objects).

    ``symtable`` runs the full parser and the symbol-table pass, which rejects a little more
    than the grammar (``nonlocal`` at module level); such files simply go on to libcst. It takes
    bytes like ``compile`` does, honouring the encoding declaration.

    Raises:
        InterpreterLimit: the interpreter refuses the source for a nesting limit.
    """
    try:
        symtable.symtable(cast(str, source), filename, "exec")
    except Exception as exc:  # noqa: BLE001 - SyntaxError, ValueError (NUL bytes), ...
        limit = interpreter_limit(exc)
        if limit is not None:
            raise limit from None
        return False
    return True


def needs_libcst(source: bytes, filename: str, *, patches: bool) -> bool:
    """Whether ``source`` may hold a finding (or a syntax error) and needs the libcst pass.

    ``False`` is a proof: no rule can fire and the file parses. ``True`` only means "look".

    Args:
        source: the file's bytes (encoding declarations are honoured).
        filename: for the parser's messages only.
        patches: HR005 (opt-in) is selected for this file and not switched off by a rewriter
            path, so the screen looks for process patches too. ``False`` screens for the
            forward gate alone: a file that only imports things is cleared by its text.

    Raises:
        InterpreterLimit: the interpreter refuses the source for a nesting limit; report it,
            do not hand it to libcst.
    """
    watch = _GATE_AND_PATCHES if patches else _GATE
    screened = source if source.isascii() else _normalized(source)
    if not _text_may_match(screened, watch):
        return not _syntax_ok(source, filename)
    if b"hyperrecipe" in screened and SUPPRESSION_HINT.search(screened):
        _syntax_ok(source, filename)  # raises for a limit
        return True  # suppression comments are invisible to ast; libcst checks them
    try:
        tree = ast.parse(source, filename)
    except Exception as exc:  # noqa: BLE001 - SyntaxError, ValueError, RecursionError, MemoryError
        limit = interpreter_limit(exc)
        if limit is not None:
            raise limit from None
        return True
    return _Screen(watch).found(tree)
