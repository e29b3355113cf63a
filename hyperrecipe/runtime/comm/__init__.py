"""Communication: the collectives production runs and the shard math under them.

Owns ``collectives`` (production collectives with their autograd duals, counted per step),
``sharding`` (shard layout math: slicing, sizes, chunked shards), ``gather_into`` (full tensors
gathered straight into their place, for ``sharding.gather_full``) and ``strided`` (DTensor's
``_StridedShard`` split on chunk boundaries for validate mode). It knows placements and process
groups, not modules, plans' boundaries or models: the rooms above call it.
"""
