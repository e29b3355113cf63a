"""The stage's two edges inside the model's own forward: where it starts and where it stops.

The entry is the first owned layer's forward: it swaps the hidden states received from the
previous stage in for the placeholder zeros the model computed, refuses a placeholder's zeros in
any other argument, and marks the stage as inside its layers. The exit is the last owned layer's
forward: it runs the layer and stops the model's forward with :class:`~hyperrecipe.errors.StageDone`, carrying the
hidden states to send. Both are one replacement forward per layer, installed by the rewriter
(a stage of one layer is entry and exit at once); nothing here assigns ``forward`` itself.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from hyperrecipe.errors import PipelineError, StageBoundaryError, StageDone
from hyperrecipe.runtime.pipeline.placeholder import StageRun

__all__ = ["edge_forward", "hidden_states_of"]


def hidden_states_of(output: Any, fqn: str) -> torch.Tensor:
    """The hidden states a layer returns: the tensor itself, or the first element of a tuple
    (the older transformers layers return ``(hidden_states, attn_weights, ...)``)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    msg = (f"{fqn} returned {type(output).__name__}; a layer of the pipeline's split list must "
           f"return its hidden states (a tensor, or a tuple starting with one) to send them on")
    raise PipelineError(msg)


def edge_forward(layer: torch.nn.Module, fqn: str, run: StageRun, *, swap: bool,
                 exit_: bool) -> Callable[..., Any]:
    """The replacement forward of a stage's first (``entry``) and/or last (``exit_``) layer.

    Args:
        layer: the owned layer; its original forward is looked up now, once.
        fqn: the layer's FQN, for messages.
        run: the stage's call state (received hidden states, placeholder outputs, phase).
        swap: this is the first owned layer of a stage that is not the first: swap the
            received hidden states in. (Every stage's first layer gets an edge, so a probe
            call, ``run.probing``, can stop there and report the hidden states' shape.)
        exit_: stop the model's forward after this layer (a stage that is not the last).

    Returns:
        A callable taking the layer's arguments, for ``Rewrite.install_forward``.
    """
    original: Callable[..., Any] = layer.forward
    params = list(inspect.signature(original).parameters.values())
    if not params or params[0].kind not in (inspect.Parameter.POSITIONAL_ONLY,
                                            inspect.Parameter.POSITIONAL_OR_KEYWORD):
        msg = (f"{fqn}: its forward takes no positional hidden-states argument "
               f"({inspect.signature(original)}); a pipeline stage starts by handing the "
               f"received hidden states to the first argument of its first layer")
        raise PipelineError(msg)
    hidden_name = params[0].name

    def swap_in(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...],
                                                                        dict[str, Any]]:
        received = run.received
        if args:
            rest: Any = (args[1:], kwargs)
            args = (received, *args[1:])
        elif hidden_name in kwargs:
            rest = {k: v for k, v in kwargs.items() if k != hidden_name}
            kwargs = {**kwargs, hidden_name: received}
        else:
            msg = f"{fqn} was called without its hidden states {hidden_name!r}"
            raise PipelineError(msg)
        for leaf in pytree.tree_leaves(rest):
            if isinstance(leaf, torch.Tensor) and run.made_here(leaf):
                msg = (f"{fqn}, the first layer of pipeline stage {run.stage}, got an argument "
                       f"computed from another stage's module (a placeholder stands in for it "
                       f"here: zeros) besides its hidden states: only the hidden states cross a "
                       f"stage boundary. Compute it on every stage (a module without "
                       f"parameters), or put the modules producing it in the recipe's "
                       f"pipeline.first so stage 0 owns them")
                raise StageBoundaryError(msg)
        return args, kwargs

    def forward(*args: Any, **kwargs: Any) -> Any:
        if run.phase == "before":
            if run.probing:
                hidden = args[0] if args else kwargs.get(hidden_name)
                raise StageDone(hidden_states_of(hidden, fqn))
            if swap:
                args, kwargs = swap_in(args, kwargs)
            run.phase = "inside"
        out = original(*args, **kwargs)
        if exit_:
            # torch's stages check the strides of what is sent against the example's
            raise StageDone(hidden_states_of(out, fqn).contiguous())
        return out

    return forward
