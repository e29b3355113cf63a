"""``tools/train.py`` as users run it: a text file as data, gradient accumulation, the warmup +
cosine schedule, bf16 autocast, resume, and ``--dp`` with the shipped ``llama-dp`` recipe.

Real gloo ranks (the tool's ``main`` runs in forked ranks of ``run_ranks``, or under
``torchrun`` where the test is about the command line), the tiny Llama of
``recipes/models/tiny-llama.json`` from a real ``save_pretrained`` checkpoint, and the repository's
README as the text file. The reference is one process computed here, not through the tool's
code: the file's bytes packed into 16-token sequences, the global batch of step s being
sequences ``s*B .. s*B+B-1``, the model's own ``labels=`` loss over the whole global batch at
once, torch's ``clip_grad_norm_`` and AdamW at the schedule's learning rate. fp32 losses agree
to atol 1e-5 and gradient norms to rtol 1e-4 (measured differences are below 1e-6).
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

from hyperrecipe.check.launcher import run_ranks
from tests.support.runtime_harness import ROOT, llama

DATA = ROOT / "README.md"
SEQ, MICRO, LR, WARMUP, STEPS = 16, 2, 1e-2, 1, 4
LOSS_ATOL, NORM_RTOL = 1e-5, 1e-4


def _tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("hyperrecipe_train_tool",
                                                  ROOT / "tools/train.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


TRAIN = _tool()


def _args(ckpt: Path, out: Path, *extra: str, accum: int = 2) -> list[str]:
    return ["--weights", str(ckpt), "--out", str(out), "--data", str(DATA), "--seq-len",
            str(SEQ), "--micro-batch", str(MICRO), "--grad-accum", str(accum), "--steps",
            str(STEPS), "--save-every", "2", "--lr", str(LR), "--warmup-steps", str(WARMUP),
            "--json", *extra]


def _run(world: int, argv: list[str]) -> list[dict[str, Any]]:
    def worker(rank: int, world: int) -> list[dict[str, Any]]:
        return TRAIN.main(argv)  # type: ignore[no-any-return]

    results = run_ranks(worker, world, timeout_s=300)
    for other in results[1:]:  # every rank's loss (and eval loss) is the global batch's
        def timeless(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
            return [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in records]

        assert timeless(other) == timeless(results[0])
    return results[0]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("hf-tiny-llama")
    model: Any = llama()
    model.save_pretrained(folder)
    return folder


def _expected_lr(step: int) -> float:
    """Warmup then cosine to lr / 10 at STEPS, written out here independently of the tool."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    return LR / 10 + 0.5 * (LR - LR / 10) * (1 + math.cos(math.pi * (step - WARMUP)
                                                         / (STEPS - WARMUP)))


def _reference(checkpoint: Path, rows: int, token_ids: torch.Tensor) -> list[dict[str, float]]:
    """One process over each step's whole global batch of ``rows`` sequences."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    packed = token_ids[:token_ids.numel() // SEQ * SEQ].view(-1, SEQ)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    out = []
    for step in range(STEPS):
        ids = packed[(step * rows + torch.arange(rows)) % packed.shape[0]]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in opt.param_groups:
            group["lr"] = _expected_lr(step)
        opt.step()
        opt.zero_grad()
        out.append({"loss": float(loss.detach()), "grad_norm": float(norm)})
    return out


def _byte_ids() -> torch.Tensor:
    return torch.tensor(list(DATA.read_bytes())) % 128


@pytest.fixture(scope="module")
def uninterrupted(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory
                  ) -> tuple[list[dict[str, Any]], Path]:
    out = tmp_path_factory.mktemp("run-a")
    return _run(2, _args(checkpoint, out)), out


def _assert_matches(records: list[dict[str, Any]], ref: list[dict[str, float]]) -> None:
    assert [r["step"] for r in records] == list(range(1, len(ref) + 1))
    assert [r["loss"] for r in records] == pytest.approx([r["loss"] for r in ref],
                                                         abs=LOSS_ATOL)
    assert [r["grad_norm"] for r in records] == pytest.approx([r["grad_norm"] for r in ref],
                                                              rel=NORM_RTOL)


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_tp2_on_a_text_file_with_grad_accum_matches_one_process_over_the_global_batch(
        checkpoint: Path, uninterrupted: tuple[list[dict[str, Any]], Path]) -> None:
    """tp=2, two micro-batches of two sequences per step against one process over the four
    sequences at once: every step's loss, clipped norm (above max_grad_norm 1.0, so the clip
    acts) and learning rate. Scaling each micro-batch's loss by 1/2 is what makes the
    accumulated gradients the global batch's: without it the norms double."""
    records, out = uninterrupted
    ref = _reference(checkpoint, 2 * MICRO, _byte_ids())
    _assert_matches(records, ref)
    assert [r["lr"] for r in records] == pytest.approx([_expected_lr(s) for s in range(STEPS)],
                                                       rel=1e-12)
    assert all(r["grad_norm"] > 1.0 for r in records)
    assert all(r["tokens_per_s"] > 0 for r in records)
    assert (out / "final" / "config.json").is_file()


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_resume_at_tp1_continues_data_and_schedule_like_the_uninterrupted_run(
        checkpoint: Path, uninterrupted: tuple[list[dict[str, Any]], Path],
        tmp_path: Path) -> None:
    """Stopped after its step-2 checkpoint (--stop-after 2: the schedule still spans four
    steps, no export), resumed on one rank: steps 2 and 3 print the uninterrupted tp=2 run's
    losses, norms and learning rates (the batch and the lr are functions of the step, the
    AdamW moments come from the checkpoint)."""
    whole, _ = uninterrupted
    first = _run(2, _args(checkpoint, tmp_path, "--stop-after", "2"))
    assert not (tmp_path / "final").exists() and (tmp_path / "step-2" / ".metadata").is_file()
    resumed = _run(1, _args(checkpoint, tmp_path))
    assert [r["step"] for r in first + resumed] == list(range(1, STEPS + 1))
    _assert_matches(first + resumed, [{k: r[k] for k in ("loss", "grad_norm")} for r in whole])
    assert [r["lr"] for r in resumed] == [r["lr"] for r in whole[2:]]


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_bf16_autocast_trains_near_the_fp32_run(
        checkpoint: Path, uninterrupted: tuple[list[dict[str, Any]], Path],
        tmp_path: Path) -> None:
    """--bf16 runs the forward under autocast: the first loss is within 1e-3 of the fp32 run's
    (measured 6e-5) and not equal to it, so autocast was on."""
    fp32 = uninterrupted[0][0]["loss"]
    bf16 = _run(2, _args(checkpoint, tmp_path, "--stop-after", "1", "--bf16"))[0]["loss"]
    assert bf16 == pytest.approx(fp32, abs=1e-3)
    assert bf16 != fp32


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_a_checkpoint_tokenizer_json_tokenises_the_text(checkpoint: Path,
                                                         tmp_path: Path) -> None:
    """With a tokenizer.json beside the weights, the ids are transformers' tokenizer's (a word
    level vocabulary of the README's 127 commonest words plus [UNK] here), not bytes: the first
    loss equals one process on the tokenizer's ids."""
    import shutil
    from collections import Counter

    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    folder = tmp_path / "with-tokenizer"
    shutil.copytree(checkpoint, folder)
    words = Counter(DATA.read_text(encoding="utf-8").split()).most_common(127)
    vocab = {"[UNK]": 0, **{w: i + 1 for i, (w, _) in enumerate(words)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(folder)
    ids = torch.tensor(tok.encode(DATA.read_text(encoding="utf-8")).ids)
    assert (folder / "tokenizer.json").is_file() and ids.numel() > 1000

    got = _run(1, _args(folder, tmp_path / "out", "--stop-after", "1"))[0]
    ref = _reference_first_loss(folder, ids)
    assert got["loss"] == pytest.approx(ref, abs=LOSS_ATOL)
    assert got["loss"] != pytest.approx(_reference_first_loss(folder, _byte_ids()), abs=1e-3)


def _reference_first_loss(folder: Path, ids: torch.Tensor) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder)
    batch = ids[:2 * MICRO * SEQ].view(2 * MICRO, SEQ)
    return float(model(input_ids=batch, labels=batch).loss.detach())


def test_dp_with_a_tp_only_recipe_is_refused_naming_the_dp_recipe(
        checkpoint: Path, capsys: pytest.CaptureFixture[str]) -> None:
    w = str(checkpoint)
    with pytest.raises(SystemExit) as exc:
        TRAIN.parse_args(["--weights", w, "--out", "o", "--dp", "2", "--recipe", "llama"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert ("--dp 2 needs a recipe whose mesh declares dp; llama declares ['tp']. "
            "Use --recipe llama-dp") in err
    args = TRAIN.parse_args(["--weights", w, "--out", "o", "--dp", "2"])
    assert args.recipe == "llama-dp"
    assert TRAIN.parse_args(["--weights", w, "--out", "o"]).recipe == "llama"


def _saved(family: str, folder: Path) -> Path:
    """A ``save_pretrained`` checkpoint of the shipped tiny ``family`` config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads((ROOT / f"recipes/models/tiny-{family}.json").read_text())
    config = AutoConfig.for_model(family, **{k: v for k, v in fields.items()
                                             if k != "model_type"})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    return folder


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_recipe_auto_trains_a_qwen3_checkpoint_with_the_qwen3_recipe_like_one_process(
        tmp_path: Path) -> None:
    """No --recipe on a Qwen3 checkpoint: the shipped qwen3 recipe (before: llama's, whose
    q/k norms' gradients stay partial), and the losses and norms of one process at tp=2."""
    qwen3 = _saved("qwen3", tmp_path / "qwen3")
    argv = _args(qwen3, tmp_path / "out", "--stop-after", "2")
    assert TRAIN.parse_args(argv).recipe == "qwen3"
    records = _run(2, argv)
    _assert_matches(records, _reference(qwen3, 2 * MICRO, _byte_ids())[:2])


def test_recipe_auto_refuses_a_family_no_shipped_recipe_covers_naming_suggest(
        checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A model_type without a shipped recipe, and a family without a [dp, tp] variant at
    --dp 2, are refused by name (exit 2), before any rank starts."""
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "gemma2"}))
    with pytest.raises(SystemExit) as exc:
        TRAIN.parse_args(["--weights", str(other), "--out", "o"])
    assert exc.value.code == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "--recipe auto: no shipped recipe covers model_type 'gemma2'" in err
    assert f"hyperrecipe suggest --model hf:gemma2 --model-config {other}/config.json" in err
    assert "shipped families: gpt2, llama, mistral, mixtral, phi3, qwen2, qwen3" in err
    (other / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    with pytest.raises(SystemExit):
        TRAIN.parse_args(["--weights", str(other), "--out", "o", "--dp", "2"])
    err = " ".join(capsys.readouterr().err.split())
    assert "--recipe auto at --dp 2: no shipped recipe covers qwen3 on a [dp, tp] mesh" in err
    with pytest.raises(SystemExit):
        TRAIN.parse_args(["--weights", str(tmp_path / "none"), "--out", "o"])
    assert "--recipe auto reads the model_type of" in capsys.readouterr().err


@pytest.mark.slow  # launches ranks (docs/benchmarks.md#test-suite)
def test_eval_split_is_held_out_and_evaluated_like_one_process(
        checkpoint: Path, tmp_path: Path) -> None:
    """--eval-fraction 0.1 at tp=2: the last 10 % of the packed sequences never train (the
    training batches are one process's over the rest) and their mean loss, after steps 2 and
    4, is one process's over all of them at once; step numbers count optimizer steps done,
    from 1, in the records as in the progress line."""
    records = _run(2, _args(checkpoint, tmp_path, "--eval-fraction", "0.1", "--eval-every",
                            "2"))
    ids = _byte_ids()
    packed = ids[:ids.numel() // SEQ * SEQ].view(-1, SEQ)
    held = math.ceil(0.1 * packed.shape[0])
    train, evals = packed[:-held], packed[-held:]
    ref, ref_evals = _reference_with_eval(checkpoint, 2 * MICRO, train, evals, every=2)
    steps = [r for r in records if "loss" in r]
    _assert_matches(steps, ref)
    got = [(r["step"], r["eval_loss"], r["eval_sequences"]) for r in records
           if "eval_loss" in r]
    assert [(s, n) for s, _, n in got] == [(2, held), (4, held)]
    assert [v for _, v, _ in got] == pytest.approx(ref_evals, abs=LOSS_ATOL)
    line = TRAIN.progress_line(steps[0], STEPS)
    assert line.startswith("step 1/4 [#####") and steps[0]["step"] == 1


def _reference_with_eval(checkpoint: Path, rows: int, train: torch.Tensor,
                         evals: torch.Tensor, every: int
                         ) -> tuple[list[dict[str, float]], list[float]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    out, eval_losses = [], []
    for step in range(STEPS):
        ids = train[(step * rows + torch.arange(rows)) % train.shape[0]]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        for group in opt.param_groups:
            group["lr"] = _expected_lr(step)
        opt.step()
        opt.zero_grad()
        out.append({"loss": float(loss.detach()), "grad_norm": float(norm)})
        if (step + 1) % every == 0:
            with torch.no_grad():
                eval_losses.append(float(model(input_ids=evals, labels=evals).loss))
    return out, eval_losses


@pytest.mark.slow  # four fresh interpreters under torchrun (docs/benchmarks.md#test-suite)
def test_dp2_tp2_out_of_the_box_matches_one_process(checkpoint: Path, tmp_path: Path) -> None:
    """``torchrun --nproc-per-node 4 tools/train.py --dp 2`` with no --recipe (the shipped
    llama-dp, FSDP2 over dp): the printed loss (averaged over dp) and norm of every step equal
    one process over the global batch of 2 micro-batches x 2 dp ranks x 2 sequences. With
    --eval-fraction 0.1 the held-out blocks of 2 sequences are dealt over the two dp ranks (an
    odd count: one rank runs a forward for FSDP only) and the eval loss after steps 2 and 4 is
    one process's over all of them."""
    # the corpus cut to a block count whose held-out tenth deals unevenly over dp (README.md
    # grows with every stop; the deal must not depend on its length)
    raw = DATA.read_bytes()
    blocks = len(raw) // SEQ
    while math.ceil(math.ceil(0.1 * blocks) / MICRO) % 2 == 0:
        blocks -= 1
    data = tmp_path / "corpus.txt"
    data.write_bytes(raw[:blocks * SEQ])
    args = [str(data) if a == str(DATA) else a for a in _args(checkpoint, tmp_path)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
         str(ROOT / "tools/train.py"), "--dp", "2", *args,
         "--eval-fraction", "0.1", "--eval-every", "2"],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "recipe llama-dp (model_type llama), mesh {'dp': 2, 'tp': 2}" in proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    ids = torch.tensor(list(data.read_bytes())) % 128
    packed = ids[:ids.numel() // SEQ * SEQ].view(-1, SEQ)
    held = math.ceil(0.1 * packed.shape[0])
    assert math.ceil(held / MICRO) % 2 == 1  # the uneven deal this test is about
    ref, ref_evals = _reference_with_eval(checkpoint, 2 * 2 * MICRO, packed[:-held],
                                          packed[-held:], every=2)
    _assert_matches([r for r in records if "loss" in r], ref)
    assert [r["eval_loss"] for r in records if "eval_loss" in r] == pytest.approx(
        ref_evals, abs=LOSS_ATOL)


def test_help_names_the_recipe_for_dp(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        TRAIN.parse_args(["--help"])
    assert ("--recipe auto: the shipped recipe named after the checkpoint's config.model_type "
            "(recipes/qwen3.yaml for Qwen3), at --dp > 1 its <model_type>-dp variant "
            "(recipes/llama-dp.yaml, mesh [dp, tp])") in " ".join(capsys.readouterr().out.split())


def test_tokens_past_the_vocab_and_a_file_shorter_than_a_sequence_are_refused(
        tmp_path: Path) -> None:
    """A tokenizer whose ids pass the model's vocab_size would index past the embedding (an
    error on one rank, another row on a vocab shard): refused, naming both numbers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={"[UNK]": 0, "big": 300}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path)
    text = tmp_path / "text.txt"
    text.write_text("small big words", encoding="utf-8")
    with pytest.raises(SystemExit, match=r"produced id 300, but the model's vocab_size is 128"):
        TRAIN.tokenize(text, tmp_path, 128)

    ids, how = TRAIN.tokenize(text, tmp_path / "no-tokenizer", 128)
    assert how == "bytes modulo vocab 128" and ids.tolist() == list(b"small big words")
    with pytest.raises(SystemExit, match=r"--data holds 15 tokens, fewer than one --seq-len "
                                         r"\(16\) sequence"):
        TRAIN.Batches(ids, vocab=128, seq_len=16, micro_batch=1, grad_accum=1, dp=1)


def test_pp2_with_accumulation_and_clipping_matches_one_process_of_the_tool(
        checkpoint: Path, tmp_path: Path) -> None:
    """``--pp 2`` (the shipped ``llama-pp``: 1F1B, 4 microbatches, picked by ``--recipe auto``)
    over 5 steps of warmup + cosine, 2 micro-batches of 4 sequences accumulated per step and
    clipping active, against the same tool on one process (``llama``, no pipeline): losses to
    atol 1e-5, norms to rtol 1e-4, the model's defaults (tiny Llama from its checkpoint)."""
    def argv(out: Path, *extra: str) -> list[str]:
        return ["--weights", str(checkpoint), "--out", str(out), "--data", str(DATA),
                "--seq-len", str(SEQ), "--micro-batch", "4", "--grad-accum", "2", "--steps", "5",
                "--lr", str(LR), "--warmup-steps", str(WARMUP), "--max-grad-norm", "1.0",
                "--json", *extra]

    one = _run(1, argv(tmp_path / "one"))
    piped = _run(2, argv(tmp_path / "pp", "--pp", "2"))
    assert [r["step"] for r in piped] == [1, 2, 3, 4, 5]
    assert min(r["grad_norm"] for r in one) > 1.0, "clipping must be active"
    assert [r["loss"] for r in piped] == pytest.approx([r["loss"] for r in one], abs=LOSS_ATOL)
    assert [r["grad_norm"] for r in piped] == pytest.approx([r["grad_norm"] for r in one],
                                                            rel=NORM_RTOL)
    assert [r["lr"] for r in piped] == [r["lr"] for r in one]
