"""Tiny causal LMs and worker bodies for the pipeline runtime tests: each rank builds the model
from one seed, pipelines it, steps, and compares the loss and every gradient it holds with a
single-process run of the same model on the same batch (computed in the rank itself)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hyperrecipe.runtime import build_pipeline
from tests.support.pipeline_plans import pipeline_plan

TINY: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128),
    "qwen3": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, head_dim=8,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128),
    "mixtral": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=128,
                    num_local_experts=4, num_experts_per_tok=2),
    # GPT-2's dropout (0.1 by default) draws different numbers per process; 0 makes the
    # comparison exact. Everything else is the model's default (the tied embedding included).
    "gpt2": dict(n_embd=32, n_layer=4, n_head=4, n_positions=32, vocab_size=128,
                 resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                 eos_token_id=0),
}
LAYERS = {"gpt2": "transformer.h"}
BATCH, SEQ = 4, 16
RTOL = 1e-5
"""Per gradient: max |pipelined - reference| <= RTOL * max |reference| (fp32)."""


def tiny(family: str, layers: int = 4) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY[family])
    cfg["n_layer" if family == "gpt2" else "num_hidden_layers"] = layers
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(family, **cfg))


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :3] = -100  # ignored tokens make the microbatch counts differ
    return ids, labels


def mesh(pp: int = 2) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (pp,), mesh_dim_names=("pp",))


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    scale = max(expected.abs().max().item(), 1e-12)
    return (actual - expected).abs().max().item() / scale


def reference(family: str, layers: int) -> tuple[float, dict[str, torch.Tensor]]:
    model = tiny(family, layers)
    ids, labels = batch()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters(remove_duplicate=False)
                         if p.grad is not None}


def one_step(family: str, schedule: str, stages_per_rank: int = 1,
             layers: int = 4) -> dict[str, Any]:
    """Loss error and the worst relative gradient error over this rank's parameters."""
    ref_loss, ref_grads = reference(family, layers)
    model = tiny(family, layers)
    plan = pipeline_plan(model, layers=LAYERS.get(family, "model.layers"), schedule=schedule,
                         stages_per_rank=stages_per_rank)
    pipe = build_pipeline(model, plan, mesh())
    ids, labels = batch()
    loss = pipe.step(input_ids=ids, labels=labels)
    named = dict(pipe.named_parameters())
    errs = {fqn: rel_err(p.grad, ref_grads[fqn]) for fqn, p in named.items()}
    return {"loss_err": abs(loss.item() - ref_loss), "grad_err": max(errs.values()),
            "params": sorted(named),
            "aliases": sorted(n for m in pipe.modules
                              for n, _ in m.named_parameters(remove_duplicate=False)),
            "stages": [s.index for s in pipe.stages],
            "no_grad": [f for f, p in named.items() if p.grad is None]}


def schedules_worker(rank: int, world: int, family: str,
                     cases: list[tuple[str, int, int]]) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    return [one_step(family, s, spr, layers) for s, spr, layers in cases]


def batch_of(k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + k)
    ids = torch.randint(0, 128, (BATCH, SEQ), generator=g)
    labels = ids.clone()
    labels[k % BATCH, : 2 + k % 5] = -100
    return ids, labels


EPS = 1e-6
"""AdamW's eps: a gradient that is zero in exact arithmetic (GPT-2's key bias: softmax ignores
it) is float noise of ~1e-9 in both runs, and at the default 1e-8 Adam turns each run's noise into
a full +-lr step of its own sign."""


def training_worker(rank: int, world: int, family: str, schedule: str, stages_per_rank: int,
                    steps: int = 5, accumulate: int = 2, max_norm: float = 0.5,
                    lr: float = 1e-3) -> dict[str, Any]:
    """``steps`` AdamW steps, each over ``accumulate`` batches and clipped, pipelined and on one
    process; the norms and losses of every step and the worst final parameter error."""
    torch.set_num_threads(1)
    ref = tiny(family)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=lr, eps=EPS)
    model = tiny(family)
    plan = pipeline_plan(model, layers=LAYERS.get(family, "model.layers"), schedule=schedule,
                         stages_per_rank=stages_per_rank)
    pipe = build_pipeline(model, plan, mesh())
    opt = torch.optim.AdamW(pipe.parameters(), lr=lr, eps=EPS)
    out: dict[str, Any] = {"norms": [], "ref_norms": [], "losses": [], "ref_losses": []}
    for step in range(steps):
        ref_opt.zero_grad()
        opt.zero_grad()
        for micro in range(accumulate):
            ids, labels = batch_of(step * accumulate + micro)
            ref_loss = ref(input_ids=ids, labels=labels).loss
            ref_loss.backward()
            out["ref_losses"].append(ref_loss.item())
            out["losses"].append(pipe.step(input_ids=ids, labels=labels).item())
        out["ref_norms"].append(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm).item())
        out["norms"].append(pipe.clip_grad_norm_(max_norm).item())
        ref_opt.step()
        opt.step()
    ref_params = dict(ref.named_parameters(remove_duplicate=False))
    # Adam moves an element by about lr per step at most: the error is measured against that
    # bound (a parameter that starts at zero has no scale of its own).
    errs = {n: (p.detach() - ref_params[n].detach()).abs().max().item() / (lr * steps)
            for n, p in pipe.named_parameters()}
    out["param_err"] = max(errs.values())
    out["worst"] = max(errs, key=lambda n: errs[n])
    return out


class ToyBlock(nn.Module):
    """A residual block; returns ``(hidden, bias)``: the bias it was given, or its own when
    ``makes_bias`` (T5's position bias: computed by the first layer, passed to the rest)."""

    def __init__(self, hidden: int, makes_bias: bool) -> None:
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)
        self.makes_bias = makes_bias

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> tuple[Any, Any]:
        if self.makes_bias:
            bias = torch.tanh(self.lin.bias) + torch.zeros_like(x)
        y = x + torch.tanh(self.lin(x))
        return y if bias is None else y + bias, bias


class Toy(nn.Module):
    """embed -> 4 blocks -> head, returning logits; ``misuse`` breaks the stage contract:
    ``head_early`` (a last module before the layers), ``layer_early`` (the last layer before
    the others), ``embed_late`` (a first module inside
    the layers), ``bias`` (the first layer's bias handed to every later layer)."""

    def __init__(self, misuse: str = "", hidden: int = 32, vocab: int = 128) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(ToyBlock(hidden, misuse == "bias" and i == 0)
                                    for i in range(4))
        self.head = nn.Linear(hidden, vocab)
        self.misuse = misuse

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(input_ids)
        if self.misuse == "head_early":
            h = h + self.head(h)[..., : h.shape[-1]]
        if self.misuse == "layer_early":
            h = self.layers[3](h)[0]
        bias = None
        for i, layer in enumerate(self.layers):
            if self.misuse == "embed_late" and i == 3:
                h = h + self.embed(input_ids)
            h, bias = layer(h, bias=bias)
        logits: torch.Tensor = self.head(h)
        return logits


def toy_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), target.flatten())


def toy(misuse: str = "", device: str = "cpu") -> Toy:
    torch.manual_seed(0)
    with torch.device(device):
        return Toy(misuse)


def misuse_worker(rank: int, world: int, misuse: str) -> None:
    torch.set_num_threads(1)
    model = toy(misuse)
    pipe = build_pipeline(model, pipeline_plan(model, layers="layers"), mesh(),
                          loss_fn=toy_loss)
    ids, _ = batch()
    pipe.step(input_ids=ids, target=ids)


def _untouched(model: nn.Module, before: dict[str, int]) -> bool:
    from hyperrecipe.runtime.pipeline.placeholder import StagePlaceholder

    now = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    return (now == before and not any(isinstance(m, StagePlaceholder) for m in model.modules())
            and not any("forward" in vars(m) for m in model.modules()))


def contract_worker(rank: int, world: int) -> dict[str, Any]:
    """The checks that leave the group usable, on one group: refusals at build time (and the
    model left as it was), the loss_fn route, a model built on meta."""
    import attrs

    from hyperrecipe.errors import PipelineError, PipelineUnsupportedError, PlanMismatchError

    torch.set_num_threads(1)
    out: dict[str, Any] = {}
    dev_mesh = mesh()
    model = tiny("llama")
    before = {n: id(p) for n, p in model.named_parameters(remove_duplicate=False)}
    plan = pipeline_plan(model)
    assert plan.pipeline is not None
    loose = attrs.evolve(plan, pipeline=attrs.evolve(plan.pipeline, last=("lm_head",)))
    try:  # model.norm is in no list: refused on every rank before anything changes
        build_pipeline(model, loose, dev_mesh)
    except PipelineError as exc:
        out["loose"] = str(exc)
    out["loose_untouched"] = _untouched(model, before)
    stages = list(plan.pipeline.stages)
    stages[0] = attrs.evolve(stages[0], params=stages[0].params[1:])
    wrong = attrs.evolve(plan, pipeline=attrs.evolve(plan.pipeline, stages=tuple(stages)))
    try:  # stage 0's parameters differ: rank 0 finds it after its placeholders went in
        built = build_pipeline(model, wrong, dev_mesh)
    except PipelineError as exc:
        out["rollback"] = str(exc)
        out["rollback_untouched"] = _untouched(model, before)
    else:  # rank 1's stage is the plan's own
        built.restore()
        out["rollback_elsewhere_restored"] = _untouched(model, before)

    # the plan of another model (4 layers) on this one (2 layers): refused on every rank by
    # the agreement before anything changes
    other = pipeline_plan(tiny("llama", 2))
    try:
        build_pipeline(model, other, dev_mesh)
    except PlanMismatchError as exc:
        out["other_model"] = str(exc)
    out["other_model_untouched"] = _untouched(model, before)

    # a model whose forward computes no causal-LM loss of its own, without loss_fn
    plain = toy()
    try:
        build_pipeline(plain, pipeline_plan(plain, layers="layers"), dev_mesh)
    except PipelineUnsupportedError as exc:
        out["no_loss"] = str(exc)

    # loss_fn: a model without labels; equal microbatches, so the mean of means is exact
    ref = toy()
    ids, _ = batch()
    ref_loss = toy_loss(ref(ids), ids)
    ref_loss.backward()
    model_t = toy()
    pipe = build_pipeline(model_t, pipeline_plan(model_t, layers="layers"), dev_mesh,
                          loss_fn=toy_loss)
    loss = pipe.step(input_ids=ids, target=ids)
    ref_grads = dict(ref.named_parameters())
    out["loss_fn_loss_err"] = abs(loss.item() - ref_loss.item())
    out["loss_fn_grad_err"] = max(rel_err(p.grad, ref_grads[n].grad)
                                  for n, p in pipe.named_parameters())

    # a model on meta: the rank's own parameters and buffers get storage, the caller loads them
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        meta_model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama",
                                                                          **TINY["llama"]))
    pipe = build_pipeline(meta_model, pipeline_plan(meta_model), dev_mesh)
    from hyperrecipe.runtime.pipeline.placeholder import StagePlaceholder

    out["meta_on_cpu"] = all(not p.is_meta for p in pipe.parameters())
    holders = [m for module in pipe.modules for m in module.modules()
               if isinstance(m, StagePlaceholder)]
    out["placeholders_hold_no_storage"] = bool(holders) and all(
        t.is_meta for h in holders for t in h.__dict__["_hr_meta"].parameters())
    mine = {f for s in pipe.stages for f in s.params}
    out["holds_only_its_stage"] = {n for n, _ in pipe.named_parameters()} == mine
    ref_model = tiny("llama")
    ref_params = dict(ref_model.named_parameters())
    ref_buffers = dict(ref_model.named_buffers())
    with torch.no_grad():
        for n, p in pipe.named_parameters():
            p.copy_(ref_params[n])
        for module in pipe.modules:
            for n, b in module.named_buffers():
                b.copy_(ref_buffers[n])
    ids, labels = batch()
    loss = pipe.step(input_ids=ids, labels=labels)
    ref_loss2, ref_grads2 = reference("llama", 4)
    out["meta_loss_err"] = abs(loss.item() - ref_loss2)
    out["meta_grad_err"] = max(rel_err(p.grad, ref_grads2[n]) for n, p in pipe.named_parameters())
    return out
