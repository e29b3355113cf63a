"""Preflight: what ``apply`` checks before it touches the model.

Owns ``plan_fit`` (an edited plan's names, shapes and shard dims against the live model),
``agreement`` (the ranks' fixed-size exchanges and the vote, each with a bounded wait),
``torch_support`` (the oldest torch the runtime runs on) and ``randomness`` (that the ranks of a
model-parallel group draw the same dropout, checked once at the first training forward). Nothing here installs a forward or
moves a tensor; a failure here leaves the model exactly as it was.
"""
