"""Communication: the collectives production runs and the shard math under them.

Owns ``collectives`` (production collectives with their autograd duals, counted per step),
``sharding`` (shard layout math: slicing, sizes, chunked shards) and ``strided`` (DTensor's
``_StridedShard`` split on chunk boundaries for validate mode) and ``dtensor_rules`` (DTensor
sharding rules for ops torch ships without one, registered by validate mode's ``apply``). It knows placements and process
groups, not modules, plans' boundaries or models: the rooms above call it.
"""
