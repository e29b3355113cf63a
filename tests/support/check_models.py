"""Models for ``hyperrecipe check`` tests: a plain-torch attention model whose forward splits
heads with an integer attribute, a Llama with non-zero biases, a factory that fails in one rank.

Only :func:`biased_llama` imports transformers (inside the function).
"""

from __future__ import annotations

import math
import os
import time
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


class HeadAttention(nn.Module):
    """Self-attention (no mask: a plain tensor mask would not mix with DTensors in validate mode) that splits heads with ``self.num_heads`` (``reshape(..., -1)``):
    with q/k/v sharded column-wise and the count left global, each rank silently splits its
    slice into too many, too narrow heads."""

    def __init__(self, dim: int, heads: int, qk_norm: bool = False) -> None:
        super().__init__()
        self.num_heads = heads
        self.head_dim = dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        # per-head norms (as Qwen3's q_norm/k_norm): with heads sharded, each rank's gradient
        # of their replicated weights covers only its heads
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else None
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        q, k, v = (t.reshape(b, n, self.num_heads, -1)
                   for t in (self.q(x), self.k(x), self.v(x)))
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        weights = F.softmax(q @ k.transpose(-1, -2) / math.sqrt(self.head_dim), dim=-1)
        out = (weights @ v).transpose(1, 2).reshape(b, n, -1)
        return self.o(out)


class AttnBlock(nn.Module):
    def __init__(self, dim: int, heads: int, qk_norm: bool = False) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = HeadAttention(dim, heads, qk_norm)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.norm(x))


class AttnToy(nn.Module):
    def __init__(self, vocab: int = 32, dim: int = 16, heads: int = 4, layers: int = 2,
                 qk_norm: bool = False) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(AttnBlock(dim, heads, qk_norm) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def make_attn_toy(**kwargs: Any) -> AttnToy:
    return AttnToy(**kwargs)


class UnlistedHeadSizeAttention(nn.Module):
    """ChatGLM-style names: the head size is ``hidden_size_per_attention_head``, which the
    resolver does not read as a head size, so a mid-head split compiles and fails at the
    ``view`` (each rank's q/k/v width is not a multiple of it)."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_attention_heads = heads
        self.hidden_size_per_attention_head = dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, n, _ = x.shape
        size = self.hidden_size_per_attention_head
        q, k, v = (t.view(b, n, -1, size).transpose(1, 2)
                   for t in (self.q(x), self.k(x), self.v(x)))
        weights = F.softmax(q @ k.transpose(-1, -2) / math.sqrt(size), dim=-1)
        return self.o((weights @ v).transpose(1, 2).reshape(b, n, -1))


def make_unlisted_head_size_toy(heads: int = 2, **kwargs: Any) -> AttnToy:
    """:class:`AttnToy` with :class:`UnlistedHeadSizeAttention` (2 heads of 8 by default)."""
    model = AttnToy(heads=heads, **kwargs)
    dim = model.embed.embedding_dim
    for layer in model.layers:
        layer.attn = UnlistedHeadSizeAttention(dim, heads)
    return model


def raising_in_rank_1(**kwargs: Any) -> AttnToy:
    """Builds in the parent and rank 0; raises in rank 1 (an injected failure)."""
    if os.environ.get("RANK") == "1":
        raise RuntimeError("injected failure while building the model in rank 1")
    return AttnToy(**kwargs)


def biased_llama(**fields: Any) -> nn.Module:
    """A tiny transformers Llama with attention and MLP biases drawn at random (transformers
    initialises biases to zero, which would hide a bias counted twice)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**{"attention_bias": True, "mlp_bias": True,
                            "attn_implementation": "eager", **fields})
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn_like(p) * 0.1)
    return model


def llama_inputs(model: nn.Module, *, batch: int, seq: int,
                 generator: torch.Generator) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """``--inputs`` for :func:`biased_llama`: token ids by keyword."""
    vocab = model.config.vocab_size  # type: ignore[union-attr]
    ids = torch.randint(0, vocab, (batch, seq), generator=generator)
    return (), {"input_ids": ids}


def hanging_in_the_parent(**kwargs: Any) -> AttnToy:
    """Never returns in the process that runs ``hyperrecipe check`` (no ``RANK`` set): a factory
    that waits on something that never comes."""
    if "RANK" not in os.environ:
        time.sleep(3600)
    return AttnToy(**kwargs)


def forward_hanging_in_the_parent(**kwargs: Any) -> AttnToy:
    """Builds everywhere; its forward never returns in the process that runs the check."""
    model = AttnToy(**kwargs)
    if "RANK" not in os.environ:
        model.register_forward_pre_hook(lambda module, args: time.sleep(3600))
    return model
