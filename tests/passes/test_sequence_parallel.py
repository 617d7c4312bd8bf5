"""Sequence parallel after tensor parallel: the TP regions' all-reduces become reduce-scatters,
their f's all-gathers, the hidden state is sliced entering the first layer, sequence lengths read
on slices are restored, and the norms' gradients are listed as partial."""

import operator
import sys

import torch

from autoshard import runtime
from autoshard.capture import capture
from autoshard.cost_models.analyze import analyze
from autoshard.passes.sequence_parallel import sequence_parallel
from autoshard.passes.tensor_parallel import tensor_parallel

from conftest import EXAMPLES

sys.path.insert(0, str(EXAMPLES))


def _calls(gm, fn):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is fn]


def test_llama_tp2_sp_rewrites_collectives_and_lists_partial_norm_gradients():
    import llama3

    cap = capture(llama3.build("tiny"), (torch.zeros(2, 16, dtype=torch.long),))
    analyze(cap)
    sharded = tensor_parallel(cap.graph_module, 2)
    partial = sequence_parallel(sharded.gm, 2, sharded.notes)
    gm = sharded.gm
    # Expected: no all-reduce left inside the layers, one reduce-scatter per row matmul,
    # one all-gather per TP region (4 in the layers + the head), one scatter into layer 0
    assert len(_calls(gm, runtime.reduce_from_tp)) == 0
    assert len(_calls(gm, runtime.reduce_scatter_to_sp)) == 4
    assert len(_calls(gm, runtime.gather_from_sp)) == 5
    assert len(_calls(gm, runtime.copy_to_tp)) == 0
    (scatter,) = _calls(gm, runtime.scatter_to_sp)
    assert scatter.args[0].target == "model.embed" or scatter.args[0].target is runtime.vocab_parallel_embedding
    assert all(n.args[1] == 1 for n in _calls(gm, runtime.gather_from_sp))  # the sequence dimension
    # x.size(1) read on a sequence slice is multiplied back to the full length
    doubled = [n for n in gm.graph.nodes if n.target is operator.mul and n.args[1] == 2]
    assert len(doubled) == 2  # one per layer's attention
    assert partial == sorted(
        [f"model.layers.{i}.{n}.weight" for i in (0, 1) for n in ("attn_norm", "ffn_norm")] + ["model.norm.weight"]
    )
