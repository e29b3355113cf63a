"""Plain-torch models written the way people write them outside transformers, for ``suggest``
on a model it has never seen (issue 39): a nanoGPT-style GPT, a litgpt-like block with a config
object, a pre-norm ViT-like encoder on patch embeddings and an encoder on
``nn.MultiheadAttention``. Each is built by a factory that takes its config fields as keyword
arguments (the ``--model pkg.mod:factory`` contract, docs/bring-your-own-model.md); the vision
ones take their images from :func:`make_pixels` (``--inputs``)."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


# --- nanoGPT: a fused c_attn split by n_embd, heads read off the input's width ------------------

class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head
        self.n_embd = n_embd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class GPTMLP(nn.Module):
    def __init__(self, n_embd: int) -> None:
        super().__init__()
        self.c_fc = nn.Linear(n_embd, 4 * n_embd)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(self.gelu(self.c_fc(x)))


class GPTBlock(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.ln_2 = nn.LayerNorm(n_embd)
        self.mlp = GPTMLP(n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size: int, block_size: int, n_layer: int, n_head: int,
                 n_embd: int, tie: bool = False) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, n_embd),
            wpe=nn.Embedding(block_size, n_embd),
            h=nn.ModuleList(GPTBlock(n_embd, n_head) for _ in range(n_layer)),
            ln_f=nn.LayerNorm(n_embd)))
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)
        if tie:  # nanoGPT ties them (weight tying)
            self.transformer.wte.weight = self.lm_head.weight  # type: ignore[union-attr]

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))


def make_gpt(vocab_size: int = 64, block_size: int = 16, n_layer: int = 2, n_head: int = 4,
             n_embd: int = 32, tie: bool = False) -> GPT:
    return GPT(vocab_size, block_size, n_layer, n_head, n_embd, tie)


class HeadSizeAttention(CausalSelfAttention):
    """nanoGPT's attention written as docs/bring-your-own-model.md says: the per-head size is
    fixed and the output takes the width it holds, so its heads divide between ranks."""

    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__(n_embd, n_head)
        self.head_dim = n_embd // n_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, -1))


def make_gpt_head_size(**fields: int) -> GPT:
    """:func:`make_gpt` with :class:`HeadSizeAttention`."""
    model = make_gpt(**fields)
    for block in model.transformer.h:  # type: ignore[union-attr]
        block.attn = HeadSizeAttention(block.attn.n_embd, block.attn.n_head)
    return model


# --- litgpt-like: a config object, separate q/k/v, SwiGLU ---------------------------------------

@dataclass
class LitConfig:
    vocab_size: int = 64
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    intermediate_size: int = 64

    @property
    def head_size(self) -> int:
        return self.n_embd // self.n_head


class LitAttention(nn.Module):
    def __init__(self, config: LitConfig) -> None:
        super().__init__()
        self.q = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.k = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.v = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)
        self.n_head = config.n_head
        self.head_size = config.head_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_head, self.head_size).transpose(1, 2)
        k = self.k(x).view(B, T, self.n_head, self.head_size).transpose(1, 2)
        v = self.v(x).view(B, T, self.n_head, self.head_size).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, self.n_head * self.head_size))


class LLaMAMLP(nn.Module):
    def __init__(self, config: LitConfig) -> None:
        super().__init__()
        self.fc_1 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.fc_2 = nn.Linear(config.n_embd, config.intermediate_size, bias=False)
        self.proj = nn.Linear(config.intermediate_size, config.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.silu(self.fc_1(x)) * self.fc_2(x))


class LitBlock(nn.Module):
    def __init__(self, config: LitConfig) -> None:
        super().__init__()
        self.norm_1 = nn.RMSNorm(config.n_embd)
        self.attn = LitAttention(config)
        self.norm_2 = nn.RMSNorm(config.n_embd)
        self.mlp = LLaMAMLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class LitGPT(nn.Module):
    def __init__(self, config: LitConfig) -> None:
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList(LitBlock(config) for _ in range(config.n_layer))
        self.ln_f = nn.RMSNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def make_litgpt(**fields: Any) -> LitGPT:
    return LitGPT(LitConfig(**fields))


# --- a pre-norm ViT on patch embeddings (no nn.Embedding) ---------------------------------------

class ViTAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        y = F.scaled_dot_product_attention(q, k, v)
        return self.proj(y.transpose(1, 2).reshape(B, N, -1))


class ViTMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ViTBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = ViTAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = ViTMLP(dim, dim * mlp_ratio)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, image_size: int, patch_size: int, embed_dim: int, depth: int,
                 num_heads: int, mlp_ratio: int, num_classes: int, conv_patches: bool) -> None:
        super().__init__()
        self.image_size = image_size
        self.patch_size = patch_size
        patches = (image_size // patch_size) ** 2
        self.patch_embed: nn.Module = (
            nn.Conv2d(3, embed_dim, kernel_size=patch_size, stride=patch_size) if conv_patches
            else nn.Linear(3 * patch_size * patch_size, embed_dim))
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.pos_embed = nn.Parameter(torch.randn(1, patches + 1, embed_dim) * 0.02)
        self.blocks = nn.ModuleList(ViTBlock(embed_dim, num_heads, mlp_ratio)
                                    for _ in range(depth))
        self.norm = nn.LayerNorm(embed_dim)
        self.head = nn.Linear(embed_dim, num_classes)

    def _patches(self, images: torch.Tensor) -> torch.Tensor:
        if isinstance(self.patch_embed, nn.Conv2d):
            return self.patch_embed(images).flatten(2).transpose(1, 2)
        p = self.patch_size
        B, C, H, W = images.shape
        tiles = images.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5)
        return self.patch_embed(tiles.reshape(B, (H // p) * (W // p), C * p * p))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        x = self._patches(images)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x)[:, 0])


def make_vit(image_size: int = 8, patch_size: int = 4, embed_dim: int = 32, depth: int = 2,
             num_heads: int = 4, mlp_ratio: int = 2, num_classes: int = 10,
             conv_patches: bool = True) -> ViT:
    return ViT(image_size, patch_size, embed_dim, depth, num_heads, mlp_ratio, num_classes,
               conv_patches)


def make_pixels(model: nn.Module, *, batch: int, seq: int, generator: torch.Generator
                ) -> tuple[tuple[torch.Tensor, ...], dict[str, Any]]:
    """``--inputs`` for the vision models: images ``[batch, 3, S, S]`` (``seq`` is unused)."""
    del seq
    side = int(getattr(model, "image_size", 8))
    return (torch.randn(batch, 3, side, side, generator=generator),), {}


# --- an encoder on nn.MultiheadAttention ------------------------------------------------------

class MHAMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.linear_1 = nn.Linear(dim, hidden)
        self.linear_2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(F.gelu(self.linear_1(x)))


class MHABlock(nn.Module):
    def __init__(self, dim: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.self_attention = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = MHAMLP(dim, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln_1(x)
        x = x + self.self_attention(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.ln_2(x))


class MHAEncoder(nn.Module):
    def __init__(self, vocab_size: int, dim: int, heads: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(MHABlock(dim, heads, hidden) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.ln(x)


def make_mha_encoder(vocab_size: int = 64, dim: int = 32, heads: int = 4, hidden: int = 64,
                     layers: int = 2) -> MHAEncoder:
    return MHAEncoder(vocab_size, dim, heads, hidden, layers)


# --- an MLP written as nn.Sequential (numbered children) ---------------------------------------

class SequentialMLPBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class SequentialMLPModel(nn.Module):
    def __init__(self, vocab_size: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab_size, dim)
        self.blocks = nn.ModuleList(SequentialMLPBlock(dim) for _ in range(layers))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return x


def make_sequential_mlp(vocab_size: int = 32, dim: int = 16, layers: int = 2
                        ) -> SequentialMLPModel:
    return SequentialMLPModel(vocab_size, dim, layers)


# --- torchvision's ViT (vit_b_16's module names and classes) ------------------------------------
# A copy of torchvision.models.vision_transformer (torchvision is not a dependency of the tests):
# the same classes (MLP as torchvision.ops.misc.MLP, an nn.Sequential; MLPBlock, EncoderBlock,
# Encoder, VisionTransformer) and the same names: conv_proj, class_token,
# encoder.pos_embedding, encoder.layers.encoder_layer_N.{ln_1, self_attention, ln_2, mlp.0 ...
# mlp.4}, encoder.ln, heads.head. Blocks named encoder_layer_N (an nn.Sequential built from an
# OrderedDict) and an MLP whose linears are mlp.0 and mlp.3 are what suggest must read.

class MLP(nn.Sequential):
    """torchvision.ops.misc.MLP: Linear, activation, Dropout per hidden layer, then Linear,
    Dropout."""

    def __init__(self, in_channels: int, hidden_channels: list[int],
                 activation_layer: type[nn.Module] = nn.ReLU, dropout: float = 0.0) -> None:
        layers: list[nn.Module] = []
        in_dim = in_channels
        for hidden_dim in hidden_channels[:-1]:
            layers += [nn.Linear(in_dim, hidden_dim), activation_layer(), nn.Dropout(dropout)]
            in_dim = hidden_dim
        layers += [nn.Linear(in_dim, hidden_channels[-1]), nn.Dropout(dropout)]
        super().__init__(*layers)


class MLPBlock(MLP):
    """torchvision's transformer MLP block: mlp.0 Linear, mlp.1 GELU, mlp.2 Dropout, mlp.3
    Linear, mlp.4 Dropout."""

    def __init__(self, in_dim: int, mlp_dim: int, dropout: float) -> None:
        super().__init__(in_dim, [mlp_dim, in_dim], activation_layer=nn.GELU, dropout=dropout)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_uniform_(m.weight)
                nn.init.normal_(m.bias, std=1e-6)


class EncoderBlock(nn.Module):
    def __init__(self, num_heads: int, hidden_dim: int, mlp_dim: int, dropout: float,
                 attention_dropout: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.ln_1 = nn.LayerNorm(hidden_dim, eps=1e-6)
        self.self_attention = nn.MultiheadAttention(hidden_dim, num_heads,
                                                    dropout=attention_dropout, batch_first=True)
        self.dropout = nn.Dropout(dropout)
        self.ln_2 = nn.LayerNorm(hidden_dim, eps=1e-6)
        self.mlp = MLPBlock(hidden_dim, mlp_dim, dropout)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        torch._assert(input.dim() == 3, f"Expected (batch_size, seq_length, hidden_dim) got "
                                        f"{input.shape}")
        x = self.ln_1(input)
        x, _ = self.self_attention(query=x, key=x, value=x, need_weights=False)
        x = self.dropout(x)
        x = x + input
        y = self.ln_2(x)
        y = self.mlp(y)
        return x + y


class Encoder(nn.Module):
    def __init__(self, seq_length: int, num_layers: int, num_heads: int, hidden_dim: int,
                 mlp_dim: int, dropout: float, attention_dropout: float) -> None:
        super().__init__()
        self.pos_embedding = nn.Parameter(torch.empty(1, seq_length, hidden_dim).normal_(std=0.02))
        self.dropout = nn.Dropout(dropout)
        layers: OrderedDict[str, nn.Module] = OrderedDict()
        for i in range(num_layers):
            layers[f"encoder_layer_{i}"] = EncoderBlock(num_heads, hidden_dim, mlp_dim, dropout,
                                                        attention_dropout)
        self.layers = nn.Sequential(layers)
        self.ln = nn.LayerNorm(hidden_dim, eps=1e-6)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        input = input + self.pos_embedding
        out: torch.Tensor = self.ln(self.layers(self.dropout(input)))
        return out


class VisionTransformer(nn.Module):
    def __init__(self, image_size: int, patch_size: int, num_layers: int, num_heads: int,
                 hidden_dim: int, mlp_dim: int, dropout: float = 0.0,
                 attention_dropout: float = 0.0, num_classes: int = 1000) -> None:
        super().__init__()
        self.image_size = image_size
        self.patch_size = patch_size
        self.hidden_dim = hidden_dim
        self.mlp_dim = mlp_dim
        self.conv_proj = nn.Conv2d(3, hidden_dim, kernel_size=patch_size, stride=patch_size)
        seq_length = (image_size // patch_size) ** 2
        self.class_token = nn.Parameter(torch.zeros(1, 1, hidden_dim))
        seq_length += 1
        self.encoder = Encoder(seq_length, num_layers, num_heads, hidden_dim, mlp_dim, dropout,
                               attention_dropout)
        self.seq_length = seq_length
        heads_layers: OrderedDict[str, nn.Module] = OrderedDict()
        heads_layers["head"] = nn.Linear(hidden_dim, num_classes)
        self.heads = nn.Sequential(heads_layers)

    def _process_input(self, x: torch.Tensor) -> torch.Tensor:
        n, _, h, w = x.shape
        p = self.patch_size
        x = self.conv_proj(x)
        x = x.reshape(n, self.hidden_dim, (h // p) * (w // p))
        return x.permute(0, 2, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self._process_input(x)
        n = x.shape[0]
        batch_class_token = self.class_token.expand(n, -1, -1)
        x = torch.cat([batch_class_token, x], dim=1)
        x = self.encoder(x)
        x = x[:, 0]
        out: torch.Tensor = self.heads(x)
        return out


def make_torchvision_vit(image_size: int = 8, patch_size: int = 4, num_layers: int = 2,
                         num_heads: int = 4, hidden_dim: int = 32, mlp_dim: int = 64,
                         num_classes: int = 10) -> VisionTransformer:
    """torchvision's ``vit_b_16`` structure at a tiny size (``vit_b_16`` is ``patch_size=16,
    num_layers=12, num_heads=12, hidden_dim=768, mlp_dim=3072``); images from
    :func:`make_pixels`."""
    return VisionTransformer(image_size, patch_size, num_layers, num_heads, hidden_dim, mlp_dim,
                             num_classes=num_classes)
