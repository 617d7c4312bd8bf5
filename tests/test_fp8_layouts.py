"""FP8 programs under the parallel layouts, checked by ``autoshard verify`` against the
single-device model running the same FP8 emulation (2 CPU processes, gloo): tensor and sequence
parallelism with selective recomputation, and context parallelism with ZeRO-3 and selective
recomputation keeping the norms' outputs as FP8 copies. (Expert
parallelism with the FP8 dispatch is trained in ``test_fp8_fidelity.py``; pipelines, full
recomputation and ZeRO-2 were verified the same way by hand: README, "FP8 training".)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from autoshard.verify import FP8_TOLERANCE, verify

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "pins", ["tp=2,recompute=activation+norm_output", "cp=2,zero=3,recompute=attention+activation"]
)
def test_an_fp8_program_matches_the_fp8_single_device_model(pins, tmp_path):
    cmd = [sys.executable, "-m", "autoshard", "compile", "examples/llama3.py", "--config", "tiny", "--hardware"]
    cmd += ["h100", "--gpus", "2", "--seq-len", "128", "--global-batch", "8", "--precision", "fp8"]
    proc = subprocess.run(
        [*cmd, "--force", pins, "-o", str(tmp_path)], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr
    # with the norms' outputs kept and only FP8 matmuls reading them, their FP8 copies are kept
    saved = json.loads((tmp_path / "plan.json").read_text())["precision"].get("fp8_saved")
    assert saved == (["norm_output"] if "attention+activation" in pins else None)
    assert ("keep_fp8=True" in (tmp_path / "layers.py").read_text()) == bool(saved)
    result = verify(tmp_path, steps=3, timeout=300)
    assert result["fp8"] == ["attention", "mlp"] and result["tolerance"] == FP8_TOLERANCE
    assert result["ok"], result
    # FP8 is really on (its own effect on the loss shows), and the layout moves the losses far less
    # than the bound
    assert result["fp8_gap"] > 1e-6
    assert max(r["rel_diff"] for r in result["steps"]) < 1e-4
