"""A module that no rule places, blamed under sequence parallelism, runs on this rank's tokens.

Sequence parallelism's rules cover the decoder layers, one final norm and the head. A model
may compute more on the residual stream between the layers and the head (HY-V4's and
DeepSeek-V4's hyper-connection head, which folds the parallel residual streams into one), and
such a module, outside every boundary, meets the stream sharded on the sequence: its
replicated parameters get partial gradients that nothing reduces. ``check`` names it (validate
mode refuses it by name; production's gradients of it differ) but no rule owns it, so there
was nothing to narrow. It is then taken as a token-local block, as the MoE blocks are: a local
region on this rank's tokens whose replicated parameters' gradients are all-reduced. Its rule
joins sequence parallelism's group, so a check that still fails on it gives sequence
parallelism up as a whole. Pure: reads the module tree and the rules.
"""

from __future__ import annotations

from collections.abc import Sequence

from hyperrecipe.model_tree import ModuleInfo
from hyperrecipe.recipe.patterns import compile_pattern
from hyperrecipe.suggest.rules import SuggestedRule
from hyperrecipe.suggest.sequence import SEQUENCE_GROUP

__all__ = ["token_local_unplaced"]

_ORDER = 10**9 + 10**6
"""After the sequence-parallel rules that :mod:`hyperrecipe.suggest.sequence` writes."""


def _under(fqn: str, root: str) -> bool:
    return fqn == root or fqn.startswith(root + ".")


def _sequence_layout(rules: Sequence[SuggestedRule]) -> object | None:
    """The stream's layout between blocks: what the first layer's boundary hands on."""
    for rule in rules:
        fields = dict(rule.fields)
        if rule.group == SEQUENCE_GROUP and fields.get("boundary") and "in_dst" in fields \
                and not fields.get("local_region"):
            return next(iter(dict(fields["out_src"]).values()), None)
    return None


def token_local_unplaced(blamed: str, rules: Sequence[SuggestedRule],
                         modules: Sequence[ModuleInfo]) -> SuggestedRule | None:
    """A local-region rule for the outermost module around ``blamed`` (a module or parameter
    FQN) that no rule reaches, or ``None``: no sequence parallelism, no such module, or one
    that takes token ids (an embedding) or holds no parameters.

    Args:
        blamed: what ``check`` named.
        rules: the rules checked.
        modules: every module of the checked model, concrete FQNs, parents first.
    """
    seq = _sequence_layout(rules)
    if seq is None:
        return None
    patterns = [compile_pattern(r.match) for r in rules]
    for m in modules:
        if not _under(blamed, m.fqn) or m.fqn == "":
            continue
        if any(p.fullmatch(m.fqn) for p in patterns):
            return None  # a rule places it or a block around it: that rule is to blame
        inside = [x for x in modules if _under(x.fqn, m.fqn)]
        if any(p.fullmatch(x.fqn) for p in patterns for x in inside):
            continue  # a rule reaches into it: not this one, perhaps a child
        if m.index_inputs or not any(x.params for x in inside) or not m.signature \
                or m.signature[0].kind in ("var_positional", "var_keyword"):
            return None
        arg = m.signature[0].name
        source = (f"deeper than the plan: sequence parallelism: {m.fqn} computes on the "
                  f"sequence-sharded stream outside every block (check named it): it runs on "
                  f"this rank's tokens and its parameters' gradients are all-reduced")
        fields = {"boundary": True, "local_region": True, "in_src": {arg: seq},
                  "in_dst": {arg: seq}, "out_src": {0: seq}}
        return SuggestedRule(match=m.fqn, fields=tuple(fields.items()), sources=(source,),
                             group=SEQUENCE_GROUP, deeper=True, order=_ORDER)
    return None
