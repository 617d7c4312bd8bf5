"""FP8 training fidelity, measured as a user would: the tiny LLaMA and the tiny DeepSeek-V3 are
compiled twice with one plan, FP8 matmuls on and off, and trained a few hundred steps on one
token file with the same seed (2 CPU processes, gloo; on CPUs the FP8 matmuls run the plain-torch
emulation of the blockwise E4M3 math and everything else, and the run without FP8, in fp32);
their final losses (the mean of the last 10 steps) differ by less than 0.5% relative.

The token file is a fixed random bigram language (each token followed by one of 4 tokens with
probabilities 0.55/0.25/0.12/0.08, about 1.13 nats of entropy), so the models learn and the
comparison is of trained models, not of two runs at the uniform loss ln(256). Measured here
(2026-12-01, this test, 64-token sequences): LLaMA 300 steps 1.21106 vs 1.21065 (3.3e-4
relative), DeepSeek-V3 with EP2 and FP8 dispatch 200 steps 1.32650 vs 1.32702 (4.0e-4); DeepSeek
reports under 0.25% at scale. The pair takes about 2.5 minutes on 2 cores: CI runs the LLaMA
case, ``python benchmarks/fp8_fidelity.py`` both."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from autoshard.runtime.data import write_tokens
from autoshard.runtime.trainer import step_records
from tests.distributed import torchrun

ROOT = Path(__file__).resolve().parents[1]
BOUND = 5e-3  # the issue's: under 0.5% relative
CASES = {  # model -> (hardware, pins besides fp8, steps)
    "llama3": ("h100", "tp=1,pp=1,dp=2,zero=1,recompute=none", 300),
    "deepseek_v3": ("h800", "tp=1,pp=1,dp=2,ep=2,zero=1,recompute=none", 200),
}


CI_CASES = ["llama3"]  # DeepSeek-V3's 200 steps take 100 s more: benchmarks/fp8_fidelity.py


@pytest.fixture(scope="module")
def tokens(tmp_path_factory) -> Path:
    return bigram_tokens(tmp_path_factory.mktemp("fp8-data") / "bigram.bin")


def bigram_tokens(path: Path) -> Path:
    """Write the fixed random bigram token file to ``path``."""
    rng = np.random.default_rng(0)
    vocab, n = 256, 200_000
    successors = rng.integers(0, vocab, size=(vocab, 4))
    picks = rng.choice(4, size=n, p=[0.55, 0.25, 0.12, 0.08])
    ids = np.empty(n, dtype=np.int64)
    t = 0
    for i in range(n):
        ids[i] = t
        t = successors[t, picks[i]]
    write_tokens(path, ids, vocab)
    return path


def _compile(out: Path, model: str, hardware: str, pins: str) -> dict:
    cmd = [sys.executable, "-m", "autoshard", "compile", f"examples/{model}.py", "--config", "tiny"]
    cmd += ["--hardware", hardware, "--gpus", "2", "--seq-len", "64", "--global-batch", "8", "--force", pins]
    proc = subprocess.run([*cmd, "-o", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return json.loads((out / "plan.json").read_text())


def _train(out: Path, steps: int, data: Path) -> list[float]:
    log = out / "loss.jsonl"
    args = ["--steps", str(steps), "--data", str(data), "--seed", "0", "--lr", "3e-3", "--warmup", "20"]
    proc = torchrun(out, 2, *args, "--lr-schedule", "cosine", "--loss-log", str(log), timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = sorted(step_records(log.read_text()), key=lambda r: r["step"])
    return [r["loss"] for r in records]


@pytest.mark.parametrize("model", CI_CASES)
def test_fp8_training_ends_within_half_a_percent_of_high_precision(model, tokens, tmp_path):
    on, off, steps = fidelity(model, tokens, tmp_path)
    gap = abs(on - off) / off
    print(f"{model}: final loss fp8 {on:.5f}, fp32 {off:.5f}, relative gap {gap:.2e} after {steps} steps")
    assert gap < BOUND


def fidelity(model: str, tokens: Path, work: Path) -> tuple[float, float, int]:
    """``model`` (a key of ``CASES``) compiled with FP8 on and off and trained on ``tokens``: the
    mean of the last 10 losses of each, and the steps."""
    hardware, pins, steps = CASES[model]
    plans = {f: _compile(work / f, model, hardware, f"{pins},fp8={f}") for f in ("on", "off")}
    fp8_on, fp8_off = plans["on"]["precision"]["fp8_matmuls"], plans["off"]["precision"]["fp8_matmuls"]
    assert fp8_on and not fp8_off
    same = {k: v for k, v in plans["on"].items() if k not in ("precision", "predicted", "forced", "alternatives")}
    assert same == {k: v for k, v in plans["off"].items() if k in same}  # one plan, FP8 aside
    losses = {f: _train(work / f, steps, tokens) for f in ("on", "off")}
    on, off = (sum(losses[f][-10:]) / 10 for f in ("on", "off"))
    assert off < 0.3 * losses["off"][0], "the model did not learn the token file: the comparison would say nothing"
    assert losses["on"] != losses["off"], "FP8 changed nothing: the FP8 matmuls did not run"
    return on, off, steps
