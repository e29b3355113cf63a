"""Sources that stress the screen: each is linted with and without it, findings must agree.

They are strings (not files) so that linting this repository does not lint them.
"""

from __future__ import annotations

TRICKY: dict[str, bytes] = {
    # HR005: patches of imported modules and classes, and a module's _apply
    "patch_after_late_import": b"def go(f):\n    torch.x = f\n\nimport torch\n",
    "patch_through_builtins_alias": b"from builtins import setattr as s\nimport torch\ns(torch, n, 1)\n",
    "patch_as_for_target": b"import torch\nfor torch.x in ys:\n    pass\n",
    "apply_escaped": b'object.__setattr__(m, "_appl\\x79", f)\n',
    "apply_split": b'setattr(m, "_ap" "ply", f)\n',
    "patch_of_local_named_like_module": b"import torch\ndef go(torch):\n    torch.x = 1\n",
    "module_metadata_reexport": b"from a import fn\nfn.__module__ = 'pkg'\n",
    "imports_but_patches_nothing": b"import torch\nself.x = torch.ones(1)\n",
    "call_impl_escaped": b'setattr(m, "_call_\\x69mpl", f)\n',
    "compiled_call_impl_split": b'setattr(m, "_compiled" "_call_impl", f)\n',
    "dunder_call_octal": b'setattr(Block, "__\\143all__", f)\n',
    "call_impl_keyword_update": b"vars(m).update(_call_impl=f)\n",
    "namespace_copy_with_aliased_vars": (
        b"from builtins import vars as v\nv(m).update(v(other))\n"
    ),
    "namespace_copy_unbound": b"dict.update(m.__dict__, other.__dict__)\n",
    "namespace_copy_into_ordinary_dict": b"state.update(other.__dict__)\n",
    "local_constant_in_method": (
        b'class A:\n    def go(self, m, f):\n        key = "forward"\n'
        b"        monkeypatch.setattr(m, name=key, value=f)\n"
    ),
    "bound_mapping_update": b'def go(m, f):\n    d = {"forward": f}\n    m.__dict__.update(d)\n',
    "patch_multiple_on_mocker": b"mocker.patch.multiple(m, forward=f)\n",
    "call_impl_read": b"out = m._call_impl(x)\nfn = type(m).__call__\n",
    "comment_between_dot_and_name": b"(m.  # a comment\n    forward) = f\n",
    "backslash_continuation": b"m. \\\n    forward = f\n",
    "tab_and_formfeed": b"m .\t\x0cforward = f\n",
    "crlf_newlines": b"x = 1\r\nm.forward = f\r\ny = 2\r\n",
    "no_trailing_newline": b"x = 1\nm.forward = f",
    "utf8_bom": b"\xef\xbb\xbfm.forward = f\n",
    "fullwidth_identifier": "m.ｆｏｒｗａｒｄ = f\n".encode(),
    "latin1_ordinal_a": b"# -*- coding: latin-1 -*-\nm.forw\xaard = f\n",
    "fullwidth_string_is_another_name": 'setattr(m, "ｆorward", f)\n'.encode(),
    "escaped_string": b'setattr(m, "\\u0066orward", f)\n',
    "octal_escape": b'm.__dict__["\\146orward"] = f\n',
    "named_escape": b'vars(m)["\\N{LATIN SMALL LETTER F}orward"] = f\n',
    "raw_string_escape_is_literal": b'setattr(m, r"\\x66orward", f)\n',
    "implicit_concatenation": b'setattr(m, ("for"\n    "ward"), f)\n',
    "plus_concatenation": b'm.__dict__["fo" + "rward"] = f\n',
    "concatenation_with_comment": b'setattr(m, ("forw"  # split\n    "ard"), f)\n',
    "class_concatenated": b'setattr(m, "__cl" "ass__", C)\n',
    "fstring_without_placeholders": b'setattr(m, f"forward", f)\n',
    "fstring_with_placeholder": b'setattr(m, f"{name}", f)\n',
    "module_constant": b'NAME = "forward"\n\ndef go(m, f):\n    setattr(m, NAME, f)\n',
    "module_constant_in_if": b'if True:\n    NAME = "forward"\nsetattr(m, NAME, f)\n',
    "constant_rebound_by_global": (
        b'NAME = "forward"\ndef f():\n    global NAME\n    NAME = "x"\nsetattr(m, NAME, f)\n'
    ),
    "constant_shadowed_by_comprehension": (
        b'NAME = "forward"\nout = [setattr(m, NAME, f) for NAME in ("a", "b")]\n'
    ),
    "alias_of_setattr": b'from builtins import setattr as put\nput(m, "forward", f)\n',
    "shadowed_setattr": b'def setattr(*a): pass\nsetattr(m, "forward", f)\n',
    "forward_called": b"y = m.forward(x)\nz = m.forward  (x)\n",
    "forward_item_store": b"m.forward[0] = 1\nm.forward.__doc__ = 'x'\n",
    "forward_in_docstring": b'"""Call m.forward.\n\nm.forward = f is forbidden."""\n',
    "forward_in_comment": b"# m.forward = f\nx = 1\n",
    "annotation_only": b"m.forward: Callable\n",
    "walrus_read": b"if (g := m.forward):\n    pass\n",
    "class_read": b"name = self.__class__.__name__\nt = {x.__class__}\n",
    "class_store_in_tuple": b"a, b.__class__ = 1, C\n",
    "for_target": b"for m.forward in fs:\n    pass\n",
    "with_target": b"with cm() as (a, m.forward):\n    pass\n",
    "comprehension_target": b"r = {k: v for k, m.forward in items}\n",
    "del_in_tuple": b"del (a, m.forward)\n",
    "suppressed": b"m.forward = f  # hyperrecipe: ignore[HR001] -- fixture\n",
    "suppressed_own_line": b"# hyperrecipe: ignore[HR001] -- fixture\nm.forward = f\n",
    "unused_suppression_only": b"x = 1  # hyperrecipe: ignore[HR001] -- stale\n",
    "suppression_in_string_only": b's = "# hyperrecipe: ignore[HR001] -- not a comment"\n',
    "header_comment_suppression": b"# hyperrecipe: ignore[HR002] -- header\nimport os\n",
    "update_keyword": b"vars(m).update(forward=f)\n",
    "update_dict_call": b"m.__dict__.update(dict(forward=f))\n",
    "update_star_dict_call": b"m.__dict__.update(**dict(forward=f))\n",
    "ior_dict_call": b"vars(m).__ior__  # read\nm.__dict__ |= dict(forward=f)\n",
    "patch_dict": b"from unittest import mock\nmock.patch.dict(m.__dict__, forward=f)\n",
    "ordinary_dict_update": b"config.update(forward=True)\nrecord(forward=1, backward=2)\n",
    "syntax_error": b"def f(:\n    pass\n",
    "syntax_error_without_trigger_words": b"x = (1,\n",
    "nul_byte": b"x = 1\x00\n",
    "python_312_type_alias": b"type Alias = int\nm.forward = f\n",
    "python_312_generic_function": b"def first[T](xs: list[T]) -> T:\n    return xs[0]\n",
    "nonlocal_at_module_level": b"nonlocal x\n",
    "deep_nesting": b"x = " + b"(" * 90 + b"1" + b")" * 90 + b"\n",
    "decorated_patch": (
        b'from unittest.mock import patch\n\n@patch.object(M, "forward")\ndef test(m):\n    pass\n'
    ),
    "super_setattr": (
        b'class A:\n    def f(self):\n        super().__setattr__("forward", self.g)\n'
    ),
    "module_level_match": (
        b'match x:\n    case 1:\n        NAME = "forward"\n    case _:\n        pass\n'
        b"setattr(m, NAME, f)\n"
    ),
    "patch_dict_copies_a_namespace": (
        b"from unittest import mock\n\ndef f(m, o):\n"
        b"    with mock.patch.dict(m.__dict__, o.__dict__):\n        pass\n"
    ),
    "patch_dict_copies_vars": b"from unittest import mock\nmock.patch.dict(m.__dict__, vars(o))\n",
    "namespace_copy_unbound_double_star": b"dict.update(m.__dict__, **vars(o))\n",
    "namespace_copy_from_a_method_call": b"m.__dict__.update(state._asdict())\n",
    "method_result_update": b"kw.setdefault('k', {}).update(kw.pop('j'))\nvars(m)\n",
    "instance_dunder_call_store": b"criteria.__call__ = compiled\n",
    "class_dunder_call_store": b"Criteria.__call__ = compiled\ntype(c).__call__ = compiled\n",
    "vars_inside_a_longer_word": b"env_vars.update(other_vars)\n",
    "split_prefix_of_call_impl": b'setattr(m, "_" "call_impl", f)\n',
    "quoted_non_prefix_pair": b'x = "fx" "ward"\ny = "_q" "x"\n',
    "empty_file": b"",
    "only_comments": b"# just a comment\n",
}
