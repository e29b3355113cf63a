"""Models over ``torch.nn.MultiheadAttention`` for the ``mha_heads`` inner wrapper's tests.

:class:`MHAProbe` calls its attentions every way a user does: the default call (``need_weights``
left at ``True``, the averaged attention weights used in the output so their gradient counts),
``batch_first=False`` with a key padding mask, a per-head boolean ``attn_mask`` of shape
``[batch * heads, L, S]`` and per-head weights, an unbatched ``[L, E]`` call, and a cross
attention whose key and value are not its query and that has no biases. Every returned tensor
reaches the output, so a wrong shard of any of them shows in the forward or in a gradient.
"""

from __future__ import annotations

import torch
from torch import nn


class MHAProbe(nn.Module):
    def __init__(self, vocab_size: int = 64, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab_size, dim)
        self.first = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.second = nn.MultiheadAttention(dim, heads)  # batch_first=False: [L, B, E]
        self.cross = nn.MultiheadAttention(dim, heads, batch_first=True, bias=False)
        self.single = nn.MultiheadAttention(dim, heads)  # called on one unbatched [L, E]
        self.norm = nn.LayerNorm(dim)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        batch, seq = ids.shape
        out, weights = self.first(x, x, x)  # the default call: averaged weights [B, L, S]
        x = x + out + weights @ x
        pad = torch.zeros(batch, seq, dtype=torch.bool)
        pad[0, -1] = True  # the last key of the first sequence is padding
        causal = torch.ones(seq, seq, dtype=torch.bool).triu(1)
        per_head = causal.expand(batch * self.heads, seq, seq).clone()
        per_head[1::self.heads, :, 0] = True  # head 1 of every sequence never sees key 0 ...
        per_head[1::self.heads, 0, 0] = False  # ... except from query 0 (a row must see a key)
        t = x.transpose(0, 1)
        out2, per_head_weights = self.second(t, t, t, key_padding_mask=pad, attn_mask=per_head,
                                             average_attn_weights=False)
        x = x + out2.transpose(0, 1) + torch.einsum("bhls,bsd->bld", per_head_weights, x)
        first_row = x[0]
        out4, row_weights = self.single(first_row, first_row, first_row)  # [L, E], [L, L]
        x = x + out4 + row_weights @ first_row
        memory = self.norm(x)
        out3, _ = self.cross(x, memory, memory, need_weights=False)
        return x + out3


def make_mha_probe(vocab_size: int = 64, dim: int = 32, heads: int = 4) -> MHAProbe:
    return MHAProbe(vocab_size, dim, heads)
