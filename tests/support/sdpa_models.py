"""A small causal Transformer whose attention calls ``F.scaled_dot_product_attention`` itself, in
the style of the test Transformer in torch's own distributed tests (no transformers import).

Validate mode cannot run it on the CPU as it is: torch 2.13 has no DTensor sharding strategy for
the CPU flash kernel SDPA dispatches to, and the call is inline in ``Attention.forward``, so a
method adapter has nothing to name. A function adapter replaces ``F.scaled_dot_product_attention``
while the attention modules run (``tests/recipes/sdpa-toy-tp.yaml``).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(b, s, -1, self.head_dim).transpose(1, 2)

        out = F.scaled_dot_product_attention(heads(self.wq(x)), heads(self.wk(x)),
                                             heads(self.wv(x)), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden)
        self.w2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.gelu(self.w1(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attention_norm = nn.LayerNorm(dim)
        self.attention = Attention(dim, heads)
        self.ffn_norm = nn.LayerNorm(dim)
        self.feed_forward = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class SdpaTransformer(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 4, hidden: int = 32,
                 layers: int = 2, max_seq: int = 16) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos_embeddings = nn.Embedding(max_seq, dim)
        self.layers = nn.ModuleList(Block(dim, heads, hidden) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        h = self.tok_embeddings(tokens) + self.pos_embeddings(positions)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def make_sdpa_transformer(**kwargs: int) -> SdpaTransformer:
    return SdpaTransformer(**kwargs)
