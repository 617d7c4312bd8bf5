"""The program at full scale: each case compiled (the plan autoshard chooses, or a published one
pinned), then ``autoshard verify --at-scale`` runs its first, last and busiest ranks one optimizer
step on fake tensors and holds peak memory, FLOPs and bytes per mesh dimension against the plan.

    python benchmarks/at_scale.py                 # the whole matrix (about 25 min on 2 cores)
    python benchmarks/at_scale.py --cases 405b,ds # some of it
    python benchmarks/at_scale.py --markdown      # the README's table
    python benchmarks/at_scale.py --parts         # and each rank's memory by part

Prints one row per (case, rank): measured / predicted peak memory, FLOPs, the worst dimension's
bytes, and whether all are within the bounds (10%, 3%, 10%); the time and resident memory the
check took. No GPU is used.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from autoshard.atscale import MEMORY_ROWS, Bounds, verify_at_scale  # noqa: E402
from autoshard.errors import AutoshardError  # noqa: E402


@dataclass(frozen=True)
class Case:
    key: str
    what: str
    model: str
    config: str
    hardware: str
    gpus: int
    seq: int
    batch: int
    force: str = ""
    precision: str = "bf16"


CASES = [
    Case("405b", "LLaMA-3 405B, chosen plan", "examples/llama3.py", "405b", "h100", 16384, 8192, 2048),
    Case("405b-meta", "LLaMA-3 405B, Meta's TP8 x PP16 x DP128", "examples/llama3.py", "405b", "h100", 16384,
         8192, 2048, "tp=8,pp=16,cp=1,dp=128,schedule=interleaved"),
    Case("70b-131k", "LLaMA-3 70B at 131K (CP)", "examples/llama3.py", "70b", "h100", 1024, 131072, 64),
    Case("gpt3", "GPT-3 175B", "examples/gpt.py", "175b", "a100", 1024, 2048, 1536),
    Case("ds", "DeepSeek-V3 671B (EP, DualPipeV, FP8)", "examples/deepseek_v3.py", "671b", "h800", 2048, 4096,
         15360, "schedule=dualpipev", "fp8"),
    Case("mixtral", "transformers' Mixtral 8x22B", "tests/models/hf_moe.py", "mixtral-8x22b", "h100", 256, 4096,
         256),
    Case("hf-70b", "transformers' Llama 70B", "tests/models/hf_llama.py", "70b", "h100", 512, 8192, 256),
    Case("zero3", "LLaMA-3 8B, ZeRO-3", "examples/llama3.py", "8b", "h100", 64, 8192, 64, "zero=3,pp=1"),
    Case("recompute", "LLaMA-3 70B, selective recomputation", "examples/llama3.py", "70b", "h100", 64, 8192, 64,
         "tp=8,pp=8,recompute=attention+activation"),
    Case("8b", "LLaMA-3 8B, TP2 x PP2 x DP2 (CI)", "examples/llama3.py", "8b", "h100", 8, 8192, 32,
         "tp=2,pp=2,dp=2"),
    Case("moe", "DeepSeek-V3 tiny, EP4 FP8 (CI)", "examples/deepseek_v3.py", "tiny", "h800", 8, 4096, 32,
         "ep=4,pp=2", "fp8"),
]  # fmt: skip


def compile_case(case: Case, out: Path) -> float:
    cmd = [sys.executable, "-m", "autoshard", "compile", case.model, "--config", case.config, "--hardware"]
    cmd += [case.hardware, "--gpus", str(case.gpus), "--seq-len", str(case.seq), "--global-batch", str(case.batch)]
    cmd += ["--precision", case.precision, "-o", str(out)] + (["--force", case.force] if case.force else [])
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"{case.key}: compile failed: {proc.stderr.strip().splitlines()[-1:]}")
    return time.perf_counter() - start


def _ratio(rows, what: str) -> float | None:
    row = next((r for r in rows if r.what.strip() == what), None)
    return row.ratio if row is not None else None


def _worst_comm(rows, floor: float):
    worst = None
    for r in rows:
        if r.bound is None or "bytes" not in r.what or abs(r.measured - r.predicted) <= floor:
            continue
        ratio = r.ratio if r.predicted else float("inf")
        if worst is None or abs(ratio - 1) > abs(worst[1] - 1):
            worst = (r.what.split()[0], ratio)
    return worst


def _parts(rows) -> str:
    """Each memory part of a rank, predicted / measured in GB (the parts the peak adds up)."""
    out = []
    for r in rows:
        what = r.what.strip()
        if r.what.startswith("  ") and what in {label for label, _, _ in MEMORY_ROWS} and (r.predicted or r.measured):
            out.append(f"{what} {r.predicted / 1e9:.2f}/{r.measured / 1e9:.2f}")
    return ", ".join(out)


def run(cases: list[Case], markdown: bool, parts: bool = False) -> int:
    failed = 0
    head = "| case | plan | rank | peak memory (GB) predicted / measured | FLOPs | bytes, worst dimension | within |"
    if markdown:
        print(head)
        print("|---|---|---|---|---|---|---|")
    for case in cases:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / case.key
            try:
                compile_s = compile_case(case, out)
                report = verify_at_scale(out, "first,last,busiest", Bounds())
            except (AutoshardError, RuntimeError) as e:  # a row that cannot run says why; the rest go on
                failed += 1
                print(f"| {case.what} | - | - | {e} | - | - | no |" if markdown else f"{case.key:10s} {e}", flush=True)
                continue
        for r in report.ranks:
            peak = next(x for x in r.rows if x.what == "peak memory")
            flops = _ratio(r.rows, "FLOPs")
            comm = _worst_comm(r.rows, report.bounds.comm_floor_bytes)
            comm_text = f"{comm[0]} {comm[1]:.3f}" if comm else "all within 1 MiB"
            ok = "yes" if r.ok else "no"
            failed += not r.ok
            where = f"{r.rank} ({'/'.join(r.chosen_as)})"
            pk = f"{peak.predicted / 1e9:.1f} / {peak.measured / 1e9:.1f} ({peak.ratio:.3f})"
            if markdown:
                row = f"| {case.what} | {report.plan} | {where} | {pk} | {flops:.4f} | {comm_text} | {ok} |"
                print(row, flush=True)
            else:
                took = f"{r.measured.seconds:.1f} s, {r.measured.rss_bytes / 1e9:.2f} GB rss, compile {compile_s:.0f} s"
                line = f"{case.key:10s} rank {where:22s} peak {pk} GB  FLOPs {flops:.4f}  bytes {comm_text:18s}"
                print(f"{line} {ok:3s}  {took}", flush=True)
            if parts:
                print(f"    parts at the peak, predicted/measured GB: {_parts(r.rows)}", flush=True)
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", help=f"comma-separated, of: {', '.join(c.key for c in CASES)} (default: all)")
    p.add_argument("--markdown", action="store_true", help="the README's table")
    p.add_argument("--parts", action="store_true", help="under each rank, its memory parts predicted/measured")
    args = p.parse_args()
    keys = args.cases.split(",") if args.cases else [c.key for c in CASES]
    unknown = [k for k in keys if k not in {c.key for c in CASES}]
    if unknown:
        p.error(f"unknown case {unknown[0]!r}; choose from {', '.join(c.key for c in CASES)}")
    return run([c for c in CASES if c.key in keys], args.markdown, args.parts)


if __name__ == "__main__":
    sys.exit(main())
