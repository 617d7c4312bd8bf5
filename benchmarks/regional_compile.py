"""Regional compilation on one GPU: the emitted program's step time with each layer class compiled
(``torch.compile``, the default on GPUs) and eagerly (``--no-compile``), side by side in one run.

    python benchmarks/regional_compile.py [--config tiny] [--seq-len 1024] [--steps 30]

Compiles ``examples/llama3.py`` for one GPU, runs ``train.py`` both ways with torchrun, and prints
the median step time after the first third of the steps (compilation and warm-up) and the ratio.
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _steps(out: Path, steps: int, *extra: str) -> list[float]:
    cmd = ["torchrun", "--nproc-per-node", "1", str(out / "train.py"), "--steps", str(steps), *extra]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    if run.returncode:
        sys.exit(f"train.py {' '.join(extra)} failed:\n{run.stderr[-3000:]}")
    lines = [json.loads(x) for x in run.stdout.splitlines() if x.startswith('{"step"')]
    return [x["seconds"] for x in lines]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=30)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "out"
        compile_cmd = [sys.executable, "-m", "autoshard", "compile", str(ROOT / "examples" / "llama3.py"),
                       "--config", args.config, "--hardware", "h100", "--gpus", "1", "--seq-len", str(args.seq_len),
                       "--global-batch", str(args.global_batch), "-o", str(out)]  # fmt: skip
        subprocess.run(compile_cmd, check=True, capture_output=True)
        skip = args.steps // 3
        compiled = _steps(out, args.steps)[skip:]
        eager = _steps(out, args.steps, "--no-compile")[skip:]
    c, e = statistics.median(compiled), statistics.median(eager)
    print(f"llama3 {args.config}, seq {args.seq_len}, batch {args.global_batch}, one GPU; medians of steps {skip}..")
    print(f"  compiled per layer class: {c * 1e3:.2f} ms/step")
    print(f"  eager (--no-compile):     {e * 1e3:.2f} ms/step")
    print(f"  eager / compiled:         {e / c:.2f}x")


if __name__ == "__main__":
    main()
