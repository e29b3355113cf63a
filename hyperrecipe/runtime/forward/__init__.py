"""The forward path: the boundary wrapper body both modes share, and what it calls per call.

Owns ``boundary`` (the wrapper body), ``arguments`` (finding declared inputs and outputs),
``layouts`` (the per-mode converters the wrapper is built with), ``validate_scope`` (what a
validate-mode compute runs under), ``grad_layouts`` (validate mode's check of how a gradient
arrives at a declared input or output against the plan's backward collective), ``marshal``
(moving values between DTensor and local tensors), ``compute`` (the local kernels production
needs), and validate mode's checks along the way: ``backward_scope`` (naming the boundary whose
backward meets an op DTensor cannot shard), ``handed_back`` (the sharded local tensors handed
back to the model's own code), ``input_grads`` (a declared replicated input's gradient, use by
use), ``outside_params`` (replicated parameters outside every boundary), ``plain_tensors``
(plain tensors the model makes inside a boundary, where they meet DTensors) and
``unwrapped_params`` (a forward that unwraps a sharded DTensor parameter itself). It does not
assign ``forward`` (the rewriter does) and does not know features such as experts or the vocab
loss.
"""
