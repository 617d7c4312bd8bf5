"""Flash-attention pass: SDPA calls and the written-out causal softmax(QK^T)V pattern become one
``fused_attention`` call, and the loss is unchanged."""

import sys

import torch

from autoshard import runtime
from autoshard.capture import capture, causal_lm_loss
from autoshard.cost_models.analyze import analyze
from autoshard.passes.contract import RewriteContext
from autoshard.passes.flash_attention import flash_attention, no_fusable_sdpa_left

from conftest import EXAMPLES
from graphs import notes

sys.path.insert(0, str(EXAMPLES))


def _ops(gm):
    return [n.meta.get("op") for n in gm.graph.nodes if n.op == "call_function"]


def _check(name, expected_before):
    module = __import__(name)
    torch.manual_seed(0)
    model = module.build("tiny")
    cap = capture(model, (torch.zeros(2, 16, dtype=torch.long),))
    analyze(cap)
    gm = cap.graph_module
    assert _ops(gm).count(expected_before) == 2  # Before: one per layer
    ctx = RewriteContext()
    gm = flash_attention(gm, ctx)
    assert len(notes(gm)) == 2
    fused = [n for n in gm.graph.nodes if n.target is runtime.fused_attention]
    assert len(fused) == 2 and all(n.args[3] is True for n in fused)  # Expected: causal fused calls
    assert expected_before not in _ops(gm)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(gm(tokens), causal_lm_loss(model(tokens), tokens), atol=1e-6)
    return gm


def test_written_out_attention_is_fused():
    gm = _check("gpt", "softmax")
    assert "masked_fill" not in _ops(gm) and "triu" not in [n.target for n in gm.graph.nodes]


def test_sdpa_calls_are_fused():
    _check("llama3", "scaled_dot_product_attention")


# ---------------------------------------------------------------------------------------------
# Before/Expected on a small hand-written attention


class Attention(torch.nn.Module):
    """Written-out causal attention, or SDPA with a mask tensor: causal (``tril``), or with a
    sliding window of ``window`` positions."""

    def __init__(self, masked_sdpa: bool = False, window: int | None = None):
        super().__init__()
        self.embed = torch.nn.Embedding(64, 32)
        self.qkv = torch.nn.Linear(32, 96, bias=False)
        self.head = torch.nn.Linear(32, 64, bias=False)
        self.masked_sdpa, self.window = masked_sdpa, window

    def forward(self, tokens):
        x = self.embed(tokens)
        b, s = tokens.size(0), tokens.size(1)
        q, k, v = self.qkv(x).view(b, s, 3, 4, 8).permute(2, 0, 3, 1, 4).unbind(0)
        if self.masked_sdpa:
            ones = torch.ones(s, s, dtype=torch.bool)
            mask = ones.tril() & ~ones.tril(-self.window) if self.window else ones.tril()
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        else:
            scores = torch.matmul(q, k.transpose(-2, -1)) * (1.0 / 8**0.5)
            future = x.new_ones(s, s, dtype=torch.bool).triu(1)
            out = torch.matmul(torch.softmax(scores.masked_fill(future, float("-inf")), dim=-1), v)
        return self.head(out.transpose(1, 2).reshape(b, s, 32))


def _captured(model):
    cap = capture(model, (torch.zeros(2, 8, dtype=torch.long),))
    analyze(cap)
    return cap.graph_module


def _attention_ops(gm):
    """The ops from q, k, v to the output projection."""
    ops = [n.meta["op"] for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")]
    start = ops.index("unbind") + 4  # unbind, then the getitems of q, k and v
    return ops[start : ops.index("linear", start)]


def test_written_out_softmax_qkt_v_becomes_one_fused_call():
    torch.manual_seed(0)
    model = Attention()
    gm = _captured(model)
    # Before: q, k, v (three getitems) then the written-out causal attention
    assert _attention_ops(gm) == [
        "transpose",
        "matmul",
        "mul",
        "new_ones",
        "triu",
        "masked_fill",
        "softmax",
        "matmul",
        "transpose",
        "reshape",
    ]
    ctx = RewriteContext()
    gm = flash_attention(gm, ctx)
    (fused,) = [n for n in gm.graph.nodes if n.target is runtime.fused_attention]
    # Expected: one causal fused call, the default scale left to the kernel
    assert fused.meta["op"] == "fused_attention" and fused.meta["op_class"] == "attention"
    assert fused.args[3:] == (True, None)
    assert _attention_ops(gm) == ["fused_attention", "transpose", "reshape"]
    assert no_fusable_sdpa_left(gm, ctx) is None
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(gm(tokens), causal_lm_loss(model(tokens), tokens), atol=1e-6)


def test_sdpa_with_a_mask_that_is_not_causal_is_left_alone():
    gm = flash_attention(_captured(Attention(masked_sdpa=True, window=4)), RewriteContext())
    assert [n.meta["op"] for n in gm.graph.nodes].count("scaled_dot_product_attention") == 1
    assert not any(n.target is runtime.fused_attention for n in gm.graph.nodes)


def test_sdpa_with_a_causal_mask_tensor_is_fused_as_causal():
    model = Attention(masked_sdpa=True)
    gm = flash_attention(_captured(model), RewriteContext())
    (fused,) = [n for n in gm.graph.nodes if n.target is runtime.fused_attention]
    assert fused.args[3] is True and "tril" not in _ops(gm)
    tokens = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    assert torch.allclose(gm(tokens), causal_lm_loss(model(tokens), tokens), atol=1e-6)
