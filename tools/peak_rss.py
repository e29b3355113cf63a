"""Peak anonymous RSS of this process, for the memory benchmarks (bench_loss, bench_memory).

``RssAnon`` of ``/proc/self/status`` is what the process allocated itself; file pages (an
mmapped safetensors file) are the page cache's and are left out. A thread samples it, so a
figure can only miss a peak, never invent one. Linux only; elsewhere every reading is 0.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path


def rss_anon() -> int:
    """This process's anonymous resident memory now, in bytes (0 where /proc is missing)."""
    status = Path("/proc/self/status")
    if not status.exists():
        return 0
    for line in status.read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    """The largest ``rss_anon()`` seen from construction until :meth:`stop`, sampled every
    ``interval_s`` seconds by a daemon thread."""

    def __init__(self, interval_s: float) -> None:
        self.peak = rss_anon()
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            time.sleep(self._interval_s)

    def stop(self) -> int:
        """Stop sampling; the peak in bytes (a last reading included)."""
        self._stop.set()
        self._thread.join()
        return max(self.peak, rss_anon())
