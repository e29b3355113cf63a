"""A world where the fake process group can be the default group.

``init_process_group("fake")`` needs a process without a default group. ``compile`` on the
command line, ``compile_recipe`` before ``init_process_group`` and ``suggest`` have none, and
run in this process. A trainer that compiles on its ranks, or applies a plan no one verified,
already has one: the step then runs in a forked child, whose copy of torch's process-group
registry is replaced by an empty one (``distributed_c10d._world``, torch's documented
extension point for that registry) before it makes its own. The child shares nothing back but
its findings as JSON; the parent's group, model and every process-wide state stay untouched.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from typing import Any

from hyperrecipe.errors import UsageError

__all__ = ["in_fake_world"]


def in_fake_world(fn: Callable[[], Any]) -> Any:
    """``fn()`` (returning JSON-able data) where this process may make the fake default group.

    Raises:
        UsageError: a process group exists and this platform cannot fork (compile before
            ``init_process_group``, or pass ``verify=False``).
        Whatever ``fn`` raised (in the forked child: a ``HyperrecipeError`` of the same text).
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        return fn()
    if not hasattr(os, "fork"):
        msg = ("verification runs its own fake process group and this process already has one, "
               "and this platform cannot fork: compile the plan before init_process_group "
               "(`hyperrecipe compile -o plan.json`), or pass verify=False at your own risk")
        raise UsageError(msg)
    return _in_forked_child(fn)


def _in_forked_child(fn: Callable[[], Any]) -> Any:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child; its result is asserted through the parent
        os.close(read_end)
        code = 0
        try:
            from torch.distributed import distributed_c10d

            distributed_c10d._world = distributed_c10d._World()
            payload = {"result": fn()}
        except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent
            payload = {"error": type(exc).__name__, "message": str(exc)}
            code = 1
        data = json.dumps(payload).encode()
        with os.fdopen(write_end, "wb") as out:
            out.write(data)
        os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as inp:
        data = inp.read()
    os.waitpid(pid, 0)
    try:
        payload = json.loads(data.decode() or "{}")
    except ValueError:
        payload = {}
    if "result" in payload:
        return payload["result"]
    from hyperrecipe.errors import HyperrecipeError

    detail = payload.get("message") or "the verification child died without a word"
    raise HyperrecipeError(f"verification failed in its forked child: "
                           f"{payload.get('error', 'exit')}: {detail}")
