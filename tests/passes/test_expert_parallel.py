"""The expert-parallel pass on captured graphs (no processes): each MoE layer's expert region is
found from what the graph computes, whatever the experts are called or how they are written, and
rewritten into dispatch -> local experts -> combine; the routing bias is told apart from
tensors that reach the gates. The programs it emits are verified against one device in
``tests/test_moe_matrix.py``."""

import importlib
import operator
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from autoshard.capture import capture, capture_file
from autoshard.passes.contract import Refusal, RewriteContext, decisions
from autoshard.runtime import collectives, moe

ep_pass = importlib.import_module("autoshard.passes.expert_parallel")

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "tests" / "models"
sys.path.insert(0, str(MODELS))


def _capture(spec: str, config: str):
    return capture_file(spec, config, 16).graph_module


@pytest.fixture(scope="module")
def example():
    return _capture(str(ROOT / "examples" / "deepseek_v3.py"), "tiny")


@pytest.fixture(scope="module")
def mixtral():
    pytest.importorskip("transformers")
    return _capture(str(MODELS / "hf_moe.py"), "mixtral")


def _calls(gm, fn) -> list:
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


def test_a_capacity_buffer_is_one_region_of_three_gemms(example):
    regions = ep_pass.find_regions(example)
    assert [r.kind for r in regions] == ["buffer", "buffer"]  # layers 1 and 2 are MoE, layer 0 dense
    first = regions[0]
    assert first.experts == 8 and len(first.gemms) == 3
    assert sorted(first.weights) == [f"model.layers.1.ffn.experts.w{i}" for i in (1, 2, 3)]
    assert [e.name for e in ep_pass._exits(first)] == [first.gemms[-1].name]  # the down projection leaves


def test_grouped_gemms_are_one_region_per_layer_with_their_counts(mixtral):
    regions = ep_pass.find_regions(mixtral)
    assert [r.kind for r in regions] == ["grouped", "grouped"]
    for r in regions:
        assert r.experts == 4 and len(r.gemms) == 2  # gate_up and down, the activation between them
        assert all(g.args[2] is r.offs for g in r.gemms)
        assert all(g.target is moe.grouped_mm for g in r.gemms)  # canonical: no library custom op left


def test_the_rewrite_dispatches_once_and_combines_once_per_layer(example):
    import copy

    gm = copy.deepcopy(example)
    ctx = RewriteContext(ep=2)
    ep_pass.expert_parallel(gm, ctx)
    assert len(_calls(gm, moe.dispatch_buffer)) == 2 and len(_calls(gm, moe.combine_buffer)) == 2
    w1 = gm.get_parameter("model.layers.1.ffn.experts.w1")
    assert tuple(w1.shape) == (4, 64, 32)  # this rank's 4 of 8 experts
    assert decisions(gm).shards["model.layers.1.ffn.experts.w1"].axis == "ep"
    assert len(decisions(gm).expert_params) == 6
    # the bmm of each expert's rows reads the dispatched buffer, not the whole one
    for bmm in [n for n in gm.graph.nodes if n.meta.get("op_class") == "experts"]:
        assert bmm.args[0].target in (moe.dispatch_buffer, operator.mul), bmm.format_node()


def test_tensor_parallel_ranks_share_the_routed_rows(mixtral):
    import copy

    gm = copy.deepcopy(mixtral)
    ep_pass.expert_parallel(gm, RewriteContext(tp=2, ep=2))
    share, unshare = _calls(gm, moe.tp_share), _calls(gm, moe.tp_unshare)
    assert len(share) == len(unshare) == 2
    for s in share:  # the rows' gradient is summed over TP before this rank takes its share
        assert s.args[0].target is collectives.copy_to_tp
    for u in unshare:  # every rank gets all rows back
        assert [x.target for x in u.users] == [collectives.reduce_from_tp]


def test_sequence_parallel_ranks_route_their_own_rows(mixtral):
    import copy

    gm = copy.deepcopy(mixtral)
    ep_pass.expert_parallel(gm, RewriteContext(tp=2, ep=2, sequence_parallel=True))
    # each TP rank holds its own slice of the tokens: no sharing of rows among the TP ranks, no
    # TP collective around the experts, the EP all-to-all alone
    assert _calls(gm, moe.tp_share) == _calls(gm, moe.tp_unshare) == []
    assert _calls(gm, collectives.copy_to_tp) == _calls(gm, collectives.reduce_from_tp) == []
    dispatches, combines = _calls(gm, moe.dispatch), _calls(gm, moe.combine)
    assert len(dispatches) == len(combines) == 2
    for region, dispatch in zip(ep_pass.find_regions(mixtral), dispatches):
        assert dispatch.args[0].name == region.inlet.name  # the rows as routed on this rank
    assert all(
        "sequence parallel" in (n.meta.get("note") or "")
        for n in gm.graph.nodes
        if n.name.startswith("getitem") and n.args[0] in dispatches and n.args[1] == 0
    )


def test_experts_ep_does_not_divide_are_refused_with_the_module(mixtral):
    import copy

    # the module by its path in the model, the line of transformers' modeling file that calls it
    where = r"modeling_mixtral\.py:\d+ \(model\.layers\.0\.mlp\.experts\): EP8 does not divide its 4 experts"
    with pytest.raises(Refusal, match=where):
        ep_pass.expert_parallel(copy.deepcopy(mixtral), RewriteContext(ep=8))


def test_the_routing_bias_is_the_buffer_that_only_steers_the_choice(example, mixtral):
    import copy

    ctx = RewriteContext()
    gm = ep_pass.expert_balance(copy.deepcopy(example), ctx)
    assert {k: v["bias"] for k, v in decisions(gm).routing.items()} == {
        f"model.layers.{i}.ffn.experts": f"model.layers.{i}.ffn.expert_bias" for i in (1, 2)
    }
    assert all(v["top_k"] == 2 and v["experts"] == 8 for v in decisions(gm).routing.values())
    ctx = RewriteContext()
    gm = copy.deepcopy(mixtral)
    ep_pass.expert_balance(gm, ctx)
    assert [v["bias"] for v in decisions(gm).routing.values()] == [None, None]  # Mixtral routes without a bias
    # the optional balance loss reads the router's softmax and its choice, on the routed rows
    attached = _calls(gm, moe.balance_loss)
    assert [a.args[1].meta["op"] for a in attached] == ["softmax", "softmax"]
    assert all(a.args[2].target is moe.record_load for a in attached)
    assert all(any(u.target is moe.grouped_mm for u in a.users) for a in attached)


class _GateBias(nn.Module):
    """Top-k over scores plus a buffer that also scales the gates: not a selection-only bias."""

    def __init__(self, experts: int = 4, hidden: int = 8):
        super().__init__()
        self.router = nn.Linear(hidden, experts, bias=False)
        self.register_buffer("shift", torch.zeros(experts))
        self.w = nn.Parameter(torch.randn(experts, hidden, hidden) * 0.1)

    def forward(self, x):
        x = x.reshape(-1, x.size(-1))
        scores = torch.sigmoid(self.router(x)) + self.shift
        gates, chosen = scores.topk(2, dim=-1)
        buf = x[None].expand(4, -1, -1)  # every expert sees every token (a dense "buffer")
        out = torch.bmm(buf, self.w)
        picked = out[chosen, torch.arange(x.size(0))[:, None]]
        return (picked * gates[..., None]).sum(1).sum()


def test_a_buffer_that_reaches_the_gates_is_not_a_routing_bias():
    with torch.device("meta"):
        model = _GateBias()
    gm = capture(model, (torch.zeros(2, 8, 8, device="meta"),), loss=lambda out, x: out).graph_module
    shift = next(n for n in gm.graph.nodes if n.op == "get_attr" and n.target.endswith("shift"))
    assert not ep_pass._selection_only(shift)
