"""A chunk's layers as the program treats them: one FSDP unit each, compiled on GPUs only."""

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import autoshard.runtime as rt
from autoshard.runtime.program import compile_layers, layer_modules, layer_units


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Linear(4, 4)

    def forward(self, x):
        return self.w(x).relu()


def _chunk() -> nn.Module:
    """What an emitted chunk builds: its layers in a ``ModuleDict`` under the model's names, one of
    them under activation checkpointing, and a module outside the layers."""
    chunk = nn.Module()
    rt.put_module(chunk, "model.layers", nn.ModuleDict({"3": Layer(), "4": Layer()}))
    chunk.checkpoint_4 = rt.Checkpoint(chunk.model.layers["4"], recompute=["activation"])
    rt.put_module(chunk, "model.norm", nn.LayerNorm(4))
    return chunk


def test_the_layers_are_the_layer_dicts_values():
    chunk = _chunk()
    assert layer_modules(chunk) == [chunk.model.layers["3"], chunk.model.layers["4"]]


def test_layers_are_compiled_on_gpus_only_and_not_under_a_checkpoint():
    chunk = _chunk()
    assert compile_layers([chunk], torch.device("cpu")) == 0
    assert compile_layers([chunk], torch.device("cuda"), enabled=False) == 0  # --no-compile
    with FakeTensorMode():  # the at-scale run counts the eager ops
        assert compile_layers([chunk], torch.device("cuda")) == 0
    assert not any("forward" in vars(layer) for layer in layer_modules(chunk))
    # the checkpointed layer stays eager: its selective policy decides what to keep op by op
    assert compile_layers([chunk], torch.device("cuda")) == 1
    assert "forward" in vars(chunk.model.layers["3"]) and "forward" not in vars(chunk.model.layers["4"])


def test_each_layer_is_one_fsdp_unit_gathered_around_its_checkpoint():
    chunk = _chunk()
    layers = chunk.model.layers
    x = torch.randn(2, 4, requires_grad=True)
    want = layers["4"].w(x).relu()
    units = layer_units(chunk)
    assert units == [layers["3"], layers["4"], [chunk.model.norm]]
    # calling the checkpoint calls the layer (where FSDP's hooks sit), which runs the checkpoint
    # around the layer's own forward
    got = chunk.checkpoint_4(x)
    assert torch.equal(got, want)
    got.sum().backward()
    assert layers["4"].w.weight.grad is not None
