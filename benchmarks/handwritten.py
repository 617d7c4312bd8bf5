"""Hand-written torch.distributed training of examples/llama3.py, for benchmarks/emit.py to
compare the emitted program against. Same model, data, micro-batching and AdamW as the emitted
program of the same plan; what a person would write by hand with the standard tools:

    torchrun --nproc-per-node 4 benchmarks/handwritten.py --mode dp --plan OUT/plan.json --steps 20
    torchrun --nproc-per-node 2 benchmarks/handwritten.py --mode pp --plan OUT/plan.json --steps 20

--mode dp: DistributedDataParallel (no_sync on all but the last micro-batch).
--mode pp: the model cut by hand into two stages, torch.distributed.pipelining Schedule1F1B.
Both clip the gradients by their global norm and (DP) average the loss over the replicas, as a
training loop does and the emitted program does. Both keep the memory a step frees for the next
(``autoshard.runtime.host``, the CPU's stand-in for a caching allocator), so the comparison is of
the programs, not of their allocators. Prints one JSON line per step with its wall time.
"""

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import llama3  # noqa: E402

MAX_GRAD_NORM = 1.0  # the emitted program runs with --max-grad-norm the same

from autoshard.capture import causal_lm_loss  # noqa: E402
from autoshard.runtime.host import keep_freed_memory  # noqa: E402
from autoshard.runtime.program import global_batch  # noqa: E402


class First(nn.Module):
    def __init__(self, model, layers):
        super().__init__()
        self.embed, self.layers = model.embed, nn.ModuleList(model.layers[:layers])

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return x


class Last(nn.Module):
    def __init__(self, model, layers):
        super().__init__()
        self.layers, self.norm, self.output = nn.ModuleList(model.layers[layers:]), model.norm, model.output

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=["dp", "pp"], required=True)
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    plan = json.loads(args.plan.read_text())
    keep_freed_memory()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = llama3.build(plan["model"]["name"].split(":")[1])
    m, mbs, seq, batch = plan["microbatches"], plan["microbatch_size"], plan["seq_len"], plan["global_batch"]
    vocab = plan["model"]["vocab"]
    if args.mode == "dp":
        net = nn.parallel.DistributedDataParallel(model)
        params = list(net.parameters())
    else:
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B

        half = len(model.layers) // 2
        part = First(model, half) if rank == 0 else Last(model, half)
        stage = PipelineStage(part, rank, world, torch.device("cpu"))
        schedule = Schedule1F1B(stage, m, loss_fn=lambda out, tokens: causal_lm_loss(out, tokens))
        params = list(part.parameters())
    optim = torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    dp_rank = rank if args.mode == "dp" else 0
    rows = m * mbs
    for step in range(args.steps):
        start = time.perf_counter()
        tokens = global_batch(step, batch, seq, vocab, 0)[dp_rank * rows : (dp_rank + 1) * rows]
        optim.zero_grad(set_to_none=True)
        loss = torch.zeros(())
        if args.mode == "dp":
            for i, mb in enumerate(tokens.split(mbs)):
                if i < m - 1:
                    with net.no_sync():
                        value = causal_lm_loss(net(mb), mb) / m
                        value.backward()
                else:
                    value = causal_lm_loss(net(mb), mb) / m
                    value.backward()
                loss += value.detach()
        else:
            losses = []
            if rank == 0:
                schedule.step(tokens)
            else:
                # (the logits are not kept for the step's return: the emitted trainer does not keep them either)
                schedule.step(target=tokens, losses=losses, return_outputs=False)
        # what a training loop does besides (and the emitted one does): clip the gradients by their
        # global norm, and average the loss over the data-parallel replicas for its log line
        if args.mode == "dp":
            nn.utils.clip_grad_norm_(params, MAX_GRAD_NORM)
        else:  # the global norm: each stage's squares summed over the stages
            square = torch.stack([p.grad.norm() ** 2 for p in params if p.grad is not None]).sum()
            dist.all_reduce(square)
            coef = MAX_GRAD_NORM / (float(square.sqrt()) + 1e-6)
            if coef < 1:
                for p in params:
                    if p.grad is not None:
                        p.grad.mul_(coef)
        if args.mode == "dp":
            dist.all_reduce(loss)  # (gloo has no average: the sum, then divided)
            loss /= world
        optim.step()
        if rank == world - 1:
            print(json.dumps({"step": step, "seconds": time.perf_counter() - start}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
