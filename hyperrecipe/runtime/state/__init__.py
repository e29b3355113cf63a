"""Training state in and out: live parameters, weights, DCP checkpoints and export.

Owns ``checkpoint`` (``LiveParams``, the view of the rank's shards every state path reads, and
the DTensor state dicts DCP stores), ``weights`` (loading a checkpoint's slices as a chain of
strategies), ``state_hooks`` (the model's and optimizer's state-dict hooks for torch's own DCP
APIs), ``export`` (consolidated safetensors for ``from_pretrained``) and ``materialize``
(allocating the rank's shards after a meta apply, and keeping non-persistent
buffers' values through a later ``to_empty``). Key conversions of third-party checkpoint
formats live in :mod:`hyperrecipe.integrations`. Nothing here installs a forward.
"""
