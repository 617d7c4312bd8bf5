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


def test_unequal_parts_are_split_part_by_part_and_put_back():
    """A fused q/k/v weight of rows (64, 32, 32): each rank holds its block of every part."""
    from autoshard.runtime.stages import slice_full, unslice

    full = torch.arange(128 * 3).reshape(128, 3)
    spec = (0, (128,), 0, (64, 32, 32))
    pieces = [slice_full(full, spec, r, 2) for r in range(2)]
    assert pieces[0][:, 0].tolist() == [3 * i for i in [*range(0, 32), *range(64, 80), *range(96, 112)]]
    assert pieces[1].shape == (64, 3)
    assert torch.equal(unslice(pieces, spec), full)
    assert torch.equal(unslice([slice_full(full, spec[:3], r, 2) for r in range(2)], spec[:3]), full)
