"""Plain-torch models with the sharding hazards verification must see (no transformers).

Each is small and written the way people write them: a nanoGPT-style GPT (fused ``c_attn``,
``B, T, C = x.size()``, a tied ``lm_head``), an attention that reads its head width off the
input, attentions that split their heads with einops (``rearrange(..., h=self.heads)`` as
vit-pytorch and x-transformers write it, and a ``Rearrange`` layer fixed at build), and a block
over ``nn.MultiheadAttention``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class FusedAttention(nn.Module):
    """nanoGPT's attention: one fused q|k|v projection, split by width; the head count is an
    attribute the recipe can divide."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.n_head = heads
        self.c_attn = nn.Linear(dim, 3 * dim, bias=False)
        self.c_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        q, k, v = (z.reshape(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class WidthOffInput(nn.Module):
    """An attention that takes its width from the input: ``C // n_head`` is the whole model's
    head width even where the projections give this rank's heads only."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.n_head = heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.size()
        hd = c // self.n_head
        q, k, v = (p(x).view(b, t, self.n_head, hd).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, c))


class EinopsAttention(nn.Module):
    """vit-pytorch's attention: a fused ``to_qkv`` chunked in three, each split into heads by
    ``rearrange`` with the head count kept on the module."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.to_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from einops import rearrange

        qkv = self.to_qkv(x).chunk(3, dim=-1)
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.heads) for t in qkv)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


class RearrangeLayerAttention(nn.Module):
    """Heads fixed in einops ``Rearrange`` layers at build: no attribute holds the count."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        from einops.layers.torch import Rearrange

        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(dim, dim, bias=False)
        self.to_v = nn.Linear(dim, dim, bias=False)
        self.split_heads = Rearrange("b n (h d) -> b h n d", h=heads)
        self.merge_heads = Rearrange("b h n d -> b n (h d)")
        self.to_out = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = (self.split_heads(p(x)) for p in (self.to_q, self.to_k, self.to_v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(self.merge_heads(out))


class RMSNorm(nn.Module):
    """litgpt's RMSNorm: the mean of squares written out, not ``nn.RMSNorm`` (whose
    ``normalized_shape`` a shard does not fit, a shape error production mode shows)."""

    def __init__(self, size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        norm_x = torch.mean(x * x, dim=-1, keepdim=True)
        return x * torch.rsqrt(norm_x + self.eps) * self.weight


class WidthNormAttention(nn.Module):
    """OLMo 2's attention in plain torch: an RMSNorm over the whole q and k width, applied
    before the split into heads; the head count is an attribute the recipe can divide."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.n_head = heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.q_norm = RMSNorm(dim)
        self.k_norm = RMSNorm(dim)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q, k = self.q_norm(self.q(x)), self.k_norm(self.k(x))
        q, k, v = (z.view(b, t, self.n_head, -1).transpose(1, 2) for z in (q, k, self.v(x)))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim, bias=False)
        self.proj = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, attention: type[nn.Module]) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = attention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A nanoGPT-style GPT: token and position embeddings, blocks, a tied ``lm_head``."""

    def __init__(self, vocab: int = 64, dim: int = 16, heads: int = 4, layers: int = 2,
                 block_size: int = 32, attention: type[nn.Module] = FusedAttention) -> None:
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block_size, dim)
        self.h = nn.ModuleList(Block(dim, heads, attention) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def make_gpt(**kwargs: int) -> GPT:
    return GPT(**kwargs)


def make_gpt_width_off_input(**kwargs: int) -> GPT:
    return GPT(attention=WidthOffInput, **kwargs)


def make_gpt_width_norm(**kwargs: int) -> GPT:
    return GPT(attention=WidthNormAttention, **kwargs)


def make_gpt_einops(**kwargs: int) -> GPT:
    return GPT(attention=EinopsAttention, **kwargs)


def make_gpt_rearrange_layers(**kwargs: int) -> GPT:
    return GPT(attention=RearrangeLayerAttention, **kwargs)


class TorchMHABlock(nn.Module):
    """A block over ``nn.MultiheadAttention``, as torchvision's ViT and most hand-written
    vision code use it: the fused ``in_proj_weight`` is the attention's own parameter, and
    ``F.multi_head_attention_forward`` reads ``out_proj.weight`` without calling ``out_proj``."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = MLP(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(x)


class MHAEncoder(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 16, heads: int = 4, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(TorchMHABlock(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_mha_encoder(**kwargs: int) -> MHAEncoder:
    return MHAEncoder(**kwargs)


class PreNormAttention(nn.Module):
    """vit-pytorch's and x-transformers' attention: the norm *inside* the block, before a
    fused ``to_qkv`` that einops splits into ``self.heads`` heads."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.to_qkv = nn.Linear(dim, 3 * inner, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner, dim), nn.Dropout(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from einops import rearrange

        qkv = self.to_qkv(self.norm(x)).chunk(3, dim=-1)
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.heads) for t in qkv)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


class PreNormFeedForward(nn.Module):
    """vit-pytorch's feed-forward: one ``Sequential`` whose first layer is the norm."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(),
                                 nn.Dropout(0.0), nn.Linear(hidden, dim), nn.Dropout(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class PreNormTransformer(nn.Module):
    """Token embedding, ``layers`` of ``[attention, feed-forward]`` pairs each added to the
    stream, a final norm and an output projection: lucidrains' layout."""

    def __init__(self, vocab: int = 64, dim: int = 32, heads: int = 4, dim_head: int = 8,
                 mlp: int = 64, depth: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(
            nn.ModuleList([PreNormAttention(dim, heads, dim_head), PreNormFeedForward(dim, mlp)])
            for _ in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.to_logits = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for attn, ff in self.layers:  # type: ignore[misc]
            x = attn(x) + x
            x = ff(x) + x
        return self.to_logits(self.norm(x))


def make_prenorm_transformer(**kwargs: int) -> PreNormTransformer:
    return PreNormTransformer(**kwargs)
