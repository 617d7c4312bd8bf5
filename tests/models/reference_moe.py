"""A small decoder whose mixture of experts is written as Mixtral's reference code writes it
(transformers' ``MixtralSparseMoeBlock.forward`` before its experts were stacked, line for line).

Experts are an ``nn.ModuleList`` of SwiGLU MLPs; the router is softmax + top-k with the gates
renormalised; the loop over experts takes each expert's (slot, token) pairs from a one-hot
expert mask (``one_hot(selected, E).permute(2, 1, 0)``, ``torch.where(mask[e])``) and adds the
gated results into the output with ``index_add_``.
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
    top_k: int = 2


CONFIGS = {"tiny": Config()}


class Expert(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.w1 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w3 = nn.Linear(cfg.hidden, cfg.ffn, bias=False)
        self.w2 = nn.Linear(cfg.ffn, cfg.hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SparseMoE(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.experts_count, self.top_k = cfg.experts, cfg.top_k
        self.gate = nn.Linear(cfg.hidden, cfg.experts, bias=False)
        self.experts = nn.ModuleList(Expert(cfg) for _ in range(cfg.experts))

    def forward(self, hidden_states):
        batch_size, sequence_length, hidden_dim = hidden_states.shape
        hidden_states = hidden_states.view(-1, hidden_dim)
        routing_weights = F.softmax(self.gate(hidden_states), dim=1, dtype=torch.float)
        routing_weights, selected_experts = torch.topk(routing_weights, self.top_k, dim=-1)
        routing_weights /= routing_weights.sum(dim=-1, keepdim=True)
        routing_weights = routing_weights.to(hidden_states.dtype)
        final_hidden_states = torch.zeros(
            (batch_size * sequence_length, hidden_dim), dtype=hidden_states.dtype, device=hidden_states.device
        )
        expert_mask = F.one_hot(selected_experts, num_classes=self.experts_count).permute(2, 1, 0)
        for expert_idx in range(self.experts_count):
            expert_layer = self.experts[expert_idx]
            idx, top_x = torch.where(expert_mask[expert_idx])
            current_state = hidden_states[None, top_x].reshape(-1, hidden_dim)
            current_hidden_states = expert_layer(current_state) * routing_weights[top_x, idx, None]
            final_hidden_states.index_add_(0, top_x, current_hidden_states.to(hidden_states.dtype))
        return final_hidden_states.reshape(batch_size, sequence_length, hidden_dim)


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.heads = cfg.heads
        self.norm1 = nn.RMSNorm(cfg.hidden)
        self.qkv = nn.Linear(cfg.hidden, 3 * cfg.hidden, bias=False)
        self.proj = nn.Linear(cfg.hidden, cfg.hidden, bias=False)
        self.norm2 = nn.RMSNorm(cfg.hidden)
        self.moe = SparseMoE(cfg)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, d))
        return x + self.moe(self.norm2(x))


class ReferenceMoE(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.embed = nn.Embedding(cfg.vocab, cfg.hidden)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = nn.RMSNorm(cfg.hidden)
        self.head = nn.Linear(cfg.hidden, cfg.vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build(config: str = "tiny") -> nn.Module:
    return ReferenceMoE(CONFIGS[config])


def sample_inputs(config: str, batch: int, seq: int) -> tuple:
    return (torch.randint(0, CONFIGS[config].vocab, (batch, seq)),)
