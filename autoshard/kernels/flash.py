"""FlashAttention forward and backward in Triton: tiled online softmax, causal or not, grouped-query
attention (fewer K/V heads), values of another head size than queries and keys (multi-head latent
attention), any sequence length (masked tails), fp32 accumulation.

Inputs are shaped like ``scaled_dot_product_attention``'s: q (batch, heads, seq_q, dim), k (batch,
kv_heads, seq_k, dim), v (batch, kv_heads, seq_k, v_dim), heads a multiple of kv_heads; the output
is (batch, heads, seq_q, v_dim). Each head size must be one of ``KERNEL_HEAD_DIMS``: a tile's
extent (``tl.arange``) must be a power of two, so other sizes (MLA's 192 for queries and keys)
would need a padded, masked head dimension, which these kernels do not have; the runtime runs
PyTorch's attention there (``attention.kernel_runs``). Every loaded tile is upcast to fp32
before arithmetic (the Triton interpreter that runs the tests on CPU does bf16 arithmetic on the
raw bits; README.md beside this file); outputs take the input dtype. The log-sum-exp is returned
in natural-log units (what ring attention merges).

Causal attention aligns the last query with the last key (queries are the tail of the keys), so
with seq_q == seq_k it is the usual lower-triangular mask.

The backward recomputes the probabilities from the saved LSE: one kernel for D = rowsum(dO * O),
one per K/V block for dK and dV (looping over the query heads of its group and every query block),
one per query block for dQ.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from autoshard.ir import KERNEL_HEAD_DIMS

LOG2E = 1.4426950408889634


@triton.jit
def _kv_block(K, V, cols, offs_d, offs_dv, sks, svs, sk):
    """Rows ``cols`` of one head's K and V (``K``/``V`` point at the head), fp32, zero past ``sk``."""
    kmask = cols[:, None] < sk
    k = tl.load(K + cols[:, None] * sks + offs_d[None, :], mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(V + cols[:, None] * svs + offs_dv[None, :], mask=kmask, other=0.0).to(tl.float32)
    return k, v


@triton.jit
def _fwd(Q, K, V, O, L, scale, sq, sk, H, G, causal_shift,
         sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos,
         CAUSAL: tl.constexpr, D: tl.constexpr, VD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, VD)
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :], mask=offs_m[:, None] < sq, other=0.0)
    q = q.to(tl.float32)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc = tl.zeros([BM, VD], tl.float32)
    qk_scale = scale * 1.4426950408889634
    hi = sk
    if CAUSAL:
        hi = tl.minimum(sk, (pid_m + 1) * BM + causal_shift)
    for start in range(0, hi, BN):
        cols = start + offs_n
        k, v = _kv_block(K + b * skb + kvh * skh, V + b * svb + kvh * svh, cols, offs_d, offs_dv, sks, svs, sk)
        s = tl.dot(q, tl.trans(k)) * qk_scale
        valid = cols[None, :] < sk
        if CAUSAL:
            valid = valid & (cols[None, :] <= offs_m[:, None] + causal_shift)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = (m_i + tl.log2(l_safe)) / 1.4426950408889634
    rows = offs_m < sq
    tl.store(O + b * sob + h * soh + offs_m[:, None] * sos + offs_dv[None, :], out.to(O.dtype.element_ty),
             mask=rows[:, None])  # fmt: skip
    tl.store(L + bh * sq + offs_m, lse, mask=rows)


@triton.jit
def _bwd_delta(O, DO, Delta, sq, H, sob, soh, sos, BM: tl.constexpr, D: tl.constexpr):
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    ptr = b * sob + h * soh + offs_m[:, None] * sos + offs_d[None, :]
    mask = offs_m[:, None] < sq
    o = tl.load(O + ptr, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(DO + ptr, mask=mask, other=0.0).to(tl.float32)
    tl.store(Delta + bh * sq + offs_m, tl.sum(o * do, 1), mask=offs_m < sq)


@triton.jit
def _bwd_dkdv(Q, K, V, DO, L, Delta, DK, DV, scale, sq, sk, H, KVH, G, causal_shift,
              sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos,
              CAUSAL: tl.constexpr, D: tl.constexpr, VD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    pid_n, bkv = tl.program_id(0), tl.program_id(1)
    b, kvh = bkv // KVH, bkv % KVH
    offs_n = pid_n * BN + tl.arange(0, BN)
    offs_m = tl.arange(0, BM)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, VD)
    kmask = offs_n[:, None] < sk
    kptr = b * skb + kvh * skh + offs_n[:, None] * sks + offs_d[None, :]
    vptr = b * svb + kvh * svh + offs_n[:, None] * svs + offs_dv[None, :]
    k = tl.load(K + kptr, mask=kmask, other=0.0).to(tl.float32)
    v = tl.load(V + vptr, mask=kmask, other=0.0).to(tl.float32)
    dk = tl.zeros([BN, D], tl.float32)
    dv = tl.zeros([BN, VD], tl.float32)
    lo = 0
    if CAUSAL:
        lo = tl.maximum(0, (pid_n * BN - causal_shift) // BM * BM)
    for g in range(0, G):
        h = kvh * G + g
        bh = b * H + h
        for start in range(lo, sq, BM):
            rows = start + offs_m
            qmask = rows[:, None] < sq
            qptr = b * sqb + h * sqh + rows[:, None] * sqs + offs_d[None, :]
            q = tl.load(Q + qptr, mask=qmask, other=0.0).to(tl.float32)
            do = tl.load(DO + b * sob + h * soh + rows[:, None] * sos + offs_dv[None, :], mask=qmask,
                         other=0.0).to(tl.float32)  # fmt: skip
            lse = tl.load(L + bh * sq + rows, mask=rows < sq, other=0.0)
            delta = tl.load(Delta + bh * sq + rows, mask=rows < sq, other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale
            valid = (rows[:, None] < sq) & (offs_n[None, :] < sk)
            if CAUSAL:
                valid = valid & (offs_n[None, :] <= rows[:, None] + causal_shift)
            p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
            dv += tl.dot(tl.trans(p), do)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None]) * scale
            dk += tl.dot(tl.trans(ds), q)
    tl.store(DK + kptr, dk.to(DK.dtype.element_ty), mask=kmask)
    tl.store(DV + vptr, dv.to(DV.dtype.element_ty), mask=kmask)


@triton.jit
def _bwd_dq(Q, K, V, DO, L, Delta, DQ, scale, sq, sk, H, G, causal_shift,
            sqb, sqh, sqs, skb, skh, sks, svb, svh, svs, sob, soh, sos,
            CAUSAL: tl.constexpr, D: tl.constexpr, VD: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    pid_m, bh = tl.program_id(0), tl.program_id(1)
    b, h = bh // H, bh % H
    kvh = h // G
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    offs_d = tl.arange(0, D)
    offs_dv = tl.arange(0, VD)
    qmask = offs_m[:, None] < sq
    q = tl.load(Q + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :], mask=qmask, other=0.0).to(tl.float32)
    do = tl.load(DO + b * sob + h * soh + offs_m[:, None] * sos + offs_dv[None, :], mask=qmask,
                 other=0.0).to(tl.float32)  # fmt: skip
    lse = tl.load(L + bh * sq + offs_m, mask=offs_m < sq, other=0.0)
    delta = tl.load(Delta + bh * sq + offs_m, mask=offs_m < sq, other=0.0)
    dq = tl.zeros([BM, D], tl.float32)
    hi = sk
    if CAUSAL:
        hi = tl.minimum(sk, (pid_m + 1) * BM + causal_shift)
    for start in range(0, hi, BN):
        cols = start + offs_n
        k, v = _kv_block(K + b * skb + kvh * skh, V + b * svb + kvh * svh, cols, offs_d, offs_dv, sks, svs, sk)
        s = tl.dot(q, tl.trans(k)) * scale
        valid = (offs_m[:, None] < sq) & (cols[None, :] < sk)
        if CAUSAL:
            valid = valid & (cols[None, :] <= offs_m[:, None] + causal_shift)
        p = tl.where(valid, tl.exp(s - lse[:, None]), 0.0)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None]) * scale
        dq += tl.dot(ds, k)
    tl.store(DQ + b * sqb + h * sqh + offs_m[:, None] * sqs + offs_d[None, :], dq.to(DQ.dtype.element_ty), mask=qmask)


def _blocks(d: int, dv: int) -> tuple[int, int]:
    return (64, 64) if max(d, dv) <= 64 else (64, 32)


def flash_forward(q, k, v, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(output, log-sum-exp in natural-log units shaped (batch, heads, seq_q)) of attention of ``q``
    over ``k, v``. No autograd here: ``autoshard.runtime.attention`` registers these launchers as
    torch ops with their backward."""
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    b, h, sq, d = q.shape
    kvh, sk, dv = k.size(1), k.size(2), v.size(-1)
    if h % kvh or d not in KERNEL_HEAD_DIMS or dv not in KERNEL_HEAD_DIMS or v.shape[:-1] != k.shape[:-1]:
        raise ValueError(f"flash_attention: heads {h} vs kv heads {kvh}, head dims {d} and {dv} (each one of "
                         f"{KERNEL_HEAD_DIMS}), k {tuple(k.shape)} v {tuple(v.shape)}")  # fmt: skip
    o = q.new_empty(b, h, sq, dv)
    lse = torch.empty(b * h, sq, device=q.device, dtype=torch.float32)
    bm, bn = _blocks(d, dv)
    shift = sk - sq
    _fwd[(triton.cdiv(sq, bm), b * h)](
        q, k, v, o, lse, scale, sq, sk, h, h // kvh, shift,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        CAUSAL=causal, D=d, VD=dv, BM=bm, BN=bn,
    )  # fmt: skip
    return o, lse.view(b, h, sq)


def flash_attention_backward(q, k, v, out, lse, do, causal: bool, scale: float):
    """(dq, dk, dv) of attention of ``q`` over ``k, v``, given the output and natural-log LSE of
    the *whole* attention the block is part of (so ring attention can use it per K/V block)."""
    q, k, v, out, do = (t.contiguous() for t in (q, k, v, out, do))
    b, h, sq, d = q.shape
    kvh, sk, v_dim = k.size(1), k.size(2), v.size(-1)
    lse = lse.reshape(b * h, sq).contiguous().float()
    bm, bn = _blocks(d, v_dim)
    shift = sk - sq
    delta = torch.empty_like(lse)
    _bwd_delta[(triton.cdiv(sq, bm), b * h)](out, do, delta, sq, h, out.stride(0), out.stride(1), out.stride(2),
                                             BM=bm, D=v_dim)  # fmt: skip
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    strides = (q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
               v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2))  # fmt: skip
    _bwd_dkdv[(triton.cdiv(sk, bn), b * kvh)](
        q, k, v, do, lse, delta, dk, dv, scale, sq, sk, h, kvh, h // kvh, shift, *strides,
        CAUSAL=causal, D=d, VD=v_dim, BM=bm, BN=bn,
    )  # fmt: skip
    _bwd_dq[(triton.cdiv(sq, bm), b * h)](
        q, k, v, do, lse, delta, dq, scale, sq, sk, h, h // kvh, shift, *strides,
        CAUSAL=causal, D=d, VD=v_dim, BM=bm, BN=bn,
    )  # fmt: skip
    return dq, dk, dv
