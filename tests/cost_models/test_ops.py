"""The op table: every row is consistent, every rule it names is implemented where it is read,
and the planner's sharding analysis treats as TP-transparent exactly the ops the TP pass can
carry a split through. Norms are found from their ops, not from their module's name."""

import pytest
import torch
from torch import fx, nn

from autoshard import ir
from autoshard.capture import capture
from autoshard.cost_models import sharding
from autoshard.ir import ops
from autoshard.passes.tensor_parallel import _TRANSFER, IMPLEMENTED

from graphs import RMS

FLOPS = ("zero", "pointwise", "matmul", "sdpa", "reduce", "norm", "loss")
SAVES = ("partner", "in0", "in1", "in2", "out", "mask", "sdpa", "logprobs")
ATTENTION_SIGNATURES = ("sdpa", "sdpa_flash", "sdpa_efficient", "fused_attention", "cp_attention")
LOSS_SIGNATURES = ("cross_entropy", "cross_entropy_loss", "cp_cross_entropy")


def _node(op: str) -> fx.Node:
    graph = fx.Graph()
    node = graph.call_function(torch.add, ())
    node.meta["op"] = op
    return node


@pytest.mark.parametrize("name", sorted(ops.RULES))
def test_row_is_consistent(name):
    r = ops.RULES[name]
    assert r.op_class in ir.OP_CLASSES
    assert r.flops in FLOPS and set(r.saves) <= set(SAVES)
    assert r.tp is None or r.tp in ops.TP_RULES
    assert r.sp is None or r.sp in ops.SP_RULES
    assert r.cp is None or r.cp in ops.CP_RULES
    assert r.metadata is None or r.metadata in ops.METADATA
    assert r.signature is None or r.signature in ops.SIGNATURES
    if r.alias or r.metadata:
        assert r.flops == "zero" and r.op_class == "other"
    if r.metadata:
        assert r.tp is None and r.sp is None  # the passes skip them; a rule would contradict that
    if r.tp in ("linear", "matmul"):
        assert r.flops == "matmul"
    if r.tp == "attention" or r.signature in ATTENTION_SIGNATURES:
        assert r.op_class == "attention" and r.tp == "attention" and r.signature in ATTENTION_SIGNATURES
    if r.tp == "loss" or r.cp == "loss":
        assert r.op_class == "loss" and r.signature in LOSS_SIGNATURES  # the passes read its arguments
    if r.cp == "attention":
        assert r.signature in ("sdpa", "fused_attention")  # the two layouts the CP pass rewrites
    if r.sp == "norm":
        assert r.op_class == "norm"
    if r.sp == "reduce":
        assert r.flops == "reduce" or r.tp == "softmax"


@pytest.mark.parametrize("name", sorted(ops.RULES))
def test_the_planner_prices_as_tp_transparent_only_what_the_pass_carries(name):
    r = ops.RULES[name]
    node = _node(name)
    transparent = sharding._transparent(node)
    assert transparent == (r.tp is not None and r.tp not in ("linear", "loss"))
    if transparent:
        assert r.tp in _TRANSFER  # the rule the pass dispatches to
    assert sharding._metadata_query(node) == (r.metadata in ("size", "attr"))


def test_every_tp_rule_is_implemented_by_the_pass():
    assert set(ops.TP_RULES) == IMPLEMENTED
    assert set(_TRANSFER) == set(ops.TP_RULES) - {"linear", "loss"}


def test_every_op_gpt2_splits_by_its_fused_qkv_has_a_rule():
    """GPT-2's attention: split of the fused QKV, views, permute, the aten SDPA kernels."""
    for name in ("split", "split_with_sizes", "chunk", "permute", "_scaled_dot_product_flash_attention_for_cpu"):
        assert ops.RULES[name].tp in _TRANSFER


def test_call_args_read_positional_keyword_and_aten_layouts():
    graph = fx.Graph()
    x, t = graph.placeholder("x"), graph.placeholder("t")
    f = graph.call_function(torch.nn.functional.cross_entropy, (x, t), {"ignore_index": 3})
    f.meta["op"] = "cross_entropy"
    aten = graph.call_function(torch.ops.aten.cross_entropy_loss.default, (x, t, None, 2, -1))
    aten.meta["op"] = "cross_entropy_loss"
    assert ops.call_args(f)["ignore_index"] == 3 and ops.call_args(f)["reduction"] == "mean"
    assert ops.call_args(aten)["reduction"] == "sum" and ops.call_args(aten)["ignore_index"] == -1
    sdpa = graph.call_function(torch.nn.functional.scaled_dot_product_attention, (x, x, x, None, 0.0, True))
    sdpa.meta["op"] = "scaled_dot_product_attention"
    assert ops.call_args(sdpa)["is_causal"] is True and ops.call_args(sdpa)["scale"] is None


# ---------------------------------------------------------------------------------------------
# norms from their ops


class LN(nn.Module):
    """A LayerNorm written by hand."""

    def __init__(self, d: int):
        super().__init__()
        self.w, self.b = nn.Parameter(torch.ones(d)), nn.Parameter(torch.zeros(d))

    def forward(self, x):
        mean = x.mean(-1, keepdim=True)
        var = x.var(-1, keepdim=True, unbiased=False)
        return (x - mean) / torch.sqrt(var + 1e-5) * self.w + self.b


class Scaled(nn.Module):
    """Not a norm: a division by a mean over features, without rsqrt or sqrt."""

    def __init__(self, d: int):
        super().__init__()

    def forward(self, x):
        return x / x.abs().mean(-1, keepdim=True)


class Block(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.norm, self.fc1, self.fc2 = norm(32), nn.Linear(32, 64), nn.Linear(64, 32)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(self.norm(x))))


class Model(nn.Module):
    def __init__(self, norm):
        super().__init__()
        self.embed = nn.Embedding(50, 32)
        self.layers = nn.ModuleList(Block(norm) for _ in range(2))
        self.norm = norm(32)
        self.head = nn.Linear(32, 50, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _classes(norm) -> list[str]:
    """The op classes of the computing nodes in order, each norm's nodes counted once."""
    cap = capture(Model(norm), seq=16)
    out = []
    for n in cap.graph_module.graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        c = n.meta["op_class"]
        if not (c == "norm" and out and out[-1] == "norm"):
            out.append(c)
    return out


@pytest.mark.parametrize("written,module", [(RMS, nn.RMSNorm), (LN, nn.LayerNorm)], ids=["rms", "layer"])
def test_hand_written_norm_is_a_norm_like_the_module(written, module):
    by_ops = _classes(written)
    assert by_ops.count("norm") == 3  # two layers' and the final norm
    assert by_ops == _classes(module)


def test_a_division_by_a_mean_is_not_a_norm():
    assert "norm" not in _classes(Scaled)


def test_the_norm_nodes_are_exactly_the_normalisation():
    cap = capture(Model(RMS), seq=16)
    norm = [
        n.meta["op"] for n in cap.graph_module.graph.nodes if n.meta.get("layer") == 0 and n.meta["op_class"] == "norm"
    ]
    assert norm == ["pow", "mean", "add", "rsqrt", "mul", "mul"]  # the residual add is not in it
