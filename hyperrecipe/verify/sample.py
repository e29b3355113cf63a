"""What ``hyperrecipe check`` runs: the seeded model, the sample batch and the loss.

The reference (in the parent) and every rank build the model the same way — ``torch.manual_seed``
then :func:`~hyperrecipe.model_tree.build_model` on the CPU, in ``eval()`` mode so dropout cannot
make two runs differ — with every all-zero parameter drawn at random (a zero bias hides its own
misplacement), and feed it the same batch. The loss is the **mean of squares of the first
output** (the logits of a causal LM, a classifier or a seq2seq LM, named ``logits`` wherever the
output has them; a base model's last hidden state): every output element gets a non-zero
gradient, no labels are needed, and it is the same function on every rank once the output is
replicated. An MoE model that returns its router load-balancing loss (``aux_loss``: its config
sets ``output_router_logits``) has it added, so its path is checked too; before, ``aux_loss``
came first in such an output and was all that check compared.

Nothing here knows about process groups or plans.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import attrs
import torch
from torch import Tensor, nn

from hyperrecipe.errors import ModelSpecError
from hyperrecipe.refs import RefError, resolve_ref
from hyperrecipe.model_tree import build_model

__all__ = [
    "Sample",
    "build_seeded",
    "build_seeded_noting",
    "draw_zero_parameters",
    "first_output",
    "loss_of",
    "make_sample",
    "weights_fingerprint",
]


@attrs.frozen(kw_only=True, eq=False)
class Sample:
    """Positional and keyword arguments of one forward call, and how they were made."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    description: str

    def to(self, device: torch.device) -> Sample:
        """The same sample with every tensor (also inside lists, tuples, dicts) on ``device``."""
        from torch.utils import _pytree

        def move(v: Any) -> Any:
            return v.to(device) if isinstance(v, Tensor) else v

        args, kwargs = _pytree.tree_map(move, (self.args, self.kwargs))
        return attrs.evolve(self, args=tuple(args), kwargs=dict(kwargs))


def build_seeded(spec: str, config: Mapping[str, Any] | None, seed: int) -> nn.Module:
    """The model of ``spec`` on the CPU with ``torch.manual_seed(seed)`` set first, in eval mode,
    its all-zero parameters drawn at random (:func:`draw_zero_parameters`).

    Raises:
        ModelSpecError: the spec cannot be built.
    """
    return build_seeded_noting(spec, config, seed)[0]


def build_seeded_noting(spec: str, config: Mapping[str, Any] | None, seed: int
                        ) -> tuple[nn.Module, list[str]]:
    """:func:`build_seeded`, and the names of the parameters it drew because they were zero."""
    torch.manual_seed(seed)
    model = build_model(spec, config, device="cpu")
    model.eval()
    return model, draw_zero_parameters(model, seed)


def draw_zero_parameters(model: nn.Module, seed: int) -> list[str]:
    """Draw every all-zero floating parameter from ``N(0, 0.1^2)`` (a generator seeded from
    ``seed``, so the reference and every rank draw the same); return their names.

    transformers initialises biases (and GPT-OSS's per-expert biases, attention sinks) to zero.
    A zero parameter hides every misplacement of itself: a bias added once per rank, or an expert
    bias indexed with another rank's expert ids, still adds zero, and the check would agree on a
    recipe that is wrong for every trained checkpoint. The check compares one model both ways, so
    any values serve; nonzero ones make each parameter's placement visible.
    """
    g = torch.Generator().manual_seed(seed + 0x5EED)
    drawn: list[str] = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.is_floating_point() and p.numel() > 0 and not bool(p.any()):
                p.copy_((torch.randn(p.shape, generator=g) * 0.1).to(p.dtype))
                drawn.append(name)
    return drawn


def weights_fingerprint(model: nn.Module) -> tuple[tuple[str, float, float], ...]:
    """Per parameter: name, sum and sum of absolute values (float64). Cheap, and equal for two
    models built from the same seed on the same device, so a rank can tell that it built the
    reference's weights."""
    with torch.no_grad():
        return tuple((name, float(p.double().sum()), float(p.double().abs().sum()))
                     for name, p in model.named_parameters())


def _import_callable(spec: str, what: str) -> Callable[..., Any]:
    try:
        target = resolve_ref(spec, what, named_by_user=True)
    except RefError as exc:
        raise ModelSpecError(str(exc)) from None
    if not callable(target):
        raise ModelSpecError(f"{what} {spec!r} is not callable")
    return target  # type: ignore[no-any-return]


def _vocab_of(model: nn.Module, spec: str) -> int:
    """The token-id range of the model's text input. A composite model (vision + text) keeps
    the vocabulary on its text config and its first embedding may be a vision tower's position
    table, so the text config and the model's own input embedding come before any embedding
    found by walking the modules."""
    if spec.startswith("hf:"):
        config: Any = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        for source in (text, config):
            vocab = getattr(source, "vocab_size", None)
            if isinstance(vocab, int) and vocab > 0:
                return vocab
    inputs = getattr(model, "get_input_embeddings", None)
    embedding = inputs() if callable(inputs) else None
    if isinstance(embedding, nn.Embedding):
        return int(embedding.num_embeddings)
    for module in model.modules():
        if isinstance(module, nn.Embedding):
            return int(module.num_embeddings)
    msg = (f"cannot make a sample batch for {spec!r}: it has no nn.Embedding to take a vocabulary "
           f"size from; pass --inputs pkg.module:make_inputs (called as make_inputs(model, "
           f"batch=B, seq=L, generator=g), returning (args, kwargs))")
    raise ModelSpecError(msg)


def make_sample(model: nn.Module, spec: str, *, batch: int, seq: int, seed: int,
                inputs: str | None = None) -> Sample:
    """The batch every run of one check feeds the model.

    Args:
        model: the built model (its vocabulary size, or image size, is read from it).
        spec: the model spec. ``hf:`` models get keyword arguments by what the model reads
            first (its ``main_input_name``): ``input_ids``, plus ``decoder_input_ids`` of the
            same shape for an encoder-decoder (T5, BART: they have no decoder input of their
            own without labels), or ``pixel_values`` of the config's ``num_channels`` and
            ``image_size`` for a vision model (ViT); every other argument keeps the model's
            default. Other specs get the token ids as their one positional argument.
        batch: rows of token ids, or images.
        seq: tokens per row (encoder and decoder alike); images take their size from the config.
        seed: seeds the generator the ids (or ``inputs``) draw from.
        inputs: ``pkg.module:make_inputs``, called as ``make_inputs(model, batch=, seq=,
            generator=)`` and returning ``(args, kwargs)``; overrides the token ids.

    Raises:
        ModelSpecError: no vocabulary size to draw ids from, an ``hf:`` model that reads
            something else first (audio features), or ``inputs`` is not usable.
    """
    g = torch.Generator().manual_seed(seed)
    if inputs is not None:
        fn = _import_callable(inputs, "--inputs")
        try:
            made = fn(model, batch=batch, seq=seq, generator=g)
        except Exception as exc:  # user code: report, don't trace
            raise ModelSpecError(f"--inputs {inputs!r} failed: {type(exc).__name__}: {exc}") from exc
        if (not isinstance(made, tuple) or len(made) != 2 or not isinstance(made[0], (tuple, list))
                or not isinstance(made[1], Mapping)):
            raise ModelSpecError(f"--inputs {inputs!r} must return (args, kwargs): a tuple of "
                                 f"positional arguments and a dict of keyword arguments")
        return Sample(args=tuple(made[0]), kwargs=dict(made[1]), description=f"from {inputs}")
    if spec.startswith("hf:"):
        return _hf_sample(model, spec, batch=batch, seq=seq, generator=g)
    vocab = _vocab_of(model, spec)
    ids = torch.randint(0, vocab, (batch, seq), generator=g)
    return Sample(args=(ids,), kwargs={}, description=f"token ids [{batch}, {seq}] < {vocab}")


def _hf_sample(model: nn.Module, spec: str, *, batch: int, seq: int,
               generator: torch.Generator) -> Sample:
    """A transformers model's batch, by its ``main_input_name`` (see :func:`make_sample`)."""
    config = getattr(model, "config", None)
    main = getattr(model, "main_input_name", "input_ids")
    if main == "pixel_values":
        channels = getattr(config, "num_channels", 3)
        size = getattr(config, "image_size", None)
        side = tuple(size) if isinstance(size, (tuple, list)) else (size, size)
        if not all(isinstance(s, int) and s > 0 for s in side) or not isinstance(channels, int):
            raise ModelSpecError(f"cannot make pixel values for {spec!r}: its config has no "
                                 f"integer image_size and num_channels (image_size={size!r}); "
                                 f"pass --inputs pkg.module:make_inputs")
        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        shape = (batch, channels, *side)
        pixels = torch.randn(shape, generator=generator).to(dtype)
        return Sample(args=(), kwargs={"pixel_values": pixels},
                      description=f"pixel values {list(shape)} ~ N(0, 1)")
    if main != "input_ids":
        raise ModelSpecError(f"cannot make a sample batch for {spec!r}: it reads {main!r} first "
                             f"and check makes input_ids and pixel_values only; pass --inputs "
                             f"pkg.module:make_inputs (called as make_inputs(model, batch=B, "
                             f"seq=L, generator=g), returning (args, kwargs))")
    vocab = _vocab_of(model, spec)
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    text = f"token ids [{batch}, {seq}] < {vocab}"
    if not getattr(config, "is_encoder_decoder", False):
        return Sample(args=(), kwargs={"input_ids": ids}, description=text)
    decoder_ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    return Sample(args=(), kwargs={"input_ids": ids, "decoder_input_ids": decoder_ids},
                  description=f"{text}, decoder token ids [{batch}, {seq}]")


def first_output(out: Any) -> Any:
    """The first output of a forward: the tensor itself, the first field of a ``ModelOutput`` or
    mapping (``logits`` when no labels were given), or the first item of a tuple or list."""
    if isinstance(out, Tensor):
        return out
    if isinstance(out, Mapping):
        if out.get("logits") is not None:  # before an MoE output's aux_loss
            return out["logits"]
        for value in out.values():
            if value is not None:
                return value
        return None
    if isinstance(out, (tuple, list)) and out:
        return out[0]
    return None


def loss_of(out: Any) -> Tensor:
    """Mean of squares of the first output, in fp32, plus the router loss (``aux_loss``) an
    MoE model returns.

    A DTensor output (a plan whose root is a boundary, in validate mode) is made whole first,
    differentiably, so the loss is the same function on every rank.

    Raises:
        ModelSpecError: the model's first output is not a floating-point tensor.
    """
    first = first_output(out)
    if not isinstance(first, Tensor) or not first.is_floating_point():
        found = type(first).__name__ if not isinstance(first, Tensor) else f"a {first.dtype} tensor"
        raise ModelSpecError(f"the model's first output is {found}; check needs a floating-point "
                             f"tensor to take the mean of squares of")
    from torch.distributed.tensor import DTensor

    if isinstance(first, DTensor):
        first = first.full_tensor()
    loss = first.float().pow(2).mean()
    aux = out.get("aux_loss") if isinstance(out, Mapping) else None
    if isinstance(aux, Tensor) and aux.is_floating_point() and aux.requires_grad:
        loss = loss + (aux.full_tensor() if isinstance(aux, DTensor) else aux).float()
    return loss
