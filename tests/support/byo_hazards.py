"""Plain-torch models with the forwards whose sharding ``check`` must explain (issue 39): heads
fixed in an einops pattern (as a layer, and in a call in the forward), and a float32 model that
computes part of its forward in bfloat16 (an explicit cast, as torchtitan's grouped experts do,
and an ``autocast`` region). nanoGPT's attention (the width read off the input) and the
``nn.MultiheadAttention`` encoder are ``tests/support/byo_models.py``'s. Each factory takes its
config fields as keyword arguments (the ``--model pkg.mod:factory`` contract)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.nn import functional as F


# --- heads fixed in einops (lucidrains' style) --------------------------------------------------

class EinopsLayerAttention(nn.Module):
    """Splits heads with an einops ``Rearrange`` layer built with ``h=heads``."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        from einops.layers.torch import Rearrange

        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.to_qkv = nn.Linear(dim, 3 * inner, bias=False)
        self.split_heads = Rearrange("b n (h d) -> b h n d", h=heads)
        self.merge_heads = Rearrange("b h n d -> b n (h d)")
        self.to_out = nn.Linear(inner, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.split_heads(t) for t in self.to_qkv(x).chunk(3, dim=-1))
        return self.to_out(self.merge_heads(F.scaled_dot_product_attention(q, k, v)))


class EinopsCallAttention(EinopsLayerAttention):
    """Splits heads with ``rearrange(t, ..., h=self.heads)`` in its forward."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__(dim, heads, dim_head)
        del self.split_heads  # the pattern is in the forward

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from einops import rearrange

        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.heads)
                   for t in self.to_qkv(x).chunk(3, dim=-1))
        return self.to_out(self.merge_heads(F.scaled_dot_product_attention(q, k, v)))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, attn: nn.Module, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm_1 = nn.LayerNorm(dim)
        self.attn = attn
        self.norm_2 = nn.LayerNorm(dim)
        self.ff = FeedForward(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.ff(self.norm_2(x))


class TokenModel(nn.Module):
    def __init__(self, vocab_size: int, dim: int, blocks: list[nn.Module]) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(blocks)
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


def make_einops_layer(vocab_size: int = 64, dim: int = 32, heads: int = 4, dim_head: int = 8,
                      hidden: int = 64, layers: int = 2) -> TokenModel:
    return TokenModel(vocab_size, dim, [Block(EinopsLayerAttention(dim, heads, dim_head), dim,
                                              hidden) for _ in range(layers)])


def make_einops_call(vocab_size: int = 64, dim: int = 32, heads: int = 4, dim_head: int = 8,
                     hidden: int = 64, layers: int = 2) -> TokenModel:
    return TokenModel(vocab_size, dim, [Block(EinopsCallAttention(dim, heads, dim_head), dim,
                                              hidden) for _ in range(layers)])


# --- 16-bit computation inside a float32 model ---------------------------------------------------

class Bf16Linear(nn.Linear):
    """An ``nn.Linear`` whose matmul runs in bfloat16 on float32 weights and hands back float32,
    as torchtitan's grouped experts do around ``_grouped_mm``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(torch.bfloat16)  # deferred: None
        return F.linear(x.to(torch.bfloat16), self.weight.to(torch.bfloat16), bias).float()


class AutocastFeedForward(FeedForward):
    """Runs its projections under ``torch.autocast`` in bfloat16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = self.down(F.gelu(self.up(x)))
        return h.float()


def _mlp_model(vocab_size: int, dim: int, hidden: int, layers: int,
               make_ff: Callable[[int, int], nn.Module]) -> TokenModel:
    return TokenModel(vocab_size, dim, [_MlpBlock(dim, make_ff(dim, hidden))
                                        for _ in range(layers)])


class _MlpBlock(nn.Module):
    def __init__(self, dim: int, ff: nn.Module) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.ff = ff

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.ff(self.norm(x))


class _Bf16FeedForward(FeedForward):
    def __init__(self, dim: int, hidden: int) -> None:
        nn.Module.__init__(self)
        self.up = Bf16Linear(dim, hidden)
        self.down = Bf16Linear(hidden, dim)


def make_bf16_cast(vocab_size: int = 64, dim: int = 32, hidden: int = 64,
                   layers: int = 2) -> TokenModel:
    """A float32 model whose MLP projections cast to bfloat16 (``x.to(torch.bfloat16)``)."""
    return _mlp_model(vocab_size, dim, hidden, layers, _Bf16FeedForward)


def make_bf16_autocast(vocab_size: int = 64, dim: int = 32, hidden: int = 64,
                       layers: int = 2) -> TokenModel:
    """A float32 model whose MLPs run under ``torch.autocast(dtype=torch.bfloat16)``."""
    return _mlp_model(vocab_size, dim, hidden, layers, AutocastFeedForward)
