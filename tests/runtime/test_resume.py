"""Checkpoints of emitted programs, run as users run them (torchrun, gloo, fp32): a resumed run
equals an uninterrupted one exactly, a run that loses a rank restarts and ends where the
uninterrupted one does, a checkpoint written under one plan continues under another, and a
collective that times out names the rank instead of hanging."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoshard.verify import assemble
from tests.distributed import torchrun

STEPS, HALF = 8, 4
LAYOUTS = {  # name -> (gpus, pins)
    "tp2-pp2": (4, "tp=2,pp=2"),
    "dp2-zero1": (2, "dp=2,zero=1"),
    "dp2-zero3": (2, "dp=2,zero=3"),
    "cp2": (2, "cp=2"),
}


def _compile(out: Path, gpus: int, pins: str) -> Path:
    cmd = [sys.executable, "-m", "autoshard", "compile", "examples/llama3.py", "--config", "tiny", "--hardware", "cpu"]
    cmd += ["--gpus", str(gpus), "--seq-len", "64", "--global-batch", "8", "--force", pins, "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=Path(__file__).parents[2])
    assert proc.returncode == 0, proc.stderr
    return out


def _losses(log: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, log.read_text().splitlines()) if "loss" in r}


def _train(out: Path, gpus: int, work: Path, name: str, *extra: str, **kw):
    args = ["--steps", str(STEPS), "--log-file", str(work / f"{name}.jsonl"), "--save-params", str(work / name)]
    proc = torchrun(out, gpus, *args, *extra, **kw)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return _losses(work / f"{name}.jsonl"), assemble(work / name)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """Each layout compiled and trained STEPS steps without a stop, writing a checkpoint at HALF."""
    root = tmp_path_factory.mktemp("resume")
    runs = {}

    def get(name):
        if name not in runs:
            gpus, pins = LAYOUTS[name]
            out = _compile(root / name, gpus, pins)
            ck = root / f"{name}-ck"
            losses, params = _train(out, gpus, root, f"{name}-straight", "--checkpoint-dir", str(ck),
                                    "--checkpoint-every", str(HALF), "--keep", "0")  # fmt: skip
            runs[name] = out, ck, losses, params
        return runs[name]

    return get


def _only(ck: Path, step: int, into: Path) -> Path:
    """A checkpoint directory holding only ``ck``'s checkpoint after ``step`` steps."""
    into.mkdir()
    shutil.copytree(ck / f"step_{step:08d}", into / f"step_{step:08d}")
    return into


# the three ways a rank's state is cut: TP shards and pipeline stages, ZeRO-1's optimizer shards,
# ZeRO-3's parameter shards (CP holds what DP holds; its run is resumed from TP2 x PP2's below)
@pytest.mark.parametrize("name", ["tp2-pp2", "dp2-zero1", "dp2-zero3"])
def test_stop_and_resume_equals_the_straight_run(straight, name, tmp_path):
    out, ck, losses, params = straight(name)
    assert sorted(losses) == list(range(STEPS))
    resumed_dir = _only(ck, HALF, tmp_path / "ck")
    again, again_params = _train(out, LAYOUTS[name][0], tmp_path, "resumed", "--checkpoint-dir", str(resumed_dir))
    assert sorted(again) == list(range(HALF, STEPS))
    events = [json.loads(line).get("event") for line in (tmp_path / "resumed.jsonl").read_text().splitlines()]
    assert "resumed" in events and "learning-rate flags differ from the checkpoint's" not in events
    assert all(again[s] == losses[s] for s in again), (again, losses)
    assert all(torch.equal(again_params[k], params[k]) for k in params)


def test_resuming_with_another_learning_rate_says_so_and_uses_it(straight, tmp_path):
    out, ck, losses, _ = straight("dp2-zero1")
    ck = _only(ck, HALF, tmp_path / "ck")
    args = ["--steps", str(STEPS), "--log-file", str(tmp_path / "log.jsonl"), "--checkpoint-dir", str(ck)]
    proc = torchrun(out, 2, *args, "--lr", "3e-3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    log = [json.loads(line) for line in (tmp_path / "log.jsonl").read_text().splitlines()]
    said = [r for r in log if r.get("event") == "learning-rate flags differ from the checkpoint's"]
    assert len(said) == 1 and said[0]["changed"] == {"lr": [3e-4, 3e-3]}
    assert "--lr 0.0003 -> 0.003" in proc.stderr
    got = _losses(tmp_path / "log.jsonl")
    assert got[HALF] == losses[HALF] and got[HALF + 1] != losses[HALF + 1]  # the new rate from the first update


def test_a_rank_killed_mid_step_restarts_and_ends_like_the_straight_run(straight, tmp_path):
    out, _, losses, params = straight("dp2-zero1")
    ck = tmp_path / "ck"
    env = {"AUTOSHARD_FAULT": "kill:1:5"}  # SIGKILL rank 1 in step 5, between backward and the optimizer step
    got, got_params = _train(out, 2, tmp_path, "killed", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
                             restarts=1, env=env, timeout=240)  # fmt: skip
    log = [json.loads(line) for line in (tmp_path / "killed.jsonl").read_text().splitlines()]
    resumed = [r for r in log if r.get("event") == "resumed"]
    assert len(resumed) == 1 and resumed[0]["step"] in (2, 4)
    assert all(got[s] == losses[s] for s in got)
    assert all(torch.equal(got_params[k], params[k]) for k in params)


def test_a_checkpoint_continues_under_another_plan(straight, tmp_path):
    """Written under TP2 x PP2 on 4 processes, continued under DP2 ZeRO-3 and under CP2 on 2."""
    _, ck, losses, params = straight("tp2-pp2")
    for name in ("dp2-zero3", "cp2"):
        out = straight(name)[0]
        work = tmp_path / name
        work.mkdir()
        got, got_params = _train(out, 2, work, "resharded", "--checkpoint-dir", str(_only(ck, HALF, work / "ck")))
        assert sorted(got) == list(range(HALF, STEPS))
        for s in got:
            assert got[s] == pytest.approx(losses[s], rel=1e-5), (name, s)
        for k in params:
            torch.testing.assert_close(got_params[k], params[k], rtol=1e-4, atol=1e-5)


def test_a_timed_out_collective_names_the_rank(straight, tmp_path):
    out = straight("dp2-zero1")[0]
    proc = torchrun(out, 2, "--steps", "4", "--timeout", "5", env={"AUTOSHARD_FAULT": "hang:1:1"}, timeout=120)
    assert proc.returncode != 0
    assert "train.py: error: rank 0: a collective failed" in proc.stderr, proc.stderr[-2000:]


def test_export_writes_the_single_device_state_dict_back(straight, tmp_path):
    """--init-from a single-device safetensors file, a checkpoint at step 0, export: the same
    tensors; and the straight run's last checkpoint exports to its trained parameters."""
    from safetensors.torch import load_file, save_file

    from autoshard.cli import main as cli

    out, ck, _, params = straight("tp2-pp2")
    assert cli(["export", str(ck), "-o", str(tmp_path / "trained.safetensors")]) == 0
    trained = load_file(tmp_path / "trained.safetensors")
    assert trained.keys() == {k.removeprefix("model.") for k in params}
    assert all(torch.equal(trained[k.removeprefix("model.")], v) for k, v in params.items())

    torch.manual_seed(1)
    start = {k: torch.randn_like(v) for k, v in trained.items()}
    save_file(start, tmp_path / "start.safetensors")
    args = ["--steps", "0", "--init-from", str(tmp_path / "start.safetensors")]
    args += ["--checkpoint-dir", str(tmp_path / "ck")]
    proc = torchrun(out, 4, *args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert cli(["export", str(tmp_path / "ck" / "step_00000000"), "-o", str(tmp_path / "back.pt")]) == 0
    back = torch.load(tmp_path / "back.pt")
    assert back.keys() == start.keys() and all(torch.equal(back[k], start[k]) for k in start)


def test_a_loss_spike_rolls_back_and_skips_its_batches(straight, tmp_path):
    out = straight("dp2-zero1")[0]
    env = {"AUTOSHARD_FAULT": "lr:0:4"}  # step 4 takes a 1000x learning rate: step 5's loss spikes
    args = ["--spike-zscore", "6", "--spike-window", "3", "--checkpoint-dir", str(tmp_path / "ck")]
    args += ["--checkpoint-every", "2", "--checkpoint-sync"]
    _train(out, 2, tmp_path, "spiky", *args, env=env)
    log = [json.loads(line) for line in (tmp_path / "spiky.jsonl").read_text().splitlines()]
    spikes = [r for r in log if r.get("event") == "loss spike: rolled back"]
    assert len(spikes) == 1 and spikes[0]["step"] == 5 and spikes[0]["to_step"] == 4
    assert spikes[0]["skipped_batches"] == [4, 6]
    steps = [r["step"] for r in log if "loss" in r and "event" not in r]
    # step 4 (its update the spike's cause) is taken again after the rollback, on new batches
    assert steps == [0, 1, 2, 3, 4, 4, 5, 6, 7]
    assert max(r["loss"] for r in log if "loss" in r and "event" not in r) < 2 * log[0]["loss"]


def test_verify_holds_with_clipping_and_a_schedule(straight):
    from autoshard.verify import verify

    out = straight("dp2-zero3")[0]
    result = verify(out, 3, 1e-5, optim={"max_grad_norm": 0.05, "warmup": 1, "lr_schedule": "cosine"}, timeout=240)
    assert result["ok"], result
