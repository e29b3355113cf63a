"""Training state in and out: the front, live parameters, weights, DCP checkpoints and export.

Owns ``front`` (``TrainingState``, reached as ``inst.state``: the one object that moves state
in and out: full and sharded state dicts, ``load_weights``, ``save_checkpoint`` /
``load_checkpoint``, ``save_pretrained`` and ``status``), ``live_params`` (``LiveParams``, the
view of the rank's shards every state path reads), ``checkpoint`` (the DTensor state dicts DCP
stores and their loading, optimizer state included), ``weights`` (loading a checkpoint's slices
as a chain of strategies, and checking an export's folder against its manifest),
``checkpoint_files`` (each weight file checked against its own structure: a safetensors header
against the file's bytes, a ``pytorch_model.bin``'s storages against their zip records),
``dcp_reader`` (reading DCP folders as data; it only reads), ``integrity`` (the one module for
digests, commit records, manifests and atomic writes: the export manifest's digest and shape,
the DCP commit record and its sampled fingerprints, the committed ``dcp.save``, the source
digest the ranks compare, ``replace_text`` / ``sync_folder``), ``folder_lock`` (one writer per
folder: the lock ``save_checkpoint`` and ``save_pretrained`` hold while they write),
``folder_switch`` (a new state written into a staging folder and switched in for the old one
in one step, so a failed or killed save leaves the old state whole),
``state_hooks`` (the model's and optimizer's state-dict hooks for torch's own DCP APIs),
``scoped_hooks`` (torch's global optimizer hooks scoped to one installation's optimizers),
``export`` (consolidated safetensors for ``from_pretrained``), ``direct_write`` (ranks on the
writer's host writing their own blocks into its file) and ``materialize`` (allocating the
rank's shards after a meta apply, and keeping non-persistent buffers' values through a later
``to_empty``). The ranks' agreements (entry checks, digests, outcomes) live in
:mod:`hyperrecipe.runtime.preflight.agreement`; key conversions of third-party checkpoint
formats live in :mod:`hyperrecipe.models`. Nothing here installs a forward.
"""
