"""LAMB (``--optimizer lamb``): the optimizer against its formula on one device; the emitted
program, whose trust ratios need each tensor's norm summed over every shard (TP slices, ZeRO-1
rows, FSDP shards, pipeline stages, expert-parallel slices), against the single-device LAMB
(``autoshard verify --optimizer lamb``: gloo, fp32, 3 steps, relative 1e-5); and a run resumed
from a checkpoint equal to the uninterrupted one (LAMB's states saved and restored)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from autoshard.cli import main
from autoshard.runtime.lamb import Lamb, trust_ratio
from autoshard.verify import assemble, verify
from tests.distributed import torchrun

ROOT = Path(__file__).resolve().parents[1]


def test_one_step_is_the_formula():
    torch.manual_seed(0)
    w0, g = torch.randn(4, 3), torch.randn(4, 3)
    zero = torch.zeros(5)  # a zero-initialised tensor: ||w|| = 0, trust ratio 1
    w, z = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(zero.clone())
    opt = Lamb([w, z], lr=0.1, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    w.grad, z.grad = g.clone(), torch.ones(5)
    opt.step()
    m, v = 0.1 * g / (1 - 0.9), 0.05 * g * g / (1 - 0.95)
    u = m / (v.sqrt() + 1e-6) + 0.1 * w0
    expect = w0 - 0.1 * (w0.norm() / u.norm()) * u
    torch.testing.assert_close(w.detach(), expect, rtol=1e-6, atol=1e-7)
    uz = torch.ones(5) / (1 + 1e-6)
    torch.testing.assert_close(z.detach(), -0.1 * uz, rtol=1e-6, atol=1e-7)
    assert trust_ratio(0.0, 2.0) == trust_ratio(3.0, 0.0) == 1.0 and trust_ratio(3.0, 2.0) == 1.5


def test_bf16_parameters_step_through_fp32_masters():
    torch.manual_seed(0)
    w16 = torch.nn.Parameter(torch.randn(8, 8).to(torch.bfloat16))
    w16.grad_dtype = torch.float32  # as the program's lowered parameters accumulate fp32 gradients
    w32 = torch.nn.Parameter(w16.detach().float())
    a, b = Lamb([w32], lr=0.01), Lamb([w16], lr=0.01)
    for _ in range(3):
        g = torch.randn(8, 8)
        w32.grad, w16.grad = g.clone(), g.clone()
        a.step()
        b.step()
    # the master is stepped exactly as an fp32 parameter; the bf16 parameter is the master rounded
    assert torch.equal(b.master(w16), w32.detach())
    assert torch.equal(w16.detach(), w32.detach().to(torch.bfloat16))
    assert not torch.equal(w32.detach(), w32.detach().to(torch.bfloat16).float())  # it moved off the bf16 grid


LAYOUTS = {  # name -> (model, config, seq, gpus, pins)
    "tp2": ("examples/llama3.py", "tiny", 64, 2, "tp=2,sp=off"),
    "dp2-zero1": ("examples/llama3.py", "tiny", 64, 2, "dp=2,zero=1"),
    "dp2-zero3": ("examples/llama3.py", "tiny", 64, 2, "dp=2,zero=3"),
    "pp2": ("examples/llama3.py", "tiny", 64, 2, "pp=2,schedule=1f1b"),
    "moe-ep2-dp2": ("examples/deepseek_v3.py", "tiny", 32, 2, "ep=2,dp=2,zero=1"),
}


def _compile(name: str, out: Path) -> Path:
    path, config, seq, gpus, pins = LAYOUTS[name]
    args = [str(ROOT / path), "--config", config, "--hardware", "cpu", "--gpus", str(gpus), "--seq-len", str(seq)]
    assert main(["compile", *args, "--global-batch", "8", "--force", pins, "-o", str(out)]) == 0
    return out


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_lamb_trains_as_on_one_device(name, tmp_path):
    out = _compile(name, tmp_path / "out")
    result = verify(out, steps=3, tolerance=1e-5, timeout=240, optim={"optimizer": "lamb"})
    assert result["optimizer"] == "lamb"
    for row in result["steps"]:
        assert row["rel_diff"] <= 1e-5, row
    assert result["max_param_abs_diff"] <= 1e-5, (result["max_param_name"], result["max_param_abs_diff"])
    assert not result["missing_params"]
    assert result["ok"]


def _train(out: Path, work: Path, name: str, steps: int, *extra: str):
    log = work / f"{name}.jsonl"
    args = ["--steps", str(steps), "--optimizer", "lamb", "--log-file", str(log), "--save-params", str(work / name)]
    proc = torchrun(out, 2, *args, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    losses = {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines()) if "loss" in r}
    return losses, assemble(work / name)


def test_lamb_resumes_exactly(tmp_path):
    """ZeRO-1: LAMB's moments as rows of each rank, saved and loaded in full-tensor coordinates."""
    out = _compile("dp2-zero1", tmp_path / "out")
    ck = tmp_path / "ck"
    losses, params = _train(out, tmp_path, "straight", 4, "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
                            "--keep", "0")  # fmt: skip
    half = tmp_path / "half"
    half.mkdir()
    (ck / "step_00000002").rename(half / "step_00000002")
    again, again_params = _train(out, tmp_path, "resumed", 4, "--checkpoint-dir", str(half))
    assert sorted(again) == [2, 3]
    assert all(again[s] == losses[s] for s in again), (again, losses)
    assert all(torch.equal(again_params[k], params[k]) for k in params)
