"""Expert parallelism as Before/Expected specifications: a top-1 MoE layer over a fixed-capacity
``(E, C, H)`` buffer (GShard's form) is captured (Before), the pass runs with the plan's EP and TP
degrees, and the result is compared with the program one rank must run (Expected): the buffer
leaves through the exchanges the degrees need, this rank's experts multiply it, the results come
back the same way, and the router stays as it was."""

import pytest
import torch
import torch.nn.functional as F
from spec import LM, assert_same_program, before, program
from torch import nn

from autoshard.passes.contract import RewriteContext, decisions
from autoshard.passes.expert_parallel import expert_parallel
from autoshard.passes.tensor_parallel import ParamShard
from autoshard.runtime.collectives import copy_to_tp, reduce_from_tp
from autoshard.runtime.moe import combine_buffer, dispatch_buffer, tp_share_buffer, tp_unshare_buffer

from graphs import loss


class MoE(nn.Module):
    """Each token to its top-1 expert's slots of an ``(E, T, H)`` buffer (capacity: every token),
    two stacked expert GEMMs, the results gathered back and gated. ``held``: the experts whose
    weights this copy holds (all of them in the Before)."""

    def __init__(self, dim: int = 16, inner: int = 32, experts: int = 4, held: int | None = None):
        super().__init__()
        self.experts = experts
        self.router = nn.Linear(dim, experts, bias=False)
        self.up = nn.Parameter(torch.randn(held or experts, dim, inner) * 0.1)
        self.down = nn.Parameter(torch.randn(held or experts, inner, dim) * 0.1)

    def forward(self, x):
        rows = x.reshape(-1, x.size(-1))
        gate, chosen = self.router(rows).softmax(-1).topk(1, dim=-1)
        mask = (chosen == torch.arange(self.experts, device=x.device)).to(x.dtype).t().unsqueeze(-1)
        out = torch.bmm(F.silu(torch.bmm(mask * rows, self.up)), self.down)
        return ((out * mask).sum(0) * gate).view_as(x)


class MoERank(nn.Module):
    """One rank's program for EP ``ep`` and TP ``tp``."""

    def __init__(self, tp: int, ep: int):
        super().__init__()
        self.tp, self.ep = tp, ep
        self.model = LM(MoE(held=4 // ep), dim=16)

    def forward(self, tokens):
        m, moe = self.model, self.model.layers[0]
        x = m.embed(tokens)
        rows = x.reshape(-1, x.size(-1))
        gate, chosen = moe.router(rows).softmax(-1).topk(1, dim=-1)  # the router: whole, on every rank
        mask = (chosen == torch.arange(4, device=x.device)).to(x.dtype).t().unsqueeze(-1)
        buffer = mask * rows
        if self.tp > 1:  # every TP rank holds the same tokens: each computes its share of the slots
            buffer = tp_share_buffer(copy_to_tp(buffer))
        if self.ep > 1:  # each expert's slots to the rank that holds it
            buffer = dispatch_buffer(buffer)
        out = torch.bmm(F.silu(torch.bmm(buffer, moe.up)), moe.down)  # this rank's 4/ep experts
        if self.ep > 1:
            out = combine_buffer(out)
        if self.tp > 1:
            out = reduce_from_tp(tp_unshare_buffer(out))
        return loss(m.head(x + ((out * mask).sum(0) * gate).view_as(x)), tokens)


@pytest.mark.parametrize(("tp", "ep"), [(1, 2), (2, 1), (2, 2)], ids=["ep2", "tp2", "tp2-ep2"])
def test_the_experts_buffer_leaves_and_returns_through_the_exchanges_of_the_plan(tp, ep):
    ctx = RewriteContext(tp=tp, ep=ep)
    gm = expert_parallel(before(LM(MoE(), dim=16)), ctx)
    held = 4 // ep
    assert_same_program(
        gm,
        program(MoERank(tp, ep)),
        meta={  # the stacked weights' recorded shapes are this rank's experts
            "model_layers_0_up": {"shape": (held, 16, 32)},
            "model_layers_0_down": {"shape": (held, 32, 16)},
            "model_layers_0_router": {"op_class": "router"},
        },
    )
    assert decisions(gm).expert_params == ["model.layers.0.up", "model.layers.0.down"]  # gradients summed over EDP
    if ep > 1:
        assert decisions(gm).shards["model.layers.0.up"] == ParamShard(0, (4,), 0, axis="ep")
        assert decisions(gm).shards["model.layers.0.down"] == ParamShard(0, (4,), 0, axis="ep")
    else:
        assert decisions(gm).shards == {}  # TP ranks share rows, not experts: every rank holds all 4
