"""Run a function on N CPU processes over gloo, with a hard timeout so a hang fails the test."""

from __future__ import annotations

import gc
import os
import pickle
import socket
import tempfile
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, world: int, port: int, fn, args, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result = fn(rank, world, *args)
        gc.collect()  # free FSDP's cyclic state while the groups exist (as the emitted train.py does)
        dist.barrier()
        payload = ("ok", result)
    except BaseException:  # noqa: BLE001 - reported to the parent
        payload = ("error", traceback.format_exc())
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
        pickle.dump(payload, f)


def run(fn, world: int, *args, timeout: float = 120.0) -> list:
    """``fn(rank, world, *args)`` on ``world`` processes; returns the per-rank results."""
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as out:
        procs = [ctx.Process(target=_worker, args=(r, world, port, fn, args, out)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        if hung:
            raise TimeoutError(f"ranks {hung} still running after {timeout:.0f} s")
        results = []
        for r in range(world):
            path = os.path.join(out, f"{r}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} died with exit code {procs[r].exitcode}")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status != "ok":
                raise RuntimeError(f"rank {r} failed:\n{value}")
            results.append(value)
        return results


def torchrun(out, nproc: int, *args: str, timeout: float = 120.0, restarts: int = 0, env: dict | None = None):
    """``torchrun`` an emitted program's ``train.py`` on ``nproc`` CPU processes (gloo), with a
    hard timeout; returns the completed process (stdout and stderr as text)."""
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    if restarts:
        cmd += [f"--max-restarts={restarts}", "--monitor-interval=0.5"]
    cmd += [str(out / "train.py"), *args]
    full_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)
