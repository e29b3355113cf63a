"""The screen (text + ``ast``) never changes findings; ``locate`` matches PositionProvider.

The fast path skips libcst for files the screen clears. These tests run the same trees with
and without the screen and require identical findings: on hand-made tricky cases and on the
installed ``torch/distributed`` package (the slow tests, ~10 s each). The screen follows the
selection: with the opt-in HR005 unselected (the default) it must clear what it cleared before
HR005 existed; with HR005 selected it must still never hide one of its findings.
"""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest
from libcst.metadata import MetadataWrapper, PositionProvider

from hyperrecipe.lint import prefilter
from hyperrecipe.lint.codes import DEFAULT_SELECTION
from hyperrecipe.lint.prefilter import needs_libcst
from hyperrecipe.lint.rule import FileContext, StatementPath
from hyperrecipe.lint.runner import lint_paths
from tests.lint.tricky_cases import TRICKY

# Tabs, mixed widths, a continuation line, a multi-line string with code after it, block footers
ODD_INDENTS = (
    b"class A:\n\tdef f(self):\n\t\ty = (1,\n  2)\n\t\tz = \"\"\"a\nb\"\"\" + c\n\t# tail\n"
    b"\tdef g(self): return 1\n\n    # odd indent comment\nclass B:\n  @d\n  def h(self):\n"
    b"      pass"
)
TORCH_DISTRIBUTED = Path(pytest.importorskip("torch").__file__).parent / "distributed"
#: The default selection and HR005 (opt-in): the selection this repository lints itself with.
WITH_PROCESS_PATCH = [*sorted(DEFAULT_SELECTION), "HR005"]
#: The tricky cases only HR005 flags (so none of them is flagged by default).
PROCESS_PATCH_CASES = {"patch_after_late_import", "patch_through_builtins_alias",
                       "patch_as_for_target", "apply_escaped", "apply_split"}


def _both(paths: list[str], jobs: int, select: list[str] | None = None) -> tuple[object, object]:
    screened = lint_paths(paths, jobs=jobs, select=select)
    full = lint_paths(paths, jobs=jobs, screen=False, select=select)
    return screened, full


@pytest.mark.parametrize("select", [None, WITH_PROCESS_PATCH], ids=["default", "with-HR005"])
def test_tricky_cases_give_identical_findings_with_and_without_the_screen(
    tmp_path: Path, select: list[str] | None
) -> None:
    for name, source in TRICKY.items():
        (tmp_path / f"{name}.py").write_bytes(source)
    screened, full = _both([str(tmp_path)], jobs=2, select=select)
    assert screened.findings == full.findings  # type: ignore[attr-defined]
    assert full.libcst_files == len(TRICKY)  # type: ignore[attr-defined]
    assert screened.libcst_files < full.libcst_files  # type: ignore[attr-defined]
    flagged = {Path(f.path).stem for f in screened.findings}  # type: ignore[attr-defined]
    if select is None:
        assert not flagged & PROCESS_PATCH_CASES
    else:
        assert PROCESS_PATCH_CASES <= flagged
    assert {"comment_between_dot_and_name", "latin1_ordinal_a", "escaped_string",
            "class_concatenated", "module_constant", "alias_of_setattr", "update_dict_call",
            "python_312_type_alias", "syntax_error_without_trigger_words", "nul_byte",
            "unused_suppression_only", "decorated_patch", "module_level_match",
            "call_impl_escaped", "compiled_call_impl_split", "dunder_call_octal",
            "call_impl_keyword_update", "namespace_copy_with_aliased_vars",
            "namespace_copy_unbound", "local_constant_in_method", "bound_mapping_update",
            "patch_multiple_on_mocker", "patch_dict_copies_a_namespace",
            "patch_dict_copies_vars", "namespace_copy_unbound_double_star",
            "class_dunder_call_store", "split_prefix_of_call_impl"} <= flagged
    assert not flagged & {"fullwidth_string_is_another_name", "raw_string_escape_is_literal",
                          "namespace_copy_into_ordinary_dict", "call_impl_read",
                          "shadowed_setattr", "forward_called", "forward_item_store",
                          "forward_in_docstring", "annotation_only", "class_read",
                          "constant_rebound_by_global", "constant_shadowed_by_comprehension",
                          "suppressed", "suppressed_own_line", "ordinary_dict_update",
                          "suppression_in_string_only", "python_312_generic_function",
                          "empty_file", "namespace_copy_from_a_method_call",
                          "method_result_update", "instance_dunder_call_store",
                          "vars_inside_a_longer_word", "quoted_non_prefix_pair",
                          "patch_of_local_named_like_module", "module_metadata_reexport",
                          "imports_but_patches_nothing"}


def _rows(result: object) -> list[tuple[str, int, str]]:
    return [
        # shown relative to the working directory when inside it (the README's `.venv` is)
        (Path(f.path).absolute().relative_to(TORCH_DISTRIBUTED).as_posix(), f.line, f.code)
        for f in result.findings  # type: ignore[attr-defined]
    ]


TORCH_GATE_FINDINGS = [
    ("_composable/replicate.py", 248, "HR004"),
    ("fsdp/_fully_shard/_fsdp_init.py", 430, "HR004"),
    ("pipelining/_IR.py", 628, "HR001"),
    ("pipelining/_IR.py", 1240, "HR001"),
    ("pipelining/_IR.py", 1242, "HR001"),
]


@pytest.mark.slow  # lints all of the installed torch.distributed (docs/benchmarks.md#test-suite)
def test_torch_distributed_has_exactly_its_three_forward_assignments_and_two_class_swaps() -> None:
    """By default (HR005 unselected) the screen is the one from before HR005: only the files
    with a finding, and a few it cannot clear, reach libcst — not the files that merely patch
    something they imported."""
    # the default selection named, so that a pyproject above the installed torch (the README's
    # venv inside this repository, which selects HR005) does not choose for the test
    screened, full = _both([str(TORCH_DISTRIBUTED)], jobs=2, select=sorted(DEFAULT_SELECTION))
    assert screened.findings == full.findings  # type: ignore[attr-defined]
    assert _rows(screened) == TORCH_GATE_FINDINGS
    assert screened.libcst_files <= 10  # type: ignore[attr-defined]


@pytest.mark.slow  # libcst over the ~20 files of torch.distributed that patch (~95 s)
def test_torch_distributed_with_process_patch_selected_finds_torch_own_patches() -> None:
    """torch patches its own modules (HR005: ``sys.excepthook``, DTensor's dispatcher flags...)
    as is its right; where HR005 is selected those findings go through the screen like the
    others, and only the files that hold a finding (about twenty) reach libcst."""
    screened, full = _both([str(TORCH_DISTRIBUTED)], jobs=2, select=WITH_PROCESS_PATCH)
    assert screened.findings == full.findings  # type: ignore[attr-defined]
    rows = _rows(screened)
    assert [row for row in rows if row[2] != "HR005"] == TORCH_GATE_FINDINGS
    patched = {path for path, _, code in rows if code == "HR005"}
    assert {"distributed_c10d.py", "tensor/experimental/__init__.py"} <= patched
    assert screened.libcst_files <= len(patched) + 5  # type: ignore[attr-defined]


def test_unselected_process_patch_adds_no_ast_walk_for_a_file_that_only_imports(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The word ``import`` alone sends a file to the ``ast`` screen only where HR005 is
    selected; the patch itself is no finding of the default rules, so the text clears it."""
    parsed: list[str] = []
    parse = prefilter.ast.parse

    def counting_parse(source: bytes, filename: str) -> object:
        parsed.append(filename)
        return parse(source, filename)

    monkeypatch.setattr(prefilter.ast, "parse", counting_parse)
    imports = b"import torch\nfrom os import path\nx = torch.ones(1)\n"
    patches = b"import torch\ntorch.nn.utils.clip_grad_norm_ = f\nm._apply = g\n"
    assert not needs_libcst(imports, "imports.py", patches=False)
    assert not needs_libcst(patches, "patches.py", patches=False)
    assert parsed == []
    assert not needs_libcst(imports, "imports.py", patches=True)
    assert needs_libcst(patches, "patches.py", patches=True)
    assert parsed == ["imports.py", "patches.py"]


@pytest.mark.slow  # screens all of torch.distributed twice (~5 s)
def test_every_file_the_default_screen_sends_to_libcst_the_process_patch_screen_sends() -> None:
    """Selecting HR005 only widens the screen: on ``torch/distributed``, every file the default
    screen cannot clear is one the wider screen cannot clear either."""
    narrow, wide = set(), set()
    for path in sorted(TORCH_DISTRIBUTED.rglob("*.py")):
        source = path.read_bytes()
        if needs_libcst(source, str(path), patches=False):
            narrow.add(path)
        if needs_libcst(source, str(path), patches=True):
            wide.add(path)
    assert narrow <= wide
    assert len(narrow) <= 10 < len(wide)


def _every_node_with_its_path(module: cst.Module) -> list[tuple[cst.CSTNode, StatementPath]]:
    """Every node, with the statement path the engine would record for it."""
    found: list[tuple[cst.CSTNode, StatementPath]] = []

    def collect(node: cst.CSTNode, path: StatementPath, skip: set[int]) -> None:
        class Collect(cst.CSTVisitor):
            def on_visit(self, inner: cst.CSTNode) -> bool:
                if id(inner) in skip:
                    return False
                found.append((inner, path))
                return True

        node.visit(Collect())

    def statement(node: cst.CSTNode, path: tuple[int, ...]) -> None:
        if isinstance(node, (cst.ClassDef, cst.FunctionDef)) and isinstance(
            node.body, cst.IndentedBlock
        ):
            inner = node.body.body
            collect(node, path, {id(s) for s in inner})
            for index, child in enumerate(inner):
                statement(child, (*path, index))
        else:
            collect(node, path, set())

    for index, top in enumerate(module.body):
        statement(top, (index,))
    for line in (*module.header, *module.footer):
        collect(line, None, set())
    return found


@pytest.mark.parametrize(
    "source",
    [
        (TORCH_DISTRIBUTED / "pipelining" / "_IR.py").read_bytes(),
        TRICKY["crlf_newlines"],
        TRICKY["no_trailing_newline"],
        b"# header\n\n# more\nclass A:\n    def f(self):\n        x = 1  # c\n\n\n# footer\n",
        ODD_INDENTS,
    ],
    ids=["torch-_IR", "crlf", "no-trailing-newline", "header-and-footer", "odd-indents"],
)
@pytest.mark.slow  # single-process but over 2 s on a quiet machine (docs/benchmarks.md#test-suite)
def test_locate_gives_exactly_the_positions_of_the_full_provider(source: bytes) -> None:
    module = cst.parse_module(source)
    expected = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    nodes = _every_node_with_its_path(module)
    located = FileContext(module).locate(nodes)
    assert len(located) > 0
    mismatches = [
        (type(n).__name__, located[n], expected[n]) for n, _ in nodes if located[n] != expected[n]
    ]
    assert mismatches == []


def test_the_screen_walk_visits_every_node_ast_walk_does_but_contexts_and_operators() -> None:
    """The ``ast`` screen walks with its own loop; it must miss no node that can hold a shape."""
    import ast

    from hyperrecipe.lint.prefilter import _nodes

    leaves = (ast.expr_context, ast.operator, ast.cmpop, ast.unaryop, ast.boolop)
    for path in [Path(ast.__file__), TORCH_DISTRIBUTED / "pipelining" / "_IR.py"]:
        tree = ast.parse(path.read_bytes())
        expected = [id(n) for n in ast.walk(tree) if not isinstance(n, leaves)]
        walked = [id(n) for n in _nodes(tree)]
        assert sorted(walked) == sorted(expected)
        assert len(walked) == len(set(walked))


@pytest.mark.parametrize("source", [ODD_INDENTS, *TRICKY.values()],
                         ids=["odd_indents", *TRICKY])
def test_the_engine_walk_finds_the_children_libcst_does(source: bytes) -> None:
    """The engine walks the tree itself (libcst's ``visit`` rebuilds every node): it must reach
    exactly the nodes libcst's ``children`` gives, at every node."""
    try:
        module = cst.parse_module(source)
    except Exception:  # noqa: BLE001 - the syntax-error cases
        return
    _assert_same_children(module)


def test_the_engine_walk_finds_the_children_libcst_does_on_a_real_file() -> None:
    source = (TORCH_DISTRIBUTED / "pipelining" / "_IR.py").read_bytes()
    assert _assert_same_children(cst.parse_module(source)) > 10_000


def _assert_same_children(module: cst.Module) -> int:
    from hyperrecipe.lint.engine import children

    pending: list[cst.CSTNode] = [module]
    seen = 0
    while pending:
        node = pending.pop()
        ours = children(node)
        assert sorted(map(id, ours)) == sorted(map(id, node.children)), type(node).__name__
        pending.extend(ours)
        seen += 1
    return seen
