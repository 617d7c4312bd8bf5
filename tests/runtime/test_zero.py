"""ZeRO-1's sharded AdamW (``runtime/zero.py``): the dimension each parameter's rows are split
along, where a checkpoint finds each rank's rows in the full tensor, and one step over 4 gloo
ranks against ``torch.optim.AdamW`` on the summed gradients, with every rank holding its share of
the states (a stack with fewer experts than ranks too)."""

import pytest
import torch
from torch import nn

from autoshard.runtime.stages import Block, restrict_rows
from autoshard.runtime.zero import ShardedAdamW, split_dim
from tests.distributed import run

SHAPES = [(16, 6), (1, 8, 5), (3, 12, 2), (5,), ()]


@pytest.mark.parametrize(
    "shape, size, dim",
    [
        ((4096, 512), 8, 0),  # a weight the group divides: by rows, as before
        ((1, 6144, 16384), 8, 1),  # one local expert over 8 ranks: the stack's rows
        ((2, 6144, 16384), 8, 1),
        ((8, 64, 32), 8, 0),
        ((5, 64), 4, 1),  # 5 rows over 4 ranks leave one rank 2/5; 64 columns split evenly
        ((7,), 4, 0),
        ((), 4, 0),
    ],
)
def test_rows_go_along_the_dimension_that_leaves_the_largest_rank_least(shape, size, dim):
    assert split_dim(shape, size) == dim


def test_restricted_blocks_along_a_later_dimension():
    piece = [Block((0, 0, 0), (3, 0, 0), (1, 8, 5))]
    assert restrict_rows(piece, 2, 6, dim=1) == [Block((0, 0, 0), (3, 2, 0), (1, 4, 5))]
    assert restrict_rows(piece, 8, 10, dim=1) == []


def _step(rank: int, world: int) -> dict:
    import torch.distributed as dist

    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(s)) for s in SHAPES]
    opt = ShardedAdamW(params, dist.group.WORLD, lr=0.1, weight_decay=0.01)
    for p in params[:-1]:  # what a checkpoint writes of this rank's rows: the blocks of the full tensor
        whole = [Block((0,) * p.dim(), (0,) * p.dim(), tuple(p.shape))]
        for b in restrict_rows(whole, *opt.rows_of(p)):
            piece = p.detach()[tuple(slice(f, f + n) for f, n in zip(b.full, b.sizes))]
            mine = opt.master(p)[tuple(slice(lo, lo + n) for lo, n in zip(b.local, b.sizes))]
            assert torch.equal(piece, mine), (tuple(p.shape), b)
    gen = torch.Generator().manual_seed(rank + 1)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.reduce_gradients(divide=world)
    opt.step()
    held = sum(m.numel() for m in opt.masters.values())
    moments = sum(s["exp_avg"].numel() for s in opt.state.values())
    return {"params": [p.detach().clone() for p in params], "held": held, "moments": moments}


def test_one_step_is_adamw_on_the_mean_gradient_with_states_shared_out():
    world = 4
    got = run(_step, world, timeout=120)
    torch.manual_seed(0)
    ref = [nn.Parameter(torch.randn(s)) for s in SHAPES]
    grads = [torch.zeros(s) for s in SHAPES]
    for rank in range(world):
        gen = torch.Generator().manual_seed(rank + 1)
        for g in grads:
            g += torch.randn(g.shape, generator=gen)
    for p, g in zip(ref, grads):
        p.grad = g / world
    opt = torch.optim.AdamW(ref, lr=0.1, weight_decay=0.01)
    opt.step()
    for r in got:
        for p, want in zip(r["params"], ref):
            torch.testing.assert_close(p, want.detach(), atol=1e-6, rtol=1e-6)
    total = sum(p.numel() for p in ref)
    assert sum(r["held"] for r in got) == total  # every element stepped once
    # the (1, 8, 5) stack is 40 of the 173 elements: split by experts, one rank would hold all of it
    assert max(r["held"] for r in got) <= -(-total // world) + 12
    assert all(r["moments"] == r["held"] for r in got)
