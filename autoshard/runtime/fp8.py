"""FP8 matmuls with fine-grained scaling, as DeepSeek-V3 trained: every GEMM of a matmul the plan
marks FP8 (forward, input gradient, weight gradient) multiplies E4M3 operands and accumulates in
fp32, each operand scaled per small group of elements so that one outlier costs only its group's
precision:

* activations and output gradients: one scale per 1x128 tile along the contraction (per token,
  128 features at a time) for the forward and the input gradient; per 128x1 tile (128 tokens of
  one feature) for the weight gradient, whose contraction runs over the tokens;
* weights: one scale per 128x128 block, the same blocks for ``W`` and its transpose.

A group's scale is ``amax / 448`` (448 is E4M3's largest finite value; amax clamped below at
``EPS`` so that a group of zeros divides by something), the group is divided by it, clamped to
+-448 and cast to ``float8_e4m3fn``. Partial sums are kept per 128 elements of the contraction
and multiplied by the two scales in fp32, which is DeepSeek-V3's promotion of the tensor cores'
partial sums every 128 elements.

The functions here are also the definition of that math: on CPUs (and wherever Triton cannot run)
the program computes exactly this in plain torch, so CPU runs train with FP8 numerics; on CUDA the
same steps run as the Triton kernels of ``autoshard.kernels.fp8``, which the tests check against
these functions (quantisation bit for bit, the GEMM to fp32 round-off).

What the forward keeps for backward is the FP8 copy of its input (1 byte per element plus one
fp32 scale per 128) rather than the input itself, one copy for all the matmuls reading that
input. Under selective recomputation (``runtime.checkpoint``) the policy sees the input's
quantisation and the forward GEMM as one op each (``torch.ops.autoshard.fp8_quantize_rows`` and
``fp8_mm``): a matmul called with ``keep_fp8=True`` has its input's FP8 copy kept through the
layer's recomputation (the input itself is rebuilt), and a kept matmul output is kept whether
the GEMM ran in torch or in a Triton kernel.

A weight is quantised once per optimizer step and its FP8 copy kept until the next one
(``new_step``, which the training program calls after each update): every micro-batch's forward
and input-gradient GEMMs reuse it, as a step's weights do not change.

The public names, as an emitted stage file calls them (``rt.<name>``):

``fp8_linear(x, w, b)``       ``x @ w.T + b``, ``w`` ``[N, K]`` (``nn.Linear``, ``F.linear``)
``fp8_matmul(x, w)``          ``x @ w`` with a weight on the right: ``[K, N]``, or stacked
                              ``[E, K, N]`` times ``x`` ``[E, C, K]`` (``torch.bmm`` over experts)
``fp8_addmm(b, x, w)``         ``b + x @ w`` (``torch.addmm`` by a weight ``[K, N]``)
``fp8_grouped_mm(x, w, offs)``  rows of ``x`` grouped by expert (``offs`` the cumulative counts)
                              times ``w`` ``[E, K, N]`` (``rt.moe_grouped_mm``)

each with ``keep_fp8`` (default False), which only a layer under selective recomputation reads.
"""

from __future__ import annotations

import weakref

import torch

from autoshard.ir.fp8 import E4M3, E4M3_MAX, EPS, TILE, tile_starts
from autoshard.runtime.phase import unrecorded


def _tiles(n: int) -> int:
    return (n + TILE - 1) // TILE


def _pad_to_tiles(x: torch.Tensor, dim: int) -> torch.Tensor:
    extra = _tiles(x.size(dim)) * TILE - x.size(dim)
    if not extra:
        return x
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, extra]
    return torch.nn.functional.pad(x, pad)


# every E4M3 value by its byte: on CPUs a table lookup widens FP8 to fp32 about 4x faster than
# the cast (``.float()`` converts one element at a time there); the same values either way
_E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(E4M3).float()


def _widen(q: torch.Tensor) -> torch.Tensor:
    """fp32 values of an E4M3 tensor."""
    if q.is_cuda:
        return q.float()
    return _E4M3_VALUES.index_select(0, q.reshape(-1).view(torch.uint8).int()).view(q.shape)


def _scale(amax: torch.Tensor) -> torch.Tensor:
    return amax.clamp(min=EPS) / E4M3_MAX


def _cast(x: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return (x / s).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1x128 tiles along the last dimension of ``x`` ``[M, K]``: (``q`` e4m3 ``[M, K]``, ``s``
    fp32 ``[M, ceil(K/128)]``)."""
    m, k = x.shape
    t = _pad_to_tiles(x.float(), 1).view(m, _tiles(k), TILE)
    s = _scale(t.abs().amax(dim=2))
    q = _cast(t, s[:, :, None]).view(m, _tiles(k) * TILE)[:, :k]
    return q, s


def dequantize_rows(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 ``[M, K]`` from ``quantize_rows``' output."""
    m, k = q.shape
    return (_pad_to_tiles(_widen(q), 1).view(m, _tiles(k), TILE) * s[:, :, None]).view(m, _tiles(k) * TILE)[:, :k]


def quantize_cols(x: torch.Tensor, offs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """128x1 tiles along the rows of ``x`` ``[M, K]`` (restarting at each group of ``offs``),
    written transposed, as the weight-gradient GEMM reads them: (``q`` e4m3 ``[K, M]``, ``s``
    fp32 ``[K, T]``, T the tiles of ``tile_starts``)."""
    m, k = x.shape
    xf = x.float()
    starts = tile_starts(m, offs)
    ends = [*starts[1:], m]  # a group's first tile starts where the group does: tiles never span two
    if not starts:
        return torch.empty(k, 0, dtype=E4M3, device=x.device), torch.empty(k, 0, device=x.device)
    sizes = torch.tensor([e - s0 for s0, e in zip(starts, ends)])
    tile = torch.repeat_interleave(torch.arange(len(starts)), sizes, output_size=m).to(x.device)
    amax = torch.zeros(len(starts), k, device=x.device).scatter_reduce_(0, tile[:, None].expand(m, k), xf.abs(), "amax")
    s = _scale(amax)  # [T, K]
    q = _cast(xf, s[tile])
    return q.t().contiguous(), s.t().contiguous()


def dequantize_cols(q: torch.Tensor, s: torch.Tensor, offs: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 ``[M, K]`` from ``quantize_cols``' transposed output."""
    k, m = q.shape
    starts = tile_starts(m, offs)
    if not starts:
        return torch.empty(m, k, device=q.device)
    tile = torch.bucketize(torch.arange(m), torch.tensor(starts[1:]), right=True).to(q.device)
    return (_widen(q) * s[:, tile]).t()


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """128x128 blocks over the last two dimensions of ``w`` ``[..., N, K]``: (``q`` e4m3, same
    shape; ``s`` fp32 ``[..., ceil(N/128), ceil(K/128)]``)."""
    *lead, n, k = w.shape
    p = _pad_to_tiles(_pad_to_tiles(w.float(), -1), -2)
    nb, kb = p.size(-2) // TILE, p.size(-1) // TILE
    blocks = p.reshape(*lead, nb, TILE, kb, TILE)
    s = _scale(blocks.abs().amax(dim=(-3, -1)))
    q = _cast(blocks, s[..., :, None, :, None]).reshape(p.shape)[..., :n, :k]
    return q, s


def dequantize_blocks(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """fp32 from ``quantize_blocks``' output."""
    *lead, n, k = q.shape
    p = _pad_to_tiles(_pad_to_tiles(_widen(q), -1), -2)
    nb, kb = p.size(-2) // TILE, p.size(-1) // TILE
    out = p.reshape(*lead, nb, TILE, kb, TILE) * s[..., :, None, :, None]
    return out.reshape(p.shape)[..., :n, :k]


def gemm_reference(
    a: torch.Tensor, a_s: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor, b_rows: bool
) -> torch.Tensor:
    """fp32 ``A @ B.T`` of FP8 operands: ``a`` ``[M, K]`` with 1x128 scales ``[M, K/128]``; ``b``
    ``[N, K]`` with 128x128 block scales ``[N/128, K/128]`` (``b_rows`` False) or 1x128 row scales
    ``[N, K/128]`` (True). The same sum as the kernel's per-128 promotion, to fp32 round-off."""
    bd = dequantize_rows(b, b_s) if b_rows else dequantize_blocks(b, b_s)
    with torch.autocast(a.device.type, enabled=False):  # fp32, whatever the caller's autocast says
        return dequantize_rows(a, a_s) @ bd.t()


# --- the operations, on the kernels or in torch ----------------------------------------------------


def _kernels(t: torch.Tensor):
    """``autoshard.kernels.fp8`` where its Triton kernels can run on ``t``, else None (plain torch)."""
    if not t.is_cuda:
        return None
    try:
        from autoshard.kernels import fp8  # lazy: Triton loads only where a GPU runs the kernels
    except ImportError:
        return None
    return fp8


def _key(t: torch.Tensor) -> tuple:
    """(the tensor a view is of, the key of this view of it): one weight or input however many
    fresh view objects (``w.unsqueeze(0)``, ``x.reshape(...)``) reach the FP8 functions."""
    base = t if t._base is None else t._base
    return base, (id(base), tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)


def _cached(table: dict, t: torch.Tensor):
    """``t``'s entry of ``table`` if its tensor is alive and unchanged since (views share their
    base's version counter), else None."""
    base, key = _key(t)
    hit = table.get(key)
    if hit is not None and hit[0]() is base and hit[1] == t._version:
        return hit[2]
    return None


def _keep(table: dict, t: torch.Tensor, value, most: int | None = None) -> None:
    for key in [key for key, v in table.items() if v[0]() is None]:  # tensors gone since
        del table[key]
    if most is not None and len(table) >= most:
        table.pop(next(iter(table)))
    base, key = _key(t)
    table[key] = (weakref.ref(base), t._version, value)


_recent: dict[tuple, tuple] = {}  # view key -> (weakref to its base, version, its 1x128 quantisation)


def _q_rows(x, reuse: bool = False, keep: bool = False):
    """``x``'s 1x128 quantisation; with ``reuse``, the one computed last for this very tensor
    (unchanged since), so the projections reading one input (Q, K and V; gate and up) quantise
    it once and keep one FP8 copy for backward. ``keep``: the recomputation policy keeps it."""
    if reuse and (hit := _cached(_recent, x)) is not None:
        return hit
    out = torch.ops.autoshard.fp8_quantize_rows(x, keep)
    if reuse:
        _keep(_recent, x, out, most=8)
    return out


def forget_inputs() -> None:
    """Forget the quantised inputs ``reuse`` finds: a checkpointed layer's forward calls this
    first, so that its recomputation meets the same first quantisations as its forward did."""
    _recent.clear()


@torch.library.custom_op("autoshard::fp8_quantize_rows", mutates_args=())
def _quantize_rows_op(x: torch.Tensor, keep: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` as one op (on the kernels where they run); ``keep`` is read only by the
    recomputation policy, which keeps the result where it is True."""
    k = _kernels(x)
    q, s = k.quantize_rows(x) if k else quantize_rows(x)
    return q.contiguous(), s


@_quantize_rows_op.register_fake
def _(x, keep):
    return x.new_empty(x.shape, dtype=E4M3), x.new_empty(x.size(0), _tiles(x.size(1)), dtype=torch.float32)


@torch.library.custom_op("autoshard::fp8_dequantize_rows", mutates_args=())
def _dequantize_rows_op(q: torch.Tensor, s: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``dequantize_rows`` in ``dtype``, as one op: a selective checkpoint's recomputation can
    skip it whole where nothing needs its rows (an expert dispatch's, whose FP8 copy is kept),
    and with it the all-to-all that brought them; on CPUs its table lookup is several ops, one of
    them an integer copy the recomputation must not skip."""
    k = _kernels(q)
    return (k.dequantize_rows(q, s) if k else dequantize_rows(q, s)).to(dtype).contiguous()


@_dequantize_rows_op.register_fake
def _(q, s, dtype):
    return q.new_empty(q.shape, dtype=dtype)


def _q_cols(x, offs):
    k = _kernels(x)
    return k.quantize_cols(x, offs) if k else quantize_cols(x, offs)


_weights: dict[tuple, tuple] = {}  # view key -> (weakref to its base, version, its 128x128 quantisation)


def _q_blocks(w):
    """``w``'s 128x128 quantisation, computed once per optimizer step (``new_step``)."""
    if (hit := _cached(_weights, w)) is not None:
        return hit
    k = _kernels(w)
    # out of a selective checkpoint's sight: the first micro-batch's forward quantises the weight
    # and its recomputation finds the copy, so the cache would hand the ops after it the wrong
    # calls' entries (a skipped call's layout, a kept output)
    with unrecorded():
        out = k.quantize_blocks(w) if k else quantize_blocks(w)
    _keep(_weights, w, out)
    return out


def new_step() -> None:
    """Forget the FP8 copies of the weights (and of recent inputs): the optimizer has changed the
    weights (some updates, such as a ZeRO broadcast, write them without a version bump)."""
    _weights.clear()
    _recent.clear()


def _gemm(a, a_s, b, b_s, b_rows: bool, out_dtype) -> torch.Tensor:
    k = _kernels(a)
    if k:
        return k.gemm(a, a_s, b, b_s, b_rows=b_rows, out_dtype=out_dtype)
    return gemm_reference(a, a_s, b, b_s, b_rows).to(out_dtype)


def _groups(offs: torch.Tensor | None, rows: int) -> list[tuple[int, int]]:
    ends = [rows] if offs is None else [int(e) for e in offs.tolist()]
    return list(zip([0, *ends[:-1]], ends))


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


class _Fp8Matmul(torch.autograd.Function):
    """``y[rows of group g] = x[rows of g] @ w[g].T`` for ``x`` ``[M, K]`` and ``w`` ``[G, N, K]``
    (any strides), rows grouped by ``offs`` (None: one group); all three GEMMs in FP8."""

    @staticmethod
    def forward(ctx, x, w, offs, rows=None, keep=False, experts=False):
        out_dtype = _out_dtype(x)
        xq, xs = _q_rows(x, reuse=True, keep=keep)
        wq, ws = _q_blocks(w)
        ctx.rows = rows if rows and _kernels(x) is None else None  # equal groups on CPU: batched
        ctx.save_for_backward(xq, xs, w, offs)
        ctx.dtypes = (x.dtype, w.dtype)
        return torch.ops.autoshard.fp8_mm(xq, xs, wq, ws, offs, ctx.rows or 0, out_dtype, experts)

    @staticmethod
    def backward(ctx, gy):
        xq, xs, w, offs = ctx.saved_tensors
        x_dtype, w_dtype = ctx.dtypes
        if ctx.rows:
            return (*_batched_backward(ctx, gy, xq, xs, w, ctx.rows), None, None, None, None)
        groups = _groups(offs, gy.size(0))
        gx = gw = None
        if _wanted(ctx, 0):
            gq, gs = _q_rows(gy)  # 1x128 along N, the input gradient's contraction
            wq, ws = _q_blocks(w)
            wt = wq.transpose(-1, -2)  # [G, K, N]: the same 128x128 blocks, transposed
            wts = ws.transpose(-1, -2)
            parts = [_gemm(gq[a:b], gs[a:b], wt[g], wts[g], False, x_dtype) for g, (a, b) in enumerate(groups)]
            gx = parts[0] if len(parts) == 1 else torch.cat(parts)
        if _wanted(ctx, 1):
            # the weight gradient contracts over tokens: both operands in 128x1 tiles along the
            # rows, the saved activation re-tiled from its FP8 copy (DeepSeek-V3's 1x128 -> 128x1)
            k = _kernels(xq)
            x_hat = k.dequantize_rows(xq, xs) if k else dequantize_rows(xq, xs)
            gtq, gts = _q_cols(gy, offs)  # [N, M], [N, T]
            xtq, xts = _q_cols(x_hat, offs)  # [K, M], [K, T]
            starts = tile_starts(gy.size(0), offs)
            out = []
            for a, b in groups:
                t0 = sum(1 for s in starts if s < a)
                t1 = t0 + _tiles(b - a)
                if a == b:
                    out.append(torch.zeros(w.shape[-2:], dtype=w_dtype, device=w.device))
                    continue
                # row scales on both sides: the contraction was tiled from the group's first row
                out.append(_gemm(gtq[:, a:b], gts[:, t0:t1], xtq[:, a:b], xts[:, t0:t1], True, w_dtype))
            gw = torch.stack(out)
        return gx, gw, None, None, None, None


@torch.library.custom_op("autoshard::fp8_mm", mutates_args=())
def _mm_op(
    xq: torch.Tensor,
    xs: torch.Tensor,
    wq: torch.Tensor,
    ws: torch.Tensor,
    offs: torch.Tensor | None,
    rows: int,
    out_dtype: torch.dtype,
    experts: bool,
) -> torch.Tensor:
    """The forward GEMM of ``_Fp8Matmul`` as one op: ``y[rows of g] = x[rows of g] @ w[g].T``
    from the FP8 operands, in ``out_dtype``; ``rows`` > 0: equal groups of that many rows, as
    one batched product (CPUs). ``experts`` is read only by the recomputation policy (which
    category the output is)."""
    if rows:
        with torch.autocast(xq.device.type, enabled=False):
            xd = dequantize_rows(xq, xs).view(wq.size(0), rows, -1)
            y = torch.bmm(xd, dequantize_blocks(wq, ws).transpose(1, 2))
        return y.view(xq.size(0), -1).to(out_dtype)
    groups = _groups(offs, xq.size(0))
    parts = [_gemm(xq[a:b], xs[a:b], wq[g], ws[g], False, out_dtype) for g, (a, b) in enumerate(groups)]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


@_mm_op.register_fake
def _(xq, xs, wq, ws, offs, rows, out_dtype, experts):
    return xq.new_empty(xq.size(0), wq.size(-2), dtype=out_dtype)


def _cols_dequantized(x: torch.Tensor, groups: int, rows: int) -> torch.Tensor:
    """``dequantize_cols(*quantize_cols(x, offs), offs)`` for ``groups`` equal groups of ``rows``
    rows (``[G, rows, K]``), batched: the same values."""
    k = x.size(1)
    t = _pad_to_tiles(x.float().view(groups, rows, k), 1).view(groups, _tiles(rows), TILE, k)
    s = _scale(t.abs().amax(dim=2, keepdim=True))
    return (_widen(_cast(t, s)) * s).view(groups, -1, k)[:, :rows]


def _wanted(ctx, i: int) -> bool:
    """Whether this backward call needs the gradient of input ``i``. ``needs_input_grad`` says
    whether the input required one when the forward ran; a split backward's input pass wants the
    inputs' gradients only and its weight pass the weights' only, and each computed both (the
    FP8 GEMMs' FLOPs of both passes in each: a 9-layer DeepSeek-V3-shaped model's busiest
    DualPipeV rank ran 1.043 of its planned FLOPs). The engine says which nodes this call runs."""
    if not ctx.needs_input_grad[i]:
        return False
    will_run = getattr(torch._C, "_will_engine_execute_node", None)
    node = ctx.next_functions[i][0] if i < len(ctx.next_functions) else None
    if will_run is None or node is None:
        return True
    try:
        return bool(will_run(node))
    except RuntimeError:  # outside an engine's backward (a direct call): everything it can
        return True


def _batched_backward(ctx, gy, xq, xs, w, rows):
    """``_Fp8Matmul``'s backward for equal groups on CPUs (stacked experts' ``bmm``): the same
    quantisation as the per-group path, the GEMMs as one batched product each."""
    x_dtype, w_dtype = ctx.dtypes
    groups = w.size(0)
    gx = gw = None
    with torch.autocast(gy.device.type, enabled=False):
        if _wanted(ctx, 0):
            wq, ws = _q_blocks(w)
            gd = dequantize_rows(*quantize_rows(gy)).view(groups, rows, -1)
            gx = torch.bmm(gd, dequantize_blocks(wq, ws)).view(gy.size(0), -1).to(x_dtype)
        if _wanted(ctx, 1):
            g_cols = _cols_dequantized(gy, groups, rows)
            x_cols = _cols_dequantized(dequantize_rows(xq, xs), groups, rows)
            gw = torch.bmm(g_cols.transpose(1, 2), x_cols).to(w_dtype)
    return gx, gw


def fp8_linear(
    x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None, *, keep_fp8: bool = False
) -> torch.Tensor:
    """``x @ w.T + bias`` (``F.linear``) with its three GEMMs in FP8; the bias is added in the
    output's precision."""
    lead = x.shape[:-1]
    y = _Fp8Matmul.apply(x.reshape(-1, x.size(-1)), w.unsqueeze(0), None, None, keep_fp8).view(*lead, w.size(0))
    return y if bias is None else y + bias.to(y.dtype)


def fp8_matmul(x: torch.Tensor, w: torch.Tensor, *, keep_fp8: bool = False) -> torch.Tensor:
    """``x @ w`` with the weight on the right: ``w`` ``[K, N]`` (any leading dimensions of ``x``)
    or ``[E, K, N]`` with ``x`` ``[E, C, K]`` (one matrix per expert, ``torch.bmm``)."""
    if w.dim() == 2:
        lead = x.shape[:-1]
        y = _Fp8Matmul.apply(x.reshape(-1, x.size(-1)), w.t().unsqueeze(0), None, None, keep_fp8)
        return y.view(*lead, w.size(1))
    e, c, k = x.shape
    offs = torch.arange(1, e + 1, device=x.device) * c
    return _Fp8Matmul.apply(x.reshape(e * c, k), w.transpose(1, 2), offs, c, keep_fp8, True).view(e, c, w.size(2))


def fp8_addmm(bias: torch.Tensor, x: torch.Tensor, w: torch.Tensor, *, keep_fp8: bool = False) -> torch.Tensor:
    """``bias + x @ w`` (``torch.addmm``, transformers' ``Conv1D``), the product in FP8 as
    ``fp8_matmul``'s."""
    y = fp8_matmul(x, w, keep_fp8=keep_fp8)
    return y + bias.to(y.dtype)


def fp8_grouped_mm(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor, *, keep_fp8: bool = False) -> torch.Tensor:
    """Rows of ``x`` ``[S, K]`` grouped by ``offs`` times their group's ``w`` ``[G, K, N]``
    (``rt.moe_grouped_mm``'s contract), all three GEMMs in FP8."""
    return _Fp8Matmul.apply(x, w.transpose(1, 2), offs, None, keep_fp8, True)


__all__ = [
    "TILE", "E4M3_MAX", "EPS", "quantize_rows", "dequantize_rows", "quantize_cols", "dequantize_cols",
    "quantize_blocks", "dequantize_blocks", "tile_starts", "gemm_reference", "fp8_linear", "fp8_matmul",
    "fp8_grouped_mm", "fp8_addmm", "new_step", "forget_inputs",
]  # fmt: skip
