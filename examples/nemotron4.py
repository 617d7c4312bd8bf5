"""Nemotron-4 (NVIDIA; 15B: arXiv 2402.16819, 340B: arXiv 2406.11704): a LLaMA-like decoder that
differs in three places: LayerNorm instead of RMSNorm, a non-gated MLP with squared ReLU (two
matrices of 4h, not SwiGLU's three), and a 256,000-token vocabulary with untied embeddings. GQA
with 8 KV heads, RoPE, no biases, as in LLaMA.

Configs: ``tiny`` (CPU tests), ``15b`` (32 layers, hidden 6,144, 48 heads) and ``340b`` (96
layers, hidden 18,432, 96 heads), both with FFN 4h. The published model rotates half of each head
(rotary percentage 0.5); this one rotates all of it, which changes no matmul and no saved tensor.
Written for ``torch.fx.symbolic_trace`` as ``examples/llama3.py`` is.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5


CONFIGS = {
    "tiny": Config(layers=2, hidden=64, heads=4, kv_heads=2, vocab=256),
    "15b": Config(layers=32, hidden=6144, heads=48, kv_heads=8, vocab=256000),
    "340b": Config(layers=96, hidden=18432, heads=96, kv_heads=8, vocab=256000),
}


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) by position, pairs (i, i + head_dim/2)."""
    seq, dim = x.size(1), x.size(3)
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv_freq)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[None, :, None, :].to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[None, :, None, :].to(x.dtype)
    half = dim // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Attention(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.heads, self.kv_heads = cfg.heads, cfg.kv_heads
        self.head_dim = cfg.hidden // cfg.heads
        self.theta = cfg.rope_theta
        self.wq = nn.Linear(cfg.hidden, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.hidden, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq = x.size(0), x.size(1)
        q = self.wq(x).view(batch, seq, self.heads, self.head_dim)
        k = self.wk(x).view(batch, seq, self.kv_heads, self.head_dim)
        v = self.wv(x).view(batch, seq, self.kv_heads, self.head_dim)
        q, k = rotary(q, self.theta), rotary(k, self.theta)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, enable_gqa=True
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, self.heads * self.head_dim))


class FeedForward(nn.Module):
    """Squared ReLU between two 4h matrices (no gate)."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.up = nn.Linear(cfg.hidden, 4 * cfg.hidden, bias=False)
        self.down = nn.Linear(4 * cfg.hidden, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.relu(self.up(x)).square())


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attn_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, bias=False)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, bias=False)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Nemotron4(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden, eps=cfg.norm_eps, bias=False)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def build(config: str = "tiny") -> nn.Module:
    return Nemotron4(CONFIGS[config])


def sample_inputs(config: str, batch: int, seq: int) -> tuple:
    return (torch.randint(0, CONFIGS[config].vocab, (batch, seq)),)
