"""Small plain-torch models for fast tests (no transformers import)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.num_heads = heads  # a stand-in head count, for head_counts tests
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm residual block; the residual stays outside the MLP boundary."""

    def __init__(self, dim: int, hidden: int, heads: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = MLP(dim, hidden, heads)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class Toy(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 8, hidden: int = 16, layers: int = 2,
                 heads: int = 4, tie: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, hidden, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        if tie:
            self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def make_toy(**kwargs: object) -> Toy:
    return Toy(**kwargs)  # type: ignore[arg-type]
