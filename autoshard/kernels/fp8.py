"""Blockwise FP8 (DeepSeek-V3 recipe) in Triton: the CUDA side of ``autoshard.runtime.fp8``, which
defines the math in plain torch and calls these functions for CUDA tensors.

* ``quantize_rows(x)``: 1x128 tiles along the last dimension of ``x`` ``[M, K]`` -> ``q`` e4m3
  ``[M, K]``, ``s`` fp32 ``[M, ceil(K/128)]``. Each program takes 64 rows of one tile column.
* ``quantize_cols(x, offs)``: 128x1 tiles along the rows, restarting at each group of ``offs``
  (cumulative ends, ``offs[-1] == M``), written transposed as the weight-gradient GEMM reads them:
  ``q`` ``[K, M]``, ``s`` ``[K, T]``, tiles in ``ir.fp8.tile_starts`` order.
* ``quantize_blocks(w)``: 128x128 blocks over the last two dimensions of ``[N, K]`` or
  ``[G, N, K]`` (any strides) -> contiguous ``q``, ``s`` ``[..., ceil(N/128), ceil(K/128)]``.
* ``dequantize_rows(q, s)``: fp32 ``[M, K]``.
* ``gemm(a, a_s, b, b_s, b_rows=..., out_dtype=...)``: ``A @ B.T`` with ``b`` ``[N, K]`` read
  through its strides (transposed or sliced views need no copy), ``b_s`` 128x128 block scales
  (``b_rows`` False) or 1x128 row scales (True). The contraction runs 128 elements at a time and
  each partial sum is multiplied by both scales in fp32 (DeepSeek-V3's per-128 promotion).

Quantisation follows the torch functions step for step (scale ``max(amax, EPS) / 448``, IEEE
division by ``tl.math.div_rn``, clamp to +-448, round-to-nearest-even cast), so on a GPU it gives
their bits. Ragged M, N, K are masked; padded elements count as zeros.

torchao's prototype ``blockwise_fp8_training`` has building blocks for the same job on SM90
(``triton_fp8_blockwise_act_quant_lhs`` / ``_rhs`` / ``_transposed_lhs``,
``triton_fp8_blockwise_weight_quant_rhs`` / ``_transposed_rhs``, ``triton_fp8_gemm_1x128_128x128``
and ``_1x128_128x1``). autoshard keeps its own because those are a prototype API that needs SM90
and cannot run or be tested on CPU; they scale by multiplying with ``448 / amax``, so they do not
reproduce bit for bit the CPU emulation that ``verify`` compares against; and they have no 128x1
tiles that restart at each group, which the experts' weight gradient needs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from autoshard.ir.fp8 import E4M3, E4M3_MAX, EPS, TILE, tile_starts

_EPS = tl.constexpr(EPS)
_FMAX = tl.constexpr(E4M3_MAX)
_TILE = tl.constexpr(TILE)

ROWS_PER_PROGRAM = 64  # quantize_rows / dequantize_rows: rows of one 1x128 tile column per program
COLS_PER_PROGRAM = 64  # quantize_cols: features of one 128x1 tile row per program


@triton.jit
def _scale(amax):
    """fp32 scale of a group from its amax: ``max(amax, EPS) / 448``, IEEE-rounded."""
    return tl.math.div_rn(tl.maximum(amax, _EPS), _FMAX)


@triton.jit
def _cast(x, s):
    """``clamp(x / s, -448, 448)`` as e4m3 (``s`` broadcast to ``x``)."""
    y = tl.math.div_rn(x, s)
    return tl.clamp(y, -_FMAX, _FMAX, propagate_nan=tl.PropagateNan.ALL).to(tl.float8e4nv)


@triton.jit
def _quant_rows(X, Q, S, M, K, KT, sxm, sxk, BM: tl.constexpr):
    pid_m, kt = tl.program_id(0), tl.program_id(1)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    cols = kt * _TILE + tl.arange(0, _TILE)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    x = tl.load(X + rows[:, None] * sxm + cols[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
    s = _scale(tl.max(tl.abs(x), axis=1))
    tl.store(Q + rows[:, None] * K + cols[None, :], _cast(x, s[:, None]), mask=mask)
    tl.store(S + rows * KT + kt, s, mask=rows < M)


@triton.jit
def _quant_cols(X, Q, S, STARTS, ENDS, M, K, T, sxm, sxk, BK: tl.constexpr):
    t, pid_k = tl.program_id(0), tl.program_id(1)
    start, end = tl.load(STARTS + t), tl.load(ENDS + t)
    rows = (start + tl.arange(0, _TILE)).to(tl.int64)
    cols = (pid_k * BK + tl.arange(0, BK)).to(tl.int64)
    mask = (rows[:, None] < end) & (cols[None, :] < K)
    x = tl.load(X + rows[:, None] * sxm + cols[None, :] * sxk, mask=mask, other=0.0).to(tl.float32)
    s = _scale(tl.max(tl.abs(x), axis=0))
    tl.store(Q + cols[None, :] * M + rows[:, None], _cast(x, s[None, :]), mask=mask)  # [K, M]: transposed
    tl.store(S + cols * T + t, s, mask=cols < K)


@triton.jit
def _quant_blocks(W, Q, S, N, K, NB, KB, swg, swn, swk):
    nb, kb, g = tl.program_id(0), tl.program_id(1), tl.program_id(2).to(tl.int64)
    rows = (nb * _TILE + tl.arange(0, _TILE)).to(tl.int64)
    cols = kb * _TILE + tl.arange(0, _TILE)
    mask = (rows[:, None] < N) & (cols[None, :] < K)
    x = tl.load(W + g * swg + rows[:, None] * swn + cols[None, :] * swk, mask=mask, other=0.0).to(tl.float32)
    s = _scale(tl.max(tl.max(tl.abs(x), axis=1), axis=0))
    tl.store(Q + g * N * K + rows[:, None] * K + cols[None, :], _cast(x, s), mask=mask)
    tl.store(S + (g * NB + nb) * KB + kb, s)


@triton.jit
def _dequant_rows(Q, S, O, M, K, sqm, sqk, ssm, ssk, BM: tl.constexpr):
    pid_m, kt = tl.program_id(0), tl.program_id(1)
    rows = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    cols = kt * _TILE + tl.arange(0, _TILE)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    q = tl.load(Q + rows[:, None] * sqm + cols[None, :] * sqk, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(S + rows * ssm + kt * ssk, mask=rows < M, other=0.0)
    tl.store(O + rows[:, None] * K + cols[None, :], q * s[:, None], mask=mask)


@triton.jit
def _gemm_kernel(A, AS, B, BS, C, M, N, K,
                 sam, sak, sasm, sask, sbn, sbk, sbsn, sbsk, scm, scn,
                 B_ROWS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr):  # fmt: skip
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    offs_m = (pid_m * BM + tl.arange(0, BM)).to(tl.int64)
    offs_n = (pid_n * BN + tl.arange(0, BN)).to(tl.int64)
    offs_k = tl.arange(0, _TILE)
    mmask, nmask = offs_m < M, offs_n < N
    bs_rows = offs_n if B_ROWS else offs_n // _TILE  # the scale row of each output column
    acc = tl.zeros([BM, BN], tl.float32)
    for kt in range(0, tl.cdiv(K, _TILE)):
        ks = kt * _TILE + offs_k
        kmask = ks < K
        a = tl.load(A + offs_m[:, None] * sam + ks[None, :] * sak, mask=mmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(B + ks[:, None] * sbk + offs_n[None, :] * sbn, mask=kmask[:, None] & nmask[None, :], other=0.0)
        a_s = tl.load(AS + offs_m * sasm + kt * sask, mask=mmask, other=0.0)
        b_s = tl.load(BS + bs_rows * sbsn + kt * sbsk, mask=nmask, other=0.0)
        acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]  # fp32 partial sum of 128, promoted with both scales
    tl.store(C + offs_m[:, None] * scm + offs_n[None, :] * scn, acc.to(C.dtype.element_ty),
             mask=mmask[:, None] & nmask[None, :])  # fmt: skip


def _tiles(n: int) -> int:
    return triton.cdiv(n, TILE)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles along the last dimension of ``x`` ``[M, K]``: (``q`` e4m3 ``[M, K]``, ``s`` fp32
    ``[M, ceil(K/128)]``), as ``runtime.fp8.quantize_rows``."""
    m, k = x.shape
    q = torch.empty(m, k, dtype=E4M3, device=x.device)
    s = torch.empty(m, _tiles(k), dtype=torch.float32, device=x.device)
    if m and k:
        bm = ROWS_PER_PROGRAM
        _quant_rows[(triton.cdiv(m, bm), _tiles(k))](x, q, s, m, k, _tiles(k), x.stride(0), x.stride(1), BM=bm)
    return q, s


def quantize_cols(x: torch.Tensor, offs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """128x1 tiles along the rows of ``x`` ``[M, K]``, restarting at each group of ``offs`` (cumulative
    ends, the last equal to M; None: one group), written transposed: (``q`` e4m3 ``[K, M]``, ``s``
    fp32 ``[K, T]``), as ``runtime.fp8.quantize_cols``."""
    m, k = x.shape
    if offs is not None and offs.numel() and int(offs[-1]) != m:
        raise ValueError(f"quantize_cols: offs must end at the row count {m}, got {int(offs[-1])}")
    starts = tile_starts(m, offs)
    t = len(starts)
    q = torch.empty(k, m, dtype=E4M3, device=x.device)
    s = torch.empty(k, t, dtype=torch.float32, device=x.device)
    if t and k:
        bounds = torch.tensor([starts, [*starts[1:], m]], dtype=torch.int64).to(x.device)
        bk = COLS_PER_PROGRAM
        _quant_cols[(t, triton.cdiv(k, bk))](x, q, s, bounds[0], bounds[1], m, k, t, x.stride(0), x.stride(1), BK=bk)
    return q, s


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks over the last two dimensions of ``w`` ``[N, K]`` or ``[G, N, K]`` (any strides):
    (``q`` e4m3, contiguous, ``w``'s shape; ``s`` fp32 ``[..., ceil(N/128), ceil(K/128)]``), as
    ``runtime.fp8.quantize_blocks``."""
    if w.dim() not in (2, 3):
        raise ValueError(f"quantize_blocks: expected [N, K] or [G, N, K], got {tuple(w.shape)}")
    w3 = w.unsqueeze(0) if w.dim() == 2 else w
    g, n, k = w3.shape
    nb, kb = _tiles(n), _tiles(k)
    q = torch.empty(g, n, k, dtype=E4M3, device=w.device)
    s = torch.empty(g, nb, kb, dtype=torch.float32, device=w.device)
    if g and n and k:
        _quant_blocks[(nb, kb, g)](w3, q, s, n, k, nb, kb, w3.stride(0), w3.stride(1), w3.stride(2), num_warps=8)
    return (q[0], s[0]) if w.dim() == 2 else (q, s)


def dequantize_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 ``[M, K]`` from ``quantize_rows``' output."""
    m, k = q.shape
    out = torch.empty(m, k, dtype=torch.float32, device=q.device)
    if m and k:
        bm = ROWS_PER_PROGRAM
        _dequant_rows[(triton.cdiv(m, bm), _tiles(k))](q, s, out, m, k, q.stride(0), q.stride(1), s.stride(0),
                                                        s.stride(1), BM=bm)  # fmt: skip
    return out


def gemm(a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor, *, b_rows: bool,
         out_dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
    """``A @ B.T`` of e4m3 operands in ``out_dtype``: ``a`` ``[M, K]`` with 1x128 scales ``a_s``
    ``[M, ceil(K/128)]``; ``b`` ``[N, K]`` with 128x128 block scales ``b_s`` ``[ceil(N/128),
    ceil(K/128)]`` (``b_rows`` False) or 1x128 row scales ``[N, ceil(K/128)]`` (True). Any strides."""
    m, k = a.shape
    n = b.size(0)
    kt = _tiles(k)
    want_bs = (n if b_rows else _tiles(n), kt)
    if b.size(1) != k or tuple(a_s.shape) != (m, kt) or tuple(b_s.shape) != want_bs:
        raise ValueError(f"fp8 gemm: a {tuple(a.shape)}, a_s {tuple(a_s.shape)}, b {tuple(b.shape)}, "
                         f"b_s {tuple(b_s.shape)} (b_s expected {want_bs})")  # fmt: skip
    if a.dtype != E4M3 or b.dtype != E4M3:
        raise ValueError(f"fp8 gemm: operands must be float8_e4m3fn, got {a.dtype} and {b.dtype}")
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    if not (m and n):
        return c
    if not k:
        return c.zero_()
    bm, bn = (64, 128) if m <= 64 else (128, 128)
    grid = (triton.cdiv(m, bm), triton.cdiv(n, bn))
    _gemm_kernel[grid](
        a, a_s, b, b_s, c, m, n, k,
        a.stride(0), a.stride(1), a_s.stride(0), a_s.stride(1), b.stride(0), b.stride(1),
        b_s.stride(0), b_s.stride(1), c.stride(0), c.stride(1),
        B_ROWS=b_rows, BM=bm, BN=bn, num_warps=8, num_stages=3,
    )  # fmt: skip
    return c


__all__ = ["quantize_rows", "quantize_cols", "quantize_blocks", "dequantize_rows", "gemm"]
