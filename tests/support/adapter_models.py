"""Third-party-style code for the adapter tests: forwards that call helper methods, with plain
buffers the helpers mix into their DTensor inputs.

``PositionalMLP.forward`` adds a slice of its position table (a plain buffer) to its input in
``add_positions(x, pos)``: DTensor refuses the mix unless ``pos`` is wrapped (``wrap``).
``rescale(h)`` multiplies by a buffer it reads itself, which no argument wrapping reaches: it must
run on local tensors (``marshal``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class PositionalMLP(nn.Module):
    table: torch.Tensor
    gain: torch.Tensor

    def __init__(self, dim: int = 8, hidden: int = 16, max_len: int = 16) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)
        self.register_buffer("table", torch.randn(max_len, dim))
        self.register_buffer("gain", torch.linspace(0.5, 1.5, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.add_positions(x, self.table[: x.shape[1]])
        out: torch.Tensor = self.down(F.gelu(self.up(self.rescale(h))))
        return out

    def add_positions(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return x + pos

    def rescale(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.gain


class PositionalToy(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.mlp = PositionalMLP(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        logits: torch.Tensor = self.head(h + self.mlp(h))
        return logits


def make_positional_toy() -> PositionalToy:
    torch.manual_seed(0)
    return PositionalToy()


class Helpers:
    """Methods of every kind, for install and restore."""

    def plain(self, x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
        return x * scale

    @staticmethod
    def static(x: torch.Tensor) -> torch.Tensor:
        return x + 1

    @classmethod
    def klass(cls, x: torch.Tensor) -> torch.Tensor:
        return x - 1

    def pair(self, x: torch.Tensor, extra: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        return x * 2, extra["y"] + 1


class DerivedHelpers(Helpers):
    """Inherits ``plain``: adapting it here sets it on this class and deletes it on restore."""


# Re-exported under a second name, as packages re-export classes at their top level.
HelpersAlias = Helpers
