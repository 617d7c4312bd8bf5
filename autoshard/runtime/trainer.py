"""The training program. An emitted ``train.py`` is a launcher that calls ``main`` with its own
directory, which holds ``plan.json``, ``program.json`` and the stage files they name; the program is
the same for every plan and reads everything plan-specific from there.

``main`` sets up the process group (NCCL on GPUs, gloo on CPUs) and tears it down; ``Trainer.build``
puts this rank's part of the plan together (mesh, pipeline chunks, precision, data parallelism at
the plan's ZeRO stage, AdamW, the pipeline schedule); ``Trainer.step`` runs one optimizer step;
``train`` loops over the steps and prints one JSON line per step (``{"step", "loss", "seconds"}``).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from autoshard.runtime import groups, moe
from autoshard.runtime import program as rt


def parse_args(argv: list[str] | None = None, description: str | None = None) -> argparse.Namespace:
    """The program's command line (``argv`` defaults to ``sys.argv[1:]``)."""
    p = argparse.ArgumentParser(
        prog="train.py", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--steps", type=int, default=10, help="optimizer steps")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--adam-eps", type=float, default=1e-8)
    p.add_argument("--seed", type=int, default=0, help="initialisation and data seed")
    p.add_argument("--data", type=Path, help="token file (int32 ids); default: synthetic tokens")
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
    p.add_argument("--loss-log", type=Path, help="append one JSON line per step here")
    p.add_argument("--save-params", type=Path, help="save each rank's parameters here after the last step")
    p.add_argument("--timeout", type=float, default=300, help="seconds a collective may wait before failing")
    p.add_argument(
        "--compute-dtype",
        choices=["auto", "fp32", "bf16"],
        default="auto",
        help="auto: the plan's precision on GPUs (bf16 autocast over fp32 master weights), fp32 on CPUs",
    )
    return p.parse_args(argv)


def main(out: Path, argv: list[str] | None = None, description: str | None = None) -> None:
    """Train the program in directory ``out`` on the processes torchrun started."""
    args = parse_args(argv, description)
    plan, program = rt.read_json(out / "plan.json"), rt.read_json(out / "program.json")
    rt.check_program(out, plan, program)
    rt.check_world(plan)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=args.timeout))
    train(args, out, plan, program, device)
    # FSDP2's and the pipeline schedule's state form reference cycles, so they outlive train()
    # until the next collection. Free them now, while their process groups are alive, rather
    # than during interpreter shutdown, where tearing down gloo work that still holds tensors
    # can abort the process.
    gc.collect()
    # every rank finishes its collectives (FSDP's last ones included) before the group goes away
    dist.barrier()
    groups.set_groups(tp=None, pp=None, dp=None, cp=None, ep=None, edp=None, route=None)
    dist.destroy_process_group()


def train(args: argparse.Namespace, out: Path, plan: dict, program: dict, device: torch.device) -> None:
    trainer = Trainer.build(args, out, plan, program, device)
    for step in range(args.steps):
        start = time.perf_counter()
        loss = trainer.step(step)
        if loss is not None and trainer.reports:
            record(step, loss, time.perf_counter() - start, args.loss_log, trainer.expert_load())
    if args.save_params:
        rt.save_parameters(args.save_params, trainer.stages, trainer.ranks, trainer.chunk_ids, program.get("tied", []))


def record(step: int, loss: float, seconds: float, log: Path | None = None, extra: dict | None = None) -> dict:
    """Print the step's JSON line (and append it to ``log``), with ``extra`` fields."""
    line = {"step": step, "loss": loss, "seconds": seconds, **(extra or {})}
    print(json.dumps(line), flush=True)
    if log:
        with open(log, "a") as f:
            f.write(json.dumps(line) + "\n")
    return line


@dataclass
class Trainer:
    """This rank's part of the plan, ready to step."""

    args: argparse.Namespace
    plan: dict
    program: dict
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
    loads: dict = field(default_factory=dict)  # MoE layer -> (max, mean) expert load of the last step
    dropped: int | None = None  # routed rows the capacity dropped in the last step, all ranks

    @classmethod
    def build(cls, args: argparse.Namespace, out: Path, plan: dict, program: dict, device: torch.device) -> Trainer:
        # 1. the device mesh: tp innermost (NVLink), then the plan's order outwards
        moe.set_capacity_factor(args.capacity_factor)
        # a balance loss's gradient is scaled as one micro-batch's loss is before its backward:
        # by 1/micro-batches here without a pipeline, by the schedule after it with one
        scale = 1.0 if plan["mesh"]["pp"] > 1 else 1.0 / plan["microbatches"]
        moe.set_aux_loss(args.aux_loss, args.aux_alpha, scale)
        mesh, ranks = rt.build_mesh(plan, device.type)
        if program.get("routing"):  # MoE layers: the expert-parallel and expert-data-parallel groups
            rt.build_expert_mesh(plan, device.type, ranks)
        # 2. this rank's pipeline chunks, built on meta and filled with only its own shards
        chunk_ids = rt.chunks_of_rank(plan, ranks.pp)
        full = rt.full_state_from_model(program, args.seed) if args.init_from_model else None
        stages = rt.build_chunks(out, program, chunk_ids, device, ranks, full, args.seed)
        ties = rt.tied_parameters(plan, program, mesh, stages, chunk_ids)  # one parameter, a copy per chunk
        rt.autocast(stages, plan, device, args.compute_dtype)  # bf16 compute; parameters and gradients stay fp32
        loss = rt.loss_fn(rt.load_loss(out, program, device))
        # 3. data parallelism at the plan's ZeRO stage (FSDP2 for ZeRO-2/3, ZeroRedundancyOptimizer
        #    for ZeRO-1, a gradient all-reduce for ZeRO-0), and AdamW
        experts = rt.expert_parameters(stages)  # stacked expert weights: replicas over the EDP ranks
        fsdp = rt.shard_data_parallel(stages, plan, mesh, experts)
        params = [p for m in stages for p in m.parameters()]
        zero_group = rt.zero_mesh(plan, mesh).get_group()  # ZeRO shards over dp x cp, as planned
        optim = rt.optimizer(params, plan["zero_stage"], zero_group, args.lr, args.weight_decay, args.adam_eps, experts)
        # 4. the plan's pipeline schedule (torch.distributed.pipelining) over the chunks
        schedule = None
        if plan["mesh"]["pp"] > 1:
            schedule = rt.pipeline_schedule(plan, stages, ranks, device, plan["microbatches"], loss)
        biases = rt.routing_biases(stages)
        return cls(
            args, plan, program, device, ranks, chunk_ids, stages, loss, fsdp, ties, params, optim, schedule,
            experts, biases,
        )  # fmt: skip

    def expert_load(self) -> dict:
        """The last step's expert imbalance per MoE layer (max load / mean load over every rank
        routing it), and the rows dropped by capacity, for the step's log line."""
        if not self.loads:
            return {}
        out = {"expert_load": {k: round(mx / mean, 4) if mean else 0.0 for k, (mx, mean) in self.loads.items()}}
        return out if self.dropped is None else {**out, "dropped_tokens": self.dropped}

    @property
    def first(self) -> bool:
        """This rank holds the first chunk (it feeds the tokens in)."""
        return 0 in self.chunk_ids

    @property
    def last(self) -> bool:
        """This rank holds the last chunk (it computes the loss)."""
        return self.plan["mesh"]["pp"] * self.plan["virtual_stages"] - 1 in self.chunk_ids

    @property
    def reports(self) -> bool:
        """This rank prints the step's line: one of the ranks that hold the loss, once per step."""
        r = self.ranks
        return self.last and r.dp == 0 and r.tp == 0 and r.cp == 0

    def tokens(self, step: int) -> torch.Tensor:
        """This data-parallel rank's rows of the step's global batch."""
        plan, args = self.plan, self.args
        rows = plan["microbatches"] * plan["microbatch_size"]  # sequences per data-parallel rank per step
        batch = rt.global_batch(
            step, plan["global_batch"], plan["seq_len"], self.program["vocab"], args.seed, args.data
        )
        return batch[self.ranks.dp * rows : (self.ranks.dp + 1) * rows].to(self.device)

    def step(self, step: int) -> float | None:
        """One optimizer step; the mean loss over the global batch on the ranks holding the last
        chunk, ``None`` on the others."""
        tokens = self.tokens(step)
        self.optim.zero_grad(set_to_none=True)
        losses: list[torch.Tensor] = []
        if self.schedule is not None:
            kwargs = {"target": tokens, "losses": losses} if self.last else {}
            self.schedule.step(tokens, **kwargs) if self.first else self.schedule.step(**kwargs)
        else:
            m = self.plan["microbatches"]
            for mb in tokens.split(self.plan["microbatch_size"]):
                value = self.loss(self.stages[0](mb), mb)
                (value / m).backward()
                losses.append(value.detach())
        rt.sum_partial_gradients(self.stages)  # sequence parallel: norms saw 1/tp of the tokens
        expert_ids = {id(p) for p in self.experts}
        if not self.fsdp:  # (FSDP reduces over dp x cp itself)
            dense = [p for p in self.params if id(p) not in expert_ids]
            rt.sum_context_parallel_gradients(dense)  # context parallel: each rank saw 2/(2cp) of each sequence
            rt.average_gradients(dense, groups.dp_group())
        rt.reduce_expert_gradients(self.experts, self.plan["mesh"]["dp"])  # summed over the ranks holding them
        rt.sum_tied_gradients(self.ties)  # one parameter: its copies' gradients add up (Megatron's embedding group)
        self.optim.step()
        if self.program.get("routing"):  # MoE: routing biases nudged toward balance, loads for the log
            self.loads = moe.update_biases(self.biases, self.args.balance_gamma)
            if self.args.capacity_factor is not None:
                self.dropped = dropped_everywhere()
        return mean_loss(losses, self.plan["mesh"]["dp"]) if self.last else None


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
    if groups.cp_group() is not None:
        dist.all_reduce(mean, group=groups.cp_group())
    dist.all_reduce(mean, group=groups.dp_group())
    return mean.item() / dp
