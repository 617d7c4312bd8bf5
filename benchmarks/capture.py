"""Capture + cost time and peak memory per example config, each run in a fresh process.

    python benchmarks/capture.py [--runs 3]

Prints the median wall time (build on meta, trace, propagate shapes, analyze) and the peak resident
memory of the process. Targets (issue #2): 405B and 671B under 20 s and 2 GiB on a 2-core machine.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CASES = [("llama3", "405b", 8192), ("deepseek_v3", "671b", 4096), ("gpt", "175b", 2048), ("llama3", "8b", 8192)]


def child(name: str, config: str, seq: int) -> None:
    start = time.perf_counter()
    from autoshard.capture import capture_file
    from autoshard.cost_models.analyze import analyze

    cost = analyze(capture_file(str(EXAMPLES / f"{name}.py"), config, seq))
    cost.flops_per_token(seq)
    elapsed = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": elapsed, "peak_bytes": peak, "params": cost.params}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--child", nargs=3)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], int(args.child[2]))
        return
    print(f"{'model':22s} {'params':>9s} {'median s':>9s} {'min s':>7s} {'peak MiB':>9s}   (runs={args.runs})")
    for name, config, seq in CASES:
        runs = []
        for _ in range(args.runs):
            out = subprocess.run(
                [sys.executable, __file__, "--child", name, config, str(seq)],
                capture_output=True,
                text=True,
                check=True,
            )
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        secs = [r["seconds"] for r in runs]
        peak = max(r["peak_bytes"] for r in runs)
        print(
            f"{name + ' ' + config:22s} {runs[0]['params'] / 1e9:8.1f}B {statistics.median(secs):9.2f} "
            f"{min(secs):7.2f} {peak / 2**20:9.0f}"
        )


if __name__ == "__main__":
    main()
