"""The data-parallel gradient reduction overlaps the step's last backward (ZeRO-0's all-reduce and
ZeRO-1's reduce-scatter, ``runtime.reduction``): its first bucket is started while the backward
is still running, none before the last micro-batch, and the gradients come out as the reduction
after the backward (``program.reduce_gradients``) makes them, bit for bit on two ranks."""

import pytest
import torch
from torch import nn

from autoshard.runtime.program import reduce_gradients
from autoshard.runtime.reduction import BucketedReduction, plan_buckets
from autoshard.runtime.zero import ShardedAdamW
from tests.distributed import run

STEPS, MICROBATCHES = 3, 3


def _model() -> nn.Sequential:
    torch.manual_seed(0)  # the same weights on every rank and for both paths
    layers = [m for _ in range(5) for m in (nn.Linear(256, 256), nn.Tanh())]
    return nn.Sequential(*layers, nn.Linear(256, 4))


def _both(rank: int, world: int) -> dict:
    """``_train`` at ZeRO-0 and ZeRO-1, overlapped and after the backward (one start of the ranks)."""
    return {(z, over): _train(rank, world, z, over) for z in (0, 1) for over in (True, False)}


def _train(rank: int, world: int, zero: int, overlapped: bool):
    """Per step: the reduced gradients (ZeRO-1: this rank's masters'), the buckets started
    before the last micro-batch, and those started by the time the backward reached the first
    layer (its output's gradient hook)."""
    import torch.distributed as dist

    model = _model()
    params = list(model.parameters())
    opt = ShardedAdamW(params, dist.group.WORLD, lr=1e-3) if zero == 1 else None
    reduction = BucketedReduction(params, dist.group.WORLD, world, sharded=opt) if overlapped else None
    out = []
    for step in range(STEPS):
        for p in params:
            p.grad = None
        seen: list[int] = []
        before_last = 0
        for mb in range(MICROBATCHES):
            if reduction is not None and mb == MICROBATCHES - 1:
                before_last = len(reduction.launched)
                reduction.arm()
            _backward(model, rank, step, mb, reduction, seen)
        if reduction is not None:
            reduction.finish()
        else:
            reduce_gradients(params, dist.group.WORLD, world, opt)
        grads = [opt.master(p).grad.clone() for p in params] if opt else [p.grad.clone() for p in params]
        flats = dict(reduction.flats) if reduction is not None else {}  # (held: a new one is another object)
        kept = bool(flats) and bool(out) and all(f is out[-1][3].get(k) for k, f in flats.items())
        out.append((grads, before_last, seen[-1] if seen else 0, flats, kept))
    return out


def _backward(model, rank: int, step: int, mb: int, reduction, seen: list[int]) -> None:
    """One micro-batch's backward; with ``reduction``, records how many buckets it has started
    when the gradient reaches the first layer's output (the backward's last layer)."""
    g = torch.Generator().manual_seed(1000 * step + 10 * mb + rank)
    x = torch.randn(8, 256, generator=g)
    first = model[0](x)
    if reduction is not None:
        first.register_hook(lambda grad: seen.append(len(reduction.launched)))
    out = model[2:](model[1](first))
    (out.square().mean() / MICROBATCHES).backward()


@pytest.fixture(scope="module")
def ranks() -> list[dict]:
    return run(_both, 2, timeout=60)


@pytest.mark.parametrize("zero", [0, 1])
def test_the_reduction_starts_during_the_last_backward_and_matches_the_one_after_it(ranks, zero):
    for rank in ranks:
        for step in range(STEPS):  # the second step on the buckets rebuilt in the order observed
            grads, before_last, at_first_layer, *_ = rank[zero, True][step]
            assert before_last == 0, "a bucket started before the last micro-batch's backward"
            assert at_first_layer >= 1, "no bucket started while the backward was running"
            for a, b in zip(grads, rank[zero, False][step][0]):
                assert torch.equal(a, b)


def test_a_cpu_bucket_is_the_same_flat_tensor_from_step_to_step(ranks):
    """ZeRO-0 on CPUs: once the buckets are rebuilt (after the first step), each bucket of
    several gradients is copied into the flat tensor it had the step before, not a new one."""
    for rank in ranks:
        assert [step[4] for step in rank[0, True]] == [False, False, True]


def test_buckets_are_small_first_one_dtype_each_and_a_large_parameter_alone():
    small = [nn.Parameter(torch.zeros(64, 1024)) for _ in range(6)]  # 256 KiB each
    big = nn.Parameter(torch.zeros(1024, 1024))
    half = nn.Parameter(torch.zeros(64, 1024, dtype=torch.bfloat16))
    buckets = plan_buckets([*small, big, half], first=2**20, cap=2**21)
    assert [len(b) for b in buckets] == [4, 2, 1, 1]
    assert buckets[2] == [big] and buckets[3] == [half]


def test_a_plans_bucket_size_replaces_the_programs_own_rule():
    """``Plan.dp_bucket_bytes`` (the cost model's choice) sets the buckets after the first."""
    params = [nn.Parameter(torch.zeros(256, 1024)) for _ in range(16)]  # 1 MiB each, 16 MiB
    own = BucketedReduction(params, None)
    mine = BucketedReduction(params, None, cap=8 * 2**20)
    assert len(own.buckets) == 9  # the first, then an eighth of the gradients each
    assert [len(b) for b in mine.buckets] == [1, 8, 7]
