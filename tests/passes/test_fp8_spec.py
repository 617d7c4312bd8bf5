"""The FP8 pass as Before/Expected specifications: the weighted matmuls of the kinds the plan names
(``ctx.fp8``) become ``rt.fp8_*`` calls on the same operands, in every form the pass reads
(``nn.Linear``, ``F.linear``, a product by a weight, ``addmm``, stacked experts), and nothing else
changes: the attention core, the router, and the kinds the plan leaves out (the head, unless
named) stay in the compute precision."""

import pytest
import torch
import torch.nn.functional as F
from spec import LM, assert_same_program, before, program
from test_expert_parallel_spec import MoE
from torch import nn

from autoshard.passes.contract import RewriteContext, decisions
from autoshard.passes.expert_parallel import expert_parallel
from autoshard.passes.fp8 import fp8
from autoshard.runtime.fp8 import fp8_addmm, fp8_linear, fp8_matmul
from autoshard.runtime.moe import combine_buffer, dispatch_buffer

from graphs import fp8_left, loss


class Attention(nn.Module):
    """Its projections in the functional forms: ``F.linear`` with a bias, a product by a weight,
    ``addmm`` by an (in, out) weight (GPT-2's Conv1D)."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.wq, self.bq = nn.Parameter(torch.randn(dim, dim)), nn.Parameter(torch.zeros(dim))
        self.wkv = nn.Parameter(torch.randn(dim, 2 * dim))
        self.wo, self.bo = nn.Parameter(torch.randn(dim, dim)), nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        b, s, d = x.shape
        q = F.linear(x, self.wq, self.bq)
        k, v = (x @ self.wkv).chunk(2, dim=-1)
        q, k, v = (t.view(b, s, 2, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b * s, d)
        return torch.addmm(self.bo, out, self.wo).view(b, s, d)


class MLP(nn.Module):
    """A norm, then ``nn.Linear`` modules."""

    def __init__(self, dim: int = 16):
        super().__init__()
        self.norm = nn.RMSNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim, bias=False)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(self.norm(x))))


def model() -> LM:
    return LM(Attention(), MLP(), dim=16)  # two layers: attention's projections are known by their layer


class Rank(nn.Module):
    """The program with the matmuls of ``kinds`` in FP8; ``keep``: the call reading the norm's
    output keeps its FP8 copy for recomputation."""

    def __init__(self, kinds: tuple[str, ...], keep: bool = False):
        super().__init__()
        self.kinds, self.keep = kinds, keep
        self.model = model()

    def forward(self, tokens):
        m, a, f = self.model, self.model.layers[0], self.model.layers[1]
        attention, mlp = "attention" in self.kinds, "mlp" in self.kinds
        x = m.embed(tokens)
        b, s, d = x.shape
        q = (fp8_linear if attention else F.linear)(x, a.wq, a.bq)
        k, v = (fp8_matmul(x, a.wkv) if attention else x @ a.wkv).chunk(2, dim=-1)
        q, k, v = (t.view(b, s, 2, -1).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b * s, d)
        x = x + (fp8_addmm if attention else torch.addmm)(a.bo, out, a.wo).view(b, s, d)
        n = f.norm(x)
        if mlp:  # an nn.Linear call becomes a call on its parameters
            keep = {"keep_fp8": True} if self.keep else {}
            h = fp8_linear(F.gelu(fp8_linear(n, f.fc1.weight, f.fc1.bias, **keep)), f.fc2.weight)
        else:
            h = f.fc2(F.gelu(f.fc1(n)))
        x = x + h
        logits = fp8_linear(x, m.head.weight) if "head" in self.kinds else m.head(x)
        return loss(logits, tokens)


@pytest.mark.parametrize(
    ("kinds", "meta"),
    [
        (("mlp",), {"fp8_linear": {"matmul_kind": "mlp"}, "model_head": {"matmul_kind": "head"}}),
        (("attention", "head"), {"fp8_addmm": {"matmul_kind": "attention"}, "fp8_linear_1": {"matmul_kind": "head"}}),
        (("attention", "mlp"), {"fp8_matmul": {"matmul_kind": "attention", "op_class": "matmul"}}),
    ],
    ids=["mlp", "attention-head", "attention-mlp"],
)
def test_the_matmuls_of_the_plans_kinds_become_fp8_calls_and_no_others(kinds, meta):
    ctx = RewriteContext(fp8=kinds)
    gm = fp8(before(model()), ctx)
    assert_same_program(gm, program(Rank(kinds)), meta=meta)
    assert not fp8_left(gm)


def test_under_recomputation_the_call_reading_a_kept_category_keeps_its_fp8_copy():
    """The norm's output is recomputed and kept only as FP8 (``fp8_saved``): fc1, which reads it,
    keeps the copy; fc2 and the attention projections, which read other tensors, do not."""
    ctx = RewriteContext(fp8=("attention", "mlp"), recompute=("activation", "attention"), fp8_saved=("norm_output",))
    gm = fp8(before(model()), ctx)
    assert_same_program(gm, program(Rank(("attention", "mlp"), keep=True)))


class ExpertsRank(nn.Module):
    """EP2, the experts in FP8: the exchanges carry FP8 where they face the experts."""

    def __init__(self):
        super().__init__()
        self.model = LM(MoE(held=2), dim=16)

    def forward(self, tokens):
        m, moe = self.model, self.model.layers[0]
        x = m.embed(tokens)
        rows = x.reshape(-1, x.size(-1))
        gate, chosen = moe.router(rows).softmax(-1).topk(1, dim=-1)  # the router: compute precision
        mask = (chosen == torch.arange(4, device=x.device)).to(x.dtype).t().unsqueeze(-1)
        buffer = dispatch_buffer(mask * rows, fp8=True)
        out = combine_buffer(fp8_matmul(F.silu(fp8_matmul(buffer, moe.up)), moe.down), fp8=True)
        return loss(m.head(x + ((out * mask).sum(0) * gate).view_as(x)), tokens)


def test_expert_gemms_and_their_exchanges_go_fp8_and_the_router_stays():
    ctx = RewriteContext(ep=2, fp8=("experts",))
    gm = fp8(expert_parallel(before(LM(MoE(), dim=16)), ctx), ctx)
    assert_same_program(
        gm,
        program(ExpertsRank()),
        meta={"fp8_matmul": {"matmul_kind": "experts"}, "model_layers_0_router": {"matmul_kind": "router"}},
    )
    assert decisions(gm).fp8_params == ["model.layers.0.up", "model.layers.0.down"]
