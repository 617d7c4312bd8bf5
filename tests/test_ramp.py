"""The long-context ramp (``autoshard compile --seq-len A,B --tokens-per-stage ...``): its stage
arithmetic, its one-line errors, and a run of two stages under two plans (data parallel at 32
tokens, context parallel at 64) through the emitted driver, which must equal training the second
stage directly from the first stage's final checkpoint (torchrun, gloo, fp32)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoshard.cli import main as cli
from autoshard.ramp import stages
from autoshard.runtime import ramp as driver
from autoshard.runtime.trainer import samples_at
from tests.distributed import torchrun

from conftest import EXAMPLES

# stage 1: 8 x 32 tokens, 3 steps, DP2; stage 2: 4 x 64 tokens, 2 steps, CP2 (256 tokens a step)
SEQ, TOKENS, FORCE, END = "32,64", "768,512", "dp=2;cp=2", 5
LR = ["--lr-schedule", "cosine", "--warmup", "1"]
ENV = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}


def test_stages_keep_the_tokens_per_step():
    got = stages([8192, 32768, 131072], 2048, [14.8e12, 4e11, 4e11])
    assert [s.global_batch for s in got] == [2048, 512, 128]  # 16,777,216 tokens a step in each
    assert [s.steps for s in got] == [882_149, 23_842, 23_842]  # tokens / 2^24, rounded up
    assert [s.first_step for s in got] == [0, 882_149, 905_991] and got[-1].end_step == 929_833
    assert [s.name for s in got] == ["stage1_s8192", "stage2_s32768", "stage3_s131072"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--tokens-per-stage", "768"], "--tokens-per-stage gives 1 token count for 2 --seq-len stages"),
        ([], "is a ramp of 2 stages: give --tokens-per-stage"),
        (["--tokens-per-stage", "768,512", "--force", "dp=2;cp=2;cp=2"], "gives 3 pin sets for 2 --seq-len stages"),
        (["--seq-len", "32,48", "--tokens-per-stage", "768,512"], "256 tokens per step, 5.33333 sequences of 48"),
    ],
)
def test_a_bad_ramp_is_one_line(capsys, argv, message):
    base = ["compile", str(EXAMPLES / "llama3.py"), "--config", "tiny", "--hardware", "cpu", "--gpus", "2"]
    base += ["--global-batch", "8", "-o", "unused"]
    seq = [] if "--seq-len" in argv else ["--seq-len", SEQ]
    assert cli(base + seq + argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_the_data_position_carries_the_tokens_read():
    assert samples_at({"samples": 24, "seq_len": 32}, 64, Path("ck")) == 12
    assert samples_at({"samples": 24, "seq_len": 64}, 64, Path("ck")) == 24
    with pytest.raises(SystemExit):
        samples_at({"samples": 3, "seq_len": 32}, 64, Path("ck"))


def test_the_driver_keeps_its_own_flags():
    with pytest.raises(SystemExit):
        driver.parse_args(["--", "--steps", "3"], None)
    args, rest = driver.parse_args(["--dry-run", "--", "--lr", "1e-3"], None)
    assert args.dry_run and rest == ["--lr", "1e-3"]


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _losses(log: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in log if "loss" in r and "event" not in r}


def _export(checkpoint: Path, to: Path) -> dict[str, torch.Tensor]:
    assert cli(["export", str(checkpoint), "-o", str(to)]) == 0
    return torch.load(to)


@pytest.fixture(scope="module")
def ramp(tmp_path_factory):
    """The ramp compiled and run through its driver to step END; its log and final parameters."""
    root = tmp_path_factory.mktemp("ramp")
    out = root / "out"
    cmd = ["compile", str(EXAMPLES / "llama3.py"), "--config", "tiny", "--hardware", "cpu", "--gpus", "2"]
    cmd += ["--seq-len", SEQ, "--global-batch", "8", "--tokens-per-stage", TOKENS, "--force", FORCE]
    assert cli([*cmd, "-q", "-o", str(out)]) == 0
    run = [sys.executable, str(out / "ramp.py"), "--", "--log-file", str(root / "ramp.jsonl"), *LR]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=240, env={**os.environ, **ENV})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out, root, _log(root / "ramp.jsonl"), _export(out / "ckpt" / f"step_{END:08d}", root / "final.pt")


def test_the_ramp_writes_a_plan_per_stage(ramp):
    out = ramp[0]
    summary = json.loads((out / "ramp.json").read_text())
    plans = [(s["global_batch"], s["plan"]["dp"], s["plan"]["cp"], s["steps"]) for s in summary["stages"]]
    assert plans == [(8, 2, 1, 3), (4, 1, 2, 2)]
    for s in summary["stages"]:
        plan = json.loads((out / s["name"] / "plan.json").read_text())
        assert (plan["seq_len"], plan["global_batch"]) == (s["seq_len"], s["global_batch"])
    assert "| stage2_s64 | 64 | 4 | 512 | 1 | 1 | 2 | 1 |" in (out / "ramp.md").read_text()


def test_the_ramp_equals_stage_two_trained_from_stage_one_checkpoint(ramp, tmp_path):
    """The driver's second stage against the same program started by hand from the first
    stage's final checkpoint (exact), and against a single process at 64 tokens from it (fp32
    tolerance): the step counter, the data position and one cosine schedule carry over."""
    out, _, log, final = ramp
    losses = _losses(log)
    assert sorted(losses) == list(range(END))
    resumed = [r for r in log if r.get("event") == "resumed"]
    assert [(r["step"], r["position"]) for r in resumed] == [(3, 3)]  # tokens read: 3 steps of 256
    lrs = {r["step"]: r["lr"] for r in log if "loss" in r and "event" not in r}
    cosine = [3e-4 * 0.5 * (1 + math.cos(math.pi * (s - 1) / (END - 1))) for s in range(1, END)]
    assert [lrs[s] for s in range(END)] == pytest.approx([3e-4, *cosine], rel=1e-12)

    stage2 = out / "stage2_s64"
    single = tmp_path / "single"
    cmd = ["compile", str(EXAMPLES / "llama3.py"), "--config", "tiny", "--hardware", "cpu", "--gpus", "1"]
    assert cli([*cmd, "--seq-len", "64", "--global-batch", "4", "-q", "-o", str(single)]) == 0
    for name, program, gpus in (("direct", stage2, 2), ("single", single, 1)):
        ck = tmp_path / f"{name}-ck"
        shutil.copytree(out / "ckpt" / "step_00000003", ck / "step_00000003")
        args = ["--steps", str(END), "--schedule-steps", str(END), "--checkpoint-dir", str(ck), *LR]
        proc = torchrun(program, gpus, *args, "--log-file", str(tmp_path / f"{name}.jsonl"), timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        got = _losses(_log(tmp_path / f"{name}.jsonl"))
        params = _export(ck / f"step_{END:08d}", tmp_path / f"{name}.pt")
        assert sorted(got) == [3, 4] and params.keys() == final.keys()
        if name == "direct":
            assert all(got[s] == losses[s] for s in got), (got, losses)
            assert all(torch.equal(params[k], final[k]) for k in final)
        else:
            for s in got:
                assert got[s] == pytest.approx(losses[s], rel=1e-5), (s, got[s], losses[s])
            for k in final:
                torch.testing.assert_close(params[k], final[k], rtol=1e-4, atol=1e-5)


def test_a_finished_ramp_runs_nothing_again(ramp):
    out, root, log, _ = ramp
    run = [sys.executable, str(out / "ramp.py"), "--", "--log-file", str(root / "ramp.jsonl")]
    proc = subprocess.run(run, capture_output=True, text=True, timeout=60, env={**os.environ, **ENV})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count(" done: ") == 2 and _log(root / "ramp.jsonl") == log


def test_a_stage_without_a_plan_is_named(tmp_path, capsys):
    """Stage 2 pinned to a mesh larger than the GPUs: stage 1 is still written, ramp.md says why
    stage 2 has none, and the compile fails with one line naming it."""
    argv = ["compile", str(EXAMPLES / "llama3.py"), "--config", "tiny", "--hardware", "cpu", "--gpus", "2"]
    argv += ["--seq-len", SEQ, "--global-batch", "8", "--tokens-per-stage", TOKENS, "--force", "dp=2;tp=4"]
    assert cli([*argv, "--plan-only", "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("autoshard: error: stage 2 (--seq-len 64) has no plan: ") and err.count("\n") == 1, err
    assert (tmp_path / "stage1_s32" / "plan.json").exists() and not (tmp_path / "stage2_s64").exists()
    md = (tmp_path / "ramp.md").read_text()
    assert "- stage2_s64 has no plan: " in md
    rows = [line.count("|") for line in md.splitlines() if line.startswith("|")]
    assert len(rows) == 4 and len(set(rows)) == 1  # header, rule, two stages: the same columns


def test_schedule_steps_spans_the_stages():
    """Stage 1 of a 5-step ramp ends at step 3 but decays toward step 5, as one run of 5 would;
    and a checkpoint's schedule agrees with the next stage's, so no warning is due."""
    from autoshard.runtime.trainer import learning_rate, lr_flags_changed, parse_args

    flags = ["--lr-schedule", "cosine", "--warmup", "1"]
    stage1 = parse_args([*flags, "--steps", "3", "--schedule-steps", "5"])
    whole = parse_args([*flags, "--steps", "5"])
    assert [learning_rate(stage1, s) for s in range(3)] == [learning_rate(whole, s) for s in range(3)]
    assert learning_rate(parse_args([*flags, "--steps", "3"]), 2) != learning_rate(whole, 2)
    saved = {"lr": 3e-4, "schedule": "cosine", "warmup": 1, "min_lr": 0.0, "steps": 5}
    assert lr_flags_changed(saved, parse_args([*flags, "--steps", "5", "--schedule-steps", "5"])) == {}
