"""The world the verification step runs in: the fake process group, or the job's own.

``compile`` on the command line, ``compile_recipe`` before ``init_process_group`` and
``suggest`` have no process group: the step makes torch's fake one (``init_process_group(
"fake")``: collectives return at once) and a ``cpu`` mesh of the plan's shape (validate mode's
DTensors need a device type with a device module: DTensor's cost model asks it for the devices
per host; ``meta`` has none), and tears both down after.

A trainer that compiles on its ranks, or applies a plan no one verified, already has a group,
and a process holds one default group at a time. There the step runs on the job's own mesh
(``apply``'s) or on one made over the job's group (a plan for one replica of a larger job: one
mesh per replica), as ``apply`` itself does: every rank of the job verifies together, the same
step on the same shapes. Either way the model is a meta copy
and its shards stay on the meta device (:func:`~hyperrecipe.runtime.state.materialize.
shards_on_meta`), and a collective on meta tensors returns without communicating, real group or
fake: the only values exchanged are ``apply``'s own agreement digests.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING

from hyperrecipe.errors import UsageError
from hyperrecipe.plan import Plan

if TYPE_CHECKING:  # pragma: no cover
    from torch.distributed.device_mesh import DeviceMesh

__all__ = ["verification_world"]


@contextlib.contextmanager
def verification_world(plan: Plan, mesh: DeviceMesh | None = None) -> Iterator[DeviceMesh]:
    """A mesh of the plan's shape to run the step on, with shards kept on the meta device.

    Args:
        plan: the plan (its mesh names and sizes).
        mesh: the job's mesh, when ``apply`` verifies (used as it is).

    Raises:
        UsageError: this process has a process group whose world the plan's mesh does not
            divide (compile in a process of its own, ``hyperrecipe compile``).
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrecipe.runtime import shards_on_meta

    shape = plan.mesh_shape
    world = math.prod(shape.values())
    with shards_on_meta():
        if not dist.is_initialized():
            dist.init_process_group("fake", rank=0, world_size=world)
            try:
                yield init_device_mesh("cpu", tuple(shape.values()), mesh_dim_names=tuple(shape))
            finally:
                dist.destroy_process_group()
            return
        if mesh is not None:
            yield mesh
            return
        size = dist.get_world_size()
        if size % world:
            here = ",".join(f"{k}={v}" for k, v in shape.items())
            msg = (f"verification runs the plan's step on this job's process group, whose "
                   f"{size} ranks the plan's mesh {here} ({world} ranks) does not divide: "
                   f"compile it in a process of its own (`hyperrecipe compile ... -o plan.json`, "
                   f"or compile_recipe before init_process_group), or pass verify=False at "
                   f"your own risk")
            raise UsageError(msg)
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        if size == world:
            yield init_device_mesh(device, tuple(shape.values()), mesh_dim_names=tuple(shape))
            return
        # a plan for one replica in a larger job (its data dims left to FSDP or DDP): each
        # replica verifies on its own ranks, every rank of the job together
        whole = init_device_mesh(device, (size // world, *shape.values()),
                                 mesh_dim_names=(_REPLICAS, *shape))
        yield whole[tuple(shape)]


_REPLICAS = "hyperrecipe_verification_replicas"
