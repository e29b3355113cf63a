"""Communication: the collectives production runs and the shard math under them.

Owns ``collectives`` (production collectives with their autograd duals, counted per step),
``sharding`` (shard layout math: slicing, sizes, chunked shards), ``gather_into`` (full tensors
gathered straight into their place, for ``sharding.gather_full``, or sent to one writing rank
alone for an export), ``strided`` (DTensor's
``_StridedShard`` split on chunk boundaries for validate mode), ``dtensor_parameters``
(validate mode's parameters as DTensors with the plan's placement) and ``dtensor_rules``
(DTensor sharding rules for ops torch ships without one, registered by validate mode's
``apply``), and ``shared_table`` (install-time objects many boundaries share, kept once and
read by index). It knows placements and process groups, not modules, plans' boundaries or models:
the rooms above call it.
"""
