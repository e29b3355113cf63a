"""Time our pipelined step against ``torch.distributed.pipelining`` used by hand, same split, same
schedule, same loss (issue 38, item 7).

The model: a transformers ``LlamaForCausalLM`` (default: hidden 256, 8 layers, 8 heads, 4 KV
heads, intermediate 688, vocab 1024; fp32, sdpa attention, ``use_cache=False``), weights from
seed 0, a batch of 8 x 128 token ids (seed 1), 4 microbatches, on 2 gloo ranks started by
:func:`hyperrecipe.check.launcher.run_ranks` (fork, one intra-op thread per rank).

``ours``
    ``build_pipeline(model, plan, mesh)`` with the plan compiled from a recipe whose only
    section is ``pipeline`` (``layers: model.layers``, the schedule, balanced split), and
    ``pipe.step(input_ids=ids, labels=ids)``: the model's own forward on every stage,
    other stages' modules replaced by placeholders, the model's own loss.
``by_hand``
    What a torchtitan user writes: each rank builds the same model, keeps only its stage's
    layers (``layers[start:stop]`` read from the same plan's stages) and sets the embedding,
    final norm and ``lm_head`` to ``None`` where the stage does not own them; a small forward
    (embed if owned, rotary table, the kept decoder layers with a causal sdpa mask, norm and
    head if owned); :class:`~torch.distributed.pipelining.PipelineStage` with the stage's input
    and output shapes given (no shape inference traffic, as ours) and torch's schedule class
    with ``loss_fn`` = the causal-LM cross entropy (mean per microbatch; torch scales each
    microbatch's gradient by 1/microbatches, the equal-token full-batch mean, as ours).

Each run is one fresh pair of ranks holding one implementation; runs of the two alternate
(ours, by hand, by hand, ours, ...) ``--rounds`` times per schedule, so a slow minute of a shared
machine falls on both. A run times ``--steps`` forward+backward steps after ``--warmup``
(gradients zeroed between steps, untimed), per rank. Memory: peak anonymous RSS of the rank
process (``RssAnon``, sampled every 1 ms by :mod:`tools.peak_rss`) during the timed steps, and
that peak minus ``RssAnon`` just before the first timed step (what the steps add: activations,
gradients, buffers of the schedule). torch has no CPU allocator statistics, hence RSS.

    python tools/bench_pipeline.py                      # GPipe, 1F1B, Interleaved1F1B
    python tools/bench_pipeline.py --schedules 1F1B --rounds 5 --json out.json

Reports per schedule and rank the median step time of each (median over all timed steps of all
its runs), ``ours / by_hand``, and the peak memory of each; ``first_loss_diff`` checks that the
two compute the same loss on the same weights (the split and the loss are the same).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run as `python tools/bench_pipeline.py` from anywhere
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch import nn  # noqa: E402

from tools.peak_rss import PeakRss, rss_anon  # noqa: E402

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
PER_RANK = {"Interleaved1F1B": 2}


def _model(cfg: dict[str, int]) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", hidden_size=cfg["hidden"],
                                  intermediate_size=cfg["intermediate"],
                                  num_hidden_layers=cfg["layers"],
                                  num_attention_heads=cfg["heads"], num_key_value_heads=cfg["kv"],
                                  vocab_size=cfg["vocab"], max_position_embeddings=cfg["seq"],
                                  use_cache=False, attn_implementation="sdpa")
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _plan(model: nn.Module, schedule: str, microbatches: int, pp: int) -> Any:
    import hyperrecipe

    per_rank = PER_RANK.get(schedule, 1)
    text = (f"recipe: bench-pp\nversion: 1\nmesh: [pp]\npipeline:\n  layers: model.layers\n"
            f"  schedule: {schedule}\n  microbatches: {microbatches}\n"
            + (f"  stages_per_rank: {per_rank}\n" if per_rank > 1 else "") + "rules: []\n")
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "pp.yaml"
        path.write_text(text, encoding="utf-8")
        return hyperrecipe.compile_recipe(str(path), model, {"pp": pp})


class HandStage(nn.Module):
    """torchtitan's way: the stage's own layers; embedding, norm and head only where owned."""

    def __init__(self, model: Any, start: int, stop: int, *, first: bool, last: bool) -> None:
        super().__init__()
        inner = model.model
        self.embed_tokens = inner.embed_tokens if first else None
        self.layers = nn.ModuleList(inner.layers[start:stop])
        self.norm = inner.norm if last else None
        self.lm_head = model.lm_head if last else None
        self.rotary_emb = inner.rotary_emb

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(h.shape[1], device=h.device).unsqueeze(0)
        cos_sin = self.rotary_emb(h, positions)
        for layer in self.layers:  # mask None: sdpa runs causal
            out = layer(h, attention_mask=None, position_ids=positions,
                        position_embeddings=cos_sin)
            h = out[0] if isinstance(out, tuple) else out
        if self.lm_head is not None:
            assert self.norm is not None
            h = self.lm_head(self.norm(h))
        return h


def causal_lm_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(),
                                       target[:, 1:].flatten())


def _by_hand(model: Any, plan: Any, mesh: Any, cfg: dict[str, int], microbatches: int) -> Any:
    """Each of this rank's plan stages as a torchtitan-style module, torch's stage and schedule."""
    import torch.distributed.pipelining as pipelining

    pipeline = plan.pipeline
    group = mesh.get_group("pp")
    pp_rank = mesh.get_local_rank("pp")
    n = len(pipeline.stages)
    mb = cfg["batch"] // microbatches
    stages = []
    for s in pipeline.stages:
        if s.rank != pp_rank:
            continue
        module = HandStage(model, s.start, s.stop, first=s.index == 0, last=s.index == n - 1)
        hidden = torch.empty(mb, cfg["seq"], cfg["hidden"])
        stages.append(pipelining.PipelineStage(
            module, s.index, n, torch.device("cpu"),
            input_args=None if s.index == 0 else hidden,
            output_args=torch.empty(mb, cfg["seq"], cfg["vocab"]) if s.index == n - 1 else hidden,
            group=group))
    cls = getattr(pipelining, {"1F1B": "Schedule1F1B", "GPipe": "ScheduleGPipe",
                               "Interleaved1F1B": "ScheduleInterleaved1F1B"}[pipeline.schedule])
    schedule = cls(stages if len(stages) > 1 else stages[0], n_microbatches=microbatches,
                   loss_fn=causal_lm_loss)
    params = [p for st in stages for p in st.submod.parameters()]
    return schedule, params


def worker(rank: int, world: int, impl: str, schedule: str, cfg: dict[str, int],
           microbatches: int, warmup: int, steps: int) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    from hyperrecipe.runtime import build_pipeline

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    model = _model(cfg)
    plan = _plan(model, schedule, microbatches, world)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg["vocab"], (cfg["batch"], cfg["seq"]), generator=g)
    if impl == "ours":
        pipe = build_pipeline(model, plan, mesh)
        params = list(pipe.parameters())

        def step() -> float:
            return float(pipe.step(input_ids=ids, labels=ids))
    else:
        sched, params = _by_hand(model, plan, mesh, cfg, microbatches)
        holds_last = any(s.rank == mesh.get_local_rank("pp") and s.index == len(
            plan.pipeline.stages) - 1 for s in plan.pipeline.stages)

        def step() -> float:
            losses: list[torch.Tensor] = []
            sched.step(ids, target=ids, losses=losses)
            return float(torch.stack(losses).detach().mean()) if holds_last else float("nan")
    del model
    times: list[float] = []
    first_loss = float("nan")
    peak = None
    before = 0
    for i in range(warmup + steps):
        if i == warmup:
            before = rss_anon()
            peak = PeakRss(0.001)
        began = time.perf_counter()
        loss = step()
        elapsed = time.perf_counter() - began
        if i == 0:
            first_loss = loss
        if i >= warmup:
            times.append(elapsed)
        for p in params:
            p.grad = None
    assert peak is not None
    peak.stop()
    return {"times": times, "first_loss": first_loss, "peak_rss": peak.peak,
            "step_rss": peak.peak - before}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    from hyperrecipe.check.launcher import run_ranks

    cfg = {"hidden": args.hidden, "intermediate": args.intermediate, "layers": args.layers,
           "heads": args.heads, "kv": args.kv_heads, "vocab": args.vocab, "seq": args.seq,
           "batch": args.batch}
    out: dict[str, Any] = {"config": {**cfg, "microbatches": args.microbatches, "pp": 2,
                                      "rounds": args.rounds, "steps": args.steps,
                                      "warmup": args.warmup, "torch": torch.__version__},
                           "schedules": {}}
    for schedule in args.schedules:
        runs: dict[str, list[list[dict[str, Any]]]] = {"ours": [], "by_hand": []}
        for r in range(args.rounds):
            order = ("ours", "by_hand") if r % 2 == 0 else ("by_hand", "ours")
            for impl in order:
                runs[impl].append(run_ranks(worker, 2, impl, schedule, cfg, args.microbatches,
                                            args.warmup, args.steps, timeout_s=args.timeout))
        per_rank = []
        for rank in range(2):
            row: dict[str, Any] = {"rank": rank}
            for impl in ("ours", "by_hand"):
                times = [t for run in runs[impl] for t in run[rank]["times"]]
                row[f"{impl}_ms"] = round(statistics.median(times) * 1e3, 2)
                row[f"{impl}_peak_rss_mib"] = round(
                    max(run[rank]["peak_rss"] for run in runs[impl]) / 2**20, 1)
                row[f"{impl}_step_rss_mib"] = round(
                    max(run[rank]["step_rss"] for run in runs[impl]) / 2**20, 1)
            row["ratio"] = round(row["ours_ms"] / row["by_hand_ms"], 3)
            per_rank.append(row)
        ours_loss = runs["ours"][0][0]["first_loss"]
        hand_loss = next(run[rank]["first_loss"] for run in runs["by_hand"] for rank in range(2)
                         if run[rank]["first_loss"] == run[rank]["first_loss"])
        out["schedules"][schedule] = {"per_rank": per_rank,
                                      "first_loss_diff": abs(ours_loss - hand_loss)}
    return out


def table(result: dict[str, Any]) -> str:
    lines = ["| schedule | rank | ours ms | by hand ms | ours / by hand | peak RssAnon ours / by "
             "hand (MiB) | added by the steps ours / by hand (MiB) |",
             "|---|---|---|---|---|---|---|"]
    for name, res in result["schedules"].items():
        for row in res["per_rank"]:
            lines.append(f"| {name} | {row['rank']} | {row['ours_ms']} | {row['by_hand_ms']} | "
                         f"{row['ratio']:.3f} | {row['ours_peak_rss_mib']} / "
                         f"{row['by_hand_peak_rss_mib']} | {row['ours_step_rss_mib']} / "
                         f"{row['by_hand_step_rss_mib']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=SCHEDULES)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--intermediate", type=int, default=688)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="runs of each, alternating")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per run")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    parser.add_argument("--json", default=None, help="write the result here ('-': stdout)")
    args = parser.parse_args(argv)
    result = bench(args)
    if args.json == "-":
        print(json.dumps(result, indent=2))
    else:
        print(table(result))
        for name, res in result["schedules"].items():
            print(f"{name}: first-step loss |ours - by hand| = {res['first_loss_diff']:.2e}")
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
