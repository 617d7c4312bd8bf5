"""LLaMA-3 (Grattafiori et al., arXiv 2407.21783): RMSNorm, RoPE, GQA attention, SwiGLU MLP.

Configs: ``tiny`` (CPU tests), ``8b``, ``70b``, ``405b`` with the shapes of the paper's Table 3
(vocabulary 128,256 as in the released checkpoints). Written so that ``torch.fx.symbolic_trace``
captures it: sizes come from ``x.size(i)``, the causal mask from ``is_causal``, rotary tables are
computed in ``forward`` so a model built on the meta device needs no buffers filled in later.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    layers: int
    hidden: int
    ffn: int
    heads: int
    kv_heads: int
    vocab: int
    rope_theta: float = 500000.0
    norm_eps: float = 1e-5


CONFIGS = {
    "tiny": Config(layers=2, hidden=64, ffn=160, heads=4, kv_heads=2, vocab=256),
    "small": Config(layers=4, hidden=256, ffn=688, heads=8, kv_heads=4, vocab=4096),  # CPU benchmarks
    # 1.1B parameters: LLaMA-3.2-1B's layers with a 32k vocabulary (checkpoint timings on a CPU machine)
    "1b": Config(layers=16, hidden=2048, ffn=8192, heads=32, kv_heads=8, vocab=32000),
    "8b": Config(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=128256),
    "70b": Config(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=128256),
    "405b": Config(layers=126, hidden=16384, ffn=53248, heads=128, kv_heads=8, vocab=128256),
    # 2.05e12 parameters (32.8 TB of model state at 16 bytes each): the dense half of the question
    # what 2T parameters take to train (README, "Two trillion parameters")
    "2t": Config(layers=160, hidden=32768, ffn=106496, heads=256, kv_heads=16, vocab=128256),
    # depth, not size: 160 narrow layers (the test that no walk of a graph recurses per layer)
    "deep": Config(layers=160, hidden=64, ffn=160, heads=4, kv_heads=2, vocab=256),
}


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate (batch, seq, heads, head_dim) by position, pairs (i, i + head_dim/2) as in LLaMA."""
    seq, dim = x.size(1), x.size(3)
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv_freq)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[None, :, None, :].to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[None, :, None, :].to(x.dtype)
    half = dim // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


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
    def __init__(self, cfg: Config):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def build(config: str = "tiny") -> nn.Module:
    return Llama(CONFIGS[config])


def sample_inputs(config: str, batch: int, seq: int) -> tuple:
    return (torch.randint(0, CONFIGS[config].vocab, (batch, seq)),)
