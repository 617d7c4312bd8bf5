"""Context-parallel attention on gloo against full attention: ring and all-gather-KV, causal and
not, GQA, a value head size other than the query/key one (MLA), a sliding window, cp=2 and
cp=4, forward and backward."""

import pytest
import torch

from autoshard.runtime.ring_attention import allgather_attention, ring_attention, shard_sequence, unshard_sequence


def _reference(q, k, v, causal, window=None):
    heads = q.size(1)
    k, v = k.repeat_interleave(heads // k.size(1), 1), v.repeat_interleave(heads // v.size(1), 1)
    if window is not None:  # each query sees itself and the window-1 positions before it
        n = q.size(2)
        band = torch.ones(n, n, dtype=torch.bool).tril() & ~torch.ones(n, n, dtype=torch.bool).tril(-window)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=band)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


def _worker(rank, world, variant, causal, kernel=False, dv=16, window=None):
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(0)
    b, h, kvh, s, d = 2, 4, 2, 8 * world, 16
    q = torch.randn(b, h, s, d, generator=gen, requires_grad=True)
    k = torch.randn(b, kvh, s, d, generator=gen, requires_grad=True)
    v = torch.randn(b, kvh, s, dv, generator=gen, requires_grad=True)
    w = torch.randn(b, h, s, dv, generator=gen)
    ref = _reference(q, k, v, causal, window)
    (ref * w).sum().backward()
    local = [shard_sequence(t.detach(), world, rank).requires_grad_() for t in (q, k, v)]
    if variant == "ring":
        out = ring_attention(*local, group=dist.group.WORLD, causal=causal, kernel=kernel, window=window)
    else:
        out = allgather_attention(*local, group=dist.group.WORLD, causal=causal, window=window)
    (out * shard_sequence(w, world, rank)).sum().backward()
    errs = {"out": (out - shard_sequence(ref, world, rank)).abs().max().item()}
    for name, full, part in zip("qkv", (q, k, v), local):
        errs[f"d{name}"] = (part.grad - shard_sequence(full.grad, world, rank)).abs().max().item()
    return errs


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("variant", ["ring", "allgather"])
@pytest.mark.parametrize("cp", [2, 4])
def test_context_parallel_attention_matches_full_attention(cp, variant, causal):
    from distributed import run

    for errs in run(_worker, cp, variant, causal, timeout=120):
        for name, err in errs.items():
            assert err < 1e-5, (name, err)


@pytest.mark.parametrize("dv", [8, 24])
@pytest.mark.parametrize("variant", ["ring", "allgather"])
def test_value_head_size_may_differ_from_the_query_key_one(variant, dv):
    """Multi-head latent attention (DeepSeek-V2/V3): values of another head size than queries and
    keys (16 here; 128 against 192 at DeepSeek-V3's full size): the output and dV take the values'."""
    from distributed import run

    for errs in run(_worker, 2, variant, True, False, dv, timeout=120):
        for name, err in errs.items():
            assert err < 1e-5, (name, err)


def _bf16_worker(rank, world):
    """Ring attention's torch path on bf16 inputs (what a bf16 program hands it on CPUs, where its
    backward runs outside autocast): gradients as the fp32 reference's, to bf16's precision."""
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 8 * world, 16, generator=gen) for _ in range(3))
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    _reference(*full, True).sum().backward()
    local = [shard_sequence(t, world, rank).bfloat16().requires_grad_() for t in (q, k, v)]
    ring_attention(*local, group=dist.group.WORLD, causal=True).float().sum().backward()
    return [(p.grad.float() - shard_sequence(f.grad, world, rank)).abs().max().item() for p, f in zip(local, full)]


def test_ring_attention_backward_takes_bf16_inputs():
    from distributed import run

    for errs in run(_bf16_worker, 2, timeout=120):
        assert max(errs) < 0.1, errs


@pytest.mark.parametrize("window", [3, 6, 13])
@pytest.mark.parametrize("variant", ["ring", "allgather"])
def test_sliding_window_attention_matches_full_attention_with_the_band(variant, window):
    """A sliding window at cp=4 (chunks of 4 positions): narrower than a chunk, across two, and
    across four, so some blocks are skipped, some cut and some queries see no key of a block."""
    from distributed import run

    for errs in run(_worker, 4, variant, True, False, 16, window, timeout=120):
        for name, err in errs.items():
            assert err < 1e-5, (name, err)


@pytest.mark.parametrize("causal,dv", [(True, 16), (False, 16), (True, 32)])
def test_ring_attention_with_the_triton_kernel_per_block(causal, dv):
    """The GPU path (each block through autoshard's Triton kernel, the ring backward through its
    backward kernels with the global LSE), run under TRITON_INTERPRET=1 on gloo; values' heads of
    the keys' size and of another."""
    pytest.importorskip("triton")
    from distributed import run

    for errs in run(_worker, 2, "ring", causal, True, dv, timeout=180):
        for name, err in errs.items():
            assert err < 1e-5, (name, err)


def test_sequence_layout_round_trips():
    x = torch.arange(2 * 3 * 24).view(2, 3, 24)
    pieces = [shard_sequence(x, 3, r) for r in range(3)]
    assert pieces[0][0, 0].tolist() == [0, 1, 2, 3, 20, 21, 22, 23]  # chunks 0 and 5 of 6
    assert torch.equal(unshard_sequence(pieces), x)
