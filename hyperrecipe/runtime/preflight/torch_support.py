"""Which torch releases the runtime runs on, checked where a plan is applied.

torch is an extra (``hyperrecipe[torch]``, ``[hf]``), not a core dependency: the lint and the
recipe loader never import it, and users bring their own build. So pip checks our range only
when it installs torch itself; a torch already in the environment is never compared with it.
Older DTensor releases do not always fail loudly or for the right reason (on torch 2.6 validate
mode reports a sharded input as "arrived replicate" at the first boundary), so :func:`apply
<hyperrecipe.runtime.install.apply>` refuses a torch older than :data:`MIN_TORCH` before it
touches the model. The bound is the oldest release the whole test-suite has passed on; the
extras in ``pyproject.toml`` declare the same one (``tests/test_packaging.py`` keeps them equal).
"""

from __future__ import annotations

import re
from typing import Final

from hyperrecipe.errors import UnsupportedTorchError

__all__ = ["MIN_TORCH", "require_supported_torch", "torch_release"]

#: The oldest torch release (major, minor) the runtime is tested on.
MIN_TORCH: Final = (2, 13)

_RELEASE: Final = re.compile(r"(\d+)\.(\d+)")


def torch_release(version: str) -> tuple[int, int] | None:
    """``(major, minor)`` of a torch version string (``2.13.0+cpu``, ``2.16.0a0+git1a2b``,
    ``2.15.0.dev20261201``), or ``None`` when it does not start with one."""
    match = _RELEASE.match(version)
    return (int(match.group(1)), int(match.group(2))) if match else None


def require_supported_torch(version: str | None = None) -> None:
    """Refuse a torch older than :data:`MIN_TORCH` (``version`` defaults to the installed one's).

    A version string that does not parse (a custom build) is let through: refusing a build we
    cannot read would block users whose torch is new enough.

    Raises:
        UnsupportedTorchError: the release is older than :data:`MIN_TORCH`.
    """
    if version is None:
        import torch

        version = str(torch.__version__)
    found = torch_release(version)
    if found is None or found >= MIN_TORCH:
        return
    need = ".".join(map(str, MIN_TORCH))
    msg = (f"hyperrecipe's runtime needs torch >= {need}; this environment has torch {version}. "
           f"Older DTensor releases lay out and redistribute shards differently, and some of "
           f"the differences would not raise. Install a newer torch (pip install "
           f"'torch>={need}'); compiling and linting recipes do not need it")
    raise UnsupportedTorchError(msg)
