"""Pipeline split: chunks hold exactly the layers the plan gives them, boundaries are explicit,
reads of an input's device are made again in the chunk that needs them, and the chunks run one
after another reproduce the whole graph's loss."""

import operator
import sys

import pytest
import torch
from torch import fx

from autoshard.capture import capture, causal_lm_loss
from autoshard.cost_models.analyze import analyze
from autoshard.errors import AutoshardError
from autoshard.passes import PASSES, RewriteContext, run_passes
from autoshard.passes.contract import decisions
from autoshard.passes.pipeline_split import SplitProgram, chunks_chained, pipeline_split

from conftest import EXAMPLES
from graphs import TinyLM, expected_loss, listing, loss, tokens

sys.path.insert(0, str(EXAMPLES))


def _tiny(layers: int, **kw):
    torch.manual_seed(0)
    model = TinyLM(layers, **kw)
    return model, capture(model, (tokens(),), loss=loss).graph_module


def _blocks(g: fx.Graph, h: fx.Node, layers) -> fx.Node:
    for i in layers:
        h = g.call_function(
            operator.add, (h, g.call_function(torch.relu, (g.call_module(f"model.layers.{i}.lin", (h,)),)))
        )
    return h


def _expected_chunks():
    first = fx.Graph()
    first.output(_blocks(first, first.call_module("model.embed", (first.placeholder("tokens"),)), (0, 1)))
    second = fx.Graph()
    second.output(second.call_module("model.head", (_blocks(second, second.placeholder("add_1"), (2, 3)),)))
    loss_graph = fx.Graph()
    logits, target = loss_graph.placeholder("model_head"), loss_graph.placeholder("tokens")
    loss_graph.output(expected_loss(loss_graph, logits, target))
    return first, second, loss_graph


def test_two_stages_of_two_layers():
    model, gm = _tiny(4)
    before = listing(gm.graph)
    ctx = RewriteContext(stage_layers=(2, 2))
    assert pipeline_split(gm, ctx) is gm
    assert listing(gm.graph) == before
    split = decisions(gm).split
    first, second, loss_graph = _expected_chunks()
    assert [listing(c.graph) for c in split.chunks] == [listing(first), listing(second)]
    assert listing(split.loss.graph) == listing(loss_graph)
    assert split.boundaries == [["add_1"], ["model_head"]]
    assert split.layers == [(0, 2), (2, 4)] and split.target == "tokens"
    x = tokens()
    assert torch.allclose(split.loss(split.chunks[1](split.chunks[0](x)), x), loss(model(x), x))


def test_no_stage_layers_is_one_chunk_of_every_layer():
    _, gm = _tiny(2)
    ctx = RewriteContext()
    pipeline_split(gm, ctx)
    assert len(decisions(gm).split.chunks) == 1 and decisions(gm).split.layers == [(0, 2)]
    calls = [n.target for n in decisions(gm).split.chunks[0].graph.nodes if n.op == "call_module"]
    assert calls == ["model.embed", "model.layers.0.lin", "model.layers.1.lin", "model.head"]


def test_a_later_chunk_reads_the_device_off_its_own_input():
    model, gm = _tiny(2, device=torch.device("meta"))  # canonicalize: zeros(device=tokens.device)
    ctx = RewriteContext(stage_layers=(1, 1))
    pipeline_split(gm, ctx)
    first, second = decisions(gm).split.chunks
    assert decisions(gm).split.boundaries[0] == ["add_1"]  # only the hidden state crosses, not the device
    for chunk, reads in ((first, "tokens"), (second, "add_1")):
        (device,) = [n for n in chunk.graph.nodes if n.target is getattr]
        assert device.args == (next(iter(chunk.graph.nodes)), "device")
        assert device.args[0].name == reads
        assert [n.kwargs["device"] for n in chunk.graph.nodes if n.target is torch.zeros] == [device]
    for block in model.layers:
        block.device = None
    x = tokens()
    assert torch.allclose(decisions(gm).split.loss(second(first(x)), x), loss(model(x), x))


def test_the_ensured_fact_holds_after_the_pass():
    _, gm = _tiny(4)
    (split_pass,) = [p for p in PASSES if p.name == "pipeline_split"]
    assert chunks_chained in split_pass.ensures
    ctx = RewriteContext(stage_layers=(2, 2))
    run_passes([split_pass], gm, ctx)  # checks requires, writes and ensures
    assert chunks_chained(gm, ctx) is None
    assert chunks_chained(gm, RewriteContext(stage_layers=(1, 1, 2))) == "2 chunks for stage_layers [1, 1, 2]"
    split = decisions(gm).split
    split.chunks.reverse()
    assert chunks_chained(gm, ctx) == "chunk 0 holds layers [2, 3], outside its [0, 2)"


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
    ctx = RewriteContext(stage_layers=(0, 1, 1, 0))  # embedding alone, one layer each, head alone
    split = decisions(pipeline_split(cap.graph_module, ctx)).split
    assert [_layers_in(c) for c in split.chunks] == [[], [0], [1], []]
    first = {n.target for n in split.chunks[0].graph.nodes if n.op == "call_module"}
    last = {n.target for n in split.chunks[-1].graph.nodes if n.op == "call_module"}
    assert "model.embed" in first and ("model.output" in last or "model.head" in last)
    assert all(len(b) == 1 for b in split.boundaries)  # only the hidden state crosses
    assert split.target == "tokens"
    batch = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    x = (batch,)
    for chunk in split.chunks:
        out = chunk(*x)
        x = out if isinstance(out, tuple) else (out,)
    assert torch.allclose(split.loss(*x, batch), causal_lm_loss(model(batch), batch))


def test_a_buffer_its_layer_no_longer_reads_goes_to_the_layers_chunk():
    """nanoGPT's causal mask, fused away by the flash pass: the read of each layer's ``bias``
    buffer, used by nothing, stays with its layer's chunk (the layer holds the buffer, part of the
    model's state), not in chunk 0 for every layer."""
    from autoshard.capture import capture_file
    from autoshard.passes.flash_attention import flash_attention

    cap = capture_file(str(EXAMPLES.parent / "tests" / "models" / "nanogpt.py"), "tiny", 32)
    ctx = RewriteContext(stage_layers=(1, 1))
    split = decisions(pipeline_split(flash_attention(cap.graph_module, ctx), ctx)).split
    held = [
        [n.target for n in chunk.graph.nodes if n.op == "get_attr" and n.target.endswith(".attn.bias")]
        for chunk in split.chunks
    ]
    assert held == [["model.transformer.h.0.attn.bias"], ["model.transformer.h.1.attn.bias"]]


def test_stage_layers_that_do_not_cover_the_model_are_refused():
    _, cap = _captured("llama3")
    with pytest.raises(AutoshardError, match="stage_layers hold 1 layers"):
        pipeline_split(cap.graph_module, RewriteContext(stage_layers=(1,)))


class _RowsOnce(torch.nn.Module):
    """Computes ``b * s`` once and flattens tokens into rows with it in every layer (as
    transformers' MoE blocks do): an int no pipeline stage may send."""

    def __init__(self, layers: int = 2, hidden: int = 8):
        super().__init__()
        self.embed = torch.nn.Embedding(16, hidden)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(hidden, hidden) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, 16)

    def forward(self, tokens):
        rows = tokens.size(0) * tokens.size(1)
        x = self.embed(tokens)
        for layer in self.layers:
            x = x + layer(x.reshape(rows, -1)).reshape(x.shape)
        return self.head(x)


def _hands_on_tensors_and_trains_as(model, split: SplitProgram) -> None:
    """Two chunks: the second reads tensors only, and together with the loss they give the model's loss."""
    first, second = split.chunks
    handed = [n for n in second.graph.nodes if n.op == "placeholder"]
    assert all(n.meta.get("shape") is not None for n in handed), [n.name for n in handed]  # tensors only
    inputs = tokens()
    hidden = first(inputs)
    logits = second(*hidden) if isinstance(hidden, tuple) else second(hidden)
    assert torch.allclose(split.loss(logits, inputs), loss(model(inputs), inputs))


def test_arithmetic_on_input_sizes_is_recomputed_not_handed_on():
    torch.manual_seed(0)
    model = _RowsOnce()
    gm = capture(model, (tokens(),), loss=loss).graph_module
    ctx = RewriteContext(stage_layers=(1, 1))
    pipeline_split(gm, ctx)
    assert chunks_chained(gm, ctx) is None
    _hands_on_tensors_and_trains_as(model, decisions(gm).split)


class _RowsInLayer(torch.nn.Module):
    """``b * s`` computed by the first layer and read by every later one (what torch.export makes
    of transformers' MoE blocks, each computing it: one node, in layer 0)."""

    def __init__(self, hidden: int = 8):
        super().__init__()
        self.linear = torch.nn.Linear(hidden, hidden)

    def forward(self, x, tokens, rows=None):
        rows = tokens.size(0) * tokens.size(1) if rows is None else rows
        return x + self.linear(x.reshape(rows, -1)).reshape(x.shape), rows


class _RowsFromFirstLayer(_RowsOnce):
    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(_RowsInLayer() for _ in range(2))

    def forward(self, tokens):
        x, rows = self.embed(tokens), None
        for layer in self.layers:
            x, rows = layer(x, tokens, rows)
        return self.head(x)


def test_arithmetic_on_input_sizes_inside_a_checkpointed_layer_is_not_handed_on():
    torch.manual_seed(0)
    model = _RowsFromFirstLayer()
    cap = capture(model, (tokens(),), loss=loss)
    analyze(cap)
    gm = cap.graph_module
    ctx = RewriteContext(stage_layers=(1, 1), recompute=("attention",))
    gm = run_passes([p for p in PASSES if p.name in ("activation_checkpoint", "pipeline_split")], gm, ctx)
    _hands_on_tensors_and_trains_as(model, decisions(gm).split)
