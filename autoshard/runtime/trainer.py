"""The training program. An emitted ``train.py`` is a launcher that calls ``main`` with its own
directory, which holds ``plan.json``, ``program.json`` and the stage files they name; the program is
the same for every plan and reads everything plan-specific from there.

``main`` sets up the process group (NCCL on GPUs, gloo on CPUs) and tears it down; ``Trainer.build``
puts this rank's part of the plan together (mesh, pipeline chunks, precision, data parallelism at
the plan's ZeRO stage, AdamW, the pipeline schedule); ``Trainer.step`` runs one optimizer step;
``train`` loops over the steps up to ``--steps`` (resuming from the newest complete checkpoint in
``--checkpoint-dir``), sets the learning rate of each step, guards against loss spikes, writes
checkpoints (``autoshard.runtime.state``; host-memory snapshots and a mirror beside them, and a
watch for slow ranks: ``autoshard.runtime.tiers``) and prints one JSON line per step (``step``, ``loss``,
``grad_norm``, ``lr``, throughput, MFU, memory, the slowest rank), and a human line on a terminal.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import io
import json
import math
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from autoshard.errors import ProgramError
from autoshard.ir.plan import Plan
from autoshard.ir.program import Program
from autoshard.runtime import collectives, data, diloco, durable, fake, fp8, groups, moe, state, tiers
from autoshard.runtime import program as rt
from autoshard.runtime.host import keep_freed_memory
from autoshard.runtime.weights import open_weights


def parse_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    """The program's command line (``argv`` defaults to ``sys.argv[1:]``). Long by nature: a
    table of ``add_argument`` rows, one per flag, in ``--help`` order."""
    p = argparse.ArgumentParser(
        prog="train.py", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=10, help="the step the run ends at (a resumed run continues to it)")
    p.add_argument("--lr", type=float, default=3e-4, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=0, help="steps of linear warm-up to --lr")
    p.add_argument(
        "--lr-schedule",
        choices=["constant", "cosine", "linear"],
        default="constant",
        help="after warm-up: constant, or a cosine or linear decay to --min-lr at --steps",
    )
    p.add_argument("--min-lr", type=float, default=0.0, help="the decay's final learning rate")
    p.add_argument(
        "--schedule-steps",
        type=int,
        help="the step the decay reaches --min-lr at (default: --steps); a run in stages (a long-context ramp's "
        "ramp.py) gives every stage the last stage's, so that one schedule spans them all",
    )
    p.add_argument(
        "--max-grad-norm",
        type=float,
        help="clip the global gradient norm (over every shard of every parallel dimension) to this",
    )
    p.add_argument(
        "--grad-accum", type=int, default=1, help="global batches per optimizer step (their gradients add up)"
    )
    p.add_argument(
        "--optimizer",
        choices=["adamw", "lamb"],
        default="adamw",
        help="adamw, or lamb: AdamW's moments scaled per tensor by the trust ratio ||w|| / ||update||, both "
        "norms over the whole tensor (every shard of every parallel dimension)",
    )
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--adam-eps", type=float, default=1e-8)
    p.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
    p.add_argument(
        "--data",
        type=Path,
        help="token file or directory of them (autoshard data prepare; raw int32 files too); default: synthetic",
    )
    p.add_argument(
        "--init-from",
        type=Path,
        help="start from real weights: a single-device state dict (safetensors or torch file) or a "
        "transformers checkpoint directory; each rank reads only its slices",
    )
    p.add_argument(
        "--init-from-model",
        action="store_true",
        help="slice the seeded single-device initialisation of the model file (verification)",
    )
    p.add_argument(
        "--balance-gamma",
        type=float,
        default=1e-3,
        help="MoE: routing-bias step per optimizer step, DeepSeek-V3's auxiliary-loss-free balancing (0: off)",
    )
    p.add_argument(
        "--capacity-factor",
        type=Fraction,
        help="MoE: each expert takes at most this times its mean share of a rank's routed tokens at the "
        "expert-parallel dispatch; the rest skip it, counted in the step's log (default: dropless)",
    )
    p.add_argument(
        "--aux-loss",
        choices=["sequence", "switch"],
        help="MoE: add a balance loss per layer: DeepSeek-V3's sequence-wise one or Switch Transformer's",
    )
    p.add_argument("--aux-alpha", type=float, default=1e-4, help="MoE: the balance loss's weight")
    p.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="run the layers eagerly (on GPUs each layer is compiled with torch.compile; on CPUs never)",
    )
    p.add_argument(
        "--log-file",
        "--log",
        "--loss-log",
        dest="log",
        type=Path,
        help="append each step's JSON line here too (under torchrun write --log-file: torchrun takes --log "
        "for an abbreviation of its own --log-dir)",
    )
    p.add_argument("--checkpoint-dir", type=Path, help="write checkpoints here and resume from the newest complete one")
    p.add_argument("--checkpoint-every", type=int, default=0, help="steps between checkpoints (0: only at the end)")
    p.add_argument("--keep", type=int, default=3, help="complete checkpoints to keep (0: all)")
    p.add_argument(
        "--checkpoint-sync", action="store_true", help="write checkpoints in the step (default: in the background)"
    )
    p.add_argument(
        "--spike-zscore",
        type=float,
        help="a step whose loss is this many standard deviations above the recent window rolls back to the "
        "newest checkpoint before it and skips the batches since",
    )
    p.add_argument("--spike-window", type=int, default=50, help="the loss window of --spike-zscore, steps")
    p.add_argument("--save-params", type=Path, help="save each rank's parameters here after the last step")
    p.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait before failing")
    p.add_argument(
        "--compute-dtype",
        choices=["auto", "fp32", "bf16"],
        default="auto",
        help="auto: the plan's precision on GPUs (bf16 autocast over fp32 master weights), fp32 on CPUs",
    )
    add_tier_args(p)
    return p.parse_args(argv)


def add_tier_args(p: argparse.ArgumentParser) -> None:
    """The flags of checkpoint tiers and slow ranks (``runtime.tiers``)."""
    p.add_argument(
        "--snapshot-every",
        type=int,
        default=0,
        help="steps between host-memory snapshots of every rank's state (tmpfs, survives a worker restart; 0: none)",
    )
    p.add_argument("--snapshot-dir", type=Path, default=Path("/dev/shm"), help="the host-memory (tmpfs) directory")
    p.add_argument("--mirror-dir", type=Path, help="copy complete disk checkpoints here too (the remote tier)")
    p.add_argument("--mirror-every", type=int, default=1, help="mirror every this-many-th disk checkpoint")
    p.add_argument(
        "--straggler-factor",
        type=float,
        default=1.5,
        help="name a rank whose compute time per step exceeds the other ranks' median by this factor",
    )
    p.add_argument(
        "--straggler-window", type=int, default=10, help="... as the median of that ratio over this many steps"
    )
    p.add_argument(
        "--drop-stragglers",
        action="store_true",
        help="end the attempt when a straggler is named (after a checkpoint), recording its host in "
        "CHECKPOINT_DIR/excluded_hosts, for the launcher to restart without it",
    )


def check_tier_args(args: argparse.Namespace) -> None:
    """One-line errors for the tier and straggler flags."""
    if args.snapshot_every < 0:
        raise ProgramError("--snapshot-every must not be negative")
    if args.mirror_every < 1:
        raise ProgramError("--mirror-every must be at least 1")
    if not (math.isfinite(args.straggler_factor) and args.straggler_factor > 1):
        raise ProgramError(f"--straggler-factor must be a finite number above 1; got {args.straggler_factor}")
    if args.straggler_window < 1:
        raise ProgramError("--straggler-window must be at least 1 step")
    for flag, given in [("--snapshot-every", args.snapshot_every), ("--mirror-dir", args.mirror_dir),
                        ("--drop-stragglers", args.drop_stragglers)]:  # fmt: skip
        if given and args.checkpoint_dir is None:
            raise ProgramError(f"{flag} works with the disk checkpoints: give --checkpoint-dir too")
    if args.snapshot_every and not args.snapshot_dir.is_dir():
        raise ProgramError(f"--snapshot-dir {args.snapshot_dir}: no such directory; give a tmpfs directory (/dev/shm)")
    if args.mirror_dir is not None and (why := durable.unusable(args.mirror_dir)) is not None:
        raise ProgramError(f"--mirror-dir {args.mirror_dir}: {why}; give a writable directory")


def main(out: Path, argv: list[str] | None = None, description: str | None = None) -> None:
    """Train the program in directory ``out`` on the processes torchrun started."""
    args = parse_args(argv, description)
    check_args(args)
    check_tier_args(args)
    Fault.from_env()  # a malformed AUTOSHARD_FAULT is said before anything starts
    check_paths(args)
    plan, program = rt.read_program(out)
    rt.check_program(out, plan, program)
    rt.check_world(plan)
    check_islands(plan)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        keep_freed_memory()  # the CPU's stand-in for a caching allocator (``runtime.host``)
    init_process_group("nccl" if cuda else "gloo", args.timeout)
    try:
        train(args, out, plan, program, device)
    except (dist.DistError, RuntimeError) as e:  # a collective that timed out or lost its peer: name the ranks
        if not isinstance(e, dist.DistError) and not any(m in str(e) for m in COLLECTIVE_FAILURES):
            raise
        behind = PROGRESS.behind()
        raise ProgramError(
            f"rank {dist.get_rank()}: a collective failed ({_first_line(e)}); "
            + (f"{behind}: it died or hangs there" if behind else "another rank died or hangs")
            + f", or --timeout {args.timeout:g} s is too short"
        ) from None
    # FSDP2's and the pipeline schedule's state form reference cycles, so they outlive train()
    # until the next collection. Free them now, while their process groups are alive, rather
    # than during interpreter shutdown, where tearing down gloo work that still holds tensors
    # can abort the process.
    gc.collect()
    # every rank finishes its collectives (FSDP's last ones included) before the group goes away
    dist.barrier()
    groups.set_groups(tp=None, pp=None, dp=None, cp=None, ep=None, edp=None, route=None)
    dist.destroy_process_group()


class Progress:
    """Where each rank is: its step and phase, in the process group's store, so that a rank whose
    collective timed out can name the rank that did not arrive rather than only itself."""

    PHASES = ("forward and backward", "gradient reduction and norm", "optimizer step")
    KEY = "autoshard/progress/"

    def __init__(self):
        self.store = None
        self.stamps: dict = {}  # phase -> when this rank's step reached it (``compute_s``)

    def mark(self, step: int, phase: int) -> None:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            self.stamps[phase] = torch.cuda.Event(enable_timing=True)
            self.stamps[phase].record()
        else:
            self.stamps[phase] = time.perf_counter()
        try:
            if self.store is None:
                self.store = dist.distributed_c10d._get_default_store()
            self.store.set(f"{self.KEY}{dist.get_rank()}", f"{step} {phase}")
        except Exception:  # noqa: BLE001 - a store that cannot say only loses the naming
            self.store = False

    def compute_s(self) -> float | None:
        """The last step's forward and backward on this rank, seconds: from the step's start to
        the gradient reductions' wait, so no wait for a slower rank's reduction (on GPUs, the
        stream's time between CUDA events). Under FSDP (its all-gathers) and a pipeline (its
        receives) waits for other ranks fall inside."""
        start, end = self.stamps.get(0), self.stamps.get(1)
        if start is None or end is None:
            return None
        if isinstance(start, float):
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def behind(self) -> str | None:
        """The ranks furthest behind, in words ("rank 1 last reported step 3, optimizer step"),
        where the ranks' reports differ; None where they agree or cannot be read."""
        if not self.store:
            return None
        try:
            world = dist.get_world_size()
            values = self.store.multi_get([f"{self.KEY}{r}" for r in range(world)])
            where = [tuple(int(x) for x in bytes(v).decode().split()) for v in values]
        except Exception:  # noqa: BLE001
            return None
        low = min(where)
        if low == max(where):
            return None
        ranks = [r for r, w in enumerate(where) if w == low]
        names = ", ".join(map(str, ranks[:8])) + (f" and {len(ranks) - 8} more" if len(ranks) > 8 else "")
        step, phase = low
        return f"rank{'s' if len(ranks) > 1 else ''} {names} last reported step {step}, {self.PHASES[phase]}"


PROGRESS = Progress()


# how gloo and NCCL report a peer that died or a collective that ran past --timeout
COLLECTIVE_FAILURES = ("Timed out", "timed out", "Connection closed by peer", "Connection reset", "NCCL", "gloo")


def _first_line(error: BaseException) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0][:200]


def check_args(args: argparse.Namespace) -> None:
    """One-line errors for flags that cannot work together."""
    for flag, value in [("--steps", args.steps), ("--grad-accum", args.grad_accum - 1), ("--keep", args.keep)]:
        if value < 0:
            raise ProgramError(f"{flag} must not be negative")
    if args.checkpoint_every < 0:
        raise ProgramError("--checkpoint-every must not be negative")
    if args.schedule_steps is not None and args.schedule_steps < 1:
        raise ProgramError(f"--schedule-steps must be a positive number of steps; got {args.schedule_steps}")
    for flag in ("lr", "min_lr", "weight_decay", "adam_eps", "max_grad_norm", "spike_zscore", "timeout", "aux_alpha",
                 "balance_gamma"):  # fmt: skip
        value = getattr(args, flag, None)
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise ProgramError(f"--{flag.replace('_', '-')} must be a finite number, not negative; got {value}")
    if args.init_from is not None and args.init_from_model:
        raise ProgramError("--init-from and --init-from-model both say where weights come from; give one")
    if args.init_from is not None and not args.init_from.exists():
        raise ProgramError(f"--init-from {args.init_from}: no such file or directory")
    if args.spike_zscore is not None and args.checkpoint_dir is None:
        raise ProgramError("--spike-zscore rolls back to a checkpoint: give --checkpoint-dir too")
    if args.spike_window < 2:
        raise ProgramError("--spike-window must be at least 2 steps")


def check_islands(plan: Plan) -> None:
    """What a run over DiLoCo islands cannot do yet (a hand-edited plan: compile refuses it), in
    one line before anything starts."""
    if diloco.islands_of(plan) is None:
        return
    if plan.model.get("experts"):
        raise ProgramError("DiLoCo islands are not emitted for MoE models yet; recompile without --islands")


def check_paths(args: argparse.Namespace) -> None:
    """The files the run writes can be written, before any step is spent: ``--log-file`` (opened
    for appending, as each step does) and ``--save-params`` (a directory)."""
    if args.log is not None:
        try:
            if args.log.is_dir():
                raise IsADirectoryError(21, "it is a directory")
            args.log.parent.mkdir(parents=True, exist_ok=True)
            with open(args.log, "a"):
                pass
        except OSError as e:
            raise ProgramError(f"--log-file {args.log}: cannot append to it ({e.strerror or e})") from None
    if args.save_params is not None and (why := durable.unusable(args.save_params)) is not None:
        raise ProgramError(f"--save-params {args.save_params}: {why}; give a writable directory")


def init_process_group(backend: str, timeout: float) -> None:
    """The default process group. Under torchrun's agent store, each restart's workers use a
    key prefix of their own (``restart<N>/``): the store outlives a restart, and gloo's
    rendezvous would otherwise find the dead workers' addresses (pytorch#135712)."""
    wait = datetime.timedelta(seconds=timeout)
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=wait)
        prefixed = dist.PrefixStore(f"restart{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world, timeout=wait)
    else:
        dist.init_process_group(backend, timeout=wait)


def learning_rate(args: argparse.Namespace, step: int) -> float:
    """The learning rate of optimizer step ``step`` (0-based): linear warm-up over ``--warmup``
    steps, then constant or a cosine or linear decay to ``--min-lr`` at ``--schedule-steps``
    (default ``--steps``)."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    if args.lr_schedule == "constant":
        return args.lr
    span = max(1, schedule_end(args) - args.warmup)
    t = min(1.0, (step - args.warmup) / span)
    shape = 0.5 * (1 + math.cos(math.pi * t)) if args.lr_schedule == "cosine" else 1 - t
    return args.min_lr + (args.lr - args.min_lr) * shape


def schedule_end(args: argparse.Namespace) -> int:
    """The step the learning-rate decay ends at: ``--schedule-steps``, else ``--steps``."""
    end = getattr(args, "schedule_steps", None)
    return args.steps if end is None else end


def train(args: argparse.Namespace, out: Path, plan: Plan, program: Program, device: torch.device) -> None:
    trainer = Trainer.build(args, out, plan, program, device)
    log = StepLog.of(args.log, plan, program, args.grad_accum)
    run = Run()
    if args.data is not None:  # every id in the vocabulary, enough data: said before any step
        for note in data.check(args.data, plan.global_batch, plan.seq_len, program.vocab,
                               args.steps * args.grad_accum):  # fmt: skip
            log.event({"event": "data", "note": note})
            if dist.get_rank() == 0:
                print(f"warning: {note}", file=sys.stderr)
    ckpt = lock = None
    guards = Safeguards.build(args, trainer, log)
    try:
        if args.checkpoint_dir is not None:
            lock = open_checkpoint_dir(args.checkpoint_dir, trainer)
            guarded = args.spike_zscore is not None
            ckpt = durable.Checkpointer(
                args.checkpoint_dir, args.keep or None, asynchronous=not args.checkpoint_sync, keep_previous=guarded
            )
            guards.open(ckpt, trainer, log)
            run = resume(trainer, args, log, guards)
        _loop(trainer, args, log, run, ckpt, guards)
        guards.close(log)
    finally:
        if lock is not None:
            lock.release()


def _loop(trainer: Trainer, args: argparse.Namespace, log: StepLog, run: Run, ckpt, guards=None) -> None:
    fault = Fault.from_env()
    while run.step < args.steps:
        step = run.step
        lr = learning_rate(args, step)
        if fault is not None:
            lr = fault.learning_rate(step, lr)
        trainer.set_lr(lr)
        start = time.perf_counter()
        loss, norm = trainer.step(step, run.position, fault)
        stats = trainer.gather_stats(loss, time.perf_counter() - start)
        finite = math.isfinite(stats["loss"]) and math.isfinite(norm)
        if args.spike_zscore is not None and run.spike(stats["loss"], norm, args.spike_zscore, args.spike_window):
            back = _rollback(trainer, ckpt, run, step, log)
            if back is not None:
                run = back
                continue
        if not finite:
            if trainer.prints:
                log.step(step, stats, norm, lr, {})
            if ckpt is not None:
                ckpt.wait()  # the checkpoint in flight was written from finite steps: it completes
            newest = durable.find(args.checkpoint_dir) if args.checkpoint_dir is not None else None
            kept = f"; the newest checkpoint is {newest}" if newest is not None else ""
            raise ProgramError(
                f"step {step}: the loss is {stats['loss']:g} and the gradient norm {norm:g}, not finite: the run "
                f"stops, the step's update not applied and no checkpoint written from it{kept}. Lower --lr, clip "
                "with --max-grad-norm, or give --spike-zscore (with --checkpoint-dir) to roll back and skip the batches"
            )
        run.advance(stats["loss"], args.grad_accum, args.spike_window)
        if trainer.prints:
            log.step(step, stats, norm, lr, {**trainer.expert_load(), **trainer.island_traffic()})
        if ckpt is not None:
            ckpt.poll()
            if args.checkpoint_every and run.step % args.checkpoint_every == 0 and run.step < args.steps:
                ckpt.save(*trainer.checkpoint(run))
        if guards is not None:
            guards.after_step(trainer, run, log, ckpt, fault)
    if ckpt is not None:
        if not durable.complete(durable.step_dir(args.checkpoint_dir, run.step)):
            ckpt.save(*trainer.checkpoint(run))
        ckpt.wait()
        for t in ckpt.timings:
            log.event({"event": "checkpoint", **t})
    if args.save_params:
        ranks = dataclasses.replace(trainer.ranks, dp=trainer.ranks.dp + trainer.island * trainer.plan.mesh.dp)
        rt.save_parameters(args.save_params, trainer.stages, ranks, trainer.chunk_ids, trainer.program.tied)


def _agreed(path: Path | None) -> Path | None:
    """Rank 0's answer, on every rank (the ranks may see a shared directory at different moments)."""
    box = [str(path) if path is not None else None]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0]) if box[0] is not None else None


def _agreed_text(text: str | None) -> str | None:
    box = [text]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def open_checkpoint_dir(directory: Path, trainer: Trainer) -> durable.DirectoryLock | None:
    """Before any step is spent: ``--checkpoint-dir`` must be a directory of checkpoints (not one
    checkpoint), writable, with room for one, and no other run's; rank 0 holds its lock."""
    directory = Path(directory)
    if durable.is_checkpoint(directory):
        raise ProgramError(
            f"--checkpoint-dir {directory} is a checkpoint, not a directory of them: new checkpoints would nest "
            f"inside it, where no restart looks; give the directory holding it: --checkpoint-dir {directory.parent}"
        )
    need = torch.tensor([state.checkpoint_bytes(trainer.entries)], dtype=torch.float64)
    dist.all_reduce(need)
    why, lock = None, None
    if dist.get_rank() == 0:
        why = durable.unusable(directory, float(need))
        if why is not None:
            why += "; give a writable directory with room"
        else:
            lock = durable.DirectoryLock(directory)
            holder = lock.acquire()
            if holder is not None:
                lock = None
                why = f"another run writes its checkpoints there ({holder}); stop it, or give another directory"
    why = _agreed_text(why)
    if why is not None:
        raise ProgramError(f"--checkpoint-dir {directory}: {why}")
    return lock


def resume(trainer: Trainer, args: argparse.Namespace, log: StepLog, guards: Safeguards | None = None) -> Run:
    """Where the run continues: the newest intact checkpoint in ``--checkpoint-dir`` (a damaged
    one is set aside, said in one line, and the next older tried), or the newest tier
    (``restore_newest_tier``), or the start."""
    directory = args.checkpoint_dir
    if dist.get_rank() == 0:
        for p in durable.remove_incomplete(directory):
            log.event({"event": "removed incomplete checkpoint", "checkpoint": str(p)})
    run, found, tier = restore_newest_tier(trainer, args, log, guards)
    if run is None:
        return Run()
    log.event({"event": "resumed", "checkpoint": str(found), "step": run.step, "position": run.position,
               "tier": tier})  # fmt: skip
    found = Path(found)
    if changed := lr_flags_changed(trainer.restored_lr, args):
        log.event({"event": "learning-rate flags differ from the checkpoint's", "changed": changed})
        if dist.get_rank() == 0:
            was = ", ".join(f"--{k.replace('_', '-')} {v[0]} -> {v[1]}" for k, v in changed.items())
            print(f"warning: resumed with other learning-rate flags than the run that wrote {found.name} "
                  f"({was}): the schedule continues under the new ones", file=sys.stderr)  # fmt: skip
    if changed := data_flags_changed(trainer.restored_meta, args, trainer.plan):
        log.event({"event": "data flags differ from the checkpoint's", "changed": changed})
        if dist.get_rank() == 0:
            was = ", ".join(f"{k} {v[0]} -> {v[1]}" for k, v in changed.items())
            print(f"warning: resumed with other data than the run that wrote {found.name} ({was}): the batches "
                  "from here on are not the ones that run would have read", file=sys.stderr)  # fmt: skip
    return run


def _agreed_newest(directory: Path | None) -> int | None:
    """The step of the newest complete checkpoint in ``directory`` (rank 0's look, on every rank)."""
    found = durable.checkpoints(directory) if directory is not None and dist.get_rank() == 0 else []
    box = [found[-1][0] if found else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def restore_newest_tier(
    trainer: Trainer, args: argparse.Namespace, log: StepLog, guards: Safeguards | None
) -> tuple[Run | None, str | None, str | None]:
    """Load the newest tier complete for every rank: the host-memory snapshot (where every rank
    holds an intact one of the same step, no older than the disk's), else the newest intact
    checkpoint of the local directory or of the mirror (``--mirror-dir``, the newer of the two
    first). Returns where training stands, what was read and its tier ("memory", "disk",
    "mirror"); Nones when there is nothing."""
    local, mirror = _agreed_newest(args.checkpoint_dir), _agreed_newest(args.mirror_dir)
    disk = max((s for s in (local, mirror) if s is not None), default=None)
    snapshots = guards.snapshots if guards is not None else None
    if snapshots is not None:
        step = guards.snapshot_step(log)
        if step is not None and (disk is None or step >= disk):
            run = trainer.restore_snapshot(snapshots.load(step))
            if run is not None:
                return run, str(snapshots.directory), "memory"
            log.event({"event": "host-memory snapshot unusable", "step": step})
    order = [(args.checkpoint_dir, "disk"), (args.mirror_dir, "mirror")]
    if mirror is not None and (local is None or mirror > local):
        order.reverse()
    for directory, tier in order:
        if directory is not None and (run := _restore_intact(trainer, directory, None, log)) is not None:
            return run, str(durable.step_dir(directory, run.step)), tier
    return None, None, None


def _restore_intact(trainer: Trainer, directory: Path, before: int | None, log: StepLog) -> Run | None:
    """Load the newest checkpoint in ``directory`` (older than step ``before`` if given) whose
    files match their checksums, setting each damaged one aside; None when none is left."""
    while True:
        found = durable.checkpoints(directory) if dist.get_rank() == 0 else []
        found = [p for s, p in found if before is None or s < before]
        path = _agreed(found[-1] if found else None)
        if path is None:
            return None
        why = durable.damage(path)
        if why is None:
            try:
                return trainer.restore(path)
            except ProgramError:
                raise
            except Exception as e:  # noqa: BLE001 - a file DCP cannot read is damage, as a bad checksum is
                why = f"it could not be loaded: {_first_line(e)}"
        if dist.get_rank() == 0:
            aside = durable.set_aside(path, durable.DAMAGED)
            print(f"warning: checkpoint {path} is damaged ({why}); set aside as {aside.name}, trying the one "
                  "before it", file=sys.stderr)  # fmt: skip
            log.event({"event": "damaged checkpoint set aside", "checkpoint": str(path), "why": why,
                       "now": str(aside)})  # fmt: skip


# rollbacks within one spike window of each other before the run gives up
MAX_ROLLBACKS = 3


def rollback_before(rollbacks: list[dict], step: int, window: int) -> int:
    """The step a spike at ``step`` rolls back to a checkpoint strictly before: the spike's own,
    or, where the last rollbacks lie within ``window`` steps of it (the same trouble again), the
    oldest checkpoint they went to. Raises after ``MAX_ROLLBACKS`` of those."""
    region = [r for r in rollbacks if step <= r["step"] + window]
    if len(region) >= MAX_ROLLBACKS:
        where = ", ".join(f"step {r['step']} to {r['to_step']}" for r in region)
        raise ProgramError(
            f"step {step}: the loss spiked again after {len(region)} rollbacks ({where}), each skipping its batches: "
            "this is not a passing spike; lower --lr, clip with --max-grad-norm, or raise --spike-zscore"
        )
    return min([step] + [r["to_step"] for r in region])


def _rollback(trainer: Trainer, ckpt, run: Run, step: int, log: StepLog) -> Run | None:
    """A loss spike (or a loss or gradient norm that is not finite) at ``step``: back to the
    newest intact checkpoint strictly before it (one written after the step whose update caused
    the spike would hold that update), skipping the batches read since (PaLM's remedy). A spike
    again within a window of the last one goes further back; after ``MAX_ROLLBACKS`` of those the
    run stops with one line. The abandoned checkpoints are set aside, so that neither a restart
    nor ``--keep`` takes them for the newest. None (train on) when there is no checkpoint before."""
    args = trainer.args
    ckpt.wait()
    before = rollback_before(run.rollbacks, step, args.spike_window)
    back = _restore_intact(trainer, ckpt.directory, before, log)
    if back is None:
        log.event({"event": "loss spike, no checkpoint to roll back to", "step": step, "loss": run.last})
        return None
    if dist.get_rank() == 0:
        for s, p in durable.checkpoints(ckpt.directory):
            if s > back.step:
                log.event({"event": "checkpoint set aside by a rollback", "checkpoint": str(p),
                           "now": str(durable.set_aside(p, durable.ROLLED_BACK))})  # fmt: skip
    dist.barrier()
    end = run.position + args.grad_accum  # past the batches of the spiking step
    back.skipped = [*back.skipped, [back.position, end]]
    back.rollbacks = [*run.rollbacks, {"step": step, "to_step": back.step}]
    log.event(
        {"event": "loss spike: rolled back", "step": step, "loss": run.last, "to_step": back.step,
         "skipped_batches": [back.position, end]}
    )  # fmt: skip
    back.position = end
    return back


@dataclass
class Run:
    """Where training stands: optimizer steps done, global batches read (``position``: a
    rollback skips some, so it can run ahead of the steps), the recent losses (the spike
    guard's window), the batch ranges skipped and the rollbacks made."""

    step: int = 0
    position: int = 0
    window: list[float] = field(default_factory=list)
    skipped: list = field(default_factory=list)
    last: float | None = None
    rollbacks: list = field(default_factory=list)  # {"step": spiking step, "to_step": the checkpoint's}

    def spike(self, loss: float, norm: float, z: float, size: int) -> bool:
        """Whether ``loss`` lies more than ``z`` standard deviations above the window's mean
        (once the window is full), or the loss or the gradient norm is not finite (always)."""
        self.last = loss
        if not (math.isfinite(loss) and math.isfinite(norm)):
            return True
        if len(self.window) < size:
            return False
        w = torch.tensor(self.window, dtype=torch.float64)
        return loss > float(w.mean()) + z * float(w.std())

    def advance(self, loss: float, accum: int, size: int) -> None:
        self.step += 1
        self.position += accum
        self.window = [*self.window, loss][-size:]


class Safeguards:
    """The checkpoint tiers beyond the disk (host-memory snapshots, the mirror) and the watch for
    slow ranks (``runtime.tiers``), at their points of the loop. Every rank calls each method."""

    def __init__(self, args: argparse.Namespace, hosts: list[str], stragglers: tiers.Stragglers | None):
        self.args, self.hosts, self.stragglers = args, hosts, stragglers
        self.snapshots: tiers.HostSnapshots | None = None
        self.mirror: tiers.Mirror | None = None
        self.checkpoints = 0  # disk checkpoints completed by this attempt (``--mirror-every``)
        self.excluded: list[str] = []  # hosts an earlier attempt's --drop-stragglers left out
        self.high = -1  # the furthest step reached (a step at or below it again: a rollback)
        self.blocked_s: list[float] = []  # the step's time per snapshot (host copy, the previous write's wait)

    @classmethod
    def build(cls, args: argparse.Namespace, trainer: Trainer, log: StepLog) -> Safeguards:
        hosts = [None] * dist.get_world_size()
        dist.all_gather_object(hosts, tiers.hostname())
        watch = tiers.Stragglers(args.straggler_factor, args.straggler_window, hosts) if len(hosts) > 1 else None
        return cls(args, hosts, watch)

    def open(self, ckpt: durable.Checkpointer, trainer: Trainer, log: StepLog) -> None:
        """With the checkpoint directory open: the run's snapshot directory, the mirror, and the
        hosts an earlier attempt's ``--drop-stragglers`` left out (said, and where this attempt
        runs on one of them, warned: the launcher decides where ranks run)."""
        args, rank = self.args, dist.get_rank()
        if args.snapshot_every:
            token = tiers.run_token(args.checkpoint_dir) if rank == 0 else None
            key = tiers.snapshot_key(_agreed_text(token), trainer.program.plan_sha256, dist.get_world_size())
            self.snapshots = tiers.HostSnapshots(args.snapshot_dir, key, rank)
        if args.mirror_dir is not None and rank == 0:
            self.mirror = tiers.Mirror(args.mirror_dir, args.keep or None)
            ckpt.finished = self._written
        self.excluded = out = tiers.excluded(args.checkpoint_dir)
        if out:
            here = sorted({r for r, h in enumerate(self.hosts) if h in out})
            log.event({"event": "excluded hosts", "hosts": out, "ranks_on_them": here})
            if rank == 0 and here:
                record = args.checkpoint_dir / tiers.EXCLUDED
                print(f"warning: ranks {here} run on hosts an earlier attempt left out ({', '.join(out)}, "
                      f"{record}): start the job without them", file=sys.stderr)  # fmt: skip

    def _written(self, path: Path) -> None:
        """Rank 0, a disk checkpoint complete: every ``--mirror-every``-th, and the last, go to the mirror."""
        self.checkpoints += 1
        if self.checkpoints % self.args.mirror_every == 0 or durable.step_of(path) == self.args.steps:
            self.mirror.copy(path)

    def snapshot_step(self, log: StepLog) -> int | None:
        """The newest step every rank holds an intact snapshot of, or None; a rank whose newest
        snapshot is missing or damaged where others hold it is said (a ``host-memory snapshot``
        event with each rank's intact steps)."""
        mine = (self.snapshots.intact(), self.snapshots.steps())
        every = [None] * dist.get_world_size()
        dist.all_gather_object(every, mine)
        intact = [e[0] for e in every]
        common = set(intact[0]).intersection(*intact[1:])
        step = max(common, default=None)
        newest = max((s for e in every for s in e[1]), default=None)
        if newest is not None and step != newest:
            lacking = [r for r, steps in enumerate(intact) if newest not in steps]
            log.event({"event": "host-memory snapshot incomplete", "step": newest, "ranks_without_it": lacking,
                       "intact_steps": intact, "using": step})  # fmt: skip
        return step

    def after_step(self, trainer: Trainer, run: Run, log: StepLog, ckpt, fault: Fault | None) -> None:
        args = self.args
        compute = PROGRESS.compute_s()
        if fault is not None:
            fault.measured(compute)
        if self.stragglers is not None and compute is not None:
            mine = torch.tensor([compute], dtype=torch.float64, device=trainer.device)
            every = [torch.zeros_like(mine) for _ in self.hosts]
            dist.all_gather(every, mine)
            for event in self.stragglers.observe(run.step - 1, [float(t) for t in every]):
                # a host left out before that the launcher started this attempt on anyway: ending
                # the attempt again would only restart it there again
                again = event["host"] in self.excluded
                log.event({**event, "already_excluded": True} if again else event)
                if args.drop_stragglers and not again:
                    self._drop(trainer, run, ckpt, event)
        if run.step <= self.high:  # a loss-spike rollback: what the tiers hold past its checkpoint is abandoned
            self._abandon(run.step)
        self.high = run.step
        if self.snapshots is not None and run.step % args.snapshot_every == 0 and run.step < args.steps:
            start = time.perf_counter()
            self.snapshots.save(run.step, trainer.snapshot(run))
            self.blocked_s.append(time.perf_counter() - start)

    def _abandon(self, step: int) -> None:
        """Drop the snapshots of ``step`` and later and set the mirror's checkpoints after ``step - 1``
        aside (``step_N.rolled-back``), as the rollback did on disk: no restart takes them."""
        if self.snapshots is not None:
            self.snapshots.discard_from(step)
        if self.mirror is not None:
            self.mirror.wait()
            for s, p in durable.checkpoints(self.mirror.directory):
                if s >= step:
                    durable.set_aside(p, durable.ROLLED_BACK)

    def _drop(self, trainer: Trainer, run: Run, ckpt, event: dict) -> None:
        """End the attempt for the launcher to restart without the straggler's host: a checkpoint
        of where training stands first, the host recorded in the checkpoint directory."""
        directory = self.args.checkpoint_dir
        if not durable.complete(durable.step_dir(directory, run.step)):
            ckpt.save(*trainer.checkpoint(run))
        ckpt.wait()
        if self.mirror is not None:
            self.mirror.wait()
        if dist.get_rank() == 0:
            tiers.record_excluded(directory, event["host"])
        dist.barrier()
        raise ProgramError(
            f"rank {event['rank']} on host {event['host']} computed {event['factor']:g}x the other ranks' median "
            f"time per step over the last {event['window']} steps (--straggler-factor {event['threshold']:g}): "
            f"--drop-stragglers ends this attempt at step {run.step}, checkpointed; {event['host']} is recorded in "
            f"{directory / tiers.EXCLUDED}: restart the job without it"
        )

    def close(self, log: StepLog) -> None:
        """The run ended: the mirror's last copy finished, this rank's snapshots removed."""
        if self.mirror is not None:
            self.mirror.wait()
            for done in self.mirror.done:
                log.event({"event": "mirrored checkpoint", **done})
        if self.snapshots is not None:
            self.snapshots.wait()
            if self.blocked_s:
                n, writes = len(self.blocked_s), self.snapshots.write_s
                log.event({"event": "host-memory snapshots", "count": n, "bytes": self.snapshots.bytes,
                           "blocked_s": round(sum(self.blocked_s) / n, 6),
                           "write_s": round(sum(writes) / max(1, len(writes)), 6)})  # fmt: skip
            self.snapshots.remove()


class Fault:
    """Fault injection for recovery tests, on a job's first attempt only:
    ``AUTOSHARD_FAULT=kill:RANK:STEP`` SIGKILLs that rank in the middle of that step (after its
    backward, before the optimizer step), ``hang:RANK:STEP`` stops it there for an hour,
    ``lr:0:STEP`` multiplies that step's learning rate by 1000 once (a genuine loss spike on the
    next step), ``nan:RANK:STEP`` turns that rank's first parameter into NaN before the
    step's forward once (weights gone bad), and ``slow:RANK:FACTOR`` makes that rank's forward
    and backward take FACTOR times their time, every step (a sleep of FACTOR - 1 times the
    rank's last measured compute: a slow host)."""

    KINDS = ("kill", "hang", "lr", "nan", "slow")

    def __init__(self, kind: str, rank: int, step: int, factor: float = 1.0):
        self.kind, self.rank, self.step, self.factor = kind, rank, step, factor
        self.fired = False
        self.slept = 0.0  # the sleep in this step's compute (``slow``)
        self.compute_s = 0.0  # this rank's last compute time without the sleep

    def slow_down(self) -> None:
        if self.kind != "slow" or dist.get_rank() != self.rank:
            return
        self.slept = (self.factor - 1) * self.compute_s
        time.sleep(self.slept)

    def measured(self, compute_s: float | None) -> None:
        """This rank's compute time of the step just run (the sleep included)."""
        if compute_s is not None:
            self.compute_s = max(0.0, compute_s - self.slept)

    def learning_rate(self, step: int, lr: float) -> float:
        if self.kind != "lr" or step != self.step or self.fired:
            return lr
        self.fired = True
        return lr * 1000

    def poison(self, step: int, params: list) -> None:
        if self.kind != "nan" or step != self.step or self.fired or dist.get_rank() != self.rank:
            return
        self.fired = True
        with torch.no_grad():
            next(p for p in params if p.is_floating_point()).fill_(float("nan"))

    @classmethod
    def from_env(cls) -> Fault | None:
        spec = os.environ.get("AUTOSHARD_FAULT")
        if not spec or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            return None
        parts = spec.split(":")
        if len(parts) == 3 and parts[0] == "slow" and parts[1].isdigit() and _factor(parts[2]) is not None:
            return cls("slow", int(parts[1]), 0, _factor(parts[2]))
        if len(parts) != 3 or parts[0] not in cls.KINDS or not all(x.isdigit() for x in parts[1:]):
            raise ProgramError(
                f"AUTOSHARD_FAULT={spec!r}: expected KIND:RANK:STEP with KIND one of {', '.join(cls.KINDS)} "
                "and RANK, STEP whole numbers (e.g. kill:1:3), or slow:RANK:FACTOR with FACTOR at least 1; "
                "unset it to train without a fault"
            )
        return cls(parts[0], int(parts[1]), int(parts[2]))

    def __call__(self, step: int) -> None:
        if self.kind not in ("kill", "hang") or step != self.step or dist.get_rank() != self.rank:
            return
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)


def _factor(text: str) -> float | None:
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) and value >= 1 else None


class StepLog:
    """The step's JSON line on stdout (and in ``--log``), a human line on a terminal (stderr),
    and events (resumed, rolled back, checkpoint timings) as JSON lines with an ``event`` key."""

    def __init__(self, path: Path | None, tokens: int = 0, flops: float | None = None, peak: float | None = None):
        self.path = path
        self.tokens = tokens  # per optimizer step
        self.flops = flops * tokens if flops and peak else None  # model FLOPs per step
        self.peak = peak  # all GPUs' peak FLOP/s
        self.tty = sys.stderr.isatty()

    @classmethod
    def of(cls, path: Path | None, plan: Plan, program: Program, accum: int) -> StepLog:
        peak = program.peak_flops
        flops = plan.model.get("training_flops_per_token")
        return cls(path, plan.global_batch * plan.seq_len * accum, flops, peak * plan.gpus if peak else None)

    def step(self, step: int, stats: dict, norm: float, lr: float, extra: dict) -> None:
        seconds = stats["slowest_s"]
        line = {
            "step": step, "loss": stats["loss"], "seconds": stats["seconds"], "grad_norm": norm, "lr": lr,
            "tokens_per_s": self.tokens / seconds if seconds else None,
            "mfu": self.flops / seconds / self.peak if self.flops and seconds else None,
            "peak_memory_gb": stats["peak_memory_gb"], "slowest_rank": stats["slowest_rank"],
            "slowest_s": seconds, **extra,
        }  # fmt: skip
        self.write(line)
        if self.tty:
            mfu = f"  MFU {line['mfu']:.1%}" if line["mfu"] is not None else ""
            print(
                f"step {step:>6d}  loss {line['loss']:.4f}  |g| {norm:.3g}  lr {lr:.3g}  "
                f"{line['tokens_per_s'] or 0:,.0f} tok/s{mfu}  {seconds:.3f} s (rank {stats['slowest_rank']})  "
                f"{stats['peak_memory_gb']:.2f} GB",
                file=sys.stderr,
                flush=True,
            )

    def event(self, line: dict) -> None:
        if dist.get_rank() == 0:
            self.write(line)

    def write(self, line: dict) -> None:
        text = json.dumps(line)
        print(text, flush=True)
        if self.path:
            with open(self.path, "a") as f:
                f.write(text + "\n")


def step_records(text: str) -> list[dict]:
    """The step lines of what a ``StepLog`` wrote (its ``--log`` file or the program's stdout), in
    the order written: the JSON lines with a loss and no ``event`` key. Events (a straggler
    named, a resume, checkpoint timings) share the log and may come at any step."""
    records = (json.loads(line) for line in text.splitlines() if line.startswith("{"))
    return [r for r in records if "loss" in r and "event" not in r]


def peak_memory_gb(device: torch.device) -> float:
    """This process's peak memory: the CUDA caching allocator's on GPUs, the resident set on CPUs."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB on Linux


@dataclass
class Trainer:
    """This rank's part of the plan, ready to step."""

    args: argparse.Namespace
    plan: Plan
    program: Program
    device: torch.device
    ranks: rt.Ranks
    chunk_ids: list[int]  # the pipeline chunks this rank holds
    stages: list[nn.Module]  # one module per chunk
    loss: Callable
    fsdp: bool  # FSDP2 reduces the gradients itself
    ties: list[rt.Tie]  # parameters held as a copy by several chunks (a tied embedding and head)
    params: list[nn.Parameter]
    optim: torch.optim.Optimizer
    schedule: object | None  # the torch.distributed.pipelining schedule; None without a pipeline
    experts: list[nn.Parameter]  # stacked expert weights (gradients summed over the EDP group)
    biases: dict[str, torch.Tensor]  # MoE layer -> routing bias, updated after each step
    zero_group: object  # the dp x cp ranks ZeRO shards over and the dense gradients are reduced over
    reductions: list  # the gradient reductions overlapping the last backward (``rt.gradient_reductions``)
    entries: list[state.Entry] = field(default_factory=list)  # every tensor held, in full-tensor coordinates
    loads: dict = field(default_factory=dict)  # MoE layer -> (max, mean) expert load of the last step
    dropped: int | None = None  # routed rows the capacity dropped in the last step, all ranks
    restored_lr: dict | None = None  # the learning-rate flags of the run whose checkpoint was loaded
    restored_meta: dict | None = None  # the trainer.json of the checkpoint loaded
    # DiLoCo (``runtime.diloco``): this rank's island of ``islands``, the outer optimizer over the
    # island group and the group of this rank's island (None: one island); ``plan`` is then the
    # plan of one island
    island: int = 0
    islands: int = 1
    outer: diloco.OuterStep | None = None
    island_world: object = None

    @property
    def microbatches(self) -> int:
        """Micro-batches per optimizer step: the plan's, times the global batches accumulated."""
        return self.plan.microbatches * self.args.grad_accum

    @classmethod
    def build(cls, args: argparse.Namespace, out: Path, plan: Plan, program: Program, device: torch.device) -> Trainer:
        """The trainer of ``program`` on this rank. Long because it is the program's set-up in
        numbered steps (mesh, chunks, data parallelism, schedule, reductions), each reading the ones
        before."""
        # 1. the device mesh: tp innermost (NVLink), then the plan's order outwards
        moe.set_capacity_factor(args.capacity_factor)
        # a balance loss's gradient is scaled as one micro-batch's loss is before its backward:
        # by 1/micro-batches here without a pipeline, by the schedule after it with one
        microbatches = plan.microbatches * args.grad_accum
        scale = 1.0 if plan.mesh.pp > 1 else 1.0 / microbatches
        moe.set_aux_loss(args.aux_loss, args.aux_alpha, scale)
        islands = diloco.islands_of(plan)
        if islands is not None:  # each island runs the plan at dp/count, over its own ranks
            mesh, ranks, island, island_group, island_world = diloco.build_mesh(plan, device.type)
            plan = diloco.inner_plan(plan)
        else:
            mesh, ranks = rt.build_mesh(plan, device.type)
        experts_mesh = None
        if program.routing:  # MoE layers: the expert-parallel and expert-data-parallel groups
            experts_mesh = rt.build_expert_mesh(plan, device.type, ranks)
        # 2. this rank's pipeline chunks, built on meta and filled with only its own shards
        chunk_ids = rt.chunks_of_rank(plan, ranks.pp)
        full = rt.full_state_from_model(program, args.seed) if args.init_from_model else None
        if args.init_from is not None:
            weights = open_weights(args.init_from)
            stages = rt.build_chunks(
                out, program, chunk_ids, device, ranks, None, args.seed, weights=weights, tied=program.tied
            )
        else:
            stages = rt.build_chunks(out, program, chunk_ids, device, ranks, full, args.seed)
        ties = rt.tied_parameters(plan, program, mesh, stages, chunk_ids)  # one parameter, a copy per chunk
        dtype = rt.autocast(stages, plan, device, args.compute_dtype)
        rt.compile_layers(stages, device, args.compile)  # regional compilation, as the kernel efficiencies assume
        collectives.regather_saved(stages)  # sequence parallelism keeps shards, gathers again in backward
        loss = rt.loss_fn(rt.load_loss(out, program, device))
        # 3. data parallelism at the plan's ZeRO stage (FSDP2 for ZeRO-2/3, optimizer rows sharded
        #    for ZeRO-1, a gradient all-reduce for ZeRO-0), and AdamW; in bf16 the parameters are
        #    bf16 with fp32 gradients and fp32 masters (the optimizer's, or FSDP2's shards)
        experts = rt.expert_parameters(stages)  # stacked expert weights: replicas over the EDP ranks
        rt.lower_parameters(rt.held_whole(stages, plan, experts), dtype)
        edp_mesh = experts_mesh["edp"] if experts_mesh is not None else None
        fsdp = rt.shard_data_parallel(stages, plan, mesh, experts, dtype, edp_mesh)
        experts = rt.expert_parameters(stages)  # (FSDP2's shards where it shards them)
        params = [p for m in stages for p in m.parameters()]
        zero_group = rt.zero_mesh(plan, mesh).get_group()  # ZeRO shards over dp x cp, as planned
        fsdp_experts = rt.shards_experts(plan)
        optim = rt.optimizer(
            params, plan.zero_stage, zero_group, args.lr, args.weight_decay, args.adam_eps, experts, fsdp_experts,
            getattr(args, "optimizer", "adamw"),
        )  # fmt: skip
        # 4. the plan's pipeline schedule (torch.distributed.pipelining) over the chunks
        schedule = None
        if plan.mesh.pp > 1:
            schedule = rt.pipeline_schedule(
                plan, stages, ranks, device, microbatches, loss, out, program, args.compute_dtype
            )
        # 5. the data-parallel gradient reductions not left to FSDP2, started in buckets during the
        #    step's last backward (the pipeline schedule divides by the micro-batches: they do it
        #    for the gradients they start early)
        scale = microbatches if schedule is not None else 1
        reductions = rt.gradient_reductions(stages, plan, optim, zero_group, experts, ties, not fsdp, scale)
        biases = rt.routing_biases(stages)
        held = state.entries(stages, chunk_ids, ranks, program.tied)
        state.use_stepped(held, optim)  # bf16 masters, ZeRO-1's rows: what checkpoints and the norm count
        trainer = cls(
            args, plan, program, device, ranks, chunk_ids, stages, loss, fsdp, ties, params, optim, schedule,
            experts, biases, zero_group, reductions, held,
        )  # fmt: skip
        if getattr(args, "optimizer", "adamw") == "lamb":  # trust ratios of whole tensors, counted as the norm is
            optim.trust_norms = functools.partial(
                state.trust_norms, held, optim, keys=program.state_dict_keys, replicated=trainer.replicated
            )
        if islands is not None:
            trainer.island, trainer.islands, trainer.island_world = island, islands.count, island_world
            share = zero_group if plan.zero_stage == 0 else None  # ZeRO-0's replicas split the outer all-reduce
            trainer.outer = diloco.OuterStep(islands, held, island_group, island, share)
        return trainer

    def expert_load(self) -> dict:
        """The last step's expert imbalance per MoE layer (max load / mean load over every rank
        routing it), and the rows dropped by capacity, for the step's log line."""
        if not self.loads:
            return {}
        out = {"expert_load": {k: round(mx / mean, 4) if mean else 0.0 for k, (mx, mean) in self.loads.items()}}
        return out if self.dropped is None else {**out, "dropped_tokens": self.dropped}

    def island_traffic(self) -> dict:
        """For the step's log line, the bytes this rank has handed so far to the all-reduce between
        DiLoCo islands (``island_bytes``) and to the data-parallel gradient all-reduce (``dp_bytes``,
        where the program runs one: ZeRO-0)."""
        dp = sum(getattr(r, "sent_bytes", 0) for r in self.reductions)
        out = {"dp_bytes": dp} if dp else {}
        return out if self.outer is None else {**out, "island_bytes": self.outer.sent_bytes}

    @property
    def prints(self) -> bool:
        """This rank writes the step's line: the reporting rank of the first island."""
        return self.reports and self.island == 0

    @property
    def replicated(self) -> bool:
        """Every rank holds every gradient whole and, once reduced, the same (data and context
        parallelism alone, ZeRO-0): the gradient norm needs no collective."""
        mesh = self.plan.mesh
        return self.plan.zero_stage == 0 and mesh.tp == mesh.pp == mesh.ep == 1

    @property
    def first(self) -> bool:
        """This rank holds the first chunk (it feeds the tokens in)."""
        return 0 in self.chunk_ids

    @property
    def last(self) -> bool:
        """This rank holds the last chunk (it computes the loss)."""
        return self.plan.mesh.pp * self.plan.virtual_stages - 1 in self.chunk_ids

    @property
    def reports(self) -> bool:
        """This rank prints the step's line: one of the ranks that hold the loss, once per step."""
        r = self.ranks
        return self.last and r.dp == 0 and r.tp == 0 and r.cp == 0

    def tokens(self, position: int) -> torch.Tensor:
        """This data-parallel rank's rows of the global batches at data positions ``position`` to
        ``position + grad_accum``, one after the other."""
        plan, args = self.plan, self.args
        rows = plan.microbatches * plan.microbatch_size  # sequences per data-parallel rank per batch
        first = (self.island * plan.mesh.dp + self.ranks.dp) * rows  # (islands: dp coordinate's outer part)
        batches = [
            data.batch_rows(
                index,
                plan.global_batch * self.islands,
                plan.seq_len,
                self.program.vocab,
                args.seed,
                args.data,
                first,
                first + rows,
            )  # fmt: skip
            for index in range(position, position + args.grad_accum)
        ]
        return torch.cat(batches).to(self.device)

    def step(self, step: int, position: int | None = None, fault: Fault | None = None) -> tuple[float | None, float]:
        """One optimizer step on the global batches at data ``position`` (default: ``step``):
        the mean loss over them on the ranks holding the last chunk (``None`` on the others),
        and the global gradient norm before clipping."""
        tokens = self.tokens(step if position is None else position)
        self.optim.zero_grad(set_to_none=True)
        PROGRESS.mark(step, 0)
        if fault is not None:
            fault.poison(step, self.params)
            fault.slow_down()
        losses: list[torch.Tensor] = []
        if self.schedule is not None:
            # (the last chunk's outputs are not kept for the step's return: m logits of the vocabulary)
            kwargs = {"target": tokens, "losses": losses, "return_outputs": False} if self.last else {}
            self.schedule.step(tokens, **kwargs) if self.first else self.schedule.step(**kwargs)
        else:
            m = self.microbatches
            for i, mb in enumerate(tokens.split(self.plan.microbatch_size)):
                if i == m - 1:  # the last backward: its gradients are final, their reductions start
                    for r in self.reductions:
                        r.arm()
                value = self.loss(self.stages[0](mb), mb)
                (value / m).backward()
                losses.append(value.detach())
        PROGRESS.mark(step, 1)
        rt.sum_partial_gradients(self.stages)  # sequence parallel: norms saw 1/tp of the tokens
        dp = self.plan.mesh.dp
        if not self.fsdp:
            # one parameter: its copies' gradients add up (Megatron's embedding group), before the
            # data-parallel reduction, which under ZeRO-1 reduces rows onto their ranks only
            rt.sum_tied_gradients(self.ties)
        # dense weights (unless FSDP reduces them over dp x cp itself, in backward): summed over
        # dp x cp (each CP rank holds its share of every sequence's mean), averaged over the dp
        # replicas, all-reduced or under ZeRO-1 reduce-scattered onto the rows each rank steps;
        # experts (unless FSDP shards them): summed over the ranks holding the same ones, divided
        # by dp. Started during the backward; here the late ones start and all are waited for.
        for r in self.reductions:
            r.finish()
        if self.fsdp:
            rt.sum_tied_gradients(self.ties)
        norm = state.clip_gradients(self.entries, self.args.max_grad_norm, self.replicated, self.island_world)
        if fault is not None:
            fault(step)
        if not math.isfinite(norm) and not fake.active():  # (the same norm on every rank: all skip) the caller decides
            self.optim.zero_grad(set_to_none=True)
            return (mean_loss(losses, dp) if self.last else None), norm
        PROGRESS.mark(step, 2)
        self.optim.step()
        if self.outer is not None and self.outer.due(step):  # DiLoCo: the islands sync
            self.outer()
            state.write_back(self.optim)  # the synced masters rounded into the parameters
        fp8.new_step()  # the weights changed: their FP8 copies are made again next step
        if self.program.routing:  # MoE: routing biases nudged toward balance, loads for the log
            self.loads = moe.update_biases(self.biases, self.args.balance_gamma)
            if self.args.capacity_factor is not None:
                self.dropped = dropped_everywhere()
        return (mean_loss(losses, dp) if self.last else None), norm

    def set_lr(self, lr: float) -> None:
        for o in getattr(self.optim, "parts", [self.optim]):
            for group in o.param_groups:
                group["lr"] = lr

    def gather_stats(self, loss: float | None, seconds: float) -> dict:
        """The step's loss (which the ranks holding the last chunk know) on every rank, and the
        slowest rank's step time and the largest peak memory, in one all-gather."""
        mine = torch.tensor([loss if self.reports else 0.0, float(self.reports), seconds, peak_memory_gb(self.device)])
        every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(every, mine)
        table = torch.stack(every).double()
        slowest = int(table[:, 2].argmax())
        return {
            "loss": float((table[:, 0] * table[:, 1]).sum() / table[:, 1].sum()),
            "seconds": seconds,
            "slowest_rank": slowest,
            "slowest_s": float(table[slowest, 2]),
            "peak_memory_gb": round(float(table[:, 3].max()), 3),
        }

    # -- checkpoints ----------------------------------------------------------------------

    def checkpoint(self, run: Run) -> tuple[dict, dict]:
        """What a checkpoint after ``run.step`` steps holds, as a DCP state dict (copies: the
        step goes on while it is written) and ``trainer.json``'s fields."""
        copy = not self.args.checkpoint_sync  # a background write needs copies; one in the step, views
        out = state.model_state(self.entries, copy, save=True)
        out.update(state.optim_state(self.entries, self.optim, copy))
        if self.outer is not None:  # DiLoCo: each island's own, and the outer state
            out = {**diloco.island_keys(out, self.island), **self.outer.state(copy)}
        out[f"rng/{dist.get_rank()}"] = state.object_state(state.rng_state())
        args, plan = self.args, self.plan
        meta = {
            "format": state.FORMAT, "step": run.step, "position": run.position,
            "samples": run.position * plan.global_batch * self.islands, "window": run.window, "skipped": run.skipped,
            "rollbacks": run.rollbacks,
            "seed": args.seed, "global_batch": plan.global_batch * self.islands, "seq_len": plan.seq_len,
            "grad_accum": args.grad_accum,
            "lr": {"lr": args.lr, "schedule": args.lr_schedule, "warmup": args.warmup, "min_lr": args.min_lr,
                   "steps": schedule_end(args)},
            "optimizer": getattr(args, "optimizer", "adamw"),
            "plan_sha256": self.program.plan_sha256, "gpus": plan.gpus, "model": plan.model.get("name"),
            "mesh": plan.mesh.degrees(), "zero_stage": plan.zero_stage,
            "tied": [list(e.names) for e in self.program.tied],
            "state_dict_keys": list(self.program.state_dict_keys),
            "time": time.time(),
        }  # fmt: skip
        return out, meta

    def snapshot(self, run: Run) -> dict:
        """This rank's state after ``run.step`` steps, copied to the host: what a disk checkpoint
        holds of it, as this rank holds it (``state.local_state``), for ``runtime.tiers``."""
        held = state.local_state(self.entries, self.optim)
        meta = {
            "step": run.step, "position": run.position, "window": run.window, "skipped": run.skipped,
            "rollbacks": run.rollbacks, "seed": self.args.seed, "seq_len": self.plan.seq_len,
            "lr": {"lr": self.args.lr, "schedule": self.args.lr_schedule, "warmup": self.args.warmup,
                   "min_lr": self.args.min_lr, "steps": self.args.steps},
            "plan_sha256": self.program.plan_sha256, "gpus": self.plan.gpus, "time": time.time(),
        }  # fmt: skip
        tensors = {k: v.detach().to("cpu", copy=True) for k, v in held.items()}
        return {"meta": meta, "tensors": tensors, "rng": state.rng_state()}

    def restore_snapshot(self, payload: dict | None) -> Run | None:
        """Load a host-memory snapshot (every rank its own); None on every rank, nothing loaded,
        where any rank's does not fit this plan."""
        fits = payload is not None and payload["meta"].get("plan_sha256") == self.program.plan_sha256
        if fits:
            saved = payload["tensors"]
            model = state.local_state(self.entries, self.optim)
            names = {k for k in saved if "/model/" in k}
            fits = names == set(model) and all(saved[k].shape == model[k].shape for k in names)
        flag = torch.tensor([int(fits)], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not int(flag):
            return None
        held = state.local_state(self.entries, self.optim, create=any("/optim/" in k for k in saved))
        if held.keys() != saved.keys():
            raise ProgramError("a host-memory snapshot does not match this rank's optimizer states; remove it")
        with torch.no_grad():
            for k, t in held.items():
                t.copy_(saved[k])
        state.write_back(self.optim)
        state.set_rng_state(payload["rng"])
        meta = payload["meta"]
        self.restored_lr, self.restored_meta = meta.get("lr"), meta
        return Run(meta["step"], meta["position"], list(meta["window"]), list(meta["skipped"]),
                   rollbacks=list(meta["rollbacks"]))  # fmt: skip

    def _check_compatible(self, path: Path, meta: dict) -> dict:
        """The checkpoint holds this model: every tensor this rank needs, at its full shape."""
        saved = state.saved_keys(path)
        if self.outer is not None:  # DiLoCo: this island's keys
            saved = diloco.own_keys(saved, self.island)
        for e in self.entries:
            key = f"model/{e.held.key}"
            if key not in saved:
                raise ProgramError(
                    f"checkpoint {path} has no {e.held.key}: it was written for another model "
                    f"({meta.get('model')}); point --checkpoint-dir at this model's checkpoints"
                )
            if saved[key] != e.held.shape:
                raise ProgramError(
                    f"checkpoint {path}: {e.held.key} is {saved[key]} there but {e.held.shape} in this model; "
                    "it was written for another configuration of the model"
                )
            stepped = meta["step"] > 0 and isinstance(e.param, nn.Parameter)
            if stepped and f"optim/exp_avg/{e.held.key}" not in saved:
                raise ProgramError(f"checkpoint {path} has no optimizer state for {e.held.key}; it is incomplete")
        return saved

    def restore(self, path: Path) -> Run:
        """Load checkpoint ``path`` into this rank's parameters, optimizer states and routing
        biases (whatever plan wrote it), and its RNG state when this same plan did; returns
        where training stands."""
        meta = json.loads((path / "trainer.json").read_text())
        self.restored_lr, self.restored_meta = meta.get("lr"), meta
        if meta.get("format") != state.FORMAT:
            raise ProgramError(f"checkpoint {path}: format {meta.get('format')}, this program reads {state.FORMAT}")
        saved = self._check_compatible(path, meta)
        passes = state.load_targets(self.entries, self.optim, saved)
        if self.outer is not None:
            passes = self.outer.load_passes(passes, saved, state.saved_keys(path))
        same_plan = meta.get("plan_sha256") == self.program.plan_sha256 and meta["gpus"] == self.plan.gpus
        rng_key = f"rng/{dist.get_rank()}"
        if same_plan:
            passes[0][rng_key] = io.BytesIO()
        with torch.no_grad():
            state.load(path, passes)
        state.write_back(self.optim)  # loaded into fp32 masters: round them into the parameters
        if self.outer is not None and not self.outer.restored:  # a checkpoint without islands
            self.outer.reset()
        if same_plan:
            buf = passes[0][rng_key]
            buf.seek(0)
            state.set_rng_state(torch.load(buf, weights_only=False))
        samples = samples_at(meta, self.plan.seq_len, path)
        batch = self.plan.global_batch * self.islands  # (islands: all of them)
        if samples % batch:
            raise ProgramError(
                f"checkpoint {path} read {samples} sequences, not a whole number of this plan's global batches "
                f"of {batch}; recompile with a global batch that divides it"
            )
        return Run(meta["step"], samples // batch, list(meta.get("window", [])),
                   list(meta.get("skipped", [])), rollbacks=list(meta.get("rollbacks", [])))  # fmt: skip


def samples_at(meta: dict, seq_len: int, path: Path) -> int:
    """The sequences a checkpoint's run read, counted in sequences of ``seq_len``: a checkpoint
    written at another sequence length (the stage before in a long-context ramp) read the same
    tokens as ``samples * its seq_len / seq_len`` sequences of this length, so the data position
    carries the tokens read over."""
    samples, then = meta["samples"], meta.get("seq_len") or seq_len
    if samples * then % seq_len:
        raise ProgramError(
            f"checkpoint {path} read {samples} sequences of {then} tokens, not a whole number of sequences of "
            f"{seq_len}; resume at a sequence length that divides the tokens it read"
        )
    return samples * then // seq_len


def lr_flags_changed(saved: dict | None, args: argparse.Namespace) -> dict:
    """The learning-rate flags (``--lr``, ``--lr-schedule``, ``--warmup``, ``--min-lr``,
    ``--steps``) whose value differs from the run that wrote a checkpoint (its ``trainer.json``'s
    ``lr``): flag -> (then, now). Empty when they agree or the checkpoint does not say."""
    now = {"lr": args.lr, "schedule": args.lr_schedule, "warmup": args.warmup, "min_lr": args.min_lr}
    if args.lr_schedule != "constant":  # only a decay reads the last step (running on is no change)
        now["steps"] = schedule_end(args)
    flags = {"schedule": "lr_schedule"}
    return {flags.get(k, k): (saved[k], v) for k, v in now.items() if saved and k in saved and saved[k] != v}


def data_flags_changed(meta: dict | None, args: argparse.Namespace, plan: Plan) -> dict:
    """What decides the batches (``--seed``, ``--data``, the sequence length) where it differs
    from the run that wrote a checkpoint: name -> (then, now)."""
    if not meta:
        return {}
    now = {"--seed": args.seed, "sequence length": plan.seq_len}
    then = {"--seed": meta.get("seed"), "sequence length": meta.get("seq_len")}
    return {k: (then[k], v) for k, v in now.items() if then[k] is not None and then[k] != v}


def dropped_everywhere() -> int:
    """Routed rows dropped by the capacity since the last call, summed over every rank."""
    count = torch.tensor([moe.dropped_tokens(reset=True)], dtype=torch.long)
    if dist.is_initialized():
        dist.all_reduce(count)
    return int(count)


def mean_loss(losses: list[torch.Tensor], dp: int) -> float:
    """The mean over the global batch of the micro-batch losses of ``dp`` data-parallel replicas,
    each replica's loss split over its context-parallel ranks (each holds its share of the
    sequence mean). Every rank of those groups takes part."""
    mean = torch.stack([x.detach().float() for x in losses]).mean()
    cp, dp_group = groups.cp_group(), groups.dp_group()
    if cp is not None:
        dist.all_reduce(mean, group=cp)
    if dist.get_world_size(dp_group) > 1:  # (one replica: nothing to add, no collective in the step)
        dist.all_reduce(mean, group=dp_group)
    return fake.value(mean) / dp
