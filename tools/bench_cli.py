"""Time what a user waits for in ``hyperrecipe check``: the first line, the verdict, the exit.

Runs a command (default: the README's ``hyperrecipe check`` example) as a child process, stamps
every line it writes on stdout or stderr with the seconds since the child was started, and
reports three times per run: the first line of output (any stream), the verdict line
(``all modes agree ...`` / ``diverged: ...``) and the process's exit. The gap between the last
two is what the interpreter's teardown costs. Figures are in ``docs/benchmarks.md``.

Usage::

    python tools/bench_cli.py [--runs 3] [--json OUT] [-- COMMAND ...]
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[1]
README_CHECK = ["hyperrecipe", "check", "recipes/llama.yaml", "--model", "hf:llama",
                "--model-config", "recipes/models/tiny-llama.json", "--mesh", "tp=2"]
VERDICTS = ("all modes agree", "diverged:")


def _pump(stream: IO[str], name: str, out: queue.Queue[tuple[float, str, str]]) -> None:
    for line in stream:
        out.put((time.perf_counter(), name, line.rstrip("\n")))


def time_once(command: list[str], *, echo: bool,
              verdicts: tuple[str, ...] = VERDICTS) -> dict[str, float | None]:
    """Run ``command`` once; return the first-line, verdict and exit times (seconds)."""
    lines: queue.Queue[tuple[float, str, str]] = queue.Queue()
    t0 = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, bufsize=1)
    assert proc.stdout is not None and proc.stderr is not None
    pumps = [threading.Thread(target=_pump, args=(s, n, lines), daemon=True)
             for s, n in ((proc.stdout, "out"), (proc.stderr, "err"))]
    for p in pumps:
        p.start()
    code = proc.wait()
    t_exit = time.perf_counter() - t0
    for p in pumps:
        p.join()
    first = verdict = None
    while not lines.empty():
        t, name, text = lines.get()
        t -= t0
        first = t if first is None else min(first, t)
        if verdict is None and text.startswith(verdicts):
            verdict = t
        if echo:
            print(f"{t:7.2f} {name} {text}")
    return {"first_line_s": first, "verdict_s": verdict, "exit_s": t_exit, "exit_code": code}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--json", help="write the runs here")
    parser.add_argument("--quiet", action="store_true", help="do not echo the stamped lines")
    parser.add_argument("--verdict", action="append", metavar="PREFIX",
                        help="a line starting with PREFIX is the verdict (default: check's)")
    parser.add_argument("command", nargs="*", help="the command (after --); default README check")
    args = parser.parse_args()
    command = args.command or README_CHECK
    print(f"command: {' '.join(command)}  (load average {os.getloadavg()[0]:.1f}, "
          f"{os.cpu_count()} cores)")
    verdicts = tuple(args.verdict) if args.verdict else VERDICTS
    runs = [time_once(command, echo=not args.quiet, verdicts=verdicts) for _ in range(args.runs)]
    for i, r in enumerate(runs):
        gap = (r["exit_s"] - r["verdict_s"]) if r["verdict_s"] is not None else None  # type: ignore[operator]
        print(f"run {i}: first line {r['first_line_s']:.2f} s, verdict "
              f"{r['verdict_s'] if r['verdict_s'] is None else round(r['verdict_s'], 2)} s, exit "
              f"{r['exit_s']:.2f} s, exit after verdict {gap if gap is None else round(gap, 2)} s, "
              f"code {r['exit_code']}")
    exits = [r["exit_s"] for r in runs if r["exit_s"] is not None]
    print(f"median exit {statistics.median(exits):.2f} s over {len(runs)} run(s)")  # type: ignore[type-var]
    if args.json:
        Path(args.json).write_text(json.dumps({"command": command, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
