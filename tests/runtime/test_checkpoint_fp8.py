"""Selective recomputation of a layer with FP8 matmuls (autoshard.runtime.checkpoint): the kinds
kept as FP8 copies hold the E4M3 quantisation of what the matmuls read (1 byte and a 4-byte scale
per 128 elements) instead of the op's output, the kept matmul outputs are the FP8 GEMM's, and the
gradients are exactly those of the layer run without checkpointing (the same FP8 math, rebuilt)."""

import pytest
import torch
import torch.nn.functional as F

from autoshard.runtime import checkpoint as ckpt
from autoshard.runtime import fp8

from conftest import cache_storages

D, F_DIM, TOKENS = 256, 384, 64


@pytest.fixture(autouse=True)
def fresh_caches():
    fp8.new_step()
    yield
    fp8.new_step()


def _weights():
    g = torch.Generator().manual_seed(0)
    w = [torch.randn(*shape, generator=g) / shape[-1] ** 0.5 for shape in ((F_DIM, D), (F_DIM, D), (D, F_DIM))]
    return [t.requires_grad_() for t in w]


def _layer(w1, w3, w2, keep):
    def fn(x):
        n = F.layer_norm(x, (D,))  # norm_output: read by the two FP8 matmuls only
        a = fp8.fp8_linear(n, w1, keep_fp8=keep)
        b = fp8.fp8_linear(n, w3, keep_fp8=keep)
        return x + fp8.fp8_linear(F.silu(a) * b, w2)

    return fn


def _run(module_for, keep):
    """(loss, input gradient, weight gradients, what the selective cache held) of one step."""
    w = _weights()
    x = torch.randn(TOKENS, D, generator=torch.Generator().manual_seed(1)).requires_grad_()
    module = module_for(_layer(*w, keep))
    held = cache_storages(module)
    fp8.new_step()
    y = module(x)
    # what the forward left in the cache for backward: (op, dtype, bytes) of every kept tensor
    kept = [
        (str(op), e.val.dtype, e.val.numel() * e.val.element_size())
        for storage in held
        for op, entries in storage.items()
        for e in entries.values()
        for e in (e if isinstance(e, tuple) else (e,))
        if isinstance(getattr(e, "val", None), torch.Tensor)
    ]
    loss = (y.float() ** 2).mean()
    loss.backward()
    return loss.detach(), x.grad, [t.grad for t in w], kept


def test_kept_fp8_copies_replace_the_norm_output_and_train_the_same():
    plain = _run(lambda fn: fn, keep=False)
    as_is = _run(lambda fn: ckpt.Checkpoint(fn, ["activation"]), keep=False)
    copies = _run(lambda fn: ckpt.Checkpoint(fn, ["activation"], ["norm_output"]), keep=True)
    for run in (as_is, copies):
        assert torch.equal(run[0], plain[0])
        assert torch.equal(run[1], plain[1])
        assert all(torch.equal(a, b) for a, b in zip(run[2], plain[2]))
    # kept as it is: the norm's output (fp32 here) and the outputs of the two FP8 GEMMs that
    # autograd keeps (read by the SiLU and the product); the last one's, read by the residual add
    # alone, is let go and made again only if the recomputation needs it
    ops = [op for op, _, _ in as_is[3]]
    assert any("layer_norm" in op for op in ops)
    assert ops.count("autoshard.fp8_mm.default") == 2
    # as FP8 copies: one E4M3 quantisation of the norm output (shared by both matmuls) and its
    # scales, no norm output; the GEMMs' outputs as before
    ops = [op for op, _, _ in copies[3]]
    assert not any("layer_norm" in op for op in ops)
    assert ops.count("autoshard.fp8_quantize_rows.default") == 2  # q and its scales, once
    q = [(dt, n) for op, dt, n in copies[3] if op == "autoshard.fp8_quantize_rows.default"]
    assert sorted(q, key=str) == sorted(
        [(torch.float8_e4m3fn, TOKENS * D), (torch.float32, TOKENS * D // 128 * 4)], key=str
    )
    # the bytes: the norm's output and statistics out, the copy in; the rest unchanged
    norm = sum(n for op, _, n in as_is[3] if "layer_norm" in op)
    copy = TOKENS * D + TOKENS * D // 128 * 4
    assert sum(n for _, _, n in copies[3]) == sum(n for _, _, n in as_is[3]) - norm + copy
    assert norm >= 4 * TOKENS * D


def test_full_recomputation_ignores_the_kept_flag():
    plain = _run(lambda fn: fn, keep=False)
    full = _run(lambda fn: ckpt.Checkpoint(fn, list(ckpt.KINDS)), keep=True)
    assert full[3] == []  # nothing cached: plain checkpointing
    assert torch.equal(full[1], plain[1]) and all(torch.equal(a, b) for a, b in zip(full[2], plain[2]))
