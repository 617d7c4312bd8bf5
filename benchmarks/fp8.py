"""Blockwise FP8 GEMM TFLOP/s (autoshard.kernels.fp8.gemm: 1x128 activation tiles, 128x128 weight
blocks) against bf16 torch.matmul at LLaMA-3 405B and DeepSeek-V3 projection shapes, and a tiny
LLaMA-3 training step with its block Linears in FP8 against plain, both under bf16 autocast.

    python benchmarks/fp8.py            # on a CUDA GPU: the table (median of --reps, CUDA events)
    python benchmarks/fp8.py --check    # no GPU: the same code paths at tiny sizes under the
                                        # Triton interpreter, correctness only, no figures

Columns: bf16 matmul, the FP8 GEMM alone (operands quantised beforehand), and the FP8 GEMM with
the activation's 1x128 quantisation included (weights are quantised once per step, not per GEMM).
Target: FP8 GEMM >= 1.5x bf16 at the large (405B) shapes. FLOPs counted as 2*M*N*K.
"""

import argparse
import functools
import importlib.util
import os
import statistics
import sys

import torch

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, ROOT)
CUDA = torch.cuda.is_available()
if not CUDA:  # @triton.jit reads this when it decorates: before the kernels are imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import autoshard.runtime.fp8 as rt_fp8  # noqa: E402
from autoshard.kernels import fp8 as kfp8  # noqa: E402

TARGET = 1.5
ROWS_405B, ROWS_DSV3 = 8192, 4096
# (name, M, N, K): y[M, N] = x[M, K] @ W[N, K].T
SHAPES = [
    ("405B qkv", ROWS_405B, 16384 + 2 * 8 * 128, 16384),
    ("405B o", ROWS_405B, 16384, 16384),
    ("405B up/gate", ROWS_405B, 53248, 16384),
    ("405B down", ROWS_405B, 16384, 53248),
    ("V3 q_a (lora)", ROWS_DSV3, 1536, 7168),
    ("V3 q_b", ROWS_DSV3, 128 * (128 + 64), 1536),
    ("V3 kv_a (lora)", ROWS_DSV3, 512 + 64, 7168),
    ("V3 kv_b", ROWS_DSV3, 128 * (128 + 128), 512),
    ("V3 o", ROWS_DSV3, 7168, 128 * 128),
    ("V3 dense up/gate", ROWS_DSV3, 18432, 7168),
    ("V3 dense down", ROWS_DSV3, 7168, 18432),
    ("V3 expert up/gate", ROWS_DSV3, 2048, 7168),
    ("V3 expert down", ROWS_DSV3, 7168, 2048),
]
CHECK_SHAPES = [("check", 67, 256, 200)]


def _median_ms(fn, reps: int, warmup: int = 3) -> float:
    """Median of ``reps`` runs timed with CUDA events after ``warmup`` runs (no GPU: one run, no time)."""
    if not CUDA:
        fn()
        return float("nan")
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _gemm_row(name, m, n, k, device, reps):
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(m, k, device=device, generator=gen, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=device, generator=gen, dtype=torch.bfloat16)
    xq, xs = kfp8.quantize_rows(x)
    wq, ws = kfp8.quantize_blocks(w)
    rows = min(m, 256)  # correctness on a slice: the kernel against the torch definition
    got = kfp8.gemm(xq[:rows], xs[:rows], wq, ws, b_rows=False, out_dtype=torch.float32)
    want = rt_fp8.gemm_reference(xq[:rows], xs[:rows], wq, ws, False)
    err = (got - want).abs().max().item() / want.abs().max().item()
    if not err <= 1e-3:
        sys.exit(f"{name}: the FP8 GEMM differs from gemm_reference by {err:.3g} (relative)")
    bf16 = functools.partial(torch.matmul, x, w.t())
    fp8 = functools.partial(kfp8.gemm, xq, xs, wq, ws, b_rows=False, out_dtype=torch.bfloat16)

    def fp8_quant():
        q, s = kfp8.quantize_rows(x)
        return kfp8.gemm(q, s, wq, ws, b_rows=False, out_dtype=torch.bfloat16)

    t_bf16, t_fp8, t_q = (_median_ms(f, reps) for f in (bf16, fp8, fp8_quant))
    tf = lambda ms: 2 * m * n * k / (ms * 1e-3) / 1e12
    return t_bf16, t_fp8, t_q, tf, err


def _load_llama():
    spec = importlib.util.spec_from_file_location("llama3_example", os.path.join(ROOT, "examples", "llama3.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _fp8_forward(lin, x):
    return rt_fp8.fp8_linear(x, lin.weight, lin.bias)


def _to_fp8(model, blocks=None):
    """Every nn.Linear of the first ``blocks`` blocks' attention and MLP (None: all blocks) runs
    ``rt.fp8_linear``; the output head stays as it is."""
    swapped = 0
    for block in list(model.layers)[:blocks]:
        for mod in (*block.attn.modules(), *block.ffn.modules()):
            if isinstance(mod, torch.nn.Linear):
                mod.forward = functools.partial(_fp8_forward, mod)
                swapped += 1
    return swapped


def _train_step(model, tokens):
    with torch.autocast(tokens.device.type, dtype=torch.bfloat16):
        logits = model(tokens)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), tokens.flatten())
    loss.backward()
    return loss


def _step_row(config, batch, seq, device, reps, blocks=None):
    llama = _load_llama()
    torch.manual_seed(0)
    plain = llama.build(config).to(device)
    fp8 = llama.build(config).to(device)
    fp8.load_state_dict(plain.state_dict())
    swapped = _to_fp8(fp8, blocks)
    tokens = torch.randint(0, llama.CONFIGS[config].vocab, (batch, seq), device=device)
    losses = [_train_step(m, tokens).item() for m in (plain, fp8)]
    grads_ok = all(p.grad is not None and torch.isfinite(p.grad).all() for p in fp8.parameters())
    if not (grads_ok and abs(losses[0] - losses[1]) < 0.05 * abs(losses[0])):
        sys.exit(f"training step: losses {losses} (plain, fp8), finite fp8 gradients {grads_ok}")
    t_plain = _median_ms(functools.partial(_train_step, plain, tokens), reps)
    t_fp8 = _median_ms(functools.partial(_train_step, fp8, tokens), reps)
    return t_plain, t_fp8, swapped, losses


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="tiny sizes; without CUDA under the Triton interpreter")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--model-config", default="tiny", help="examples/llama3.py config for the training step")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    args = p.parse_args()
    if not CUDA and not args.check:
        print("no CUDA GPU available: no figures measured (run on a GPU, or --check for the interpreter run)")
        return
    device = "cuda" if CUDA else "cpu"
    if not CUDA:  # the runtime calls the kernels for CUDA tensors only: route its CPU calls to them too
        rt_fp8._kernels = lambda t: kfp8
    shapes = CHECK_SHAPES if args.check else SHAPES
    reps = 2 if args.check else args.reps
    where = torch.cuda.get_device_name() if CUDA else "cpu, Triton interpreter (correctness only, no timings)"
    print(f"device: {where}; blockwise FP8 (1x128 x 128x128, e4m3, fp32 promotion every 128) vs bf16")
    print(f"{'shape':<18s} {'M':>6s} {'N':>6s} {'K':>6s} {'bf16 TF/s':>10s} {'fp8 TF/s':>9s} {'+quant':>7s} "
          f"{'fp8/bf16':>8s} {'+quant':>7s}")  # fmt: skip
    met = []
    for name, m, n, k in shapes:
        t_bf16, t_fp8, t_q, tf, _ = _gemm_row(name, m, n, k, device, reps)
        if CUDA:
            ratio = t_bf16 / t_fp8
            if name.startswith("405B"):
                met.append(ratio >= TARGET)
            print(f"{name:<18s} {m:>6d} {n:>6d} {k:>6d} {tf(t_bf16):>10.0f} {tf(t_fp8):>9.0f} {tf(t_q):>7.0f} "
                  f"{ratio:>8.2f} {t_bf16 / t_q:>7.2f}")  # fmt: skip
        else:
            print(f"{name:<18s} {m:>6d} {n:>6d} {k:>6d} {'-':>10s} {'-':>9s} {'-':>7s} {'-':>8s} {'-':>7s}")
    batch, seq = (1, 64) if args.check else (args.batch, args.seq)
    blocks = 1 if args.check else None  # one block shows the paths; the interpreter is slow
    t_plain, t_fp8, swapped, losses = _step_row(args.model_config, batch, seq, device, reps, blocks)
    step = f"llama3 {args.model_config}, batch {batch} x seq {seq}, {swapped} Linears in FP8, bf16 autocast"
    if CUDA:
        speed = t_plain / t_fp8
        print(f"training step ({step}): bf16 {t_plain:.2f} ms, fp8 {t_fp8:.2f} ms, fp8/bf16 speed {speed:.2f}")
        if met:
            print(f"target FP8 GEMM >= {TARGET}x bf16 at the 405B shapes: met at {sum(met)} of {len(met)}")
    else:
        print(f"training step ({step}): loss {losses[0]:.4f} plain, {losses[1]:.4f} fp8; gradients finite")
        print("interpreter check: the FP8 quantisation, GEMM and training-step paths work (no figures measured)")


if __name__ == "__main__":
    main()
