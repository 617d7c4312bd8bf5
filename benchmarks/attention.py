"""Forward + backward TFLOP/s of autoshard's Triton FlashAttention against
torch.nn.functional.scaled_dot_product_attention (its fastest backend), causal, head dim 128, bf16.

    python benchmarks/attention.py                 # on a CUDA GPU: sequence 1K..16K
    TRITON_INTERPRET=1 python benchmarks/attention.py --check   # CPU: one tiny size, correctness only

Prints one row per sequence length: milliseconds and TFLOP/s of each, and the ratio (target >= 0.8).
FLOPs counted as the causal forward (2 matmuls, half the square) plus backward (2.5x forward).
"""

import argparse
import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from autoshard.runtime.attention import flash_attention  # noqa: E402


def _time(fn, reps: int) -> float:
    cuda = torch.cuda.is_available()
    times = []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _step(attn, q, k, v, do):
    out = attn(q, k, v)
    out.backward(do)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--check", action="store_true", help="tiny size on CPU under TRITON_INTERPRET=1")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch-tokens", type=int, default=16384, help="batch * seq kept constant")
    p.add_argument("--reps", type=int, default=10)
    args = p.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not args.check:
        sys.exit("no CUDA device: run on a GPU, or with TRITON_INTERPRET=1 ... --check for a correctness run")
    dtype = torch.bfloat16
    seqs = [64] if args.check else [1024, 2048, 4096, 8192, 16384]
    d = 128
    sdpa = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    ours = lambda q, k, v: flash_attention(q, k, v, causal=True)
    print(f"device: {torch.cuda.get_device_name() if device == 'cuda' else 'cpu (interpreter check)'}, bf16, "
          f"causal, head dim {d}, {args.heads} heads")  # fmt: skip
    print(
        f"{'seq':>6s} {'batch':>5s} {'sdpa ms':>9s} {'sdpa TF/s':>10s} {'ours ms':>9s} {'ours TF/s':>10s} {'ratio':>6s}"
    )
    for s in seqs:
        b = max(1, args.batch_tokens // s) if not args.check else 1
        h = args.heads if not args.check else 2
        q, k, v, do = (torch.randn(b, h, s, d, device=device, dtype=dtype) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        ref = sdpa(q, k, v)
        got = ours(q, k, v)
        err = (got.float() - ref.float()).abs().max().item()
        if err > 5e-2:
            sys.exit(f"seq {s}: kernel output differs from SDPA by {err:.3g}")
        reps = 2 if args.check else args.reps
        _step(sdpa, q, k, v, do), _step(ours, q, k, v, do)  # warm up / compile
        t_ref = _time(functools.partial(_step, sdpa, q, k, v, do), reps)
        t_ours = _time(functools.partial(_step, ours, q, k, v, do), reps)
        flops = 3.5 * (4 * b * h * s * s * d) / 2
        print(f"{s:>6d} {b:>5d} {t_ref * 1e3:>9.2f} {flops / t_ref / 1e12:>10.1f} {t_ours * 1e3:>9.2f} "
              f"{flops / t_ours / 1e12:>10.1f} {t_ref / t_ours:>6.2f}")  # fmt: skip


if __name__ == "__main__":
    main()
