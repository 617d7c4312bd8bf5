"""The driver of a long-context ramp (``autoshard compile --seq-len A,B,...``): an emitted
``ramp.py`` calls ``main`` with its own directory, which holds ``ramp.json`` and one program
directory per stage.

Every stage's train.py shares one checkpoint directory. Stage k runs to its last step (its
``--steps``) and writes a checkpoint there; stage k+1, another plan at a longer sequence length,
resumes from that newest checkpoint: the trainer loads weights and optimizer state written under
any plan into its own shards, continues the step counter, and carries the data position over as
tokens read (``trainer.Trainer.restore``); the tokens per step being the same in every stage,
step s reads data position s whichever stage runs it. Every stage gets ``--schedule-steps`` of the
whole ramp, so a warm-up and decay run once over all stages rather than once per stage.

A stage whose last step the newest checkpoint already reached is skipped, so a ramp stopped
anywhere continues from where it stopped when started again.
"""

from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
from pathlib import Path

from autoshard.runtime import durable

# train.py flags the driver sets for every stage; the user gives them to the driver, or not at all
OWN_FLAGS = ("--steps", "--schedule-steps", "--checkpoint-dir")


def _error(message: str) -> SystemExit:
    print(f"ramp.py: error: {message}", file=sys.stderr)
    return SystemExit(2)


def parse_args(argv: list[str] | None, description: str | None) -> tuple[argparse.Namespace, list[str]]:
    """The driver's own flags, and the train.py flags after ``--`` (given to every stage)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    own, rest = argv[:cut], argv[cut + 1 :]
    p = argparse.ArgumentParser(
        prog="ramp.py",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="train.py flags for every stage (--lr, --lr-schedule, --warmup, --data, --log-file, ...) go after --",
    )
    p.add_argument(
        "--launcher",
        help='the command that starts train.py on every process, e.g. "torchrun --nnodes 2 --nproc-per-node 8 '
        '--rdzv-backend c10d --rdzv-endpoint HOST:29500" (default for up to 8 GPUs: torchrun on this node)',
    )
    p.add_argument("--checkpoint-dir", type=Path, help="the stages' checkpoints (default: OUT/ckpt)")
    p.add_argument("--dry-run", action="store_true", help="print each stage's command; run nothing")
    args = p.parse_args(own)
    for flag in OWN_FLAGS:
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            raise _error(f"{flag} is the driver's to set for each stage; leave it out of the train.py flags")
    return args, rest


def launcher(text: str | None, gpus: int) -> list[str]:
    """The command that starts train.py on ``gpus`` processes."""
    if text:
        return shlex.split(text)
    if gpus > 8:
        raise _error(f"the ramp runs on {gpus} GPUs over several nodes: give --launcher, the torchrun command")
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}"]


def commands(out: Path, ramp: dict, start: list[str], checkpoints: Path, flags: list[str]) -> list[tuple[dict, list]]:
    """Each stage and the command that runs it to its last step."""
    total = str(ramp["total_steps"])
    return [
        (
            s,
            [
                *start,
                str(out / s["name"] / "train.py"),
                *flags,
                "--steps",
                str(s["end_step"]),
                "--schedule-steps",
                total,
                "--checkpoint-dir",
                str(checkpoints),
            ],
        )  # fmt: skip
        for s in ramp["stages"]
    ]


def main(out: Path, argv: list[str] | None = None, description: str | None = None) -> None:
    """Run the ramp in directory ``out`` stage by stage."""
    args, flags = parse_args(argv, description)
    ramp = json.loads((out / "ramp.json").read_text())
    checkpoints = args.checkpoint_dir or out / "ckpt"
    start = launcher(args.launcher, ramp["gpus"])
    count = len(ramp["stages"])
    for s, cmd in commands(out, ramp, start, checkpoints, flags):
        where = f"stage {s['index']}/{count} ({s['name']}: steps {s['first_step']} to {s['end_step']})"
        if args.dry_run:
            print(shlex.join(cmd))
            continue
        done = durable.checkpoints(checkpoints)
        if done and done[-1][0] >= s["end_step"]:
            print(f"ramp: {where} done: {done[-1][1]} is past it", flush=True)
            continue
        print(f"ramp: {where}: {shlex.join(cmd)}", flush=True)
        code = subprocess.run(cmd).returncode
        if code:
            raise _error(f"{where} failed (exit code {code}); run ramp.py again to continue from its newest checkpoint")
