"""What a pipeline stage sends is contiguous: gloo and NCCL send and receive only contiguous
tensors, and a neighbour's receive buffer takes the strides of the tensor it stands for. A chunk's
outputs are handed on contiguous (``program._hand_on_copies``: GPT-J hands on its rotary sin and
cos as views of one table split along its last dimension), the gradients a stage sends back too
(``program._ContiguousGradients``); a tensor already contiguous is sent as it is."""

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from autoshard.cli import main
from autoshard.runtime.program import _ContiguousGradients, _hand_on_copies
from autoshard.verify import verify

MODELS = Path(__file__).parents[1] / "models"


class SplitsATable(nn.Module):
    """A chunk like GPT-J's first: hidden states, and sin and cos split off one table."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        sin, cos = torch.cat([x.sin(), x.cos()], dim=-1).split(8, dim=-1)
        return self.proj(x), sin, cos


def test_a_chunk_hands_on_views_contiguous_and_contiguous_outputs_as_they_are():
    chunk = SplitsATable()
    x = torch.randn(2, 4, 8, requires_grad=True)
    hidden, sin, cos = SplitsATable.forward(chunk, x)
    assert not sin.is_contiguous() and not cos.is_contiguous()
    _hand_on_copies(chunk)
    handed = chunk(x)
    assert all(t.is_contiguous() for t in handed)
    assert torch.equal(handed[0], hidden) and torch.equal(handed[1], sin) and torch.equal(handed[2], cos)
    (handed[1].sum() + handed[2].sum()).backward()
    assert torch.allclose(x.grad, x.cos() - x.sin())


def test_a_contiguous_output_is_handed_on_without_a_copy():
    class Passes(nn.Module):
        def forward(self, x):
            return x * 2

    chunk = Passes()
    made = []
    chunk.register_forward_hook(lambda m, args, out: made.append(out))
    _hand_on_copies(chunk)
    out = chunk(torch.randn(3, 4))
    assert out is made[0]


class _Sends:
    def __init__(self, tensors):
        self.tensors = tensors

    def get_bwd_send_ops(self, bwd_chunk_id):
        return [SimpleNamespace(tensor=t) for t in self.tensors]


class _Stage(_ContiguousGradients, _Sends):
    pass


def test_gradients_are_sent_contiguous_and_a_contiguous_one_as_it_is():
    transposed, plain = torch.randn(4, 3).t(), torch.randn(3, 4)
    ops = _Stage([transposed, plain]).get_bwd_send_ops(0)
    assert ops[0].tensor.is_contiguous() and torch.equal(ops[0].tensor, transposed)
    assert ops[1].tensor is plain


def test_gptj_trains_under_pp2_as_on_one_device(tmp_path):
    """GPT-J's first chunk hands on its split rotary sin and cos: without contiguous sends,
    gloo fails ("input tensor has to be contiguous") on both pipeline ranks."""
    pytest.importorskip("transformers")  # a test dependency
    out = tmp_path / "out"
    args = [str(MODELS / "hf_zoo.py"), "--config", "gptj", "--hardware", "cpu", "--gpus", "2", "--seq-len", "32"]
    assert main(["compile", *args, "--global-batch", "4", "--force", "pp=2,schedule=1f1b", "-o", str(out)]) == 0
    result = verify(out, steps=2, tolerance=1e-5, timeout=240)
    assert [row["rel_diff"] <= 1e-5 for row in result["steps"]] == [True, True], result["steps"]
    assert result["max_param_abs_diff"] <= 1e-5, result["max_param_name"]
    assert not result["missing_params"]
    assert result["ok"]
