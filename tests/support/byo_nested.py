"""Models laid out as x-transformers (2.x) and vit-pytorch lay theirs out, for
tests/suggest/test_suggest_nested.py: the MLP's Linears sit in a plain ``nn.Sequential`` inside
the block (``ff.0.0`` / ``ff.2``, ``net.1`` / ``net.4``), and each layer is an
``nn.ModuleList`` of parts of several classes rather than a module with named children. Both
attentions fix the head count in an einops pattern: x-transformers' in ``Rearrange`` layers
built with the count (no recipe divides it: ``suggest`` leaves it replicated), vit-pytorch's in
a ``rearrange(..., h=self.heads)`` call (its region divides ``heads``). minGPT's MLP is an
``nn.ModuleDict`` called through a lambda.
"""

from __future__ import annotations

from typing import Any

import torch
from einops import rearrange
from einops.layers.torch import Rearrange
from torch import nn


class XAttention(nn.Module):
    """x-transformers' ``Attention``: separate q/k/v, heads split by einops layers."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.split_q_heads = Rearrange("b n (h d) -> b h n d", h=heads)
        self.split_k_heads = Rearrange("b n (h d) -> b h n d", h=heads)
        self.split_v_heads = Rearrange("b n (h d) -> b h n d", h=heads)
        self.merge_heads = Rearrange("b h n d -> b n (h d)")
        self.to_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.split_q_heads(self.to_q(x))
        k = self.split_k_heads(self.to_k(x))
        v = self.split_v_heads(self.to_v(x))
        out = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(self.merge_heads(out))


class XFeedForward(nn.Module):
    """x-transformers' ``FeedForward``: ``Sequential(Sequential(Linear, GELU), Dropout,
    Linear)``."""

    def __init__(self, dim: int, mult: int) -> None:
        super().__init__()
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU()),
                                nn.Dropout(0.0), nn.Linear(dim * mult, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ff(x)


class XResidual(nn.Module):
    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return x + residual


class XDecoder(nn.Module):
    """Layers alternate attention and feed-forward: ``layers.N`` is
    ``ModuleList([ModuleList([norm]), block, residual])``, the block's kind set by N."""

    def __init__(self, dim: int, depth: int, heads: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList()
        for _ in range(depth):
            for block in (XAttention(dim, heads, dim // heads), XFeedForward(dim, 4)):
                self.layers.append(nn.ModuleList([nn.ModuleList([nn.LayerNorm(dim)]), block,
                                                  XResidual()]))
        self.final_norm = nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norms, block, residual in self.layers:  # type: ignore[misc]
            x = residual(block(norms[0](x)), x)
        return self.final_norm(x)


class XTransformer(nn.Module):
    def __init__(self, num_tokens: int, dim: int, depth: int, heads: int) -> None:
        super().__init__()
        self.token_emb = nn.Embedding(num_tokens, dim)
        self.attn_layers = XDecoder(dim, depth, heads)
        self.to_logits = nn.Linear(dim, num_tokens, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.to_logits(self.attn_layers(self.token_emb(ids)))


def make_x_transformer(num_tokens: int = 64, dim: int = 32, depth: int = 2, heads: int = 4
                       ) -> XTransformer:
    return XTransformer(num_tokens, dim, depth, heads)


class PAttention(nn.Module):
    """vit-pytorch's ``Attention``: its own norm, one fused ``to_qkv`` chunked in 3,
    ``rearrange(..., h=self.heads)``, ``to_out = Sequential(Linear, Dropout)``."""

    def __init__(self, dim: int, heads: int, dim_head: int) -> None:
        super().__init__()
        inner = heads * dim_head
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.to_qkv = nn.Linear(dim, inner * 3, bias=False)
        self.to_out = nn.Sequential(nn.Linear(inner, dim), nn.Dropout(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.to_qkv(self.norm(x)).chunk(3, dim=-1)
        q, k, v = (rearrange(t, "b n (h d) -> b h n d", h=self.heads) for t in qkv)
        out = nn.functional.scaled_dot_product_attention(q, k, v)
        return self.to_out(rearrange(out, "b h n d -> b n (h d)"))


class PFeedForward(nn.Module):
    """vit-pytorch's ``FeedForward``: ``net = Sequential(LayerNorm, Linear, GELU, Dropout,
    Linear, Dropout)``."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, hidden), nn.GELU(),
                                 nn.Dropout(0.0), nn.Linear(hidden, dim), nn.Dropout(0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class PViT(nn.Module):
    """vit-pytorch's ``ViT``: ``transformer.layers.N`` is ``ModuleList([Attention,
    FeedForward])``; patches through a Linear, a class token, a classifier head."""

    def __init__(self, image_size: int, patch_size: int, dim: int, depth: int, heads: int,
                 mlp_dim: int, num_classes: int) -> None:
        super().__init__()
        patches = (image_size // patch_size) ** 2
        self.to_patch_embedding = nn.Sequential(
            Rearrange("b c (h p1) (w p2) -> b (h w) (p1 p2 c)", p1=patch_size, p2=patch_size),
            nn.Linear(3 * patch_size * patch_size, dim))
        self.pos_embedding = nn.Parameter(torch.randn(1, patches + 1, dim))
        self.cls_token = nn.Parameter(torch.randn(1, 1, dim))
        self.transformer = nn.Module()
        self.transformer.layers = nn.ModuleList(
            nn.ModuleList([PAttention(dim, heads, dim // heads), PFeedForward(dim, mlp_dim)])
            for _ in range(depth))
        self.transformer.norm = nn.LayerNorm(dim)
        self.mlp_head = nn.Linear(dim, num_classes)

    def forward(self, img: torch.Tensor) -> torch.Tensor:
        x = self.to_patch_embedding(img)
        x = torch.cat((self.cls_token.expand(x.shape[0], -1, -1), x), dim=1)
        x = x + self.pos_embedding
        for attn, ff in self.transformer.layers:  # type: ignore[union-attr]
            x = attn(x) + x
            x = ff(x) + x
        return self.mlp_head(self.transformer.norm(x)[:, 0])  # type: ignore[operator]


def make_vit_pytorch(image_size: int = 8, patch_size: int = 4, dim: int = 32, depth: int = 2,
                     heads: int = 4, mlp_dim: int = 64, num_classes: int = 10) -> PViT:
    return PViT(image_size, patch_size, dim, depth, heads, mlp_dim, num_classes)


def make_pixels(model: nn.Module, *, batch: int, seq: int, generator: torch.Generator
                ) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """8 x 8 RGB images for :func:`make_vit_pytorch`."""
    return (torch.randn(batch, 3, 8, 8, generator=generator),), {}


class MinBlock(nn.Module):
    """minGPT's ``Block``: its MLP an ``nn.ModuleDict`` of ``c_fc``, ``c_proj``, ``act`` and
    ``dropout``, called through a lambda over the children (the dict's own forward never runs);
    its attention nanoGPT's, reading the width off its input."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(dim)
        self.attn = MinAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = nn.ModuleDict(dict(c_fc=nn.Linear(dim, 4 * dim), c_proj=nn.Linear(4 * dim, dim),
                                      act=nn.GELU(), dropout=nn.Dropout(0.0)))
        m = self.mlp
        self.mlpf = lambda x: m.dropout(m.c_proj(m.act(m.c_fc(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlpf(self.ln_2(x))  # type: ignore[no-any-return]


class MinAttention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.c_proj = nn.Linear(dim, dim)
        self.n_head = heads
        self.n_embd = dim

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class MinGPT(nn.Module):
    def __init__(self, vocab_size: int, dim: int, depth: int, heads: int) -> None:
        super().__init__()
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(vocab_size, dim),
            h=nn.ModuleList(MinBlock(dim, heads) for _ in range(depth)),
            ln_f=nn.LayerNorm(dim)))
        self.lm_head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx)  # type: ignore[operator]
        for block in self.transformer.h:  # type: ignore[union-attr]
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))  # type: ignore[operator]


def make_mingpt(vocab_size: int = 64, dim: int = 32, depth: int = 2, heads: int = 4) -> MinGPT:
    return MinGPT(vocab_size, dim, depth, heads)


class MetaAttention(nn.Module):
    """Meta's reference Llama attention (its fairscale parallel Linears as ``nn.Linear``): the
    counts it shapes by are ``n_local_heads`` and ``n_local_kv_heads``."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.n_local_heads = n_heads
        self.n_local_kv_heads = n_kv_heads
        self.n_rep = n_heads // n_kv_heads
        self.head_dim = dim // n_heads
        self.wq = nn.Linear(dim, n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(n_heads * self.head_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_local_heads, self.head_dim).transpose(1, 2)
        xk = self.wk(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim).transpose(1, 2)
        xv = self.wv(x).view(bsz, seqlen, self.n_local_kv_heads, self.head_dim).transpose(1, 2)
        xk = xk.repeat_interleave(self.n_rep, dim=1)
        xv = xv.repeat_interleave(self.n_rep, dim=1)
        out = nn.functional.scaled_dot_product_attention(xq, xk, xv, is_causal=True)
        return self.wo(out.transpose(1, 2).contiguous().view(bsz, seqlen, -1))


class MetaFeedForward(nn.Module):
    """Meta's reference Llama MLP: ``w1``, ``w2``, ``w3`` registered in that order, so the
    row-wise ``w2`` sits between the two column-wise projections."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))


class MetaBlock(nn.Module):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int) -> None:
        super().__init__()
        self.attention = MetaAttention(dim, n_heads, n_kv_heads)
        self.feed_forward = MetaFeedForward(dim, 4 * dim)
        self.attention_norm = nn.RMSNorm(dim)
        self.ffn_norm = nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class MetaLlama(nn.Module):
    def __init__(self, vocab_size: int, dim: int, n_layers: int, n_heads: int,
                 n_kv_heads: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(MetaBlock(dim, n_heads, n_kv_heads) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def make_meta_llama(vocab_size: int = 64, dim: int = 32, n_layers: int = 2, n_heads: int = 4,
                    n_kv_heads: int = 2) -> MetaLlama:
    return MetaLlama(vocab_size, dim, n_layers, n_heads, n_kv_heads)
