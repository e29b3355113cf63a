"""A model written as litgpt (0.5) writes its attention, for tests/suggest/test_suggest_grouped.py.

The attention holds no head count of its own: its forward reads ``n_head``, ``n_query_groups``
and ``head_size`` off ``self.config``, the one config object every module shares, and splits
one fused ``qkv`` into ``n_head`` query heads and ``n_query_groups`` key and value heads each
(``qkv.split((query_size, key_size, value_size))``). With ``n_query_groups == n_head`` the
three parts are equal (litgpt's Pythia); with fewer groups they are not (its Llama).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class GroupedConfig:
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_query_groups: int = 2
    n_embd: int = 32
    intermediate_size: int = 64
    head_size: int = 0

    def __post_init__(self) -> None:
        # a field, as litgpt's Config stores it: a property over n_embd / n_head would change
        # with the divided count on the attention's copy of the config
        self.head_size = self.head_size or self.n_embd // self.n_head


class GroupedAttention(nn.Module):
    def __init__(self, config: GroupedConfig) -> None:
        super().__init__()
        shape = (config.n_head + 2 * config.n_query_groups) * config.head_size
        self.qkv = nn.Linear(config.n_embd, shape, bias=True)
        self.proj = nn.Linear(config.n_head * config.head_size, config.n_embd, bias=True)
        self.config = config

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head_size = self.config.head_size
        n_head = self.config.n_head
        n_query_groups = self.config.n_query_groups
        B, T, C = x.size()
        qkv = self.qkv(x)
        query_size = n_head * head_size
        key_size = value_size = n_query_groups * head_size
        q, k, v = qkv.split((query_size, key_size, value_size), dim=-1)
        q = q.view(B, T, n_head, head_size).transpose(1, 2)
        k = k.view(B, T, n_query_groups, head_size).transpose(1, 2)
        v = v.view(B, T, n_query_groups, head_size).transpose(1, 2)
        if n_query_groups != n_head:
            k = k.repeat_interleave(n_head // n_query_groups, dim=1)
            v = v.repeat_interleave(n_head // n_query_groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, head_size * n_head))


class GroupedMLP(nn.Module):
    def __init__(self, config: GroupedConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(config.n_embd, config.intermediate_size)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class GroupedBlock(nn.Module):
    def __init__(self, config: GroupedConfig) -> None:
        super().__init__()
        self.norm_1 = nn.LayerNorm(config.n_embd)
        self.attn = GroupedAttention(config)
        self.norm_2 = nn.LayerNorm(config.n_embd)
        self.mlp = GroupedMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class GroupedGPT(nn.Module):
    def __init__(self, config: GroupedConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList(GroupedBlock(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def make_grouped_gpt(**fields: Any) -> GroupedGPT:
    return GroupedGPT(GroupedConfig(**fields))
