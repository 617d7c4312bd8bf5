"""Checkpoint write and load times of an emitted program on this machine (CPU processes, gloo).

    python benchmarks/checkpoint.py --config tiny --gpus 2 --force dp=2,zero=1
    python benchmarks/checkpoint.py --config 1b --gpus 2 --force tp=2 --sync

Compiles ``examples/llama3.py`` at the config, starts the program's ranks with torchrun, builds
each rank's part (parameters by the model's own initialisation, AdamW states made as the first
step makes them), then writes checkpoints (``--repeat`` times; background writes report the time
the step is blocked and the time until ``COMPLETE``) and loads the last one back into the same
ranks, as a resumed run does. Prints one JSON line: parameters, bytes on disk, median seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(out: Path, ckpt: Path, repeat: int, sync: bool) -> None:
    import torch
    import torch.distributed as dist

    from autoshard.runtime import durable, state, trainer
    from autoshard.runtime import program as rt

    args = trainer.parse_args(["--checkpoint-dir", str(ckpt)] + (["--checkpoint-sync"] if sync else []))
    plan, prog = rt.read_program(out)
    trainer.init_process_group("gloo", 600)
    t = trainer.Trainer.build(args, out, plan, prog, torch.device("cpu"))
    for e, opt in state._optimized(t.entries, t.optim):  # the states AdamW's first step makes
        st = state._moments(opt, e.param, create=True)
        st["step"].fill_(1)
    ck = durable.Checkpointer(ckpt, keep=1, asynchronous=not sync)
    blocked, total = [], []
    for i in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        ck.save(*t.checkpoint(trainer.Run(step=i + 1, position=i + 1)))
        blocked.append(time.perf_counter() - start)
        ck.wait()
        dist.barrier()
        total.append(time.perf_counter() - start)
    path = durable.find(ckpt)
    loads = []
    for _ in range(repeat):
        dist.barrier()
        start = time.perf_counter()
        t.restore(path)
        dist.barrier()
        loads.append(time.perf_counter() - start)
    if dist.get_rank() == 0:
        size = sum(f.stat().st_size for f in path.iterdir())
        params = plan["model"]["params"]
        print(
            json.dumps(
                {
                    "config": plan["model"]["name"],
                    "params": params,
                    "plan": plan["mesh"],
                    "zero": plan["zero_stage"],
                    "mode": "sync" if sync else "async",
                    "bytes": size,
                    "repeat": repeat,
                    "save_blocked_s": statistics.median(blocked),
                    "save_total_s": statistics.median(total),
                    "load_s": statistics.median(loads),
                    "write_gb_per_s": size / statistics.median(total) / 1e9,
                }  # fmt: skip
            ),
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiny")
    p.add_argument("--gpus", type=int, default=2)
    p.add_argument("--force", default="dp=2,zero=1")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--sync", action="store_true", help="write inside the step (views, no copies)")
    p.add_argument("--dir", type=Path, help="where to write (default: a temporary directory)")
    p.add_argument("--worker", nargs=2, type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(*args.worker, args.repeat, args.sync)
        return
    work = Path(tempfile.mkdtemp(prefix="autoshard-ckpt-", dir=args.dir))
    try:
        out = work / "out"
        cmd = [sys.executable, "-m", "autoshard", "compile", str(ROOT / "examples/llama3.py"), "--config", args.config]
        cmd += ["--hardware", "cpu", "--gpus", str(args.gpus), "--seq-len", "64", "--global-batch", "8"]
        subprocess.run([*cmd, "--force", args.force, "-o", str(out)], check=True, capture_output=True)
        run = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}"]
        run += [__file__, "--worker", str(out), str(work / "ckpt"), "--repeat", str(args.repeat)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
        proc = subprocess.run(run + (["--sync"] if args.sync else []), env=env, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
        if proc.returncode or not lines:
            sys.exit(f"checkpoint benchmark failed:\n{proc.stderr[-2000:]}")
        print(lines[-1])
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
