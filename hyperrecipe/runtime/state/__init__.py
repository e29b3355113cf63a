"""Training state in and out: live parameters, weights, DCP checkpoints and export.

Owns ``checkpoint`` (``LiveParams``, the view of the rank's shards every state path reads, and
the DTensor state dicts DCP stores), ``weights`` (loading a checkpoint's slices as a chain of
strategies), ``checkpoint_files`` (each weight file checked against its own structure: a
safetensors header against the file's bytes, a ``pytorch_model.bin``'s storages against their
zip records), ``state_hooks`` (the model's and optimizer's state-dict hooks for torch's own DCP
APIs), ``export`` (consolidated safetensors for ``from_pretrained``), ``direct_write`` (ranks on the
writer's host writing their own blocks into its file), ``file_digest`` (the
export manifest's digest and shape) and ``materialize``
(allocating the rank's shards after a meta apply, and keeping non-persistent
buffers' values through a later ``to_empty``), ``dcp_reader`` (DCP's ``.metadata`` read in
bounded time and memory, and the commit record of a DCP folder) and ``scoped_hooks`` (torch's global
optimizer step pre-hooks, held weakly so they live as long as the model they serve). Key conversions of third-party checkpoint
formats live in :mod:`hyperrecipe.models`. Nothing here installs a forward.
"""
