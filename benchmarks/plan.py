"""Plan time of the large problems, phase by phase, each run in a fresh process.

    python benchmarks/plan.py [--runs 3] [--hf] [--only NAME]

Each run is ``autoshard compile MODEL --plan-only`` (``compiler.compile_file``) in a new Python
process, so imports count as a user sees them. Prints, per case, the median over the runs of each
phase (``autoshard.capture.timing``): imports, build on meta (with the initialisation recorder
where it runs), trace, canonicalisation, structure, shape propagation, cost analysis, search and
the plan-only dry run of the rewrite passes; then capture + search (everything but the dry run)
and the total with its spread. A regression shows in the phase that caused it.

The two example problems always run; ``--hf`` adds transformers' Llama 3.1 405B and DeepSeek-V3
671B (``benchmarks/capture.py``'s configurations) and Mixtral 8x22B (``tests/models/hf_moe.py``),
all three traced by torch.export. Targets (issue 28): capture + search under 5 s for the examples and
under 15 s for the transformers models on a 2-core machine.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
HF = ROOT / "benchmarks" / "capture.py"
MOE = ROOT / "tests" / "models" / "hf_moe.py"

# name: (model file, config, hardware, gpus, seq, global batch, precision)
CASES = {
    "llama3-405b on 16384 x h100": (EXAMPLES / "llama3.py", "405b", "h100", 16384, 8192, 2048, "bf16"),
    "deepseek-v3-671b on 2048 x h800": (EXAMPLES / "deepseek_v3.py", "671b", "h800", 2048, 4096, 15360, "fp8"),
}
HF_CASES = {
    "hf llama3-405b on 16384 x h100": (HF, "llama3-405b", "h100", 16384, 8192, 2048, "bf16"),
    "hf deepseek-v3-671b on 2048 x h800": (HF, "deepseek-v3-671b", "h800", 2048, 4096, 15360, "fp8"),
    "hf mixtral-8x22b on 1024 x h100": (MOE, "mixtral-8x22b", "h100", 1024, 4096, 1024, "bf16"),
}
PHASES = (
    "imports",
    "build on meta + init recorder",
    "build on meta",
    "init recorder",
    "trace",
    "canonicalise",
    "structure",
    "shape propagation",
    "analysis",
    "search",
    "dry-run passes",
)
SHORT = {"build on meta + init recorder": "build+init", "build on meta": "build", "shape propagation": "shapes"}


def child(name: str) -> None:
    path, config, hw, gpus, seq, batch, precision = {**CASES, **HF_CASES}[name]
    start = time.perf_counter()
    from autoshard.capture import timing
    from autoshard.compiler import compile_file

    imported = time.perf_counter()
    with timing.collect() as phases:
        compiled = compile_file(
            str(path), config, hardware=hw, gpus=gpus, seq_len=seq, global_batch=batch, precision=precision,
            plan_only=True,
        )  # fmt: skip
    done = time.perf_counter()
    phases = {"imports": imported - start, **phases}
    total = done - start
    out = {"phases": phases, "total": total, "capture+search": total - phases.get("dry-run passes", 0.0)}
    out["plan"] = compiled.plan.mesh.product_form()
    print(json.dumps(out))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hf", action="store_true", help="also the transformers models (slower)")
    parser.add_argument("--only", help="run the cases whose name contains this")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    cases = [n for n in {**CASES, **(HF_CASES if args.hf else {})} if not args.only or args.only in n]
    results = {name: [_run(name) for _ in range(args.runs)] for name in cases}
    shown = [p for p in PHASES if any(p in r["phases"] for runs in results.values() for r in runs)]
    heads = [SHORT.get(p, p) for p in shown]
    print(f"seconds, median of {args.runs} fresh processes per case")
    print(f"{'problem':35s} " + " ".join(f"{h:>{max(len(h), 6)}s}" for h in heads), end="")
    print(f" {'capt+search':>11s} {'total':>6s} {'min-max':>11s}  plan")
    for name, runs in results.items():
        cells = [_median(runs, p) for p in shown]
        print(f"{name:35s} " + " ".join(f"{c:>{max(len(h), 6)}.2f}" for c, h in zip(cells, heads)), end="")
        totals = [r["total"] for r in runs]
        both = statistics.median(r["capture+search"] for r in runs)
        print(
            f" {both:11.2f} {statistics.median(totals):6.2f} {min(totals):5.2f}-{max(totals):5.2f}  {runs[0]['plan']}"
        )


def _run(name: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", name], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _median(runs: list[dict], phase: str) -> float:
    return statistics.median(r["phases"].get(phase, 0.0) for r in runs)


if __name__ == "__main__":
    main()
