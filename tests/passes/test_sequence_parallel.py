"""Sequence parallel after tensor parallel: the TP regions' all-reduces become reduce-scatters,
their f's all-gathers, the hidden state is sliced entering the first layer, sequence lengths read
on slices are restored, and the norms' gradients are listed as partial."""

import operator
import sys

import pytest
import torch
from torch import nn

from autoshard import runtime
from autoshard.capture import capture, capture_file
from autoshard.cost_models.analyze import analyze
from autoshard.passes.contract import Refusal, RewriteContext, decisions
from autoshard.passes.sequence_parallel import sequence_parallel
from autoshard.passes.tensor_parallel import tensor_parallel
from autoshard.runtime import moe

from conftest import EXAMPLES
from graphs import RMS

sys.path.insert(0, str(EXAMPLES))
MODELS = EXAMPLES.parent / "tests" / "models"


def _calls(gm, fn):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


def test_llama_tp2_sp_rewrites_collectives_and_lists_partial_norm_gradients():
    import llama3

    cap = capture(llama3.build("tiny"), (torch.zeros(2, 16, dtype=torch.long),))
    analyze(cap)
    ctx = RewriteContext(tp=2, sequence_parallel=True)
    gm = sequence_parallel(tensor_parallel(cap.graph_module, ctx), ctx)
    partial = decisions(gm).partial_grads
    # Expected: no all-reduce left, one reduce-scatter per row matmul, one all-gather per TP
    # region (4 in the layers + the head), and the vocabulary-parallel embedding reduce-scattering
    # its partial sums onto the sequence slices itself (Megatron's; no all-reduce, then a cut)
    assert len(_calls(gm, runtime.reduce_from_tp)) == 0
    assert len(_calls(gm, runtime.reduce_scatter_to_sp)) == 4
    assert len(_calls(gm, runtime.gather_from_sp)) == 5
    assert len(_calls(gm, runtime.copy_to_tp)) == 0
    assert _calls(gm, runtime.scatter_to_sp) == []
    (embedding,) = _calls(gm, runtime.vocab_parallel_embedding)
    assert embedding.kwargs["sp_dim"] == 1
    assert all(n.args[1] == 1 for n in _calls(gm, runtime.gather_from_sp))  # the sequence dimension
    # x.size(1) read on a sequence slice is multiplied back to the full length
    doubled = [n for n in gm.graph.nodes if n.target is operator.mul and n.args[1] == 2]
    assert len(doubled) == 2  # one per layer's attention
    assert partial == sorted(
        [f"model.layers.{i}.{n}.weight" for i in (0, 1) for n in ("attn_norm", "ffn_norm")] + ["model.norm.weight"]
    )


# ---------------------------------------------------------------------------------------------
# Before/Expected on a small hand-written model


class FFN(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 64, bias=False)
        self.fc2 = nn.Linear(64, 64, bias=False)

    def forward(self, x):
        return self.fc2(nn.functional.gelu(self.fc1(x)))


class Block(nn.Module):
    def __init__(self, norm, cumsum=False):
        super().__init__()
        self.norm, self.ffn, self.cumsum = norm(64), FFN(), cumsum

    def forward(self, x):
        x = x + self.ffn(self.norm(x))
        return x.cumsum(1) if self.cumsum else x


class Tiny(nn.Module):
    def __init__(self, norm=RMS, cumsum=False):
        super().__init__()
        self.embed = nn.Embedding(64, 64)
        self.layers = nn.ModuleList(Block(norm, cumsum) for _ in range(2))
        self.head = nn.Linear(64, 64, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _tp_sp(model):
    cap = capture(model, (torch.zeros(2, 8, dtype=torch.long),))
    analyze(cap)
    ctx = RewriteContext(tp=2, sequence_parallel=True)
    return sequence_parallel(tensor_parallel(cap.graph_module, ctx), ctx), ctx


def _layer_program(gm, layer):
    return [
        n.meta["op"]
        for n in gm.graph.nodes
        if n.op in ("call_function", "call_method", "call_module") and n.meta.get("layer") == layer
    ]


@pytest.mark.parametrize("norm", [RMS, nn.RMSNorm], ids=["written-out", "module"])
def test_tp_regions_gather_and_reduce_scatter_the_sequence(norm):
    gm, ctx = _tp_sp(Tiny(norm))
    (embedding,) = _calls(gm, runtime.vocab_parallel_embedding)  # reduce-scatters onto the slices
    assert embedding.kwargs["sp_dim"] == 1 and _calls(gm, runtime.scatter_to_sp) == []
    norm_ops = ["pow", "mean", "add", "rsqrt", "mul", "mul"] if norm is RMS else ["rms_norm"]
    # Expected: the norm and the residual add run on the slice; the MLP between an all-gather
    # and a reduce-scatter of the sequence
    assert _layer_program(gm, 1) == [
        *norm_ops,
        "gather_from_sp",
        "linear",
        "gelu",
        "linear",
        "reduce_scatter_to_sp",
        "add",
    ]
    weights = ["model.layers.0.norm.w", "model.layers.1.norm.w"]
    if norm is nn.RMSNorm:
        weights = [w.replace(".w", ".weight") for w in weights]
    assert decisions(gm).partial_grads == weights  # the norm's weight sees this rank's tokens only


def test_an_op_across_the_sequence_is_refused():
    with pytest.raises(Refusal, match=r"'cumsum' is not per-token; plan with --force sp=off") as e:
        _tp_sp(Tiny(cumsum=True))
    assert (e.value.axis, e.value.value) == ("sp", True)
    assert "test_sequence_parallel.py:" in str(e.value)


class LowRank(nn.Module):
    """A low-rank projection normalised over its own features before the column matmul (MLA's
    q_a_proj and q_a_layernorm): tensor parallelism leaves it whole."""

    def __init__(self):
        super().__init__()
        self.norm, self.low, self.ffn = RMS(64), nn.Linear(64, 16, bias=False), FFN()
        self.ffn.fc1 = nn.Linear(16, 64, bias=False)

    def forward(self, x):
        return x + self.ffn(nn.functional.rms_norm(self.low(self.norm(x)), (16,)))


def test_a_linear_left_whole_runs_on_the_slice_and_its_gradient_is_partial():
    model = Tiny()
    model.layers = nn.ModuleList(LowRank() for _ in range(2))
    gm, _ = _tp_sp(model)
    # Expected: the low-rank projection and its norm on the slice, the gather before the column matmul
    assert _layer_program(gm, 1) == [
        *["pow", "mean", "add", "rsqrt", "mul", "mul"],
        "linear",
        "rms_norm",
        "gather_from_sp",
        "linear",
        "gelu",
        "linear",
        "reduce_scatter_to_sp",
        "add",
    ]
    assert "model.layers.1.low.weight" in decisions(gm).partial_grads


class Rotary(nn.Module):
    """A per-token op by a table over every position (a rotary embedding's cos): cut to the slice."""

    def __init__(self):
        super().__init__()
        self.norm, self.ffn = RMS(64), FFN()

    def forward(self, x):
        table = torch.arange(x.size(1), dtype=x.dtype)[:, None].cos()
        return x + self.ffn(self.norm(x) * table)


def test_a_table_over_the_whole_sequence_is_cut_to_this_ranks_positions():
    model = Tiny()
    model.layers = nn.ModuleList(Rotary() for _ in range(2))
    gm, _ = _tp_sp(model)
    cuts = [n for n in _calls(gm, runtime.scatter_to_sp) if n.meta.get("layer") == 1]
    assert len(cuts) == 1 and cuts[0].args[1] == 0  # the table's positions are its first dimension
    assert [u.meta["op"] for u in cuts[0].users] == ["mul"]
    # the table is built over the whole sequence: its length read on the slice is made whole
    (arange,) = [n for n in gm.graph.nodes if n.meta.get("op") == "arange" and n.meta.get("layer") == 1]
    assert arange.args[0].target is operator.mul and arange.args[0].args[1] == 2


# ---------------------------------------------------------------------------------------------
# MoE layers on the slice


def _moe_sp(path, config, ep=2):
    from autoshard.passes.expert_parallel import expert_balance, expert_parallel

    cap = capture_file(str(path), config, 16)
    analyze(cap)
    ctx = RewriteContext(tp=2, ep=ep, seq=16, sequence_parallel=True)
    gm = tensor_parallel(cap.graph_module, ctx)
    gm = expert_balance(expert_parallel(sequence_parallel(gm, ctx), ctx), ctx)
    return gm


def test_a_moe_layer_routes_this_ranks_slice_without_gathering_it():
    gm = _moe_sp(EXAMPLES / "deepseek_v3.py", "tiny")
    partial = decisions(gm).partial_grads
    for layer in (1, 2):
        gate = next(n for n in gm.graph.nodes if n.target == f"model.layers.{layer}.ffn.gate")
        assert gate.args[0].meta["sp_tp"] == 2  # the router reads the slice, not a gathered sequence
        assert f"model.layers.{layer}.ffn.gate.weight" in partial  # it saw this rank's tokens only
        assert not any(f"model.layers.{layer}.ffn.experts" in p for p in partial)  # summed over EP's ranks
    # the routed rows go to their experts and back by the EP all-to-all alone: no TP sharing of rows
    assert len(_calls(gm, moe.dispatch_buffer)) == len(_calls(gm, moe.combine_buffer)) == 2
    assert _calls(gm, moe.tp_share_buffer) == _calls(gm, moe.tp_unshare_buffer) == []
    assert _calls(gm, runtime.copy_to_tp) == _calls(gm, runtime.reduce_from_tp) == []
    # the shared experts are a TP-split MLP: the flattened tokens gathered, reduce-scattered after
    assert len(_calls(gm, runtime.gather_tokens)) == len(_calls(gm, runtime.reduce_scatter_tokens)) == 2
    # the balance loss (when the program sets one) counts over the whole sequences, this rank's 16 / 2
    for loss in _calls(gm, moe.balance_loss):
        assert loss.args[4] == 8 and loss.args[6] is True


def test_sizes_a_moe_layer_reads_from_the_whole_sequence_become_this_ranks():
    pytest.importorskip("transformers")
    gm = _moe_sp(MODELS / "hf_moe.py", "mixtral")
    assert _calls(gm, moe.tp_share) == [] and len(_calls(gm, moe.dispatch)) == 2
    # transformers' Mixtral counts its rows from the token ids' batch x sequence, once for all
    # layers: the experts' layers read this rank's share of it
    shares = {n for n in gm.graph.nodes if n.target is operator.floordiv and n.args[1] == 2}
    assert shares and all(n.args[0].meta["op"] == "sym_size" for n in shares)
    routed = [
        n
        for n in gm.graph.nodes
        if n.meta.get("op") == "arange" and any(u.meta.get("sp_tp") for u in n.users)  # read on the slice
    ]
    assert len(routed) == 2  # one per MoE layer: the positions of its routed rows
    for arange in routed:
        above, todo = set(), [arange]
        while todo:
            todo.extend(a for a in todo.pop().all_input_nodes if a not in above and not above.add(a))
        assert above & shares  # counted from this rank's share of the sequence
