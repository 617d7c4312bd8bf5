"""Expert parallelism against the same model without it (CPU processes), and the grouped GEMM
against a loop over experts (one GPU).

    python benchmarks/moe.py [--forms deepseek,mixtral] [--steps 8] [--rounds 2]   # CPU, 4 gloo ranks
    python benchmarks/moe.py --gpu                                                 # one CUDA GPU, < 2 min

CPU. Each form of benchmarks/moe_models.py (``deepseek``: the bundled example's fixed-capacity
buffers, dispatched by ``rt.moe_dispatch_buffer``; ``mixtral``: transformers' grouped-GEMM experts,
dispatched dropless by ``rt.moe_dispatch``) is compiled for 4 processes with ``--force ep=K,dp=4``,
K = 1, 2, 4: the same model, weights (``--init-from-model``) and global batch (8 x 256 tokens),
fp32, gloo, one thread per process; the last step's loss, printed, agrees across the cases.
Each round runs EP1, EP2 and EP4 back to back, so the cases share the noisy machine; a case's
step time is the median over its steps after the first two of every run (warm-up), and EPK/EP1
is the ratio of those medians. The runs set ``AUTOSHARD_MOE_TIMING=1`` (autoshard/runtime/moe.py):
the share is the median over steps of the wall time rank 0 spent in dispatch and combine, forward
and backward, over its step time. That time is the all-to-alls (waits for slower ranks included)
and their reorders; filling the buffer, or sorting rows by expert, is the model's own code and
not in it. EP1 has no dispatch at all. ``--no-timing`` runs without the timer (no share).

GPU. ``autoshard.runtime.moe.grouped_mm`` (``torch._grouped_mm``) against its per-expert loop, both
running one rank's routed experts at DeepSeek-V3's shapes (hidden 7168, expert FFN 2048, 256
experts over EP32: 8 local experts; 4096 tokens x top-8 = 32768 rows per rank), bf16, SwiGLU,
forward and backward, with even and skewed rows per expert. Prints medians of 20 timed iterations
after 3 warm-up ones, TFLOP/s, the ratio, and the largest difference between the two. Without a
CUDA device it says so and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = Path(__file__).with_name("moe_models.py")
GPUS, SEQ, GLOBAL_BATCH, WARMUP = 4, 256, 8, 2
EPS = (1, 2, 4)


# --- CPU: EP1 / EP2 / EP4 on gloo processes ------------------------------------------------------


def compile_case(form: str, ep: int, out: Path) -> None:
    subprocess.run(
        [sys.executable, "-m", "autoshard", "compile", str(MODELS), "--config", form, "--hardware", "cpu",
         "--gpus", str(GPUS), "--seq-len", str(SEQ), "--global-batch", str(GLOBAL_BATCH),
         "--force", f"ep={ep},dp={GPUS}", "-o", str(out)],
        check=True, capture_output=True,
    )  # fmt: skip


def run_case(out: Path, steps: int, timing: bool) -> list[dict]:
    """The program's step lines after the warm-up, each with ``moe_seconds`` (rank 0's timed
    dispatch/combine functions in that step) when ``timing``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={GPUS}"]
    cmd += [__file__, "--worker", str(out), "--steps", str(steps)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    env.pop("AUTOSHARD_MOE_TIMING", None)
    if timing:
        env["AUTOSHARD_MOE_TIMING"] = "1"
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    if done.returncode:
        raise SystemExit(f"{out.name}: the program failed:\n{done.stderr[-2000:]}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    lines = [r for r in lines if "event" not in r]  # a straggler named, say
    return lines[WARMUP:]


def worker(out: Path, steps: int) -> None:
    """One rank of the program in ``out`` (torchrun runs this file with ``--worker``): the trainer
    of train.py, each step's line carrying the timer's sums for that step (read, then reset)."""
    from autoshard.runtime import moe, trainer

    plain = trainer.record

    def record(step, loss, seconds, log=None, extra=None):
        return plain(step, loss, seconds, log, {**(extra or {}), "moe_seconds": moe.timings(reset=True)})

    trainer.record = record
    trainer.main(out, ["--steps", str(steps), "--init-from-model"])  # every case from the same weights


def share(line: dict) -> float:
    return sum(line["moe_seconds"].values()) / line["seconds"]


def cpu(forms: list[str], steps: int, rounds: int, timing: bool) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        outs = {}
        for form in forms:
            for ep in EPS:
                outs[form, ep] = Path(tmp) / f"{form}-ep{ep}"
                compile_case(form, ep, outs[form, ep])
        for form in forms:
            lines: dict[int, list[dict]] = {ep: [] for ep in EPS}
            for r in range(rounds):
                for ep in EPS:
                    run = run_case(outs[form, ep], steps, timing)
                    lines[ep] += run
                    median = statistics.median(x["seconds"] for x in run)
                    print(f"{form} round {r} EP{ep}: {median:.3f} s/step", file=sys.stderr, flush=True)
            report(form, lines, timing)


def report(form: str, lines: dict[int, list[dict]], timing: bool) -> None:
    base = statistics.median(x["seconds"] for x in lines[1])
    print(f"\n{form} ({len(lines[1])} steps per case)")
    print("| case | step s | EPK/EP1 | dispatch+combine share | last loss |\n|---|---|---|---|---|")
    for ep, run in lines.items():
        median = statistics.median(x["seconds"] for x in run)
        timed = timing and ep > 1
        part = f"{statistics.median(share(x) for x in run):.1%}" if timed else "-"
        print(f"| EP{ep} | {median:.3f} | {median / base:.3f} | {part} | {run[-1]['loss']:.4f} |")


# --- GPU: grouped GEMM against a loop over experts -----------------------------------------------

HIDDEN, FFN, LOCAL_EXPERTS, ROWS = 7168, 2048, 8, 4096 * 8


def expert_counts(rows: int, experts: int, skewed: bool) -> list[int]:
    """Rows per expert: equal, or skewed (expert i's share grows with i, the largest about 4x the
    smallest), summing to ``rows``."""
    weights = [1 + 3 * i / (experts - 1) if skewed else 1 for i in range(experts)]
    counts = [int(rows * w / sum(weights)) for w in weights]
    counts[-1] += rows - sum(counts)
    return counts


def swiglu_experts(mm, x, w1, w3, w2, offs):
    """The experts' SwiGLU FFN on rows grouped by ``offs`` with matmul ``mm(a, b, offs)``."""
    import torch.nn.functional as F

    return mm(F.silu(mm(x, w1, offs)) * mm(x, w3, offs), w2, offs)


def time_experts(mm, tensors, offs, iters: int, warmup: int) -> tuple[float, object]:
    """Median seconds of forward + backward, and the last output."""
    import torch

    sync = torch.cuda.synchronize if offs.is_cuda else lambda: None
    times = []
    for i in range(warmup + iters):
        for t in tensors:
            t.grad = None
        sync()
        start = time.perf_counter()
        out = swiglu_experts(mm, *tensors, offs)
        out.backward(torch.ones_like(out))
        sync()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times), out.detach()


def grouped_against_loop(device: str, rows: int, hidden: int, ffn: int, experts: int, iters: int, warmup: int) -> None:
    """Print the table of ``--gpu`` for these shapes on ``device``."""
    import torch

    from autoshard.runtime import moe

    gen = torch.Generator(device=device).manual_seed(0)

    def param(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=gen) * scale).bfloat16().requires_grad_()

    x = param(rows, hidden)
    w1, w3 = (param(experts, hidden, ffn, scale=hidden**-0.5) for _ in range(2))
    w2 = param(experts, ffn, hidden, scale=ffn**-0.5)
    if not moe.grouped_mm_runs(x, w1):
        raise SystemExit(f"torch._grouped_mm has no {device} kernel for bf16 here (torch {torch.__version__})")
    flops = 3 * 3 * 2 * rows * hidden * ffn  # three matmuls, forward + two backward each
    name = torch.cuda.get_device_name() if device == "cuda" else device
    print(f"{name}, torch {torch.__version__}: {experts} experts, {rows} rows, hidden {hidden}, FFN {ffn}, "
          f"bf16, SwiGLU forward+backward, median of {iters}")  # fmt: skip
    print("| rows per expert | grouped ms | loop ms | grouped TFLOP/s | loop TFLOP/s | loop/grouped | max rel diff |")
    print("|---|---|---|---|---|---|---|")
    for skewed in (False, True):
        counts = expert_counts(rows, experts, skewed)
        offs = torch.tensor(counts, device=device).cumsum(0).to(torch.int32)
        grouped, out_g = time_experts(moe.grouped_mm, (x, w1, w3, w2), offs, iters, warmup)
        loop, out_l = time_experts(moe._grouped_mm_loop, (x, w1, w3, w2), offs, iters, warmup)
        diff = ((out_g.float() - out_l.float()).abs().max() / out_l.float().abs().max()).item()
        label = f"{min(counts)}-{max(counts)}" if skewed else f"{counts[0]} each"
        print(f"| {label} | {grouped * 1e3:.2f} | {loop * 1e3:.2f} | {flops / grouped / 1e12:.1f} | "
              f"{flops / loop / 1e12:.1f} | {loop / grouped:.2f} | {diff:.1e} |")  # fmt: skip


def gpu() -> int:
    import torch

    if not torch.cuda.is_available():
        print("benchmarks/moe.py --gpu: no CUDA device here; the GPU variant needs one", file=sys.stderr)
        return 1
    grouped_against_loop("cuda", ROWS, HIDDEN, FFN, LOCAL_EXPERTS, iters=20, warmup=3)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--forms", default="deepseek,mixtral", help="configs of benchmarks/moe_models.py")
    p.add_argument("--steps", type=int, default=8, help="steps per run, the first two warm-up")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-timing", action="store_true", help="run without the dispatch/combine timer")
    p.add_argument("--gpu", action="store_true", help="grouped GEMM against a loop on one CUDA GPU")
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker, a.steps)
        return 0
    if a.gpu:
        return gpu()
    cpu(a.forms.split(","), a.steps, a.rounds, not a.no_timing)
    return 0


if __name__ == "__main__":
    sys.exit(main())
