"""Models for the overhead benchmarks, built from random weights (nothing is downloaded)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    """A post-LN BERT-style encoder layer out of plain Linear/LayerNorm/GELU/Dropout modules."""

    def __init__(self, d: int, heads: int, ffn: int, dropout: float = 0.1):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop1 = nn.Dropout(dropout)
        self.norm1 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, ffn)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(ffn, d)
        self.drop2 = nn.Dropout(dropout)
        self.norm2 = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v)
        a = a.transpose(1, 2).reshape(b, t, d)
        x = self.norm1(x + self.drop1(self.proj(a)))
        return self.norm2(x + self.drop2(self.fc2(self.act(self.fc1(x)))))


class Encoder(nn.Module):
    """Token + position embeddings, ``layers`` blocks, a vocabulary head (MLM-style) or, with
    ``n_out``, a classifier of the mean token."""

    def __init__(self, vocab: int = 30522, d: int = 768, layers: int = 12, heads: int = 12,
                 ffn: int = 3072, max_len: int = 512, n_out: int | None = None):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.norm = nn.LayerNorm(d)
        self.blocks = nn.ModuleList(Block(d, heads, ffn) for _ in range(layers))
        self.pool = n_out is not None  # classify the mean token (as BERT's pooler) instead of every token
        self.head = nn.Linear(d, n_out if n_out is not None else vocab)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.norm(self.tok(ids) + self.pos(pos))
        for blk in self.blocks:
            x = blk(x)
        return self.head(x.mean(1) if self.pool else x)
