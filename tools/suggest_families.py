"""Run ``hyperrecipe suggest`` over every transformers family whose config carries a
``base_model_tp_plan``, at tp=2, and count verified / narrowed / refused.

The families are not hand-picked: every model type in transformers' ``CONFIG_MAPPING`` whose
config class has a non-empty ``base_model_tp_plan``, in sorted order (``--only`` picks some).
Each is built from a tiny config derived from the family's defaults
(:func:`hyperrecipe.models.hf_tiny.tiny_config`: hidden 64, 2 layers, 4 heads of 16,
vocab 128, 4 experts, ...) and :func:`hyperrecipe.suggest.suggest_recipe` is run with
verification (``check`` in both modes against one process). A family is

- **verified**: check agreed, nothing the plan shards was given up;
- **narrowed**: check agreed after some rules were left replicated (each listed with why);
- **refused**: no recipe (no plan entry translates, every rule narrowed away, the model is not a
  causal LM or fails in one process; the reason is listed).

Every verified or narrowed recipe is written under ``--out`` and checked again from the file
(``--recheck``), as a user would. Results go to a JSON file as they come (a run cut short by
``--budget-s`` reports what it reached) and a Markdown summary is printed for
docs/benchmarks.md.

MoE families (those whose config class carries a ``base_model_ep_plan``, the plan ``suggest``
shards experts from) run at ``tp=2,ep=2``, four ranks each, unless ``--no-ep``; ``--moe-only``
runs just them. ``--pp N`` runs every family at ``pp=N`` alone instead: ``suggest`` proposes
only the ``pipeline`` section (the split list from ``base_model_pp_plan`` or the structure),
verified by ``check`` in both modes; the row records the split and, for a refusal, why.
``--family-timeout-s`` runs the families one at a time in a worker process of
its own session, under an address-space limit (``--memory-gb``, inherited by the check's
ranks): a family that runs past the timeout is recorded as ``timed out`` and the worker is
killed with all its ranks, and a new one takes the next family.

Usage::

    python tools/suggest_families.py [--only llama qwen2] [--budget-s 1800] [--recheck]
                                     [--no-ep] [--out /tmp/suggest-families] [--json results.json]
    python tools/suggest_families.py --moe-only --family-timeout-s 240 [--memory-gb 6]
    python tools/suggest_families.py --pp 2 --family-timeout-s 300 --recheck
    python tools/suggest_families.py --recheck-dir /tmp/suggest-families [--budget-s 600]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import selectors
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def families_with_a_plan() -> list[str]:
    """Every model type whose config class declares a tensor-parallel plan."""
    from transformers import CONFIG_MAPPING

    out = []
    for model_type in sorted(CONFIG_MAPPING.keys()):
        try:
            cls = CONFIG_MAPPING[model_type]
        except Exception:  # noqa: BLE001 - a family whose optional dependency is missing
            continue
        if getattr(cls, "base_model_tp_plan", None):
            out.append(model_type)
    return out


def is_moe(model_type: str) -> bool:
    """Whether the family's config class carries an expert-parallel plan: what ``suggest``
    shards experts over ``ep`` from (without one it proposes nothing on ``ep``)."""
    from transformers import CONFIG_MAPPING

    return bool(getattr(CONFIG_MAPPING[model_type], "base_model_ep_plan", None))


def causal_families_without_a_plan() -> list[str]:
    """Every model type with a causal-LM class whose config class declares no tensor-parallel
    plan: ``suggest`` reads their plan off the structure."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    out = []
    for model_type in sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES):
        try:
            cls = CONFIG_MAPPING[model_type]
        except Exception:  # noqa: BLE001 - a family whose optional dependency is missing
            continue
        if not getattr(cls, "base_model_tp_plan", None):
            out.append(model_type)
    return out


def _mesh(model_type: str, ep: bool, pp: int) -> dict[str, int]:
    if pp > 1:
        return {"pp": pp}
    return {"tp": 2, "ep": 2} if is_moe(model_type) and ep else {"tp": 2}


def _one(model_type: str, out_dir: Path, recheck: bool, ep: bool, pp: int = 0
         ) -> dict[str, Any]:
    from hyperrecipe.check.run import CheckOptions, run_check
    from hyperrecipe.errors import HyperrecipeError
    from hyperrecipe.models.hf_tiny import tiny_config
    from hyperrecipe.suggest import SuggestOptions, suggest_recipe
    from hyperrecipe.suggest.gathered import GATHERED_INSTEAD
    from hyperrecipe.suggest.sequence import SEQUENCE_GROUP
    from hyperrecipe.suggest.translate import LOSS_GROUP

    t0 = time.perf_counter()
    row: dict[str, Any] = {"family": model_type}
    mesh = _mesh(model_type, ep, pp)
    row["mesh"] = ",".join(f"{k}={v}" for k, v in mesh.items())
    try:
        config = tiny_config(model_type)
        s = suggest_recipe(f"hf:{model_type}", mesh, model_config=config,
                           options=SuggestOptions(timeout_s=120, max_attempts=6))
    except (HyperrecipeError, Exception) as exc:  # noqa: BLE001 - a family's own failure
        why = " ".join(f"{type(exc).__name__}: {exc}".split())
        not_causal = ("for this kind of AutoModel: AutoModelForCausalLM" in why
                      or "has no causal-lm model" in why)
        outcome = "not a causal LM" if not_causal else "refused"
        row.update(outcome=outcome, why=why[:300], seconds=time.perf_counter() - t0)
        return row
    if pp > 1:
        return _pipeline_row(row, s, out_dir, recheck, mesh, t0)
    groups = {r.group for r in s.rules}
    row.update(sequence_parallel=SEQUENCE_GROUP in groups, loss_parallel=LOSS_GROUP in groups,
               experts=any(dict(r.fields).get("local_region") and r.group != SEQUENCE_GROUP
                           for r in s.rules),
               sharded_ep=s.sharded_fraction.get("ep", 0.0))
    if not row["sequence_parallel"]:  # not proposed (why), or given up by check (what failed)
        row["sequence_parallel_why"] = next(
            (" ".join(n.why.split())[:300] for n in s.narrowed
             if n.what.startswith(SEQUENCE_GROUP)),
            next((n.why for n in s.narrowed if "every addition beyond" in n.why), ""))
    # an entry for a module this config does not build, and the expert-parallel plan on a
    # mesh with no ep dim, give nothing up: they are reported, not counted as narrowing; nor
    # is a block the plan leaves out, read off the structure and then given up (or computed
    # whole on the gathered sequence)
    beyond = _blocks_read_off_the_structure(model_type, s.check_config)
    plan_gave_up = [n for n in s.narrowed if "matches no module" not in n.why
                    and "so the experts stay whole" not in n.why
                    and n.what not in (SEQUENCE_GROUP, LOSS_GROUP)
                    and n.what.removesuffix(GATHERED_INSTEAD) not in beyond]
    row["structure_blocks"] = sorted(beyond)
    row.update(
        attempts=len(s.attempts), sharded=s.sharded_fraction.get("tp", 0.0),
        narrowed=[f"{n.what}: {' '.join(n.why.split())[:200]}" for n in plan_gave_up],
        corrections=[c.what for c in s.corrections], seconds=time.perf_counter() - t0)
    if not s.verified:
        row.update(outcome="refused", why=s.reason)
        return row
    row["outcome"] = "narrowed" if plan_gave_up else "verified"
    path = out_dir / f"{model_type}.yaml"
    path.write_text(s.text, encoding="utf-8")
    if recheck:
        report = run_check(CheckOptions(recipe=str(path), model=f"hf:{model_type}",
                                        model_config=s.check_config, mesh=mesh,
                                        timeout_s=120))
        row["recheck"] = report.agree
    return row


def _pipeline_row(row: dict[str, Any], s: Any, out_dir: Path, recheck: bool,
                  mesh: dict[str, int], t0: float) -> dict[str, Any]:
    """A family at ``pp`` alone: verified (the pipeline section check agreed on) or refused."""
    from hyperrecipe.check.run import CheckOptions, run_check

    row.update(attempts=len(s.attempts), pipeline=s.pipeline, seconds=time.perf_counter() - t0,
               sharded=0.0)
    if not s.verified:
        row.update(outcome="refused", why=" ".join(s.reason.split())[:400])
        return row
    row["outcome"] = "verified"
    path = out_dir / f"{row['family']}.yaml"
    path.write_text(s.text, encoding="utf-8")
    if recheck:
        report = run_check(CheckOptions(recipe=str(path), model=f"hf:{row['family']}",
                                        model_config=s.check_config, mesh=mesh, timeout_s=120))
        row["recheck"] = report.agree
    row["seconds"] = time.perf_counter() - t0
    return row


_READY, _ROW = "@@ready", "@@row "
"""Markers of the worker's protocol lines on its stdout (anything else it prints is passed on)."""


def serve_families() -> int:
    """The worker (``--worker``): one JSON request per stdin line, one ``@@row`` line each."""
    import torch

    from hyperrecipe.suggest import suggest_recipe  # noqa: F401 - imported before READY

    torch.set_num_threads(1)
    print(_READY, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        row = _one(req["family"], Path(req["out"]), req["recheck"], req["ep"], req.get("pp", 0))
        print(_ROW + json.dumps(row), flush=True)
    return 0


class FamilyWorker:
    """A worker process in a session of its own (so its check ranks die with it), under an
    address-space limit; restarted after a family runs past its timeout."""

    def __init__(self, memory_gb: float) -> None:
        self.memory_bytes = int(memory_gb * 2**30)
        self.proc: subprocess.Popen[bytes] | None = None
        self.buffer = b""

    def _limit(self) -> None:
        resource.setrlimit(resource.RLIMIT_AS, (self.memory_bytes, self.memory_bytes))

    def _line(self, prefix: str, deadline: float) -> str | None:
        """The next stdout line starting with ``prefix`` before ``deadline``; ``None`` on
        timeout or exit. Other lines go to stderr."""
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while True:
                while b"\n" in self.buffer:
                    raw, self.buffer = self.buffer.split(b"\n", 1)
                    text = raw.decode("utf-8", "replace")
                    if text.startswith(prefix):
                        return text[len(prefix):]
                    print(text, file=sys.stderr, flush=True)
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(timeout=left):
                    return None
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return None
                self.buffer += chunk

    def start(self) -> None:
        self.buffer = b""
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True,
            preexec_fn=self._limit)
        if self._line(_READY, time.monotonic() + 600) is None:
            self.stop()
            raise RuntimeError("the family worker did not start within 600 s")

    def ensure(self) -> None:
        """A live worker, started (imports done) if there is none: its start-up is not
        counted against a family's timeout."""
        if self.proc is None or self.proc.poll() is not None:
            self.start()

    def run(self, request: dict[str, Any], timeout_s: float) -> dict[str, Any] | None:
        """The family's row, or ``None`` when it ran past ``timeout_s`` or the worker died
        (the worker is then killed with its ranks)."""
        self.ensure()
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        row = self._line(_ROW, time.monotonic() + timeout_s)
        if row is None:
            self.stop()
            return None
        result: dict[str, Any] = json.loads(row)
        return result

    def stop(self) -> None:
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.proc = None


def _blocks_read_off_the_structure(model_type: str, config: dict[str, Any]) -> set[str]:
    """The blocks ``suggest`` read off the structure because the plan names nothing of them
    (:func:`hyperrecipe.suggest.structure.blocks_the_plan_leaves_out`): beyond the plan."""
    from hyperrecipe.models.hf_plans import read_plans
    from hyperrecipe.model_tree import build_model
    from hyperrecipe.suggest.structure import blocks_the_plan_leaves_out, structural_entries

    model = build_model(f"hf:{model_type}", config)
    extra = blocks_the_plan_leaves_out(read_plans(model), structural_entries(model))
    return {e.pattern.rsplit(".", 1)[0] for e in extra if not e.head}


def recheck_dir(folder: Path, budget_s: float) -> int:
    """``hyperrecipe check`` (both modes) on every recipe written under ``folder``, on the config
    its header says it was checked on; prints one line each and the count that agree."""
    from hyperrecipe.check.run import CheckOptions, run_check

    start, agree, done = time.perf_counter(), 0, 0
    for path in sorted(folder.glob("*.yaml")):
        if time.perf_counter() - start > budget_s:
            break
        text = path.read_text(encoding="utf-8")
        header = next(line for line in text.splitlines() if line.startswith("# Checked on the config "))
        mesh_line = next(line for line in text.splitlines() if line.startswith("mesh: ["))
        dims = [d.strip() for d in mesh_line[len("mesh: ["):-1].split(",")]
        config = json.loads(header.removeprefix("# Checked on the config "))
        report = run_check(CheckOptions(recipe=str(path), model=f"hf:{path.stem}",
                                        model_config=config, mesh={d: 2 for d in dims},
                                        timeout_s=120))
        done += 1
        agree += report.agree
        print(f"{path.stem}: {'agree' if report.agree else 'DISAGREE'}", flush=True)
    print(f"re-checked from the written file: {agree} of {done} agree in both modes")
    return 0 if agree == done else 1


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", nargs="*", help="these model types only")
    p.add_argument("--budget-s", type=float, default=3600.0,
                   help="stop starting families after this many seconds")
    p.add_argument("--recheck", action="store_true", help="check each written file again")
    p.add_argument("--no-ep", action="store_true",
                   help="MoE families at tp=2 only (default: tp=2,ep=2, four ranks)")
    p.add_argument("--out", default="/tmp/suggest-families", help="folder for the recipes")
    p.add_argument("--json", default="/tmp/suggest-families.json", help="results file")
    p.add_argument("--without-plan", action="store_true",
                   help="the causal-LM families whose config declares no tensor-parallel plan "
                        "instead (the plan is read off the model's structure)")
    p.add_argument("--recheck-dir", metavar="DIR",
                   help="only re-check the recipes a previous run wrote under DIR")
    p.add_argument("--moe-only", action="store_true",
                   help="only the families with an expert-parallel plan (tp=2,ep=2 unless --no-ep)")
    p.add_argument("--family-timeout-s", type=float, default=None,
                   help="run each family in a worker process and give up on it after this many "
                        "seconds (recorded as 'timed out')")
    p.add_argument("--memory-gb", type=float, default=6.0,
                   help="address-space limit of the worker and of each of its ranks "
                        "(with --family-timeout-s)")
    p.add_argument("--pp", type=int, default=0, metavar="N",
                   help="every family at pp=N alone: the pipeline section suggest proposes, "
                        "verified by check (default: tensor parallel)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        return serve_families()
    import torch

    torch.set_num_threads(1)
    if args.recheck_dir:
        return recheck_dir(Path(args.recheck_dir), args.budget_s)
    families = causal_families_without_a_plan() if args.without_plan else families_with_a_plan()
    which = ("causal-LM families without a base_model_tp_plan" if args.without_plan
             else "families with a base_model_tp_plan")
    if args.moe_only:
        families = [f for f in families if is_moe(f)]
        which += " and a base_model_ep_plan"
    if args.only:
        families = [f for f in families if f in set(args.only)]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    worker = FamilyWorker(args.memory_gb) if args.family_timeout_s is not None else None
    try:
        rows = _run_all(families, args, out_dir, worker, start)
    finally:
        if worker is not None:
            worker.stop()
    if args.pp > 1:
        _print_pipeline_summary(rows, families, which, args.recheck, start, args.pp)
    else:
        _print_summary(rows, families, which, args.recheck, start)
    return 0


def _run_all(families: list[str], args: argparse.Namespace, out_dir: Path,
             worker: FamilyWorker | None, start: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for i, family in enumerate(families):
        if time.perf_counter() - start > args.budget_s:
            break
        if worker is None:
            row = _one(family, out_dir, args.recheck, not args.no_ep, args.pp)
        else:
            print(f"[{i + 1}/{len(families)} {time.perf_counter() - start:7.1f} s] {family}: "
                  f"started", flush=True)
            worker.ensure()
            t0 = time.perf_counter()
            request = {"family": family, "out": str(out_dir), "recheck": args.recheck,
                       "ep": not args.no_ep, "pp": args.pp}
            got = worker.run(request, args.family_timeout_s)
            row = got if got is not None else {
                "family": family, "outcome": "timed out", "seconds": time.perf_counter() - t0,
                "mesh": ",".join(f"{k}={v}" for k, v in
                                 _mesh(family, not args.no_ep, args.pp).items()),
                "why": f"no result within {args.family_timeout_s:g} s (or the worker died): "
                       f"the worker and its ranks were killed"}
        rows.append(row)
        print(f"[{i + 1}/{len(families)} {time.perf_counter() - start:7.1f} s] {family}: "
              f"{row['outcome']} ({row['seconds']:.1f} s)"
              + (f" recheck={row['recheck']}" if "recheck" in row else "")
              + (f" -- {row['why']}" if row.get("why") else ""), flush=True)
        Path(args.json).write_text(json.dumps({"families": len(families), "rows": rows},
                                              indent=1), encoding="utf-8")
    return rows


def _print_pipeline_summary(rows: list[dict[str, Any]], families: list[str], which: str,
                            recheck: bool, start: float, pp: int) -> None:
    counts = Counter(r["outcome"] for r in rows)
    ok = [r for r in rows if r["outcome"] == "verified"]
    print(f"\n{len(rows)} of {len(families)} {which} reached at pp={pp} in "
          f"{time.perf_counter() - start:.0f} s: verified {counts['verified']}, refused "
          f"{counts['refused']}, timed out {counts['timed out']}, not a causal LM "
          f"{counts['not a causal LM']}"
          + (f"; re-checked from the file: {sum(r.get('recheck', False) for r in ok)}"
             if recheck else ""))
    print("\n| family | outcome | checks | s | split / why |")
    print("|---|---|---|---|---|")
    for r in rows:
        detail = r.get("why") or r.get("pipeline", "")
        print(f"| {r['family']} | {r['outcome']} | {r.get('attempts', '-')} | "
              f"{r['seconds']:.0f} | {detail[:200].replace('|', '/')} |")


def _print_summary(rows: list[dict[str, Any]], families: list[str], which: str, recheck: bool,
                   start: float) -> None:
    counts = Counter(r["outcome"] for r in rows)
    ok = [r for r in rows if r["outcome"] in ("verified", "narrowed")]
    print(f"\n{len(rows)} of {len(families)} {which} reached in "
          f"{time.perf_counter() - start:.0f} s: verified {counts['verified']}, narrowed "
          f"{counts['narrowed']}, refused {counts['refused']}, timed out "
          f"{counts['timed out']}, not a causal LM {counts['not a causal LM']}; of the {len(ok)} with a recipe: sequence parallel "
          f"{sum(r['sequence_parallel'] for r in ok)}, loss on vocab shards "
          f"{sum(r['loss_parallel'] for r in ok)}, experts over ep "
          f"{sum(r['experts'] for r in ok)}"
          + (f"; re-checked from the file: {sum(r.get('recheck', False) for r in ok)}"
             if recheck else ""))
    no_sp = [r for r in ok if not r["sequence_parallel"]]
    if no_sp:
        print(f"\nwhy sequence parallelism is not in {len(no_sp)} recipes:")
        for r in no_sp:
            print(f"- {r['family']}: {r.get('sequence_parallel_why', '')}")
    print("\n| family | mesh | outcome | checks | SP | loss | tp bytes | ep bytes | s | "
          "given up / why |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        detail = r.get("why") or "; ".join(r.get("narrowed", []))
        yes = {True: "yes", False: "-", None: "-"}
        print(f"| {r['family']} | {r.get('mesh', '')} | {r['outcome']} | "
              f"{r.get('attempts', '-')} | {yes[r.get('sequence_parallel')]} | "
              f"{yes[r.get('loss_parallel')]} | {r.get('sharded', 0.0):.0%} | "
              f"{r.get('sharded_ep', 0.0):.0%} | {r['seconds']:.0f} | "
              f"{detail[:140].replace('|', '/')} |")


if __name__ == "__main__":
    raise SystemExit(main())
