"""The full export at tp=2 against transformers' own one-process ``save_pretrained`` (issue 29).

A transformers ``LlamaForCausalLM`` built from a config (fp32; the default, hidden 2048,
intermediate 5632, 3 layers, vocab 32000, is about 1.1 GiB) on 2 gloo ranks started by
:func:`hyperrecipe.check.launcher.run_ranks` (fork, one intra-op thread per rank). Rank 0 also
builds the same model unapplied (same seed), the reference. Each round, in alternating order:

``transformers``
    ``reference.save_pretrained(folder)`` on rank 0 alone (safetensors, one file, no fsync:
    what a user of one process gets); rank 1 waits at a barrier.
``transformers+fsync``
    The same, then every file it wrote synced: the same bytes made durable, as the export makes
    them before it renames them into place.
``hyperrecipe``
    ``Installation.save_pretrained(folder)`` on both ranks: every tensor gathered (the next one
    while rank 0 writes the current one), hashed (xxh3_128) as it streams, synced, renamed
    into place, the manifest written last. The figure is the slower rank's.

Before the rounds, the first export is checked against the reference tensor by tensor (equal
bytes). Each folder is deleted after its round, so the page cache and the disk hold one export
at a time. Medians over ``--rounds``; ``ratio`` is hyperrecipe / transformers (target <= 1.3),
``ratio_to_fsynced`` hyperrecipe / transformers+fsync.

``--baseline REV`` measures a git revision's ``hyperrecipe`` in the same run of the tool:
``git archive REV hyperrecipe`` is unpacked into a temporary folder and the ranks are launched
``--launches`` times per tree, alternating baseline and working tree (each launch a fresh
``python`` with that tree first on ``PYTHONPATH``), so both see the same machine load.

Usage::

    python tools/bench_export.py [--hidden 2048] [--layers 3] [--vocab 32000] [--rounds 3]
                                 [--baseline REV] [--launches 1] [--json OUT]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from bench_host import alternate_launches  # tools/ is sys.path[0]

REPO = Path(__file__).resolve().parents[1]
WAYS = ("transformers", "transformers+fsync", "hyperrecipe")


def _config(args: argparse.Namespace) -> dict[str, Any]:
    return {"hidden_size": args.hidden,
            "intermediate_size": args.intermediate or args.hidden * 11 // 4,
            "num_hidden_layers": args.layers, "num_attention_heads": max(args.hidden // 128, 2),
            "num_key_value_heads": max(args.hidden // 128, 2), "vocab_size": args.vocab,
            "max_position_embeddings": 128, "tie_word_embeddings": False}


def _worker(rank: int, world: int, cfg: dict[str, Any], rounds: int,
            root: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from safetensors import safe_open
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrecipe import apply, compile_recipe
    from hyperrecipe.model_tree import build_model

    warnings.filterwarnings("ignore", category=FutureWarning)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    plan = compile_recipe(str(REPO / "recipes/llama.yaml"), build_model("hf:llama", cfg),
                          {"tp": world})
    reference: Any = None  # a transformers model: save_pretrained is not typed on nn.Module
    if rank == 0:
        torch.manual_seed(0)
        reference = build_model("hf:llama", cfg, device="cpu")
    torch.manual_seed(0)
    model = build_model("hf:llama", cfg, device="cpu")
    inst = apply(model, plan, mesh)
    model_bytes = sum(p.numel() * p.element_size() for p in
                      (reference.parameters() if reference is not None else []))

    first = Path(root) / "check"
    inst.save_pretrained(first)
    if reference is not None:  # the export holds the reference's tensors, byte for byte
        with safe_open(str(first / "model.safetensors"), framework="pt") as f:
            for name, value in reference.state_dict().items():
                assert torch.equal(f.get_tensor(name), value), name
        shutil.rmtree(first)
    dist.barrier()

    times: dict[str, list[float]] = {w: [] for w in WAYS}
    for r in range(rounds):
        for way in WAYS[r % len(WAYS):] + WAYS[:r % len(WAYS)]:
            folder = Path(root) / f"{way}-{r}"
            dist.barrier()
            start = time.perf_counter()
            if way == "hyperrecipe":
                inst.save_pretrained(folder)
            elif reference is not None:
                reference.save_pretrained(folder)
                if way == "transformers+fsync":
                    for file in folder.iterdir():
                        with open(file, "rb") as handle:
                            os.fsync(handle.fileno())
            elapsed = time.perf_counter() - start
            dist.barrier()
            if rank == 0:
                times[way].append(elapsed)
                shutil.rmtree(folder)
            elif way == "hyperrecipe":
                times[way].append(elapsed)
    return {"times": times, "model_bytes": model_bytes}


def _launch_here(args: argparse.Namespace) -> dict[str, Any]:
    """One launch of the ranks with whatever ``hyperrecipe`` this interpreter imports."""
    from hyperrecipe.check.launcher import run_ranks

    cfg = _config(args)
    root = tempfile.mkdtemp(prefix="bench-export-", dir=args.dir)
    try:
        results = run_ranks(_worker, 2, cfg, args.rounds, root, timeout_s=3600)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    per_round = {"transformers": results[0]["times"]["transformers"],
                 "transformers+fsync": results[0]["times"]["transformers+fsync"],
                 "hyperrecipe": [max(v) for v in zip(*(r["times"]["hyperrecipe"]
                                                        for r in results))]}
    med = {w: round(statistics.median(v), 3) for w, v in per_round.items()}
    return {"model_bytes": results[0]["model_bytes"],
            "transformers_save_pretrained_s": med["transformers"],
            "transformers_save_pretrained_fsync_s": med["transformers+fsync"],
            "hyperrecipe_save_pretrained_s": med["hyperrecipe"],
            "ratio": round(med["hyperrecipe"] / med["transformers"], 3),
            "ratio_to_fsynced": round(med["hyperrecipe"] / med["transformers+fsync"], 3),
            "rounds": per_round, "config": cfg}


def _launch_tree(tree: Path | None, args: argparse.Namespace) -> dict[str, Any]:
    """One launch in a fresh interpreter with ``tree``'s hyperrecipe first (``None``: this
    checkout's)."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, "--one-launch", "--json", out.name,
               "--hidden", str(args.hidden), "--layers", str(args.layers),
               "--vocab", str(args.vocab), "--rounds", str(args.rounds)]
        cmd += ["--intermediate", str(args.intermediate)] if args.intermediate else []
        cmd += ["--dir", args.dir] if args.dir else []
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([*([str(tree)] if tree else []), str(REPO)])
        subprocess.run(cmd, env=env, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
        result: dict[str, Any] = json.loads(Path(out.name).read_text())
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=None,
                        help="default: 11/4 of hidden (5632 at 2048)")
    parser.add_argument("--layers", type=int, default=3)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write (default: a temp folder)")
    parser.add_argument("--baseline", metavar="REV", help="also measure this git revision")
    parser.add_argument("--launches", type=int, default=1, help="launches per tree")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--one-launch", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    keys = ("model_bytes", "transformers_save_pretrained_s",
            "transformers_save_pretrained_fsync_s", "hyperrecipe_save_pretrained_s", "ratio",
            "ratio_to_fsynced")
    if args.one_launch or (not args.baseline and args.launches == 1):
        result = _launch_here(args)
        if not args.one_launch:
            print(json.dumps({k: result[k] for k in keys}))
        if args.json:
            args.json.write_text(json.dumps(result, indent=2))
        return 0
    runs = alternate_launches(args.baseline, args.launches,
                              lambda tree: _launch_tree(tree, args),
                              lambda result: {k: result[k] for k in keys})
    summary = {which: {k: round(statistics.median(r[k] for r in rs), 3) for k in keys[1:]}
               for which, rs in runs.items()}
    print(json.dumps({"baseline": args.baseline, "median_over_launches": summary}))
    if args.json:
        args.json.write_text(json.dumps({"baseline": args.baseline, "runs": runs,
                                         "summary": summary}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
