"""The forward path: the boundary wrapper body both modes share, and what it calls per call.

Owns ``boundary`` (the wrapper body), ``arguments`` (finding declared inputs and outputs),
``layouts`` (the per-mode converters the wrapper is built with), ``validate_scope`` (what a
validate-mode compute runs under), ``grad_layouts`` (validate mode's check of how a gradient
arrives at a declared input or output against the plan's backward collective), ``marshal``
(moving values between DTensor and local tensors) and ``compute`` (the local kernels production needs). It does not assign ``forward`` (the
rewriter does) and does not know features such as experts or the vocab loss.
"""
