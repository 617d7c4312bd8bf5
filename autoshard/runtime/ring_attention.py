"""Context-parallel attention over a sequence sharded across a CP group.

Layout (causal load balance): the sequence is cut into ``2*cp`` chunks and rank ``i`` holds chunks
``i`` and ``2*cp-1-i``, so every rank has the same amount of causal work. ``shard_sequence`` and
``unshard_sequence`` convert between the full sequence and this layout.

``ring_attention``: K/V blocks travel around the ring with ``batch_isend_irecv``; the exchange of
the next block is started before the current block is computed; partial outputs are merged by
their log-sum-exp. Backward runs the ring again with the block's dK/dV travelling with it, so they
arrive back at their owner after ``cp`` steps. ``allgather_attention`` is the variant LLaMA-3 used:
all-gather K and V, attend locally, reduce-scatter their gradients.

Both take q (batch, heads, local_seq, dim), k (batch, kv_heads, local_seq, dim) and v (batch,
kv_heads, local_seq, v_dim) in this layout and return the output (batch, heads, local_seq, v_dim)
in it; ``v_dim`` may differ from ``dim`` (multi-head latent attention). The per-block math is
plain PyTorch (exact in fp32 on CPU); on GPUs (and on fake tensors, which stand for the GPU
program) the Triton flash kernel takes its place where it is built for the head sizes
(``attention.kernel_runs``), so no score matrix is materialised there.

A sliding ``window`` (causal attention to the last ``window`` positions, the query's own
included) masks each block by its chunks' global positions, and skips the blocks wholly outside
the window; it runs the per-block math (the Triton kernel has no window).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from autoshard.runtime import checkpoint
from autoshard.runtime.attention import autocast_inputs, flash_attention, kernel_runs


def shard_sequence(x: torch.Tensor, cp: int, rank: int, dim: int = 2) -> torch.Tensor:
    """This rank's two chunks (``rank`` and ``2*cp-1-rank``) of the full sequence along ``dim``."""
    chunks = x.chunk(2 * cp, dim=dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=dim)


def unshard_sequence(pieces: list[torch.Tensor], dim: int = 2) -> torch.Tensor:
    """The full sequence from every rank's ``shard_sequence`` piece (in rank order)."""
    cp = len(pieces)
    halves = [p.chunk(2, dim=dim) for p in pieces]
    order = [halves[i][0] for i in range(cp)] + [halves[i][1] for i in reversed(range(cp))]
    return torch.cat(order, dim=dim)


def _chunks(rank: int, cp: int) -> tuple[int, int]:
    return rank, 2 * cp - 1 - rank


def _expand_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x if x.size(1) == heads else x.repeat_interleave(heads // x.size(1), dim=1)


def _fold_kv(grad: torch.Tensor, kv_heads: int) -> torch.Tensor:
    if grad.size(1) == kv_heads:
        return grad
    b, h, s, d = grad.shape
    return grad.view(b, kv_heads, h // kv_heads, s, d).sum(dim=2)


def _hidden(qc, kc, n, causal, window) -> bool:
    """Does causality or the window hide every key of chunk ``kc`` (``n`` positions each) from
    every query of chunk ``qc``?"""
    return causal and kc > qc or window is not None and (qc - kc) * n - (n - 1) >= window


def _scores(q, k, scale, qc, kc, causal, window=None):
    """Scores of query chunk ``qc`` against key chunk ``kc`` (global chunk indices), masked; None
    when causality or the window hides the whole block."""
    n = q.size(-2)
    if _hidden(qc, kc, n, causal, window):
        return None
    s = torch.matmul(q, k.transpose(-2, -1)) * scale
    if window is not None:  # distance q - k of each pair, by the chunks' global positions
        distance = torch.arange(n, device=q.device)[:, None] - torch.arange(n, device=q.device) + (qc - kc) * n
        s = s.masked_fill((distance < 0) | (distance >= window), float("-inf"))
    elif causal and kc == qc:
        s = s.masked_fill(torch.ones(n, n, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return s


def _block_forward(q, k, v, scale, rank, src, cp, causal, out, lse, kernel=False, window=None):
    """Fold the attention of the local queries over the K/V block of rank ``src`` into (out, lse).
    A query whose keys the window hides all (in this block, or so far) keeps a zero output and
    a log-sum-exp of -inf, which the merge weighs 0."""
    q_parts, k_parts, v_parts = q.chunk(2, dim=2), k.chunk(2, dim=2), v.chunk(2, dim=2)
    for qi, qc in enumerate(_chunks(rank, cp)):
        for ki, kc in enumerate(_chunks(src, cp)):
            if _hidden(qc, kc, q_parts[qi].size(2), causal, window):
                continue
            if kernel:  # the Triton kernel (K/V heads may be fewer: it handles the groups)
                block_out, block_lse = torch.ops.autoshard.flash_attention(
                    q_parts[qi], k_parts[ki], v_parts[ki], causal and kc == qc, scale
                )
                block_out = block_out.float()
            else:
                s = _scores(q_parts[qi], _expand_kv(k_parts[ki], q.size(1)), scale, qc, kc, causal, window)
                block_lse = torch.logsumexp(s, dim=-1)
                p = torch.exp(s - _finite(block_lse).unsqueeze(-1))
                block_out = torch.matmul(p, _expand_kv(v_parts[ki], q.size(1)))
            o, l_ = out[qi], lse[qi]
            new = torch.logaddexp(l_, block_lse)
            ref = _finite(new).unsqueeze(-1)
            out[qi] = o * torch.exp(l_.unsqueeze(-1) - ref) + block_out * torch.exp(block_lse.unsqueeze(-1) - ref)
            lse[qi] = new


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """``lse`` with -inf (a query with no key yet) as 0: exp(-inf - 0) weighs it 0, not NaN."""
    return lse.masked_fill(lse == float("-inf"), 0.0)


def _block_backward(q, k, v, do, out, lse, scale, rank, src, cp, causal, dq, dk, dv, kernel=False, window=None):
    q_parts, k_parts, v_parts = q.chunk(2, dim=2), k.chunk(2, dim=2), v.chunk(2, dim=2)
    do_parts, o_parts, lse_parts = do.chunk(2, dim=2), out.chunk(2, dim=2), lse.chunk(2, dim=2)
    if kernel:
        for qi, qc in enumerate(_chunks(rank, cp)):
            for ki, kc in enumerate(_chunks(src, cp)):
                if causal and kc > qc:
                    continue
                g = torch.ops.autoshard.flash_attention_backward(
                    q_parts[qi], k_parts[ki], v_parts[ki], o_parts[qi], lse_parts[qi], do_parts[qi],
                    causal and kc == qc, scale,
                )  # fmt: skip
                dq[qi] += g[0].float()
                dk[ki] += g[1].float()
                dv[ki] += g[2].float()
        return
    # the torch path computes in fp32 (the accumulators' dtype): backward runs outside autocast,
    # so bf16 inputs would meet fp32 probabilities in one matmul
    heads = q.size(1)
    q_parts, do_parts, o_parts = ([x.float() for x in xs] for xs in (q_parts, do_parts, o_parts))
    k_parts = [_expand_kv(x.float(), heads) for x in k_parts]
    v_parts = [_expand_kv(x.float(), heads) for x in v_parts]
    for qi, qc in enumerate(_chunks(rank, cp)):
        delta = (do_parts[qi] * o_parts[qi]).sum(-1, keepdim=True)
        for ki, kc in enumerate(_chunks(src, cp)):
            s = _scores(q_parts[qi], k_parts[ki], scale, qc, kc, causal, window)
            if s is None:
                continue
            p = torch.exp(s - lse_parts[qi].unsqueeze(-1))
            dv[ki] += torch.matmul(p.transpose(-2, -1), do_parts[qi])
            dp = torch.matmul(do_parts[qi], v_parts[ki].transpose(-2, -1))
            ds = p * (dp - delta) * scale
            dq[qi] += torch.matmul(ds, k_parts[ki])
            dk[ki] += torch.matmul(ds.transpose(-2, -1), q_parts[qi])


def _rotate(tensors: list[torch.Tensor], group) -> tuple[list, list[torch.Tensor]]:
    """Start sending ``tensors`` to the next rank of the ring and receiving the previous rank's."""
    rank, size = dist.get_rank(group), dist.get_world_size(group)
    nxt, prv = dist.get_global_rank(group, (rank + 1) % size), dist.get_global_rank(group, (rank - 1) % size)
    tensors = [t.contiguous() for t in tensors]
    received = [torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    ops = [dist.P2POp(dist.isend, t, nxt, group) for t in tensors]
    ops += [dist.P2POp(dist.irecv, r, prv, group) for r in received]
    return dist.batch_isend_irecv(ops), received


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, kernel, window):
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        heads = q.size(1)
        b, _, s2, _ = q.shape
        dv = v.size(-1)  # the output's head size is the values' (MLA's differs from the keys')
        out = [q.new_zeros(b, heads, s2 // 2, dv, dtype=torch.float32) for _ in range(2)]
        lse = [q.new_full((b, heads, s2 // 2), float("-inf"), dtype=torch.float32) for _ in range(2)]
        block = [k.contiguous(), v.contiguous()]
        for step in range(cp):
            pending = _rotate(block, group) if step < cp - 1 else None
            src = (rank - step) % cp
            _block_forward(q, block[0], block[1], scale, rank, src, cp, causal, out, lse, kernel, window)
            if pending is not None:
                for w in pending[0]:
                    w.wait()
                block = pending[1]
        out, lse = torch.cat(out, dim=2).to(q.dtype), torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)  # the output as returned: in the compute precision
        ctx.group, ctx.causal, ctx.scale, ctx.kernel, ctx.window = group, causal, scale, kernel, window
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        group, causal, scale = ctx.group, ctx.causal, ctx.scale
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        heads, kv_heads = q.size(1), k.size(1)
        kernel = ctx.kernel
        dq = [torch.zeros(x.shape, dtype=torch.float32, device=x.device) for x in q.chunk(2, dim=2)]
        do = do.contiguous()
        zeros = lambda t: torch.zeros(t.shape, dtype=torch.float32, device=t.device)  # noqa: E731
        block = [k.contiguous(), v.contiguous(), zeros(k), zeros(v)]
        width = kv_heads if kernel else heads  # the kernel returns K/V gradients per K/V head
        for step in range(cp):
            src = (rank - step) % cp
            dk = [zeros(x) for x in _expand_kv(block[0], width).chunk(2, dim=2)]
            dv = [zeros(x) for x in _expand_kv(block[1], width).chunk(2, dim=2)]
            _block_backward(
                q, block[0], block[1], do, out, lse, scale, rank, src, cp, causal, dq, dk, dv, kernel, ctx.window
            )
            block[2] = block[2] + _fold_kv(torch.cat(dk, dim=2), kv_heads)
            block[3] = block[3] + _fold_kv(torch.cat(dv, dim=2), kv_heads)
            # pass the block and its gradients on; after cp steps the gradients are home (the
            # last step sends them alone: every rank has seen the K/V block)
            work, moved = _rotate(block if step < cp - 1 else block[2:], group)
            for w in work:
                w.wait()
            block = moved if step < cp - 1 else [None, None, *moved]
        dq = torch.cat(dq, dim=2).to(q.dtype)
        return dq, block[2].to(k.dtype), block[3].to(v.dtype), None, None, None, None, None


def ring_attention(
    q,
    k,
    v,
    group=None,
    causal: bool = True,
    scale: float | None = None,
    kernel: bool | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of this rank's queries over the whole (CP-sharded) sequence, ring style, over
    the last ``window`` positions only where given. Each block runs autoshard's Triton kernel
    when ``kernel`` (default: on CUDA, without a window), PyTorch math otherwise."""
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    if group is None or dist.get_world_size(group) == 1:
        return _local(q, k, v, causal, scale, window)
    if kernel is None:  # off for head sizes the kernel has no tile for (MLA's): the per-block math
        kernel = kernel_runs(q, k, v) and window is None
    if kernel:
        q, k, v = autocast_inputs(q, k, v)
    return checkpoint.unit(_RingAttention.apply, q, k, v, group, causal, scale, kernel, window)


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        checkpoint.read_by_keeper(x)  # the attention keeps what this gathers from it
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x, group=group)
        return unshard_sequence(parts, dim=2)

    @staticmethod
    def backward(ctx, grad):
        group = ctx.group
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        pieces = [shard_sequence(grad, cp, r, dim=2).contiguous() for r in range(cp)]
        out = torch.empty(pieces[rank].shape, dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter(out, pieces, group=group)
        return out, None


def allgather_attention(
    q, k, v, group=None, causal: bool = True, scale: float | None = None, window: int | None = None
) -> torch.Tensor:
    """Context parallelism by all-gathering K and V (LLaMA-3's choice for GQA, where K/V are
    small); over the last ``window`` positions only where given (torch's attention with the mask)."""
    scale = 1.0 / math.sqrt(q.size(-1)) if scale is None else scale
    if group is None or dist.get_world_size(group) == 1:
        return _local(q, k, v, causal, scale, window)
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    kernel = kernel_runs(q, k, v) and window is None
    if kernel:
        q, k, v = autocast_inputs(q, k, v)  # gathered at the kernel's precision
    k_full, v_full = _GatherSeq.apply(k, group), _GatherSeq.apply(v, group)
    if kernel:
        # the kernel per local chunk, over the keys up to that chunk's end (causal: its queries
        # are their tail), never the whole score matrix
        n = q.size(2) // 2
        outs = []
        for part, c in zip(q.chunk(2, dim=2), _chunks(rank, cp)):
            end = (c + 1) * n if causal else k_full.size(2)
            outs.append(flash_attention(part, k_full[:, :, :end], v_full[:, :, :end], causal=causal, scale=scale))
        return torch.cat(outs, dim=2)
    heads = q.size(1)
    k_full, v_full = _expand_kv(k_full, heads), _expand_kv(v_full, heads)
    mask = None
    if causal:
        n = q.size(2) // 2
        positions = torch.arange(q.size(2) * cp, device=q.device)
        mine = torch.cat([positions[c * n : (c + 1) * n] for c in _chunks(rank, cp)])
        mask = _allowed(mine, positions, window)
    # torch's attention with the layout's mask, not the written-out softmax: on a GPU its
    # memory-efficient kernel takes head sizes the Triton one does not (MLA's) without keeping
    # the scores for backward
    return torch.nn.functional.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask, scale=scale)


def _allowed(queries: torch.Tensor, keys: torch.Tensor, window: int | None) -> torch.Tensor:
    """Which keys each query sees, by global positions: the earlier ones and its own, within the window."""
    distance = queries[:, None] - keys[None, :]
    return (distance >= 0) if window is None else (distance >= 0) & (distance < window)


def _local(q, k, v, causal, scale, window=None):
    heads = q.size(1)
    k, v = _expand_kv(k, heads), _expand_kv(v, heads)
    if window is not None:
        positions = torch.arange(q.size(2), device=q.device)
        mask = _allowed(positions, positions, window)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
