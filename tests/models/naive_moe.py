"""A mixture-of-experts decoder written the way most people first write one.

Experts are an ``nn.ModuleList`` of ordinary MLPs; the router is softmax + top-k; each expert
takes its tokens with ``torch.where`` in a Python loop, so how many tokens an expert computes is
known only from the data (a data-dependent size). ``dense`` (``CONFIGS["tiny_dense"]``) is the
same decoder with one always-on MLP of the expert's width per token slot, the dense model whose
FLOPs the MoE should match under balanced routing (``tests/test_capture.py``).
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    vocab: int = 128
    hidden: int = 64
    heads: int = 4
    ffn: int = 96
    layers: int = 2
    experts: int = 4
    top_k: int = 2  # with experts=0, top_k dense MLPs per token (the dense equivalent)


CONFIGS = {"tiny": Config(), "tiny_dense": Config(experts=0)}


class Expert(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.up = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.down = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoE(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.top_k = cfg.top_k
        self.router = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.experts))

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        probs = F.softmax(self.router(x), dim=-1)
        w, topi = probs.topk(self.top_k, dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            idx, slot = torch.where(topi == i)
            out[idx] += w[idx, slot, None] * expert(x[idx])
        return out.reshape(shape)


class DenseSlots(nn.Module):
    """``top_k`` MLPs every token goes through, each with weight ``1/top_k``."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.mlps = nn.ModuleList(Expert(cfg) for _ in range(cfg.top_k))

    def forward(self, x):
        return sum(mlp(x) for mlp in self.mlps) / len(self.mlps)


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.LayerNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.norm2 = nn.LayerNorm(cfg.hidden)
        self.ffn = MoE(cfg) if cfg.experts else DenseSlots(cfg)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.ffn(self.norm2(x))


class NaiveMoE(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.LayerNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build(config: str = "tiny") -> nn.Module:
    return NaiveMoE(CONFIGS[config])


def sample_inputs(config: str, batch: int, seq: int) -> tuple:
    return (torch.randint(0, CONFIGS[config].vocab, (batch, seq)),)
