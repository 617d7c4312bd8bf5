"""Plan time of the large problems, phase by phase, each run in a fresh process.

    python benchmarks/plan.py [--runs 3] [--hf] [--2t] [--only NAME] [--cpu] [--plans DIR]

Each run is ``autoshard compile MODEL --plan-only`` (``compiler.compile_file``, under the command
line's garbage-collector setting, ``autoshard.gcpolicy``) in a new Python process, so imports
count as a user sees them. Prints, per case, the median over the runs of each phase
(``autoshard.capture.timing``): imports, build on meta (with the initialisation recorder where it
runs), trace, canonicalisation, structure, shape propagation, cost analysis, search and the
plan-only dry run of the rewrite passes; then capture + search (everything but the dry run) and
the total with its spread. A regression shows in the phase that caused it.

The two example problems always run; ``--hf`` adds transformers' Llama 3.1 405B and DeepSeek-V3
671B (``benchmarks/capture.py``'s configurations) and Mixtral 8x22B (``tests/models/hf_moe.py``),
all three traced by torch.export. Targets (issue 28): capture + search under 5 s for the examples and
under 15 s for the transformers models on a 2-core machine. ``--plans DIR`` writes each case's plan
(``DIR/<case>.json``), so that a change meant only to be faster can be shown to leave every plan as
it was: run it before and after, and diff the two folders.
"""

import argparse
import json
import os
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
# the seed's question (issue 29): 2-trillion-parameter configs, dense and DeepSeek-V3-style MoE;
# target: planned in under 30 s
TWO_T_CASES = {
    "llama3-2t on 16384 x h100": (EXAMPLES / "llama3.py", "2t", "h100", 16384, 8192, 4096, "bf16"),
    "deepseek-v3-2t on 16384 x h800": (EXAMPLES / "deepseek_v3.py", "2t", "h800", 16384, 4096, 16384, "fp8"),
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
SHORT = {"build on meta + init recorder": "build+init"}


def child(name: str, plans: str | None = None) -> None:
    path, config, hw, gpus, seq, batch, precision = {**CASES, **HF_CASES, **TWO_T_CASES}[name]
    start = time.perf_counter(), _cpu()
    from autoshard.gcpolicy import fewer_collections

    with fewer_collections():  # as the command line runs a command (``cli.main``)
        from autoshard.capture import timing
        from autoshard.compiler import compile_file

        imported = time.perf_counter(), timing.cpu_seconds()
        with timing.collect() as phases:
            compiled = compile_file(
                str(path), config, hardware=hw, gpus=gpus, seq_len=seq, global_batch=batch, precision=precision,
                plan_only=True,
            )  # fmt: skip
    done = time.perf_counter(), timing.cpu_seconds()
    phases = {"imports": [imported[0] - start[0], imported[1] - start[1]], **phases}
    total = [done[0] - start[0], done[1] - start[1]]
    dry = phases.get("dry-run passes", [0.0, 0.0])
    out = {"phases": phases, "total": total, "capture+search": [total[0] - dry[0], total[1] - dry[1]]}
    out["plan"] = f"{compiled.plan.mesh.product_form()}, {compiled.plan.predicted.step_time_s:.4f} s/step"
    if plans:
        folder = Path(plans)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{'-'.join(name.split())}.json").write_text(compiled.plan.to_json())
    print(json.dumps(out))


def _cpu() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--hf", action="store_true", help="also the transformers models (slower)")
    parser.add_argument("--2t", dest="two_t", action="store_true", help="also the 2T dense and MoE configs (slower)")
    parser.add_argument("--only", help="run the cases whose name contains this")
    parser.add_argument("--cpu", action="store_true", help="CPU seconds (this process and the search's helper)")
    parser.add_argument("--plans", help="write each case's plan as DIR/<case>.json (from its first run)")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(args.child, args.plans)
        return
    clock = 1 if args.cpu else 0
    every = {**CASES, **(HF_CASES if args.hf else {}), **(TWO_T_CASES if args.two_t else {})}
    cases = [n for n in every if not args.only or args.only in n]
    print(f"{'CPU' if args.cpu else 'wall'} seconds, median of {args.runs} fresh processes per case")
    results = {}
    for name in cases:
        results[name] = runs = [_run(name, args.plans if i == 0 else None) for i in range(args.runs)]
        shown = [p for p in PHASES if any(p in r["phases"] for r in runs)]
        cells = [f"{SHORT.get(p, p)} {statistics.median(r['phases'].get(p, [0, 0])[clock] for r in runs):.2f}"
                 for p in shown]  # fmt: skip
        totals = [r["total"][clock] for r in runs]
        both = statistics.median(r["capture+search"][clock] for r in runs)
        print(
            f"{name}: capture + search {both:.2f}, total {statistics.median(totals):.2f} "
            f"({min(totals):.2f}-{max(totals):.2f}), {runs[0]['plan']}\n    " + ", ".join(cells),
            flush=True,
        )


def _run(name: str, plans: str | None) -> dict:
    command = [sys.executable, __file__, "--child", name, *(["--plans", plans] if plans else [])]
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    main()
