"""GPT in the Megatron-LM layout (Korthikanti et al., arXiv 2205.05198): pre-LayerNorm blocks, fused
QKV projection, explicit attention (QK^T, causal mask, softmax, dropout, attention over V), a 4h GeLU
MLP, dropout after both residual branches, learned positions.

The attention is written out instead of calling ``scaled_dot_product_attention`` so that the saved
activations are the ones Korthikanti et al. count: sbh(34 + 5as/h) bytes per layer in 16-bit.
Configs: ``tiny`` (CPU tests, no dropout so distributed runs match bit for bit) and ``175b``
(GPT-3: 96 layers, hidden 12288, 96 heads, sequence 2048, dropout 0.1).
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    layers: int
    hidden: int
    heads: int
    vocab: int
    max_seq: int
    dropout: float


CONFIGS = {
    "tiny": Config(layers=2, hidden=64, heads=4, vocab=256, max_seq=256, dropout=0.0),
    "175b": Config(layers=96, hidden=12288, heads=96, vocab=50257, max_seq=2048, dropout=0.1),
}


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.heads, self.head_dim = cfg.heads, cfg.hidden // cfg.heads
        self.dropout = cfg.dropout
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.size(0), x.size(1)
        qkv = self.qkv(x).view(batch, seq, 3, self.heads, self.head_dim)
        q, k, v = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2), qkv[:, :, 2].transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / math.sqrt(self.head_dim))
        future = x.new_ones(seq, seq, dtype=torch.bool).triu(1)
        probs = F.softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        probs = F.dropout(probs, self.dropout, self.training)
        out = torch.matmul(probs, v).transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim)
        return F.dropout(self.proj(out), self.dropout, self.training)


class MLP(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.dropout = cfg.dropout
        self.fc1 = nn.Linear(cfg.hidden, 4 * cfg.hidden)
        self.fc2 = nn.Linear(4 * cfg.hidden, cfg.hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.fc2(F.gelu(self.fc1(x))), self.dropout, self.training)


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.hidden)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.hidden)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.dropout = cfg.dropout
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.pos = nn.Embedding(cfg.max_seq, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.size(1), device=tokens.device)
        x = F.dropout(self.embed(tokens) + self.pos(positions), self.dropout, self.training)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))


def build(config: str = "tiny") -> nn.Module:
    return GPT(CONFIGS[config])


def sample_inputs(config: str, batch: int, seq: int) -> tuple:
    cfg = CONFIGS[config]
    if seq > cfg.max_seq:
        raise ValueError(f"config {config!r} has {cfg.max_seq} positions; use --seq-len <= {cfg.max_seq}")
    return (torch.randint(0, cfg.vocab, (batch, seq)),)
