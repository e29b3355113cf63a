"""The runtime: applying a plan to a live model on every rank.

What lives here: ``install.apply`` (checks, parameter sharding, head counts, boundary install, all in
one rewriter transaction), the boundary wrapper body shared by both modes (``boundary``), the
per-mode converters (``layouts``), method adapters for third-party code (``adapters``), moving
values between DTensor and local tensors (``marshal``), local kernels production needs (``compute``), shard layout
math (``sharding``), production collectives with their autograd duals (``collectives``) and the
``Installation`` handle. What does not: resolving recipes (the plan is final here) and any
direct assignment of ``forward`` (only :mod:`hyperrecipe.rewriter` does that).
"""

from hyperrecipe.runtime.install import Mode, apply
from hyperrecipe.runtime.installation import Installation, StatusRow

__all__ = ["Installation", "Mode", "StatusRow", "apply"]
