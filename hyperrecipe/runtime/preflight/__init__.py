"""Preflight: what ``apply`` checks before it touches the model.

Owns ``plan_fit`` (an edited plan's names, shapes and shard dims against the live model),
``agreement`` (every agreement between the ranks, each with a bounded wait: the plan
agreement and the vote around ``apply``, and for the training state the entry check of a
gathering call, the digest of a checkpoint about to be read, each rank's outcome of a step
and the meeting at a training loop's end),
``torch_support`` (the oldest torch the runtime runs on), and what is checked once at the first
training forward, when there is a batch: ``batches`` (that the ranks of a model-parallel group
were handed the same batch) and ``randomness`` (that they draw the same dropout), judged from one
bounded exchange by ``first_forward``'s one hook. Nothing here installs a forward or moves a
tensor; a failure here leaves the model exactly as it was.
"""
