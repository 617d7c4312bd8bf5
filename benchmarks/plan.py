"""Capture + search time for the two large golden problems, each run in a fresh process.

    python benchmarks/plan.py [--runs 5]

Prints the median and the spread of the wall time of capture (build on meta, trace, costs) and
search (branch and bound, partition, the neighbouring meshes for the alternatives). Target (issue
#3): under 10 s each on a 2-core machine.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CASES = {
    "llama3-405b on 16384 x h100": ("llama3", "405b", "h100", 16384, 8192, 2048, "bf16"),
    "deepseek-v3-671b on 2048 x h800": ("deepseek_v3", "671b", "h800", 2048, 4096, 15360, "fp8"),
}


def child(name: str) -> None:
    model, config, hw, gpus, seq, batch, precision = CASES[name]
    start = time.perf_counter()
    from autoshard import planner
    from autoshard.capture import capture_file
    from autoshard.cost_models import hardware
    from autoshard.cost_models.analyze import analyze

    cost = analyze(capture_file(str(EXAMPLES / f"{model}.py"), config, seq))
    captured = time.perf_counter()
    problem = planner.Problem(cost, hardware.load(hw), gpus, seq, batch, precision)
    plan, result = planner.solve(problem)
    done = time.perf_counter()
    print(
        json.dumps(
            {
                "capture": captured - start,
                "search": done - captured,
                "total": done - start,
                "plan": plan.mesh.product_form(),
                "leaves": result.leaves,
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    print(
        f"{'problem':34s} {'capture s':>9s} {'search s':>9s} {'total s':>8s} {'min-max s':>12s}  plan",
        f"  (median of {args.runs})",
    )
    for name in CASES:
        runs = []
        for _ in range(args.runs):
            out = subprocess.run(
                [sys.executable, __file__, "--child", name], capture_output=True, text=True, check=True
            )
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        med = {k: statistics.median(r[k] for r in runs) for k in ("capture", "search", "total")}
        totals = [r["total"] for r in runs]
        print(
            f"{name:34s} {med['capture']:9.2f} {med['search']:9.2f} {med['total']:8.2f} "
            f"{min(totals):5.2f}-{max(totals):5.2f}  {runs[0]['plan']}"
        )


if __name__ == "__main__":
    main()
