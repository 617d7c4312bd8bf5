"""The Before/Expected comparison (``spec.assert_same_program``) is strict: an Expected program one
step away from what the tensor-parallel pass produces is rejected, and the report names the first
node that differs, what differs there, and shows both programs."""

import operator

import pytest
import torch
from spec import assert_same_program, program
from test_tensor_parallel_spec import LM, MLP, VOCAB_META, Attention, AttentionRank, MLPRank, rewrite
from torch import fx, nn

from autoshard.runtime.collectives import reduce_from_tp, vocab_parallel_cross_entropy


def _node(gm: fx.GraphModule, target) -> fx.Node:
    (node,) = [n for n in gm.graph.nodes if n.target is target or n.target == target]
    return node


def without_the_reduce(gm: fx.GraphModule) -> None:
    g = _node(gm, reduce_from_tp)
    g.replace_all_uses_with(g.args[0])
    gm.graph.erase_node(g)


def fc1_split_by_inputs(gm: fx.GraphModule) -> None:
    gm.get_submodule("model.layers.0").fc1 = nn.Linear(16, 64, bias=False)  # in_features halved, not out


def residual_operands_swapped(gm: fx.GraphModule) -> None:
    add = _node(gm, operator.add)
    add.args = add.args[::-1]


def ignore_index_a_float(gm: fx.GraphModule) -> None:
    ce = _node(gm, vocab_parallel_cross_entropy)
    ce.args = (*ce.args[:2], -100.0, *ce.args[3:])


NEAR_MISSES = {  # how the Expected misses -> what the report says differs first
    "reduce missing": (without_the_reduce, "(target, args)"),
    "split along the inputs": (fc1_split_by_inputs, "(target)"),
    "operands swapped": (residual_operands_swapped, "(args)"),
    "constant of another type": (ignore_index_a_float, "(args)"),
}


@pytest.fixture(scope="module")
def mlp():
    return rewrite(LM(MLP()))[0]


def test_the_expected_program_matches(mlp):
    assert_same_program(mlp, program(MLPRank()), meta=VOCAB_META)


@pytest.mark.parametrize("miss", list(NEAR_MISSES))
def test_a_near_miss_is_rejected_at_the_node_it_misses(mlp, miss):
    change, differs = NEAR_MISSES[miss]
    expected = program(MLPRank())
    change(expected)
    expected.recompile()
    with pytest.raises(AssertionError, match=r"differs from the Expected at node \d+ ") as e:
        assert_same_program(mlp, expected)
    report = str(e.value)
    assert differs in report.splitlines()[0]
    assert "--- actual ---" in report and "--- expected ---" in report and "reduce_from_tp(" in report


def test_a_wrong_decision_in_node_meta_is_rejected(mlp):
    with pytest.raises(AssertionError, match=r"meta\['tp'\]: 'replicated' where the Expected has 'sharded'"):
        assert_same_program(mlp, program(MLPRank()), meta={"copy_to_tp": {"tp": "sharded"}})
    with pytest.raises(AssertionError, match=r"meta names nodes the Expected program does not have: \['fc1'\]"):
        assert_same_program(mlp, program(MLPRank()), meta={"fc1": {"tp_role": "column"}})


def test_heads_left_unsplit_in_a_view_are_rejected():
    gm, _ = rewrite(LM(Attention()))
    expected = program(AttentionRank())
    view = next(n for n in expected.graph.nodes if n.target == "view")
    view.args = (*view.args[:3], 4, 8)  # all 4 query heads, as in the Before
    with pytest.raises(AssertionError, match=r"at node \d+ \(args\)"):
        assert_same_program(gm, expected)


def test_a_program_shorter_than_the_pass_output_is_rejected(mlp):
    class Truncated(nn.Module):  # the Expected stops before the loss
        def __init__(self):
            super().__init__()
            self.model = MLPRank().model

        def forward(self, tokens):
            return torch.zeros(())

    with pytest.raises(AssertionError, match="differs from the Expected"):
        assert_same_program(mlp, program(Truncated()))
