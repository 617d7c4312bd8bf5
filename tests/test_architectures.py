"""The architecture matrix's CI subset: transformers' decoders at tiny configs
(``tests/models/hf_zoo.py``), each compiled with a forced layout and verified against the
single-device model (fp32, gloo, relative 1e-5), one case per feature that needed its own rule;
and a constant the forward makes, which capture lifts into a buffer.
The whole matrix is ``python benchmarks/architectures.py``; its table is in the README."""

import sys
from pathlib import Path

import pytest

from autoshard.cli import main
from autoshard.verify import verify

MODELS = Path(__file__).parent / "models"
sys.path.insert(0, str(MODELS))
hf_zoo = pytest.importorskip("hf_zoo")  # needs transformers, a test dependency


# the CI subset, and Falcon: multi-query attention through a fused projection, its one key/value
# head kept whole on every TP rank; nanoGPT under ring CP: its written-out attention, masked by a
# buffer built on meta, is found causal and fused, and the buffer, read by nothing, still saved
CASES = [*hf_zoo.CI_SUBSET, ("falcon", "pp2"), ("falcon", "tp2-sp"), ("nanogpt", "cp2")]


@pytest.mark.parametrize("arch,layout", CASES, ids=[f"{a}-{c}" for a, c in CASES])
def test_architecture_trains_as_on_one_device(arch, layout, tmp_path):
    gpus, pins = hf_zoo.LAYOUTS[layout]
    file, config = hf_zoo.FILES.get(arch, ("tests/models/hf_zoo.py", arch))
    _compiled_and_verified(str(MODELS.parent.parent / file), ["--config", config], gpus, pins, tmp_path)


LIFTED = """
import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        y = self.fc2(F.gelu(self.fc1(x)))
        if x.size(1) > 1:  # a branch on a size: torch.fx cannot trace it, torch.export does
            y = y[..., [15, *range(15)]]
        return x + y


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 16)
        self.layers = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(16, 64, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build(config=None):
    return Model()


def sample_inputs(config, batch, seq):
    return (torch.randint(0, 64, (batch, seq)),)
"""


def test_a_constant_of_the_forward_trains_as_on_one_device(tmp_path):
    """A list index torch.export lifts into a constant (as Falcon's forward had,
    ``fused_qkv[..., [-2], :]``), captured on the meta device: each pipeline stage holds it as a
    buffer the program fills with its value."""
    model = tmp_path / "lifted.py"
    model.write_text(LIFTED)
    _compiled_and_verified(str(model), [], 2, "pp=2,schedule=1f1b", tmp_path)


def _compiled_and_verified(model: str, config: list[str], gpus: int, pins: str, tmp_path) -> None:
    out = tmp_path / "out"
    args = [model, *config, "--hardware", "cpu", "--gpus", str(gpus)]
    assert main(["compile", *args, "--seq-len", "32", "--global-batch", "8", "--force", pins, "-o", str(out)]) == 0
    result = verify(out, steps=2, tolerance=1e-5, timeout=240)
    for row in result["steps"]:
        assert row["rel_diff"] <= 1e-5, row
    assert result["max_param_abs_diff"] <= 1e-5, result["max_param_name"]
    assert not result["missing_params"]
    assert result["ok"]
