"""Overhead of the emitted program against hand-written torch.distributed code of the same plan.

    python benchmarks/emit.py [--steps 20] [--rounds 3] [--hardware PROFILE]

Cases (examples/llama3.py config small, CPU, gloo, fp32): DP4 (emitted ZeRO-0 against DDP) and
PP2 1F1B (emitted against torch.distributed.pipelining driven by hand). Each round runs the
emitted and the hand-written program back to back, so both see the same machine; a run's step
time is the median over its steps after the first three (warm-up). Both clip the gradients (global
norm 1.0) and the hand-written DP loop averages its loss over the replicas, as the emitted
trainer does for its log line. Prints per-round medians and
the throughput ratio emitted / hand-written (target: at least 1.0: the emitted program overlaps
its gradient reduction with the last backward as DDP does).
"""

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from autoshard.runtime.trainer import step_records

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "DP4 (DDP)": ("dp", 4, "dp=4,zero=0"),
    "PP2 1F1B (pipelining)": ("pp", 2, "pp=2,schedule=1f1b,microbatches=4"),
}
WARMUP = 3


def _torchrun(nproc: int, script: str, *args: str) -> list[float]:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", script, *args]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=True).stdout
    times = [r["seconds"] for r in step_records(out)]
    return times[WARMUP:]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--hardware", default="cpu", help="the profile the plans are compiled for (calibrated: this host)")
    args = p.parse_args()
    print(f"{'case':24s} {'round':>5s} {'emitted s':>10s} {'hand s':>10s} {'ratio':>6s}")
    for name, (mode, gpus, pins) in CASES.items():
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "out"
            subprocess.run(
                [sys.executable, "-m", "autoshard", "compile", str(ROOT / "examples" / "llama3.py"),
                 "--config", "small", "--hardware", args.hardware, "--gpus", str(gpus), "--seq-len", "256",
                 "--global-batch", "16", "--force", pins, "-o", str(out)],
                check=True, capture_output=True,
            )  # fmt: skip
            ratios, emitted_all, hand_all = [], [], []
            for r in range(args.rounds):
                emitted = statistics.median(
                    _torchrun(gpus, str(out / "train.py"), "--steps", str(args.steps), "--max-grad-norm", "1.0")
                )
                hand = statistics.median(
                    _torchrun(gpus, str(ROOT / "benchmarks" / "handwritten.py"), "--mode", mode,
                              "--plan", str(out / "plan.json"), "--steps", str(args.steps))
                )  # fmt: skip
                ratios.append(hand / emitted)
                emitted_all.append(emitted)
                hand_all.append(hand)
                print(f"{name:24s} {r:>5d} {emitted:>10.4f} {hand:>10.4f} {hand / emitted:>6.3f}", flush=True)
            print(
                f"{name:24s} {'med':>5s} {statistics.median(emitted_all):>10.4f} {statistics.median(hand_all):>10.4f} "
                f"{statistics.median(ratios):>6.3f}   <- throughput emitted / hand-written"
            )


if __name__ == "__main__":
    main()
