"""Every number a trainer logged, compared with one process's run.

A trainer's log lines carry losses and norms, and counters and rates gathered over the
ranks (``num_input_tokens_seen``, TRL's ``num_tokens``, ``total_flos``,
``*_per_second``). On an applied plan the model-parallel ranks hold copies of each batch, so
a counter gathered over the world counts it once per copy. These helpers compare every key
of every line: values to a tolerance, and rates, which are times and so never equal, by the
count they imply (``rate × {split}_runtime`` of the same line).
"""

from __future__ import annotations

from typing import Any

import pytest

__all__ = ["assert_same_logs"]

# a rate × the runtime rounded to 4 digits, itself rounded to 3 digits: the count it implies
# is known to a few parts in a thousand when the runtime is short
RATE_REL = 2e-2


def assert_same_logs(actual: list[dict[str, Any]], expected: list[dict[str, Any]], *,
                     rel: float = 1e-5, abs_: float = 1e-5,
                     not_compared: frozenset[tuple[int, str]] = frozenset()) -> None:
    """Each line of ``actual`` has the keys of the same line of ``expected`` and its values:
    plain numbers to ``rel``/``abs_``, ``X_per_second`` by ``X_per_second × {split}_runtime``
    to :data:`RATE_REL`; ``*_runtime`` itself is a wall time and is not compared, nor the
    ``(step, key)`` pairs named in ``not_compared`` (each caller says why)."""
    assert len(actual) == len(expected), (actual, expected)
    for line, (got, ref) in enumerate(zip(actual, expected, strict=True)):
        assert sorted(got) == sorted(ref), f"line {line}: keys {sorted(got)} != {sorted(ref)}"
        for key, value in ref.items():
            where = f"line {line} (step {ref.get('step')}): {key}"
            if key.endswith("_runtime") or (ref.get("step"), key) in not_compared:
                continue
            if key.endswith("_per_second"):
                runtime = f"{key.split('_', 1)[0]}_runtime"
                assert got[key] * got[runtime] == pytest.approx(
                    value * ref[runtime], rel=RATE_REL, abs=1e-3), (
                    f"{where}: {got[key]} x {got[runtime]} s against {value} x {ref[runtime]} s")
                continue
            assert got[key] == pytest.approx(value, rel=rel, abs=abs_), (
                f"{where}: {got[key]} against {value}")
