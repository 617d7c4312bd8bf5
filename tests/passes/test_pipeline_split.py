"""Pipeline split: chunks hold the layers the plan gives them, boundaries are explicit, and the
chunks run one after another reproduce the whole graph's loss."""

import sys

import pytest
import torch

from autoshard.capture import capture, causal_lm_loss
from autoshard.cost_models.analyze import analyze
from autoshard.errors import AutoshardError
from autoshard.passes.pipeline_split import pipeline_split

from conftest import EXAMPLES

sys.path.insert(0, str(EXAMPLES))


def _captured(name):
    module = __import__(name)
    torch.manual_seed(0)
    model = module.build("tiny")
    cap = capture(model, (torch.zeros(2, 16, dtype=torch.long),))
    analyze(cap)
    return model, cap


def _layers_in(gm):
    return sorted(
        {int(n.target.split(".")[2]) for n in gm.graph.nodes if n.op == "call_module" and ".layers." in n.target}
    )


@pytest.mark.parametrize("name", ["llama3", "gpt"])
def test_chunks_follow_stage_layers_and_reproduce_the_loss(name):
    model, cap = _captured(name)
    split = pipeline_split(cap.graph_module, [0, 1, 1, 0])  # embedding alone, one layer each, head alone
    assert [_layers_in(c) for c in split.chunks] == [[], [0], [1], []]
    first = {n.target for n in split.chunks[0].graph.nodes if n.op == "call_module"}
    last = {n.target for n in split.chunks[-1].graph.nodes if n.op == "call_module"}
    assert "model.embed" in first and ("model.output" in last or "model.head" in last)
    assert all(len(b) == 1 for b in split.boundaries)  # only the hidden state crosses
    assert split.target == "tokens"
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    x = (tokens,)
    for chunk in split.chunks:
        out = chunk(*x)
        x = out if isinstance(out, tuple) else (out,)
    loss = split.loss(*x, tokens)
    assert torch.allclose(loss, causal_lm_loss(model(tokens), tokens))


def test_stage_layers_that_do_not_cover_the_model_are_refused():
    _, cap = _captured("llama3")
    with pytest.raises(AutoshardError, match="stage_layers hold 1 layers"):
        pipeline_split(cap.graph_module, [1])
