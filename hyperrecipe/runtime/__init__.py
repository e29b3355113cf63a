"""Everything that touches a live model: applying a plan, sharded parameters, boundary wrappers
and the autograd-aware production collectives (:mod:`hyperrecipe.runtime.collectives`).

Placeholder: the package namespace is owned by ``apply()`` and is filled in with it.
"""
