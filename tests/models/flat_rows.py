"""A model whose layers read the batch and sequence sizes off the token ids, on rows of flattened
tokens: no pipeline split can hand a later chunk those sizes (tests/test_compiler.py)."""

import torch
from torch import nn


class Block(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, 2 * d)
        self.down = nn.Linear(2 * d, d)

    def forward(self, h, tokens):
        y = self.down(torch.relu(self.up(self.norm(h))))
        return h + y.view(tokens.size(0) * tokens.size(1), -1)


class FlatLM(nn.Module):
    def __init__(self, vocab=64, d=32, layers=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.layers = nn.ModuleList(Block(d) for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens).flatten(0, 1)
        for layer in self.layers:
            h = layer(h, tokens)
        return self.head(h).view(tokens.size(0), tokens.size(1), -1)


def build(config="tiny"):
    return FlatLM()


def sample_inputs(config, batch, seq):
    return (torch.zeros(batch, seq, dtype=torch.long),)
