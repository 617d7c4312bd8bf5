"""The public names emitted stage files build themselves with."""

import torch
from torch import nn

import autoshard.runtime as rt


def test_put_creates_the_containers_of_a_dotted_name():
    root = nn.Module()
    rt.put_module(root, "model.layers.0.attn.wq", nn.Linear(4, 2))
    rt.put_parameter(root, "model.embed.weight", nn.Parameter(torch.zeros(8, 4)))
    rt.put_buffer(root, "model.layers.0.attn.rope", torch.ones(3))
    assert {n: tuple(p.shape) for n, p in root.named_parameters()} == {
        "model.layers.0.attn.wq.weight": (2, 4),
        "model.layers.0.attn.wq.bias": (2,),
        "model.embed.weight": (8, 4),
    }
    assert [n for n, _ in root.named_buffers()] == ["model.layers.0.attn.rope"]
    assert isinstance(root.model.layers, nn.Module) and root.model.layers.get_submodule("0.attn.wq").in_features == 4
