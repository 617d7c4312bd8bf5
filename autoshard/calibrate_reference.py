"""The reference model ``autoshard calibrate`` measures a host's residual per-op cost on.

A small decoder (RMSNorm, grouped-query attention through SDPA, a SwiGLU MLP, an untied output
head), run as a bf16 program runs on a CPU: bf16 weights (``runtime.program.lower_parameters``),
bf16 autocast, one thread. Calibrate times its forward and backward and
sets ``Hardware.pointwise_efficiency`` so that the cost model explains it: what the GEMMs, the
attention and the host time per op (priced from the profile's other measured fields) leave is
the memory-bound ops' time, which a CPU core spends well below its copy bandwidth (bf16
arithmetic, transcendental functions, norms and the loss's softmax in fp32).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from autoshard.capture import capture, causal_lm_loss
from autoshard.cost_models.analyze import analyze
from autoshard.cost_models.layers import POST, PRE, LayerCosts
from autoshard.runtime.program import _adamw, lower_parameters

HIDDEN, HEADS, KV_HEADS, FFN, VOCAB, LAYERS = 384, 6, 2, 1024, 2048, 2
BATCH, SEQ = 2, 256
ADAMW = {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}  # its cost is the same whatever the values


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        d = HIDDEN // HEADS
        self.norm1, self.norm2 = nn.RMSNorm(HIDDEN), nn.RMSNorm(HIDDEN)
        self.q = nn.Linear(HIDDEN, HEADS * d, bias=False)
        self.kv = nn.Linear(HIDDEN, 2 * KV_HEADS * d, bias=False)
        self.o = nn.Linear(HEADS * d, HIDDEN, bias=False)
        self.gate_up = nn.Linear(HIDDEN, 2 * FFN, bias=False)
        self.down = nn.Linear(FFN, HIDDEN, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.size(0), x.size(1), HIDDEN // HEADS
        h = self.norm1(x)
        q = self.q(h).view(b, s, HEADS, d).transpose(1, 2)
        k, v = self.kv(h).view(b, s, 2, KV_HEADS, d).permute(2, 0, 3, 1, 4).unbind(0)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, HIDDEN))
        gate, up = self.gate_up(self.norm2(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Reference(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.layers = nn.ModuleList(_Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def predicted_step(hw) -> tuple[float, float]:
    """(seconds, memory-bound seconds): the cost model's forward and backward of the reference
    model on ``hw`` (``op_overhead_us`` included, ranks alone on the host), and the part of it
    that is memory-bound ops' bytes over the bandwidth (``pointwise_efficiency`` divides it)."""
    with torch.device("meta"):
        model = Reference()
    cost = analyze(capture(model, (torch.zeros(BATCH, SEQ, dtype=torch.long, device="meta"),), seq=SEQ))
    layers = LayerCosts(cost, SEQ, replace(hw, cores=0.0), False)
    seconds = pointwise = 0.0
    for block, count in [(PRE, 1), *((i, b.count) for i, b in enumerate(cost.blocks)), (POST, 1)]:
        f, b, w, *_ = layers.compute(block, BATCH, 1, 1, (), frozenset())
        seconds += count * (f + b + w)
        pointwise += count * 3 * layers._rest(block, BATCH, 1, 1)[1]  # once forward, twice backward
    return seconds, pointwise


def training_step():
    """A function running one training step of the reference model as a bf16 program runs it on a
    CPU: forward and loss under bf16 autocast, backward, and the program's optimizer step (fp32
    masters of bf16 weights); and the function running its forward and backward alone."""
    torch.manual_seed(0)
    model = Reference()
    params = list(model.parameters())
    lower_parameters(params, "bf16")
    optim = _adamw(params, False, None, ADAMW)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ))

    def forward_backward():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = causal_lm_loss(model(tokens), tokens)
        loss.backward()

    def step():
        forward_backward()
        optim.step()
        model.zero_grad(set_to_none=True)

    def without_step():
        forward_backward()
        model.zero_grad(set_to_none=True)

    return step, without_step


def measured_step(timer) -> float:
    """Median seconds of the reference model's forward, loss and backward as a bf16 program
    runs them on a CPU (``timer``: calibrate's median timer over a function)."""
    return timer(training_step()[1])
