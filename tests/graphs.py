"""Small graphs for the pass specifications: a structural listing to compare a pass's output with
its Expected graph, and a tiny language model that traces to a short, readable graph."""

import torch
import torch.nn.functional as F
from torch import fx, nn


def notes(gm: fx.GraphModule) -> dict[str, str]:
    """The passes' decisions recorded on ``gm``'s nodes (``meta["note"]``), by node name."""
    return {n.name: n.meta["note"] for n in gm.graph.nodes if "note" in n.meta}


def fp8_left(gm: fx.GraphModule) -> list[str]:
    """The matmuls of an FP8 kind the FP8 pass left in the compute precision (``meta["fp8_left"]``)."""
    return [n.name for n in gm.graph.nodes if "fp8_left" in n.meta]


def listing(graph: fx.Graph) -> list[tuple]:
    """``(op, target, args, kwargs)`` of each node, in order, with the nodes an argument refers to
    written as their position: two graphs with equal listings are the same program."""
    index = {n: i for i, n in enumerate(graph.nodes)}
    ref = lambda a: fx.map_arg(a, lambda n: f"%{index[n]}")
    return [(n.op, n.target, ref(n.args), ref(n.kwargs)) for n in graph.nodes]


# a transformers decoder config small enough for CPU tests (Llama, Mixtral, ...)
TINY_DECODER = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)


class RMS(nn.Module):
    """An RMSNorm written by hand, under a class name that says nothing of norms."""

    def __init__(self, d: int):
        super().__init__()
        self.w = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w


class Block(nn.Module):
    """``x + relu(lin(x))``; with ``device`` it also adds zeros made on that fixed device, as
    torch.export records a factory call made while tracing on meta; with ``scale`` it multiplies
    by a parameter of its own, which the graph reads with ``get_attr`` (as export reads every one)."""

    def __init__(self, dim: int, device: torch.device | None = None, scale: bool = False):
        super().__init__()
        self.lin = nn.Linear(dim, dim)
        self.device = device
        self.scale = nn.Parameter(torch.ones(dim)) if scale else None

    def forward(self, x):
        h = x + torch.relu(self.lin(x))
        if self.device is not None:
            h = h + torch.zeros(h.size(-1), device=self.device)
        if self.scale is not None:
            h = h * self.scale
        return h


class TinyLM(nn.Module):
    def __init__(self, layers: int, dim: int = 8, vocab: int = 16, device: torch.device | None = None, scale=False):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, device, scale) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def loss(logits, tokens):
    """Cross-entropy of every position against its own token: three nodes in the graph."""
    return F.cross_entropy(logits.flatten(0, 1), tokens.flatten())


def tokens(batch: int = 2, seq: int = 6, vocab: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(0))


CROSS_ENTROPY_KWARGS = {
    "weight": None,
    "size_average": None,
    "ignore_index": -100,
    "reduce": None,
    "reduction": "mean",
    "label_smoothing": 0.0,
}


def expected_loss(graph: fx.Graph, logits: fx.Node, target: fx.Node) -> fx.Node:
    """Append :func:`loss` as fx traces it to an Expected graph."""
    flat_logits = graph.call_method("flatten", (logits, 0, 1))
    flat_target = graph.call_method("flatten", (target,))
    return graph.call_function(F.cross_entropy, (flat_logits, flat_target), CROSS_ENTROPY_KWARGS)
