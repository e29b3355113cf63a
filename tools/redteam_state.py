"""Issue 41's red-team findings, rerun as one harness: each case held or broken, then ``N/M held``.

Every finding of the state red team (round 4: kills at precise points, injected I/O errors,
concurrent writers and readers, forged chunk metadata, FIFO swaps, long strings, unreadable
folders) is reproduced by tests of the suite against real files, real gloo ranks, real DCP and
real transformers. This runs them grouped by finding, each case in a fresh interpreter under a
wall-clock bound (a hang is a broken case, not a stuck harness), and says for each whether the
promise of docs/security.md held. A case holds when every test it names passes; a test that is
skipped or not collected breaks it (a case cannot hold by running nothing).

Run::

    python tools/redteam_state.py            # every case (about 10 min on 2 cores)
    python tools/redteam_state.py --list     # the cases and their tests
    python tools/redteam_state.py --only 2 5 # cases whose id starts with 2 or 5

Exit status 0 when every case held, 1 otherwise.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import attrs

ROOT = Path(__file__).resolve().parent.parent
S = "tests/runtime/state/"


@attrs.frozen
class Case:
    id: str
    finding: str
    tests: tuple[str, ...]


CASES = (
    Case("1", "DCP chunk gaps, overlaps and relabels load silently",
         (S + "test_dcp_chunks.py",)),
    Case("2a", "a writer killed before its switch destroys the old export or checkpoint",
         (S + "test_export_crash.py::test_a_writer_killed_before_its_switch_leaves_the_old_"
              "export_byte_for_byte",
          S + "test_checkpoint_bounded.py::test_a_save_killed_before_its_switch_keeps_the_old_"
              "checkpoint_and_the_next_save_cleans_up",
          S + "test_checkpoint_bounded.py::test_saving_again_into_a_committed_folder_switches_"
              "the_new_checkpoint_in")),
    Case("2b", "a writer killed mid-switch lets from_pretrained load a mix",
         (S + "test_export_crash.py::test_a_writer_killed_right_after_its_switch_leaves_the_"
              "new_export_whole",
          S + "test_folder_switch.py")),
    Case("2c", "config.json cut short by a kill is not covered by the manifest",
         (S + "test_state_trust.py::test_an_export_changed_after_it_was_written_is_refused_"
              "by_name",)),
    Case("3", "a reader during a re-export reads a mix",
         (S + "test_snapshot_reads.py",)),
    Case("4", "two jobs saving into one folder both report success",
         (S + "test_one_writer.py", S + "test_folder_lock.py")),
    Case("5", "a hung peer inside save_checkpoint or load_checkpoint waits 30 min",
         (S + "test_checkpoint_bounded.py::test_a_rank_stopped_or_killed_in_dcp_save_makes_the_"
              "other_raise_export_error_naming_it",
          S + "test_checkpoint_bounded.py::test_a_rank_stopped_in_dcp_load_makes_the_other_"
              "raise_weight_load_error_naming_it",
          S + "test_checkpoint_bounded.py::test_a_full_disk_under_rank_0s_first_record_raises_"
              "the_same_error_on_every_rank")),
    Case("6", "errors after the agreement reach one rank only",
         (S + "test_export_crash.py::test_an_error_at_the_switch_reaches_every_rank_as_the_"
              "same_export_error",
          S + "test_checkpoint_bounded.py::test_a_full_disk_under_the_committed_record_raises_"
              "the_same_error_on_every_rank")),
    Case("7", "a FIFO swapped in after the check hangs load_weights",
         (S + "test_fifo_opens.py",)),
    Case("8", "a long string where a plan wants a list costs 3 KB per character",
         ("tests/recipe/test_untrusted_recipes.py::test_a_plan_of_the_wrong_shape_is_refused_"
          "at_its_first_misfit",
          "tests/recipe/test_untrusted_recipes.py::test_hostile_plan_json_raises_only_plan_"
          "format_error")),
    Case("9", "the lint passes a tree whose folders it could not read",
         ("tests/lint/test_unreadable_paths.py",)),
)

_SUMMARY = re.compile(r"(\d+) (passed|failed|skipped|error|errors|deselected|xfailed|xpassed)")


def _run(case: Case, timeout_s: float) -> tuple[bool, str]:
    """Whether ``case`` held, and the pytest summary (or why not)."""
    missing = [t for t in case.tests if not (ROOT / t.split("::")[0]).is_file()]
    if missing:
        return False, f"no such test file: {missing}"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *case.tests]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    except subprocess.TimeoutExpired:
        return False, f"did not finish within {timeout_s:g} s (a hang is a broken case)"
    tail = (done.stdout.strip().splitlines() or [""])[-1]
    counts = {kind: int(n) for n, kind in _SUMMARY.findall(tail)}
    held = done.returncode == 0 and counts.get("passed", 0) > 0 and not any(
        counts.get(k) for k in ("failed", "skipped", "error", "errors", "xfailed"))
    return held, tail or done.stderr.strip()[-300:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--list", action="store_true", help="print the cases and their tests")
    parser.add_argument("--only", nargs="*", default=None, metavar="ID",
                        help="run the cases whose id starts with one of these")
    parser.add_argument("--timeout", type=float, default=900.0,
                        help="seconds each case may take (default 900)")
    args = parser.parse_args(argv)
    cases = [c for c in CASES
             if args.only is None or any(c.id.startswith(o) for o in args.only)]
    if args.list:
        for case in cases:
            print(f"{case.id:>3}  {case.finding}")
            for test in case.tests:
                print(f"       {test}")
        return 0
    held = 0
    for case in cases:
        start = time.monotonic()
        ok, summary = _run(case, args.timeout)
        held += ok
        print(f"{case.id:>3}  {'held  ' if ok else 'BROKEN'}  {case.finding}  "
              f"[{summary}; {time.monotonic() - start:.0f} s]", flush=True)
    print(f"{held}/{len(cases)} held")
    return 0 if held == len(cases) else 1


if __name__ == "__main__":
    raise SystemExit(main())
