"""The cost model against the emitted programs it describes, run here: predicted against measured
step time and peak memory per rank, over plans of every parallel dimension.

    python benchmarks/accuracy_local.py [--hardware PROFILE] [--steps 8] [--quick] [--json]

Two small models on one problem each (``GPUS`` processes, CPU, gloo): the LLaMA example (dense)
and the DeepSeek-V3 example (MoE, MLA). For each, plans pinned with ``--force`` (TP with and
without SP, PP with each schedule, DP with each ZeRO stage, CP, EP, recomputation sets) and the
plan the unforced search picks. Each plan is compiled (``autoshard compile``), run with
``torchrun`` in the plan's precision (``--compute-dtype bf16``, as ``plan.json``'s memory
breakdown counts bytes) with ``OMP_NUM_THREADS=1``, and compared:

- step time: the median of the slowest rank's step time over the steps after the first two
  (warm-up), the last step excluded (it is the one whose memory is counted, below);
- peak memory per rank: the live bytes of the tensors the rank holds, at their largest during
  the last step, counted by ``autoshard.atscale.MemoryCounter`` (the counter ``verify
  --at-scale`` uses; here on real tensors). The process's resident set, which the trainer logs
  on CPUs, is not comparable: it holds the Python interpreter, torch's libraries and the
  allocator's free pages. Against each rank, the plan's prediction for its pipeline rank.

Metrics: the median of |predicted / measured - 1| step time (target <= 15%), Spearman's rank
correlation of predicted and measured step time over the plans (>= 0.8), and regret: how much
less measured throughput the searched plan has than the best measured plan of its problem (<= 10%).

The prediction holds for this machine only as well as the profile describes it: all ranks of
a problem share the host's cores (``--hardware``'s ``cores``), and a profile measured with
``autoshard calibrate`` is the one to pass. The machine this runs on may be shared: a busy
neighbour slows every measured plan.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WARMUP = 2
SEARCH = "search"  # the plan name of the unforced search's pick


@dataclass(frozen=True)
class Problem:
    name: str
    model: str
    config: str
    gpus: int
    seq: int
    batch: int
    plans: dict[str, str]  # name -> --force pins ("" for the search's pick)
    quick: tuple[str, ...] = ()


PROBLEMS = (
    Problem(
        "dense", "examples/llama3.py", "small", 4, 128, 8,
        {
            "tp4": "tp=4,sp=off",
            "tp2-sp-dp2": "tp=2,sp=on,dp=2,zero=1",
            "pp2-1f1b-dp2": "pp=2,dp=2,schedule=1f1b,microbatches=4",
            "pp2-interleaved-dp2": "pp=2,dp=2,schedule=interleaved,microbatches=4",
            "pp2-zero-bubble-dp2": "pp=2,dp=2,schedule=zero-bubble,microbatches=4",
            "pp2-zbv-dp2": "pp=2,dp=2,schedule=zbv,microbatches=4",
            "pp2-dualpipev-dp2": "pp=2,dp=2,schedule=dualpipev,microbatches=4",
            "dp4-zero0": "dp=4,zero=0",
            "dp4-zero1": "dp=4,zero=1",
            "dp4-zero2": "dp=4,zero=2",
            "dp4-zero3": "dp=4,zero=3",
            "cp2-ring-dp2": "cp=2,dp=2,attention=ring",
            "cp2-allgather-dp2": "cp=2,dp=2,attention=allgather-kv",
            "dp4-recompute-full": "dp=4,zero=1,recompute=full",
            "tp2-dp2-recompute-act": "tp=2,sp=on,dp=2,recompute=activation",
            SEARCH: "",
        },
        quick=("tp4", "pp2-1f1b-dp2"),
    ),
    Problem(
        "moe", "examples/deepseek_v3.py", "tiny", 4, 128, 8,
        {
            "ep4-dp4": "dp=4,ep=4",
            "ep2-dp4": "dp=4,ep=2",
            "ep2-tp2-dp2": "tp=2,dp=2,ep=2",
            "ep2-pp2-dp2": "pp=2,dp=2,ep=2,schedule=1f1b,microbatches=4",
            "dp4-zero3-ep1": "dp=4,zero=3,ep=1",
            SEARCH: "",
        },
        quick=("ep2-dp4",),
    ),
)  # fmt: skip


@dataclass
class Result:
    problem: str
    plan: str
    gpus: int
    pins: dict
    predicted_step_s: float
    measured_step_s: float
    predicted_memory_bytes: list[float] = field(default_factory=list)  # per rank
    measured_memory_bytes: list[float] = field(default_factory=list)
    # the ranks' CPU seconds per step (median over the timed steps) over the cores they share:
    # the step time on a machine nothing else runs on, as long as the ranks keep its cores busy
    # (a shared machine's neighbours stretch the wall clock, not this)
    measured_busy_s: float = 0.0
    layout: str = ""
    measured_memory_parts: list[dict] = field(default_factory=list)  # per rank, at its peak (MemoryCounter's parts)

    def error(self, busy: bool = False) -> float:
        return self.predicted_step_s / (self.measured_busy_s if busy else self.measured_step_s) - 1


# -------------------------------------------------------------------------------------------
# compile and run


def _compile(problem: Problem, pins: str, hardware: str, out: Path) -> dict:
    cmd = [
        sys.executable, "-m", "autoshard", "compile", str(ROOT / problem.model), "--config", problem.config,
        "--hardware", hardware, "--gpus", str(problem.gpus), "--seq-len", str(problem.seq),
        "--global-batch", str(problem.batch), "-o", str(out),
    ]  # fmt: skip
    if pins:
        cmd += ["--force", pins]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"compile {pins!r} failed: {done.stderr.strip().splitlines()[-1:]}")
    return json.loads((out / "plan.json").read_text())


def _run(out: Path, gpus: int, steps: int, dtype: str = "bf16") -> tuple[float, float, dict[int, dict]]:
    """The program in ``out``: its median step time, its median busy time (``Result.measured_busy_s``)
    and each rank's record of its peak tensor bytes (``peak_bytes``, ``parts``)."""
    memory = out / "memory"
    memory.mkdir(exist_ok=True)
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
        __file__, "--program", str(out), "--memory-dir", str(memory),
        "--", "--steps", str(steps), "--compute-dtype", dtype,
    ]  # fmt: skip
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode:
        raise RuntimeError(f"run of {out} failed: {done.stderr.strip().splitlines()[-3:]}")
    times = [json.loads(line)["slowest_s"] for line in done.stdout.splitlines() if line.startswith('{"step"')]
    records = {int(p.stem[4:]): json.loads(p.read_text()) for p in memory.glob("rank*.json")}
    cpu = [sum(r["cpu_s"][i] for r in records.values()) for i in range(WARMUP, steps - 1)]
    busy = statistics.median(cpu) / min(gpus, os.cpu_count() or 1)
    return statistics.median(times[WARMUP:-1]), busy, {rank: r for rank, r in records.items()}


def _rank_program(out: Path, memory_dir: Path, argv: list[str]) -> None:
    """One rank of the program in ``out`` (under torchrun), its last step's tensors counted."""
    import runpy

    import torch.distributed as dist

    from autoshard.atscale import MemoryCounter
    from autoshard.runtime import trainer
    from autoshard.runtime.state import optimizer_parts

    steps = int(argv[argv.index("--steps") + 1])
    plain = trainer.Trainer.step
    cpu: list[float] = []

    def step(self, index, *args, **kwargs):
        if index != steps - 1:
            start = time.process_time()
            result = plain(self, index, *args, **kwargs)
            cpu.append(time.process_time() - start)
            return result
        counter = MemoryCounter()
        counter.hold(self.stages, optimizer_parts(self.optim))
        with counter:
            result = plain(self, index, *args, **kwargs)
        counter.release()
        record = {"peak_bytes": counter.peak, "parts": counter.at_peak, "cpu_s": cpu}
        (memory_dir / f"rank{dist.get_rank()}.json").write_text(json.dumps(record))
        return result

    trainer.Trainer.step = step
    sys.argv = [str(out / "train.py"), *argv]
    runpy.run_path(str(out / "train.py"), run_name="__main__")


def _predicted_memory(plan: dict) -> list[float]:
    """The plan's peak bytes for each rank, in rank order (by its pipeline coordinate)."""
    from autoshard.atscale import coordinates
    from autoshard.ir.plan import Plan

    mesh = Plan.from_dict(plan).mesh
    by_pp = {r["pp_rank"]: r["memory_bytes"]["total"] for r in plan["predicted"]["ranks"]}
    return [by_pp[coordinates(mesh, rank)["pp"]] for rank in range(plan["gpus"])]


def measure(problem: Problem, name: str, hardware: str, steps: int, work: Path, dtype: str = "bf16") -> Result:
    out = work / f"{problem.name}-{name}"
    plan = _compile(problem, problem.plans[name], hardware, out)
    seconds, busy, records = _run(out, problem.gpus, steps, dtype)
    mesh = plan["mesh"]
    layout = " ".join(f"{k}{mesh[k]}" for k in ("tp", "pp", "cp", "ep", "dp") if mesh[k] > 1)
    layout += f" z{plan['zero_stage']}" + (f" {plan['schedule']}" if mesh["pp"] > 1 else "")
    return Result(
        problem.name, name, problem.gpus, plan.get("forced", {}), plan["predicted"]["step_time_s"], seconds,
        _predicted_memory(plan), [records[r]["peak_bytes"] for r in sorted(records)], busy, layout,
        [records[r]["parts"] for r in sorted(records)],
    )  # fmt: skip


# -------------------------------------------------------------------------------------------
# metrics


def ranks(values: list[float]) -> list[float]:
    """1-based ranks, ties given their mean rank."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(xs: list[float], ys: list[float]) -> float:
    """Spearman's rank correlation: Pearson's over the ranks."""
    rx, ry = ranks(xs), ranks(ys)
    mx, my = statistics.fmean(rx), statistics.fmean(ry)
    cov = sum((a - mx) * (b - my) for a, b in zip(rx, ry))
    var = math.sqrt(sum((a - mx) ** 2 for a in rx) * sum((b - my) ** 2 for b in ry))
    return cov / var if var else float("nan")


def regret(results: list[Result], busy: bool = False) -> float | None:
    """Over each problem: 1 - (the searched plan's measured throughput) / (the best measured);
    the largest over the problems. None where no searched plan ran."""
    worst = None
    for problem in {r.problem for r in results}:
        mine = [r for r in results if r.problem == problem]
        picked = [r for r in mine if r.plan == SEARCH]
        if not picked:
            continue
        seconds = [r.measured_busy_s if busy else r.measured_step_s for r in mine]
        value = 1 - min(seconds) / seconds[mine.index(picked[0])]
        worst = value if worst is None else max(worst, value)
    return worst


def metrics(results: list[Result], busy: bool = False) -> dict:
    """The three figures against the wall-clock step time (``busy``: against the busy time)."""
    if not results:
        return {"median_abs_error": None, "spearman": None, "regret": None}
    pred = [r.predicted_step_s for r in results]
    meas = [r.measured_busy_s if busy else r.measured_step_s for r in results]
    return {
        "median_abs_error": statistics.median(abs(r.error(busy)) for r in results),
        "spearman": spearman(pred, meas) if len(results) > 2 else None,
        "regret": regret(results, busy),
    }


# -------------------------------------------------------------------------------------------
# the machine's own fields


def write_profile(base: str, path: Path) -> None:
    """A profile extending ``base`` with what ``autoshard calibrate`` measures of this host in
    seconds (its GEMM and memory rates, ``cores``, the per-op host costs), without the minutes
    its collectives take: for a base profile measured on a machine of this kind."""
    from autoshard.calibrate import _as_a_rank, _toml, measure_host, measure_rates

    name = Path(base).stem if base.endswith(".toml") else base
    with _as_a_rank("cpu"):
        host = measure_host("cpu", quick=True)
    text = _toml({"name": path.stem, "extends": name} | measure_rates("cpu", quick=True) | host)
    path.parent.mkdir(parents=True, exist_ok=True)
    if base.endswith(".toml"):
        import shutil

        shutil.copy(base, path.parent / Path(base).name)
    path.write_text(text)
    print(text, end="")


# -------------------------------------------------------------------------------------------
# the command


def _table(results: list[Result], summary: dict) -> str:
    lines = [
        f"{'problem':8s} {'plan':24s} {'layout':28s} {'pred s':>8s} {'meas s':>8s} {'err':>6s} {'busy s':>8s}  "
        f"{'pred MB/rank':>14s} {'meas MB/rank':>24s}"
    ]
    for r in results:
        pm = f"{max(r.predicted_memory_bytes) / 1e6:.0f}"
        mm = "/".join(f"{m / 1e6:.0f}" for m in r.measured_memory_bytes)
        lines.append(
            f"{r.problem:8s} {r.plan:24s} {r.layout:28s} {r.predicted_step_s:8.3f} {r.measured_step_s:8.3f} "
            f"{r.error():+6.0%} {r.measured_busy_s:8.3f}  {pm:>14s} {mm:>24s}"
        )
    for what, m in (("wall clock", summary), ("busy time", summary["busy"])):
        reg, rho, err = m["regret"], m["spearman"], m["median_abs_error"]
        lines.append(
            f"{what:10s}: median |pred/meas - 1| {'n/a' if err is None else f'{err:.1%}'} (target <= 15%)   "
            f"Spearman {'n/a' if rho is None else f'{rho:.3f}'} (>= 0.8)   "
            f"regret {'n/a' if reg is None else f'{reg:.1%}'} (<= 10%)"
        )
    return "\n".join(lines)


def run(
    hardware: str,
    steps: int,
    quick: bool,
    only: list[str] | None = None,
    work: Path | None = None,
    dtype: str = "bf16",
    log=sys.stderr,
) -> tuple[list[Result], list[dict]]:
    """Every plan measured (in ``work``, kept, or a temporary directory), and the plans that
    failed to compile or run, with why."""
    results, failed = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for problem in PROBLEMS:
            for name in problem.quick if quick else tuple(problem.plans):
                if only and name not in only:
                    continue
                try:
                    r = measure(problem, name, hardware, steps, work or Path(tmp), dtype)
                except (RuntimeError, subprocess.TimeoutExpired, KeyError, ValueError) as e:
                    failed.append({"problem": problem.name, "plan": name, "error": str(e)})
                    print(f"{problem.name} {name}: FAILED {e}", file=log, flush=True)
                    continue
                print(
                    f"{problem.name} {name}: predicted {r.predicted_step_s:.3f} s, measured {r.measured_step_s:.3f} s "
                    f"(busy {r.measured_busy_s:.3f} s)",
                    file=log,
                    flush=True,
                )
                results.append(r)
    return results, failed


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if "--program" in argv:  # one rank of a program, under torchrun
        cut = argv.index("--")
        p = argparse.ArgumentParser()
        p.add_argument("--program", type=Path)
        p.add_argument("--memory-dir", type=Path)
        a = p.parse_args(argv[:cut])
        return _rank_program(a.program, a.memory_dir, argv[cut + 1 :])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hardware", default="cpu", help="profile name or path (default: cpu)")
    p.add_argument("--steps", type=int, default=8, help="steps per run (the first two and the last are not timed)")
    p.add_argument("--quick", action="store_true", help="the reduced set CI runs")
    p.add_argument("--only", nargs="*", help="run only these plan names")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--work", type=Path, help="keep each plan's program and measurements here")
    p.add_argument(
        "--compute-dtype",
        choices=["bf16", "fp32"],
        default="bf16",
        help="the programs' compute (bf16: the plan's precision, as its memory counts bytes; fp32: as the "
        "trainer runs on CPUs by default, for a profile whose bf16 peak is an fp32 rate)",
    )
    p.add_argument(
        "--write-profile",
        type=Path,
        metavar="PATH",
        help="write a profile extending --hardware with this host's cores and measured op_overhead_us, and stop",
    )
    args = p.parse_args(argv)
    if args.write_profile:
        return write_profile(args.hardware, args.write_profile)
    if args.steps < WARMUP + 2:
        p.error(f"--steps must be at least {WARMUP + 2} (warm-up, one timed step, the memory step)")
    results, failed = run(args.hardware, args.steps, args.quick, args.only, args.work, args.compute_dtype)
    summary = {**metrics(results), "busy": metrics(results, busy=True)}
    if args.json:
        print(json.dumps({"plans": [asdict(r) for r in results], **summary, "failed": failed}))
    else:
        print(_table(results, summary))
        for f in failed:
            print(f"FAILED {f['problem']} {f['plan']}: {f['error']}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
