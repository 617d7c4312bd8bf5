"""Autograd-aware collectives on two gloo processes against the single-process computation."""

import torch

from autoshard import runtime


def _rel(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def _worker(rank, world):
    import torch.distributed as dist

    runtime.set_groups(tp=dist.group.WORLD)
    gen = torch.Generator().manual_seed(0)
    errs = {}
    # sequence parallel: gather tokens, weight them, reduce-scatter back == local math on a full copy
    full = torch.randn(2, 8, 4, generator=gen, requires_grad=True)
    weight = torch.randn(4, 4, generator=gen)
    shard = full.detach().chunk(world, dim=1)[rank].clone().requires_grad_()
    gathered = runtime.gather_from_sp(shard, dim=1)
    out = runtime.reduce_scatter_to_sp(gathered @ weight, dim=1)  # every rank adds the same product
    (out * out).sum().backward()
    ref = (full @ weight) * world
    (ref * ref).sum().backward()
    errs["sp_forward"] = _rel(out, ref.chunk(world, dim=1)[rank])
    errs["sp_backward"] = _rel(shard.grad, full.grad.chunk(world, dim=1)[rank])
    # scatter keeps the rank's slice, its backward gathers the slices
    x = torch.randn(2, 8, 3, generator=gen, requires_grad=True)
    runtime.scatter_to_sp(x, dim=1).sum().backward()
    errs["scatter_backward"] = (x.grad - 1.0).abs().max().item()
    # vocabulary-parallel cross-entropy with an ignored position
    logits = torch.randn(6, 10, generator=gen, requires_grad=True)
    target = torch.tensor([1, 9, 4, -100, 0, 7])
    ref = torch.nn.functional.cross_entropy(logits, target)
    ref.backward()
    local = logits.detach().chunk(world, dim=1)[rank].clone().requires_grad_()
    loss = runtime.vocab_parallel_cross_entropy(local, target)
    loss.backward()
    errs["ce_forward"] = abs(loss.item() - ref.item())
    errs["ce_backward"] = (local.grad - logits.grad.chunk(world, dim=1)[rank]).abs().max().item()
    errs["ce_input_unchanged"] = (local.detach() - logits.detach().chunk(world, dim=1)[rank]).abs().max().item()
    # vocabulary-parallel embedding
    table = torch.randn(10, 3, generator=gen)
    tokens = torch.tensor([[0, 9, 5, 4]])
    emb = runtime.vocab_parallel_embedding(tokens, table.chunk(world, dim=0)[rank])
    errs["embedding"] = (emb - table[tokens]).abs().max().item()
    runtime.set_groups(tp=None)
    return errs


def test_collectives_match_single_process():
    from distributed import run

    for errs in run(_worker, 2, timeout=120):
        for name, err in errs.items():
            assert err < 1e-5, name


def test_collectives_are_identities_without_a_group():
    x = torch.randn(2, 4, 6)
    assert runtime.copy_to_tp(x) is x and runtime.reduce_from_tp(x) is x and runtime.gather_from_sp(x) is x
    logits, target = torch.randn(4, 6), torch.tensor([0, 5, -100, 2])
    assert torch.allclose(
        runtime.vocab_parallel_cross_entropy(logits, target), torch.nn.functional.cross_entropy(logits, target)
    )
