"""DeepSeek-V3 (arXiv 2412.19437): multi-head latent attention, 3 dense layers then MoE layers with
1 shared + 256 routed experts, top-8 of a sigmoid gate whose bias steers routing only.

Configs: ``tiny`` (CPU tests), ``2t`` (about 2e12 parameters, 512 experts) and ``671b`` (61
layers, hidden 7168, 128 heads, expert intermediate 2048, dense FFN 18432, vocabulary 129280).
The multi-token-prediction module (14B parameters, not counted in the 671B) is left out.

One simplification, for static shapes: routed experts run on a fixed-capacity buffer (GShard-style)
of ``capacity_factor * tokens * top_k / experts`` slots per expert, filled in token order. DeepSeek-V3
trains without dropping tokens; with capacity factor 1.0 the buffer holds exactly the average expert
load, so FLOPs and dispatch volume match the dropless model on average, and a token over capacity
skips that expert (its other experts, the shared expert and the residual still carry it). ``tiny``
sets the capacity to the token count, so nothing is ever dropped there.
"""

from dataclasses import dataclass, replace
from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class Config:
    layers: int
    dense_layers: int
    hidden: int
    dense_ffn: int
    vocab: int
    heads: int
    q_rank: int
    kv_rank: int
    qk_nope_dim: int
    qk_rope_dim: int
    v_dim: int
    experts: int
    shared_experts: int
    expert_ffn: int
    top_k: int
    groups: int
    top_groups: int
    route_scale: float
    capacity_factor: Fraction
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6


CONFIGS = {
    "tiny": Config(
        layers=3,
        dense_layers=1,
        hidden=64,
        dense_ffn=128,
        vocab=256,
        heads=4,
        q_rank=32,
        kv_rank=16,
        qk_nope_dim=16,
        qk_rope_dim=8,
        v_dim=16,
        experts=8,
        shared_experts=1,
        expert_ffn=32,
        top_k=2,
        groups=2,
        top_groups=1,
        route_scale=1.0,
        capacity_factor=Fraction(8, 2),
    ),
    "671b": Config(
        layers=61,
        dense_layers=3,
        hidden=7168,
        dense_ffn=18432,
        vocab=129280,
        heads=128,
        q_rank=1536,
        kv_rank=512,
        qk_nope_dim=128,
        qk_rope_dim=64,
        v_dim=128,
        experts=256,
        shared_experts=1,
        expert_ffn=2048,
        top_k=8,
        groups=8,
        top_groups=4,
        route_scale=2.5,
        capacity_factor=Fraction(1),
    ),
}
# about 2e12 parameters in DeepSeek-V3's style: 512 routed experts of the same width on a wider,
# deeper trunk (README, "Two trillion parameters")
CONFIGS["2t"] = replace(CONFIGS["671b"], layers=80, hidden=8192, dense_ffn=22528, experts=512)


def rotary(x: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate (batch, seq, heads, dim) by position, pairs (i, i + dim/2)."""
    seq, dim = x.size(1), x.size(3)
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim)
    angles = torch.outer(torch.arange(seq, device=x.device, dtype=torch.float32), inv_freq)
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)[None, :, None, :].to(x.dtype)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)[None, :, None, :].to(x.dtype)
    half = dim // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class LatentAttention(nn.Module):
    """MLA: queries and keys/values pass through low-rank latents; a shared RoPE key part."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        qk_dim = cfg.qk_nope_dim + cfg.qk_rope_dim
        self.wq_a = nn.Linear(cfg.hidden, cfg.q_rank, bias=False)
        self.q_norm = nn.RMSNorm(cfg.q_rank, eps=cfg.norm_eps)
        self.wq_b = nn.Linear(cfg.q_rank, cfg.heads * qk_dim, bias=False)
        self.wkv_a = nn.Linear(cfg.hidden, cfg.kv_rank + cfg.qk_rope_dim, bias=False)
        self.kv_norm = nn.RMSNorm(cfg.kv_rank, eps=cfg.norm_eps)
        self.wkv_b = nn.Linear(cfg.kv_rank, cfg.heads * (cfg.qk_nope_dim + cfg.v_dim), bias=False)
        self.wo = nn.Linear(cfg.heads * cfg.v_dim, cfg.hidden, bias=False)
        self.scale = qk_dim**-0.5

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        batch, seq = x.size(0), x.size(1)
        q = self.wq_b(self.q_norm(self.wq_a(x))).view(batch, seq, cfg.heads, -1)
        q_nope, q_rope = torch.split(q, [cfg.qk_nope_dim, cfg.qk_rope_dim], dim=-1)
        kv_latent, k_rope = torch.split(self.wkv_a(x), [cfg.kv_rank, cfg.qk_rope_dim], dim=-1)
        k_rope = rotary(k_rope.view(batch, seq, 1, cfg.qk_rope_dim), cfg.rope_theta)
        kv = self.wkv_b(self.kv_norm(kv_latent)).view(batch, seq, cfg.heads, -1)
        k_nope, v = torch.split(kv, [cfg.qk_nope_dim, cfg.v_dim], dim=-1)
        q = torch.cat([q_nope, rotary(q_rope, cfg.rope_theta)], dim=-1)
        k = torch.cat([k_nope, k_rope.expand(batch, seq, cfg.heads, cfg.qk_rope_dim)], dim=-1)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=self.scale
        )
        return self.wo(out.transpose(1, 2).reshape(batch, seq, cfg.heads * cfg.v_dim))


class FeedForward(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """Routed experts as stacked weights: (experts, capacity, hidden) in, same out."""

    def __init__(self, experts: int, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.w2 = nn.Parameter(torch.empty(experts, ffn, hidden))
        for w in (self.w1, self.w3, self.w2):
            nn.init.normal_(w, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.bmm(F.silu(torch.bmm(x, self.w1)) * torch.bmm(x, self.w3), self.w2)


class MoE(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.cfg = cfg
        self.gate = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        # Routing-only bias, adjusted by load balancing outside the gradient (persistent state).
        self.register_buffer("expert_bias", torch.zeros(cfg.experts))
        self.experts = Experts(cfg.experts, cfg.hidden, cfg.expert_ffn)
        self.shared = FeedForward(cfg.hidden, cfg.shared_experts * cfg.expert_ffn)

    def route(self, scores: torch.Tensor) -> torch.Tensor:
        """Top-k experts by biased score, only from the ``top_groups`` best expert groups."""
        cfg = self.cfg
        tokens = scores.size(0)
        biased = scores + self.expert_bias
        if cfg.groups > 1:
            grouped = biased.view(tokens, cfg.groups, cfg.experts // cfg.groups)
            group_score = grouped.topk(2, dim=-1)[0].sum(dim=-1)
            best = group_score.topk(cfg.top_groups, dim=-1)[1]
            keep = torch.zeros_like(group_score).scatter(1, best, 1.0)
            biased = grouped.masked_fill(keep[:, :, None] == 0, float("-inf")).view(tokens, -1)
        return biased.topk(cfg.top_k, dim=-1)[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        shape = x.shape
        x = x.reshape(-1, cfg.hidden)
        tokens = x.size(0)
        scores = torch.sigmoid(self.gate(x))
        chosen = self.route(scores)
        weights = scores.gather(1, chosen)
        weights = weights / weights.sum(dim=-1, keepdim=True) * cfg.route_scale
        # Fixed-capacity dispatch: slot = expert * capacity + arrival order; overflow -> a dummy row.
        cf = cfg.capacity_factor
        capacity = (tokens * cfg.top_k * cf.numerator + cfg.experts * cf.denominator - 1) // (
            cfg.experts * cf.denominator
        )
        flat = chosen.reshape(-1)
        onehot = flat.new_zeros(flat.size(0), cfg.experts).scatter(1, flat[:, None], 1)
        position = (onehot.cumsum(0) * onehot).sum(dim=1) - 1
        slot = torch.where(position < capacity, flat * capacity + position, cfg.experts * capacity)
        routed_in = x[:, None, :].expand(tokens, cfg.top_k, cfg.hidden).reshape(-1, cfg.hidden)
        buffer = x.new_zeros(cfg.experts * capacity + 1, cfg.hidden).index_add(0, slot, routed_in)
        expert_out = self.experts(buffer[:-1].view(cfg.experts, capacity, cfg.hidden))
        expert_out = torch.cat([expert_out.reshape(-1, cfg.hidden), x.new_zeros(1, cfg.hidden)])
        routed = (expert_out.index_select(0, slot) * weights.reshape(-1, 1)).view(tokens, cfg.top_k, -1)
        return (self.shared(x) + routed.sum(dim=1)).view(shape)


class Block(nn.Module):
    def __init__(self, cfg: Config, moe: bool):
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.attn = LatentAttention(cfg)
        self.ffn_norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.ffn = MoE(cfg) if moe else FeedForward(cfg.hidden, cfg.dense_ffn)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.ffn(self.ffn_norm(x))


class DeepSeekV3(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg, moe=i >= cfg.dense_layers) for i in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden, eps=cfg.norm_eps)
        self.output = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def build(config: str = "tiny") -> nn.Module:
    return DeepSeekV3(CONFIGS[config])


def sample_inputs(config: str, batch: int, seq: int) -> tuple:
    return (torch.randint(0, CONFIGS[config].vocab, (batch, seq)),)
