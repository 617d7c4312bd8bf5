"""A program keeps what the single-device state dict has (``state.kept``): the parameters and the
persistent buffers, as the model registers them (``program.build_chunks`` makes the others
non-persistent), and MoE routing biases. Saved for verification, checkpointed and exported, a
persistent buffer (nanoGPT's causal mask ``bias``) is there and is compared."""

import sys
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

from autoshard.cli import main
from autoshard.runtime.program import _persistent_as_in_model
from autoshard.runtime.state import kept
from autoshard.verify import verify
from tests.distributed import torchrun

MODELS = Path(__file__).parents[1] / "models"
sys.path.insert(0, str(MODELS))
import nanogpt  # noqa: E402

MASKS = [f"model.transformer.h.{i}.attn.bias" for i in range(nanogpt.CONFIGS["tiny"].n_layer)]


def _chunk(routing: dict | None = None) -> nn.Module:
    """A chunk as a stage file builds it: every buffer registered persistent (``rt.put_buffer``)."""
    chunk = nn.Module()
    chunk.model = nn.Module()
    chunk.model.proj = nn.Linear(4, 4)
    chunk.model.register_buffer("mask", torch.ones(4, 4))
    chunk.model.register_buffer("rotary", torch.ones(4))
    chunk.model.register_buffer("expert_bias", torch.zeros(4))
    chunk.register_buffer("_tensor_constant0", torch.ones(2))
    chunk.stage_file = SimpleNamespace(ROUTING=routing or {})
    return chunk


def test_the_program_keeps_the_buffers_the_state_dict_has():
    chunk = _chunk()
    keys = ["model.proj.weight", "model.proj.bias", "model.mask", "model.expert_bias"]
    _persistent_as_in_model(chunk, {}, keys)
    assert [name for name, _ in kept(chunk)] == keys
    assert set(chunk.state_dict()) == set(keys)  # the chunk's state dict is the model's piece of it


def test_a_routing_bias_is_kept_whatever_the_model_registers_it_as():
    chunk = _chunk({"model.moe": {"bias": "model.expert_bias"}})
    _persistent_as_in_model(chunk, {}, ["model.proj.weight", "model.proj.bias"])
    assert [name for name, _ in kept(chunk)] == ["model.proj.weight", "model.proj.bias", "model.expert_bias"]


def test_a_buffer_renamed_by_the_program_is_kept_under_its_model_name():
    chunk = _chunk()
    _persistent_as_in_model(chunk, {"model.rotary": "model.inv_freq"}, ["model.inv_freq"])
    assert [name for name, _ in kept(chunk)] == ["model.proj.weight", "model.proj.bias", "model.rotary"]


def _compile(out: Path, pins: str) -> Path:
    args = [str(MODELS / "nanogpt.py"), "--config", "tiny", "--hardware", "cpu", "--gpus", "2", "--seq-len", "32"]
    assert main(["compile", *args, "--global-batch", "4", "--force", pins, "-o", str(out)]) == 0
    return out


def test_nanogpt_under_dp2_saves_and_compares_its_causal_mask(tmp_path):
    """The mask is in the model's state dict: a program that saves only parameters fails
    verification on it ("never saved") although every loss matches."""
    result = verify(_compile(tmp_path / "out", "dp=2,zero=1"), steps=2, tolerance=1e-5, timeout=240)
    assert [row["rel_diff"] <= 1e-5 for row in result["steps"]] == [True, True], result["steps"]
    assert not result["missing_params"]
    assert result["max_param_abs_diff"] <= 1e-5, result["max_param_name"]
    assert result["ok"]


def test_nanogpt_exports_its_causal_mask(tmp_path):
    """A checkpoint holds the persistent buffers; ``autoshard export`` writes the single-device
    state dict, the mask with the parameters, and the model loads it strictly."""
    out = _compile(tmp_path / "out", "dp=2,zero=1")
    ck = tmp_path / "ck"
    proc = torchrun(out, 2, "--steps", "1", "--checkpoint-dir", str(ck), "--checkpoint-every", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert main(["export", str(ck), "-o", str(tmp_path / "trained.pt")]) == 0
    trained = torch.load(tmp_path / "trained.pt")
    model = nanogpt.build("tiny")
    assert trained.keys() == model.state_dict().keys()
    for name in MASKS:
        assert torch.equal(trained[name.removeprefix("model.")], model.get_buffer(name.removeprefix("model.")))
    model.load_state_dict(trained, strict=True)
