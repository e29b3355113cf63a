"""Recipe features installed beside the boundaries: one module per feature.

Owns ``adapters`` (method and function adapters for third-party code), ``inner`` (inner
wrappers: fallback chains, hooks, the local-tensor edge), ``context_parallel`` (the built-in
context-parallel attention wrappers), ``multihead_attention`` (the built-in ``mha_heads``:
``torch.nn.MultiheadAttention`` on each rank's heads), ``local_region`` (boundaries that compute on local tensors in both modes),
``experts``, ``token_dispatch`` and ``reach`` (expert parallelism and keeping every rank's
backward in step) ``vocab_loss`` (the loss on vocab shards) and ``router_loss`` (a mixture-of-experts router
loss counted once under a plan that sums the routers' gradients). Features build on
:mod:`~hyperrecipe.runtime.forward` and :mod:`~hyperrecipe.runtime.comm`; they never move
training state (that is :mod:`~hyperrecipe.runtime.state`).
"""
