"""What the passes ask of a node: how a message names it (``describe``), in words and with the
line of the model's code that wrote it, never as an fx node dump."""

from pathlib import Path

import torch
from torch import nn

from autoshard.capture import capture
from autoshard.passes._graph import describe


def _line(marker: str) -> int:
    return next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1) if text.endswith(marker))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.fc(x))  # the block's line


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed, self.block, self.head = nn.Embedding(32, 16), Block(), nn.Linear(16, 32)
        self.scale = nn.Parameter(torch.ones(16))

    def forward(self, tokens):
        return self.head(self.block(self.embed(tokens)) * self.scale)


def _described() -> dict[str, str]:
    cap = capture(Net(), (torch.zeros(2, 8, dtype=torch.long),))
    return {n.name: describe(n) for n in cap.graph_module.graph.nodes}


def test_an_op_is_named_in_words_with_its_line_and_module():
    line = _line("# the block's line")
    described = _described()
    relu = next(d for d in described.values() if d.startswith("the relu "))
    assert relu == f"the relu at test_graph.py:{line} (block)"
    # a module call by its path in the model and its class
    assert f"the Linear block.fc at test_graph.py:{line}" in described.values()
    assert not any("%" in d or "call_" in d for d in described.values())


def test_inputs_parameters_and_the_loss_are_named_as_the_user_knows_them():
    described = _described()
    loss = [d for d in described.values() if d.endswith(" in the loss")]
    # autoshard's own loss has no line in the model's code
    assert loss and not any(" at " in d for d in loss)
    assert described["tokens"] == "the model input tokens"
    # by its name in the user's model, not the training wrapper's ("model.scale")
    assert "the parameter scale" in described.values()
