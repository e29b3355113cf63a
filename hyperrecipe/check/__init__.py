"""Multi-rank validation against a single-process reference.

This package runs a plan on real process groups and compares what every rank computes (forward
outputs and gradients) with the same model run in one process, reporting the first boundary that
diverges. :mod:`hyperrecipe.check.launcher` starts the ranks (forked or spawned processes on one
host, gloo on CPU, NCCL when there is a GPU per rank) and turns a failing or hanging rank into a
:class:`~hyperrecipe.check.launcher.RankFailedError`. Nothing here is used on a training hot path,
and importing this package imports nothing heavy: import the submodules you need.
"""
