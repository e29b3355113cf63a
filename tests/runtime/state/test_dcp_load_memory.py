"""``load_weights`` of a DCP folder reads straight into the shards (issue 28's "left alone":
main read the rank's shards whole into fresh buffers, then copied them in: one extra copy of the
rank's shards per DCP load).

Real ``save_checkpoint`` from real gloo ranks at tp=2, loaded into a model applied on the meta
device; memory is the peak anonymous RSS (``/proc/self/status``, sampled by a thread: it can
miss a peak, never invent one) above the level just before the call.
"""

from __future__ import annotations

import gc
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from hyperrecipe import apply, compile_recipe
from hyperrecipe.check.launcher import run_ranks
from hyperrecipe.model_tree import build_model
from tests.support.runtime_harness import ROOT, mesh_1d

pytestmark = pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)

LLAMA = str(ROOT / "recipes/llama.yaml")
CFG = {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 32000,
       "max_position_embeddings": 128, "tie_word_embeddings": False}
"""Embedding and head dominate (16 MiB shards of 36 MiB per rank), so a second copy of the
rank's shards and one shard of staging are far apart."""


def _rss_anon() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    return 0


def _peak_during(fn: Any) -> int:
    gc.collect()
    base = peak = _rss_anon()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, _rss_anon())
            time.sleep(0.0005)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        fn()
    finally:
        done.set()
        thread.join()
    return max(peak, _rss_anon()) - base


def _applied(world: int, device: str) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = build_model("hf:llama", CFG, device=device)
    plan = compile_recipe(LLAMA, build_model("hf:llama", CFG, device="meta"), {"tp": world})
    return model, apply(model, plan, mesh_1d(world), mode="production")


def _save_then_load(rank: int, world: int, folder: str) -> dict[str, Any]:
    saved, inst = _applied(world, "cpu")
    inst.state.save_checkpoint(folder)
    model, loading = _applied(world, "meta")
    shards = [p.detach() for p in model.parameters()]
    extra = _peak_during(lambda: loading.state.load_weights(folder))
    again = _peak_during(lambda: loading.state.load_weights(folder))
    mine = dict(saved.named_parameters())
    return {"extra": extra, "again": again, "largest": max(s.nbytes for s in shards),
            "total": sum(s.nbytes for s in shards),
            "equal": all(torch.equal(p, mine[n]) for n, p in model.named_parameters())}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="RssAnon is Linux's")
def test_a_dcp_load_holds_no_second_copy_of_the_ranks_shards(tmp_path: Path) -> None:
    for res in run_ranks(_save_then_load, 2, str(tmp_path / "ckpt"), timeout_s=600):
        assert res["equal"], "the DCP load did not give the saved values"
        mib = 2**20
        # main, first load and reload alike: +65 MiB here (the rank's 35 MiB of shards read
        # into fresh buffers, on top of dcp.load's own reading of each stored chunk: its bytes,
        # then its tensor). Now only dcp.load's own: 31 MiB on the first load (2 x the largest
        # chunk), and a reload reuses that memory.
        assert res["extra"] < res["total"] + res["largest"], (
            f"first load: extra {res['extra'] / mib:.1f} MiB for shards of "
            f"{res['total'] / mib:.1f} MiB: a second copy of the shards")
        assert res["again"] <= res["largest"] + 2 * mib, (
            f"reload: extra {res['again'] / mib:.1f} MiB, largest shard "
            f"{res['largest'] / mib:.1f} MiB")
