"""Plain-torch causal-LM toys for ``hyperrecipe check`` at pipeline parallel: each one breaks
the pipeline's contract silently (the runtime raises nothing), so only values can show it.

- ``skip_embeddings``: the model's own loop adds the embeddings back after every layer
  (``h = layer(h) + x0``). A stage sends its last layer's output; the next stage starts from
  that, not from the sum, and its ``x0`` is a placeholder's zeros.
- ``batch_centered``: every layer subtracts the mean over the batch's rows, so a microbatch's
  rows give other values than the whole batch's.
"""

from __future__ import annotations

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int, batch_centered: bool) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = nn.Linear(dim, dim)
        self.batch_centered = batch_centered

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = h + self.ff(self.norm(h))
        return out - out.mean(dim=0, keepdim=True) if self.batch_centered else out


class ToyLM(nn.Module):
    def __init__(self, *, vocab: int = 64, dim: int = 16, layers: int = 2,
                 skip_embeddings: bool = False, batch_centered: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, batch_centered) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.skip_embeddings = skip_embeddings

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        x0 = self.embed(input_ids)
        h = x0
        for layer in self.layers:
            h = layer(h)
            if self.skip_embeddings:
                h = h + x0
        logits: torch.Tensor = self.head(self.norm(h))
        return logits


def toy_lm(**config: object) -> ToyLM:
    return ToyLM(**config)  # type: ignore[arg-type]
