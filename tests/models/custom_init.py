"""A hand-written decoder whose modules initialise themselves their own way, as an autoshard model
file: an RMSNorm whose parameter is called ``scale`` (ones), a linear layer with its own truncated
normal init, an output projection initialised with ``orthogonal_`` (not element-wise), a gate from
``torch.randn`` scaled, and a buffer computed from ``arange``. None is a torch.nn layer but the
embedding."""

import torch
import torch.nn.functional as F
from torch import nn

CONFIGS = {"tiny": dict(vocab=128, dim=64, hidden=128, layers=2)}


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.scale = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.scale


class TruncLinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, std: float = 0.02):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        nn.init.trunc_normal_(self.weight, std=std, a=-2 * std, b=2 * std)

    def forward(self, x):
        return F.linear(x, self.weight)


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.norm = RMSNorm(dim)
        self.up = TruncLinear(dim, hidden)
        self.down = nn.Parameter(torch.empty(dim, hidden))
        nn.init.orthogonal_(self.down, gain=0.5)
        self.gate = nn.Parameter(torch.randn(dim) * 0.1)

    def forward(self, x):
        return x + F.linear(F.gelu(self.up(self.norm(x))), self.down) * self.gate


class Decoder(nn.Module):
    def __init__(self, vocab: int, dim: int, hidden: int, layers: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.register_buffer("decay", 1.0 / (1.0 + torch.arange(dim, dtype=torch.float32) / dim))
        self.layers = nn.ModuleList([Block(dim, hidden) for _ in range(layers)])
        self.norm = RMSNorm(dim)
        self.head = TruncLinear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) * self.decay
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def build(config: str = "tiny"):
    return Decoder(**CONFIGS[config])


def sample_inputs(config: str, batch: int, seq: int) -> tuple:
    return (torch.randint(0, CONFIGS[config]["vocab"], (batch, seq)),)
