"""``autoshard calibrate``: measure the machine this runs on into a hardware profile.

What is measured, one progress line each, and which profile field it becomes:

- On CPUs every rate below is one thread's, as each rank of an emitted program runs one
  (torchrun sets ``OMP_NUM_THREADS=1``); ``cores`` says how many such ranks run at once.
- GEMMs at shapes plans produce (tokens x hidden x ffn, small to large), a linear layer's
  forward and backward from fp32 weights under autocast, as the program runs them, in each dtype the
  emitted program may compute in (bf16 on GPUs; fp32 and bf16 on CPUs, where the program
  computes in fp32 unless run with ``--compute-dtype bf16``): ``peak_tflops`` per dtype is the
  best rate measured. Without ``--extends`` that rate is the peak and ``matmul_efficiency`` is 1
  (the cost model's peak x efficiency is then the measured best); extending a profile keeps its
  bf16 peak and writes ``matmul_efficiency`` = best / that peak.
- Host costs: ``op_overhead_us``, the host time of one op whatever its size (a chain of tiny ops
  forward and backward; it matters where kernels do not run ahead of the host, on CPUs), and
  ``checkpoint_op_overhead_us``, what selective checkpointing adds to it per op of a layer it
  wraps (its policy sees every op of the forward and of the replay); on CPUs
  ``cores``, how many ranks' worth of work the host's CPUs do at once (measured: a reference
  model's training step in one process against one per CPU running together), and where the
  largest ``--ranks`` outnumbers the CPUs, ``oversubscribed_cores``, the same with that many.
- The optimizer step: the gradient norm and the program's own AdamW (fp32 masters of bf16
  weights) on layer-sized weights, their time per parameter at the measured memory bandwidth ->
  ``optimizer_bytes_per_param``.
- Memory bandwidth: a large tensor copy (read + write) -> ``hbm_gbps``.
- The memory-bound ops (CPUs): a reference decoder's forward and backward
  (``calibrate_reference``) against the cost model's prediction from the fields above; what it
  lacks goes to its memory-bound ops -> ``pointwise_efficiency``.
- Attention: torch SDPA, causal, forward and backward at a short length with head dimensions 32
  and 64 and at a long length, each direction fitted to ``cost_models.compute.attention_time``'s
  form (matmuls at a rate, the softmax's work per score, both slowed on short sequences by
  (keys + half length) / keys) -> ``attention_efficiency``, ``attention_score_ns``,
  ``attention_half_length`` and the backward's ``attention_backward`` (its matmuls' time over
  the forward's), ``attention_backward_score_ns``, ``attention_backward_half_length``: a CPU's
  kernels spend most of a short sequence's time per score, whatever the head dimension.
- Every collective the runtime uses (all-reduce, all-gather, reduce-scatter, all-to-all, and the
  ring send/receive of ``batch_isend_irecv`` that ring attention and the pipeline use) over each
  rank count of ``--ranks``, processes on this host (gloo on CPUs, NCCL where there is a GPU per
  rank), at several message sizes. ``cost_models.comm`` prices one as (bytes its formula counts)
  / bandwidth + steps x latency; a least-squares fit of that form over every (ranks, size) gives
  ``collectives.<kind> = { gbps, latency_us }``.
- Overlap (``overlap.<kind>``): how much of each kind of communication the emitted program hides
  beside compute, measured with the runtime's own primitives where it launches the transfer
  asynchronously: compute alone, transfer alone and both as the program runs them; the hidden
  share is (compute + transfer - both) / min(compute, transfer), clipped to [0, 1]. Where the
  program waits on each transfer before it computes on (``SYNCHRONOUS``) the share is 0 by
  construction, and the profile says why instead of timing noise.

Writing is atomic: the profile is loaded and validated from a temporary file beside the target,
which then replaces it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import fields as dataclass_fields
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from autoshard import progress
from autoshard.calibrate_reference import ADAMW, measured_step, predicted_step, training_step
from autoshard.cost_models import hardware
from autoshard.errors import AutoshardError
from autoshard.runtime import ring_attention as ra
from autoshard.runtime.checkpoint import Checkpoint
from autoshard.runtime.collectives import _gather_into, _scatter_from
from autoshard.runtime.host import keep_freed_memory
from autoshard.runtime.program import _adamw, lower_parameters
from autoshard.runtime.reduction import BucketedReduction

GEMM_SHAPES = ((256, 256, 256), (512, 1024, 512), (1024, 1024, 1024), (2048, 1024, 4096), (2048, 2048, 2048))
QUICK_GEMM_SHAPES = GEMM_SHAPES[:3]
MESSAGE_BYTES = (2**14, 2**18, 2**21, 2**23)
QUICK_MESSAGE_BYTES = (2**14, 2**20)

# Kinds of communication the emitted program runs blocking: what it waits on before computing on.
SYNCHRONOUS = {
    "tp": "runtime.collectives runs each TP collective blocking, inside the autograd function needing it",
    "ep": "runtime.moe's expert GEMMs read each all-to-all's rows at once, and torch's DualPipeV runs its "
    "overlapped forward and backward pairs one after the other",
}


def calibrate(out: str, ranks: tuple[int, ...] = (2, 4), extends: str | None = None, quick: bool = False) -> dict:
    """Measure this machine and write the profile to ``out``; returns the fields written."""
    ranks = _check_ranks(ranks)
    path = _check_out(Path(out))
    parent = hardware.load(extends) if extends else None
    device = "cuda" if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()
    _say(f"calibrating on {device} ({_machine(device)}), ranks {', '.join(map(str, ranks))}")
    with _as_a_rank(device):
        gemm = {dtype: measure_gemms(device, quick, dtype) for dtype in _dtypes(device)}
        peaks = {dtype: max(rates.values()) for dtype, rates in gemm.items()}
        mem = measure_memory(device, quick)
        attn = measure_attention(device, peaks["bf16"], quick)
        host = measure_host(device, quick, ranks)
        host["optimizer_bytes_per_param"] = measure_optimizer(device, quick, mem)
    points, overlap, wait = measure_distributed(ranks, device, quick)
    fields = {"name": path.stem} | ({"extends": extends} if extends else {})
    fields |= _fields(device, peaks, mem, attn, fit_collectives(points), overlap, parent, ranks) | host
    fields["blocking_wait_us"] = _round(wait)
    if device == "cpu":
        fields["pointwise_efficiency"] = measure_pointwise(fields, parent, quick)
    elapsed = time.perf_counter() - start
    backends = sorted({p["backend"] for p in points})
    _write(path, fields, _header(device, ranks, elapsed, gemm["bf16"], extends, backends))
    _say(f"wrote {out} in {elapsed:.0f} s")
    return fields


@contextlib.contextmanager
def _as_a_rank(device: str):
    """Measure as a rank of an emitted program runs: on CPUs one thread (torchrun's
    OMP_NUM_THREADS=1), so the rates are one core's and ``cores`` says how many ranks run at those
    rates at once, and freed memory kept as the program's ranks keep it (``runtime.host``)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1 if device == "cpu" else threads)
    if device == "cpu":
        keep_freed_memory()
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def measure_rates(device: str, quick: bool) -> dict:
    """The rates a profile's compute and memory-bound work are priced at, measured here as a rank
    runs: ``peak_tflops`` (the best GEMM per dtype, with ``matmul_efficiency`` 1) and
    ``hbm_gbps``; the seconds' part of ``calibrate``, for a profile that extends one measured on
    another machine of this kind."""
    with _as_a_rank(device):
        peaks = {dtype: max(measure_gemms(device, quick, dtype).values()) for dtype in _dtypes(device)}
        mem = measure_memory(device, quick)
    return {
        "peak_tflops": {dtype: _round(rate / 1e12) for dtype, rate in peaks.items()},
        "matmul_efficiency": 1.0,
        "hbm_gbps": _round(mem / 1e9),
    }


def _check_ranks(ranks: tuple[int, ...]) -> tuple[int, ...]:
    if not ranks or any(n < 2 for n in ranks):
        raise AutoshardError(f"--ranks takes process counts of 2 or more, e.g. 2,4; got {','.join(map(str, ranks))}")
    return tuple(sorted(set(ranks)))


def _check_out(path: Path) -> Path:
    """``path``, where a profile can be written (checked before minutes of measuring)."""
    if path.suffix != ".toml":
        raise AutoshardError(f"calibrate writes a .toml profile; give -o a path ending in .toml, not {path}")
    if not path.parent.is_dir():
        raise AutoshardError(f"calibrate: directory {path.parent} does not exist; create it or choose another -o")
    return path


def _say(line: str) -> None:
    progress.echo(f"calibrate: {line}")


def _machine(device: str) -> str:
    if device == "cuda":
        return torch.cuda.get_device_name()
    return f"{os.cpu_count()} cores, {torch.get_num_threads()} threads"


def _median_time(fn, device: str, min_s: float = 0.2, reps: int = 3) -> float:
    """Median seconds of ``fn()`` over at least ``reps`` runs lasting ``min_s`` together, after
    one warm-up run. On a CPU running one thread (as each rank does) the seconds are this
    thread's CPU time: other jobs on a shared machine stretch the wall clock, not the work, so
    the profile describes the host as the program's ranks find it when they have it to
    themselves (``cores`` says how many share it)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    clock = time.thread_time if device == "cpu" and torch.get_num_threads() == 1 else time.perf_counter
    fn()
    sync()
    times: list[float] = []
    while len(times) < reps or sum(times) < min_s:
        t = clock()
        fn()
        sync()
        times.append(clock() - t)
    return statistics.median(times)


DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _dtypes(device: str) -> tuple[str, ...]:
    """The dtypes the emitted program computes in here (CPUs: fp32 by default, bf16 on request)."""
    return ("bf16",) if device == "cuda" else ("bf16", "fp32")


@progress.stage("GEMMs")
def measure_gemms(device: str, quick: bool, dtype: str = "bf16") -> dict[tuple[int, int, int], float]:
    """FLOP/s of a linear layer's three GEMMs (forward, input and weight gradients: m x k x n
    each) per plan-like shape, as the program runs them: fp32 weights, computed in ``dtype``
    under autocast (its casts included). A standalone bf16 GEMM is 2-3x faster than that on a
    CPU core (measured here: 1.1 against 0.1-0.5 TFLOP/s), which the programs never see."""
    out = {}
    for m, k, n in QUICK_GEMM_SHAPES if quick else GEMM_SHAPES:
        x = torch.randn(m, k, device=device, requires_grad=True)
        w = torch.randn(n, k, device=device, requires_grad=True)

        def step(x=x, w=w):
            with torch.autocast(device, dtype=DTYPES[dtype], enabled=dtype != "fp32"):
                y = F.linear(x, w)
            y.float().sum().backward()

        t = _median_time(step, device, 0.05 if quick else 0.2)
        out[(m, k, n)] = 3 * 2 * m * k * n / t
        _say(f"gemm {dtype} {m}x{k}x{n} forward and backward: {out[(m, k, n)] / 1e9:.1f} GFLOP/s")
    return out


@progress.stage("memory copy")
def measure_memory(device: str, quick: bool) -> float:
    """Bytes/s of a large copy (each element read once and written once)."""
    elems = 2**23 if quick else 2**25
    x = torch.randn(elems, device=device)
    y = torch.empty_like(x)
    t = _median_time(lambda: y.copy_(x), device, 0.05 if quick else 0.2)
    rate = 2 * x.numel() * x.element_size() / t
    _say(f"memory copy {x.numel() * x.element_size() / 2**20:.0f} MiB: {rate / 1e9:.1f} GB/s")
    return rate


ATTENTION_SHAPES = ((128, 32), (128, 64))  # (keys, head dim): a small and a larger head, short


@progress.stage("attention")
def measure_attention(device: str, peak: float, quick: bool) -> dict:
    """The attention fields of ``cost_models.compute.attention_time`` (efficiency, half length
    and per-score time, forward and backward): causal SDPA (bf16, 2 sequences x 8 heads) at a
    short length with two head dimensions, which sets the matmuls' share against the per-score
    work, and at a long length, which sets the half length; the fit reproduces all three."""
    shapes = (*ATTENTION_SHAPES, (512 if quick else 1024, 64))
    forward, backward = [], []
    for s, d in shapes:
        q, k, v = (torch.randn(2, 8, s, d, device=device, dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        grad = torch.randn_like(q)

        def attend(q=q, k=k, v=v):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        def both(grad=grad, attend=attend):
            attend().backward(grad)

        t_f = _median_time(attend, device, 0.05 if quick else 0.2)
        t_b = max(_median_time(both, device, 0.05 if quick else 0.2) - t_f, 1e-3 * t_f)
        forward.append(t_f)
        backward.append(t_b)
        _say(f"attention causal {s} keys, head dim {d}: forward {t_f * 1e3:.2f} ms, backward {t_b * 1e3:.2f} ms")
    rate, half, per_score = _attention_fit(shapes, forward)
    rate_b, half_b, per_score_b = _attention_fit(shapes, backward)
    eff = min(1.0, rate / peak)
    out = {
        "attention_efficiency": _round(eff),
        "attention_half_length": _round(half),
        "attention_score_ns": _round(per_score * 1e9),
        "attention_backward": _round(peak * eff / rate_b),
        "attention_backward_half_length": _round(half_b),
        "attention_backward_score_ns": _round(per_score_b * 1e9),
    }
    _say(
        f"attention: matmuls at {eff:.2f} of the peak, {out['attention_score_ns']:.3g} ns per score, half speed at "
        f"{half:.0f} keys; backward matmuls {out['attention_backward']:.2f}x, {out['attention_backward_score_ns']:.3g} "
        f"ns per score, half speed at {half_b:.0f} keys"
    )
    return out


def _attention_fit(shapes, seconds: list[float]) -> tuple[float, float, float]:
    """(matmul FLOP/s, half length, seconds per score) of t = (F / rate + S x per_score) x
    (s + half) / s through the three measurements of ``measure_attention``: the two head
    dimensions at one length split the time into matmuls (which grow with the head dimension)
    and per-score work; the long length gives the half length. Where the matmuls do not show
    (no growth with the head dimension) their rate is taken as infinite (a huge number); where
    nothing slows short sequences the half length is 0."""
    (s1, d1), (_, d2), (s3, d3) = shapes
    flops = [2 * 2 * 8 * s * s * (d + d) / 2 for s, d in shapes]
    scores = [2 * 8 * s * s / 2 for s, _ in shapes]
    t1, t2, t3 = seconds
    # at length s1: t = k1 (F / rate + S c), F doubling with the head dimension, S the same
    matmul1 = max(0.0, (t2 - t1) / (flops[1] / flops[0] - 1))  # k1 F1 / rate
    score1 = max(0.0, t1 - matmul1)  # k1 S1 c
    at3 = matmul1 * flops[2] / flops[0] + score1 * scores[2] / scores[0]  # k1 (F3 / rate + S3 c)
    ratio = t3 / at3  # k3 / k1 = ((s3 + h) / s3) / ((s1 + h) / s1)
    r = s3 / s1
    half = 0.0 if ratio >= 1 else (s3 * (1 - ratio) / (ratio * r - 1) if ratio * r > 1 else 1e6)
    k1 = (s1 + half) / s1
    rate = k1 * flops[0] / matmul1 if matmul1 > 0 else 1e30
    return rate, half, score1 / (k1 * scores[0])


def measure_host(device: str, quick: bool, ranks: tuple[int, ...] = ()) -> dict:
    """``op_overhead_us``, ``checkpoint_op_overhead_us``, ``fsdp_unit_overhead_us`` and, on CPUs,
    ``cores`` (and ``oversubscribed_cores``)."""
    out = {"op_overhead_us": _round(measure_op_overhead(device, quick))}
    out["checkpoint_op_overhead_us"] = _round(measure_checkpoint_overhead(device, quick))
    out["fsdp_unit_overhead_us"] = _round(measure_fsdp_overhead(device, quick))
    if device == "cpu":
        out |= measure_cores(quick, ranks)
    return out


@progress.stage("optimizer step")
def measure_optimizer(device: str, quick: bool, bandwidth: float) -> float:
    """``optimizer_bytes_per_param``: what the program does once a step per parameter, on
    weights of layer-like sizes: the gradient norm it clips by (``state.clip_gradients``, one
    norm per tensor) and its own AdamW step (``runtime.program``'s, over bf16 weights with fp32
    gradients and masters, as a plan's bf16 program steps them); their time per parameter at the
    measured memory bandwidth, so that the cost model's bytes / bandwidth reproduces it
    (per-tensor host time included)."""
    tensors, rows = (12, 512) if quick else (24, 512)  # well beyond the caches either way
    params = [torch.nn.Parameter(torch.randn(rows, 512, device=device)) for _ in range(tensors)]
    lower_parameters(params, "bf16")
    for p in params:
        p.grad = torch.randn(p.shape, device=device)
    optim = _adamw(params, False, None, ADAMW)

    def step():
        total = torch.zeros((), dtype=torch.float64, device=device)
        for p in params:
            total += torch.linalg.vector_norm(p.grad).double() ** 2
        optim.step()

    t = _median_time(step, device, 0.1 if quick else 0.4)
    count = sum(p.numel() for p in params)
    out = _round(t / count * bandwidth)
    _say(f"optimizer step {count / 1e6:.1f}M parameters: {t * 1e3:.1f} ms, {out:.0f} bytes per parameter")
    return out


@progress.stage("cores the ranks share")
def measure_cores(quick: bool, ranks: tuple[int, ...] = ()) -> dict[str, float]:
    """``cores``: how many one-thread ranks' worth of work this host does at once, measured: the
    reference model's training step (``calibrate_reference.training_step``: the GEMMs,
    attention, memory-bound ops and optimizer step a rank runs) in one process, then in one
    process per CPU at the same time: the CPUs times the rate each process then keeps over the
    rate of one alone. Virtual CPUs that are hyperthreads of one core, or cores that share the
    memory bus, count for less than one. Where the largest of ``ranks`` outnumbers the CPUs, that
    many processes again, time-sliced: ``oversubscribed_cores`` (each refills its caches after
    every switch). Rates are steps per CPU second of each process (other jobs on a shared machine
    take CPU time, not speed), so the figures describe the host with the ranks alone on it."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    seconds = 1.5 if quick else 4.0
    alone = _spinning(1, seconds)
    together = _spinning(cpus, seconds) if cpus > 1 else alone
    out = {"cores": _round(min(float(cpus), max(1.0, cpus * together / alone)))}
    _say(f"cores the ranks share: {cpus} CPUs do the work of {out['cores']:.2f} ranks at once")
    most = max(ranks, default=0)
    if most > cpus:
        over = _round(min(out["cores"], max(1.0, cpus * _spinning(most, seconds) / alone)))
        out["oversubscribed_cores"] = over
        _say(f"cores the ranks share: {most} ranks on {cpus} CPUs do the work of {over:.2f} at once")
    return out


def _spinning(processes: int, seconds: float) -> float:
    """Training steps per CPU second of each of ``processes`` processes (their mean), started
    together once all have loaded torch and built the reference model, over ``seconds``."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    with tempfile.TemporaryDirectory() as tmp:
        code = f"from autoshard.calibrate import _spin; _spin({tmp!r}, {processes}, {seconds!r})"
        runs = [
            subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=env)
            for _ in range(processes)
        ]
        return statistics.mean(float(r.communicate()[0].split()[-1]) for r in runs)


def _spin(tmp: str, processes: int, seconds: float) -> None:
    """One process of ``_spinning``: ready, wait for the others, then print the steps per CPU
    second it completes over (about) ``seconds`` of wall time."""
    torch.set_num_threads(1)
    keep_freed_memory()  # as the program's ranks allocate
    step = training_step()[0]
    step()
    Path(tmp, f"ready-{os.getpid()}").touch()
    while len(os.listdir(tmp)) < processes:
        time.sleep(0.002)
    count, cpu, end = 0, time.thread_time(), time.perf_counter() + seconds
    while time.perf_counter() < end or count == 0:
        step()
        count += 1
    print(count / (time.thread_time() - cpu))


@progress.stage("reference model")
def measure_pointwise(fields: dict, parent, quick: bool) -> float:
    """``pointwise_efficiency`` (CPUs): the reference model's forward and backward
    (``calibrate_reference``) measured, and the cost model's prediction of it from the fields
    measured so far; what the prediction lacks is put on its memory-bound ops, whose achieved
    bandwidth share this is (at most 1: a prediction already slower leaves it at 1)."""
    names = {f.name for f in dataclass_fields(hardware.Hardware)}
    hw = replace(parent or hardware.load("cpu"), **{k: v for k, v in fields.items() if k in names})
    hw = replace(hw, pointwise_efficiency=1.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seconds, pointwise = predicted_step(hw)
        measured = measured_step(lambda fn: _median_time(fn, "cpu", 0.3 if quick else 1.0))
    finally:
        torch.set_num_threads(threads)
    rest = measured - (seconds - pointwise)
    out = _round(min(1.0, max(0.01, pointwise / rest))) if rest > 0 else 1.0
    _say(
        f"reference model forward and backward: {measured * 1e3:.1f} ms, predicted {seconds * 1e3:.1f} ms "
        f"({pointwise * 1e3:.1f} memory-bound): memory-bound ops at {out:.2f} of the copy bandwidth"
    )
    return out


@progress.stage("host time per op")
def measure_op_overhead(device: str, quick: bool, ops: int = 200) -> float:
    """Microseconds per forward op of a chain of ops on 16 x 16 elements (a linear and a scale in
    turn, under bf16 autocast as the programs run), forward and backward: three ops per forward
    op, as ``cost_models.layers.LayerCosts.op_overhead`` counts them. One thread on CPUs: each
    rank of an emitted program runs with one."""
    us = _time_chain(device, quick, ops) / (3 * (ops + 1)) * 1e6
    _say(f"host time per op: {us:.1f} us")
    return us


@progress.stage("checkpointing's host time")
def measure_checkpoint_overhead(device: str, quick: bool, ops: int = 200) -> float:
    """Microseconds a selectively checkpointed layer adds per forward op beyond the FLOPs it
    recomputes: ``measure_op_overhead``'s chain run inside the runtime's ``Checkpoint`` keeping
    its linears' outputs (torch's selective checkpoint; the runtime's policy sees every op of
    the forward and of its replay, which reruns the rest), against the chain alone."""
    wrapped = _time_chain(device, quick, ops, lambda layer: Checkpoint(layer, recompute=["activation"]))
    us = max(0.0, (wrapped - _time_chain(device, quick, ops)) / (ops + 1) * 1e6)
    _say(f"selective checkpointing's host time per op: {us:.1f} us")
    return us


def _time_chain(device: str, quick: bool, ops: int, wrap=None) -> float:
    """Median seconds of the forward and backward of ``ops`` ops in a chain (a linear and a scale
    in turn on 16 x 16 elements, under bf16 autocast), the chain wrapped by ``wrap`` if given;
    one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    x, w = (torch.randn(16, 16, device=device, requires_grad=True) for _ in range(2))

    def layer(y):
        for _ in range(ops // 2):
            y = F.linear(y, w) * 1.0001
        return y

    fn = wrap(layer) if wrap else layer

    def chain():
        with torch.autocast(device, dtype=torch.bfloat16):
            y = fn(x)
        y.float().sum().backward()

    try:
        return _median_time(chain, device, 0.2 if quick else 1.0, reps=5)
    finally:
        torch.set_num_threads(threads)


@progress.stage("FSDP2's host time")
def measure_fsdp_overhead(device: str, quick: bool, units: int = 8) -> float:
    """Microseconds FSDP2 adds per unit per forward and backward beyond its collectives: a
    chain of small linear layers, each its own ``fully_shard`` unit resharded after the forward
    (ZeRO-3, as ``runtime.program`` wraps a layer), in a process group of one rank (whose
    collectives are copies), against the chain alone."""
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "fsdp.json"
        mp.spawn(_fsdp_main, args=(_free_port(), str(result), device, quick, units), nprocs=1, join=True)
        us = json.loads(result.read_text())["us"]
    _say(f"FSDP2's host time per unit, forward and backward: {us:.0f} us")
    return us


def _fsdp_main(rank: int, port: int, result: str, device: str, quick: bool, units: int) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # lazy: only this process

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1 if device == "cpu" else torch.get_num_threads())
    dist.init_process_group("nccl" if device == "cuda" else "gloo", rank=0, world_size=1)
    try:
        dev = "cuda:0" if device == "cuda" else "cpu"
        x = torch.randn(16, 64, device=dev)

        def chain():
            return torch.nn.Sequential(*(torch.nn.Linear(64, 64, device=dev) for _ in range(units)))

        def timed(model):
            def step():
                model(x).float().sum().backward()

            return _median_time(step, device, 0.2 if quick else 1.0, reps=5)

        plain, sharded = chain(), chain()
        mp_policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in sharded:
            fully_shard(layer, reshard_after_forward=True, mp_policy=mp_policy)
        with torch.autocast(device, dtype=torch.bfloat16):
            extra = timed(sharded) - timed(plain)
        Path(result).write_text(json.dumps({"us": max(0.0, extra / units * 1e6)}))
    finally:
        dist.destroy_process_group()


def measure_distributed(ranks: tuple[int, ...], device: str, quick: bool) -> tuple[list[dict], dict, float]:
    """Per world size in ``ranks``, processes spawned on this host time every collective (and, in
    the smallest world, the overlap of the asynchronous kinds, in the largest the wait of a
    blocking one between computations): (timing points, overlap shares, microseconds)."""
    points: list[dict] = []
    overlap: dict = {}
    for n in ranks:
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / "result.json"
            args = (n, _free_port(), str(result), device, quick, n == ranks[0])
            try:
                mp.spawn(_rank_main, args=args, nprocs=n, join=True)
            except Exception as e:  # a rank failed: its own traceback is already on stderr
                if not result.is_file():
                    raise AutoshardError(
                        f"calibrate: the {n}-process measurement failed ({e}); see the output above"
                    ) from e
                # rank 0 wrote every measurement; a rank that fails while its process group is
                # torn down (gloo aborts at exit now and then) loses nothing measured
                _say(f"{n} processes: a rank failed at exit after the measurements ({e})")
            data = json.loads(result.read_text())
        points += data["points"]
        overlap |= data["overlap"]
        wait = data["wait_us"]  # the largest world's: where the ranks outnumber the CPUs, if anywhere
    _say(f"a blocking collective between computations waits {wait:.0f} us more with {ranks[-1]} ranks")
    return points, overlap, wait


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def fit_collectives(points: list[dict]) -> dict[str, dict[str, float]]:
    """Per kind, the ``{gbps, latency_us}`` that fit seconds = volume / bandwidth + steps x
    latency best in least squares over its points (``volume`` the bytes ``cost_models.comm``
    counts, ``steps`` its latency steps), neither negative."""
    out = {}
    for kind in hardware.COLLECTIVES:
        pts = [(p["volume"], p["steps"], p["seconds"]) for p in points if p["kind"] == kind]
        if pts:
            inv_bw, lat = _nonnegative_fit(pts)
            out[kind] = {"gbps": _round(1 / inv_bw / 1e9), "latency_us": _round(lat * 1e6)}
    return out


def _nonnegative_fit(pts: list[tuple[float, float, float]]) -> tuple[float, float]:
    """(seconds per byte, seconds per step) minimising the squared relative error, both >= 0
    (a negative latency is refitted as zero)."""
    a = np.array([[v / t, s / t] for v, s, t in pts])
    y = np.ones(len(pts))
    (inv_bw, lat), *_ = np.linalg.lstsq(a, y, rcond=None)
    if lat < 0 or inv_bw <= 0:
        lat = 0.0
        inv_bw = float(a[:, 0] @ y / (a[:, 0] @ a[:, 0]))
    return float(inv_bw), float(lat)


def _round(x: float) -> float:
    """Four significant figures: what a timing on a shared machine can claim."""
    return float(f"{x:.4g}") if x else 0.0


def _fields(device, peaks, mem, attn, collectives, overlap, parent, ranks) -> dict:
    """The profile's fields: the measured ones, and without a parent the ones it needs besides
    (this host's memory and core count; its loopback as its only link)."""
    fields: dict = {"hbm_gbps": _round(mem / 1e9), **attn}
    spec = parent.peak_tflops.get("bf16") if parent else None
    if spec and spec * 1e12 >= peaks["bf16"]:
        fields["matmul_efficiency"] = _round(peaks["bf16"] / (spec * 1e12))
    else:  # the measured best is the peak
        fields["peak_tflops"] = {dtype: _round(rate / 1e12) for dtype, rate in peaks.items()}
        fields["matmul_efficiency"] = 1.0
    fields["collectives"] = collectives
    fields["overlap"] = {k: overlap.get(k, 0.0) for k in hardware.OVERLAP_KINDS}
    if parent is None:
        fields |= _host_fields(device, collectives, ranks)
    return fields


def _host_fields(device: str, collectives: dict, ranks: tuple[int, ...]) -> dict:
    """What a profile needs that calibrate does not measure: memory, link fall-backs (the
    measured send), the domain (the most ranks measured), no price."""
    if device == "cuda":
        memory_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
        cores = torch.cuda.get_device_properties(0).multi_processor_count
    else:
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
        cores = torch.get_num_threads()
    send = collectives["send"]
    return {
        "hbm_gb": _round(memory_gb),
        "nvlink_gbps": send["gbps"],
        "nvlink_latency_us": send["latency_us"],
        "nvlink_domain": max(ranks),
        "network_gbps": send["gbps"],
        "network_latency_us": send["latency_us"],
        "link_efficiency": 1.0,
        "sm_count": cores,
        "price_per_gpu_hour": 0.0,
    }


def _header(device: str, ranks, elapsed: float, gemm: dict, extends: str | None, backends: list[str]) -> list[str]:
    when = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    best = max(gemm, key=gemm.get)
    lines = [
        f"Measured by `autoshard calibrate` on {when}: {_machine(device)}, "
        f"processes {', '.join(map(str, ranks))} ({', '.join(backends)}), {elapsed:.0f} s.",
        f"GEMMs: best {gemm[best] / 1e9:.1f} GFLOP/s at {'x'.join(map(str, best))}; "
        + ", ".join(f"{'x'.join(map(str, s))} {r / 1e9:.1f}" for s, r in gemm.items() if s != best),
        "collectives: fitted bus bandwidth and per-step latency (cost_models.comm's formulas).",
        "overlap: measured with the runtime's own primitives where it launches transfers asynchronously;",
    ]
    lines += [f"  {kind} = 0 by construction: {why}" for kind, why in SYNCHRONOUS.items()]
    if extends:
        lines.append(f"Fields not measured come from the profile {extends!r}.")
    return lines


def _write(path: Path, fields: dict, header: list[str]) -> None:
    """Write the profile atomically: a temporary file beside ``path``, validated by loading it,
    then renamed over it. Nothing is left behind on failure."""
    _check_out(path)
    text = "".join(f"# {line}\n" for line in header) + _toml(fields)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".toml", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        hardware.load(tmp)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _toml(fields: dict) -> str:
    """The fields as TOML (flat values and inline tables, the profiles' own style)."""

    def value(v) -> str:
        if isinstance(v, dict):
            return "{ " + ", ".join(f"{k} = {value(x)}" for k, x in v.items()) + " }"
        if isinstance(v, str):
            return json.dumps(v)
        return repr(v) if isinstance(v, float) and math.isfinite(v) else str(v)

    order = ["name", "extends"] + [k for k in fields if k not in ("name", "extends")]
    return "".join(f"{k} = {value(fields[k])}\n" for k in order if k in fields)


# ---- what each spawned rank runs ----


def _rank_main(rank: int, n: int, port: int, result: str, device: str, quick: bool, overlaps: bool) -> None:
    """One process of an ``n``-rank measurement: every collective at every size, and, where
    ``overlaps``, the hidden shares of the asynchronous kinds; rank 0 writes them to ``result``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    nccl = device == "cuda" and torch.cuda.device_count() >= n
    if nccl:
        torch.cuda.set_device(rank)
    dev = f"cuda:{rank}" if nccl else "cpu"
    backend = "nccl" if nccl else "gloo"
    dist.init_process_group(backend, rank=rank, world_size=n, timeout=timedelta(seconds=120))
    if rank == 0:
        _say(f"{n} processes over {backend}{'' if nccl or device == 'cpu' else ' (fewer GPUs than processes)'}")
    try:
        points = [p for kind in hardware.COLLECTIVES for p in _time_collective(kind, n, dev, quick)]
        overlap = {"cp": _overlap_cp(dev, quick), "pp": _overlap_pp(dev, quick), "dp": _overlap_dp(dev, quick)}
        overlap = overlap if overlaps else {}
        wait = _blocking_wait(dev, quick)
        if rank == 0:
            tmp = Path(result).with_suffix(".part")
            tmp.write_text(json.dumps({"points": points, "overlap": overlap, "wait_us": wait}))
            tmp.replace(result)  # whole or absent: the parent reads it even if a rank fails at exit
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _rank_times(fn, reps: int, dev: str) -> float:
    """The slowest rank's median seconds of ``fn()`` over ``reps`` runs after a warm-up (every rank
    runs the same count: collectives must match)."""
    sync = torch.cuda.synchronize if dev.startswith("cuda") else (lambda: None)
    fn()
    sync()
    dist.barrier()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    slowest = torch.tensor([statistics.median(times)], dtype=torch.float64, device=dev)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(slowest.item())


def _collective_op(kind: str, nbytes: int, n: int, dev: str):
    """(operation, volume, steps) of one ``kind`` collective handed ``nbytes`` as
    ``cost_models.comm`` counts them (a gathered size, a size before scattering, what one rank
    sends)."""
    elems = max(n, nbytes // 4 // n * n)
    x = torch.randn(elems, device=dev)
    share = (n - 1) / n * elems * 4
    if kind == "all_reduce":
        return (lambda: dist.all_reduce(x)), 2 * share, 2 * (n - 1)
    if kind == "all_gather":
        part = x[: elems // n].clone()
        return (lambda: _gather_into(x, part)), share, n - 1
    if kind == "reduce_scatter":
        part = x[: elems // n].clone()
        return (lambda: _scatter_from(part, x)), share, n - 1
    if kind == "all_to_all":
        y = torch.empty_like(x)
        return (lambda: dist.all_to_all_single(y, x)), share, n - 1
    return _ring_send([x]), elems * 4, 1


def _ring_send(tensors: list):
    """One rotation of ``tensors`` around the ring with ``batch_isend_irecv`` (what ring attention
    and the pipeline's sends run), waited."""

    def op():
        for w in ra._rotate(tensors, dist.group.WORLD)[0]:
            w.wait()

    return op


def _time_collective(kind: str, n: int, dev: str, quick: bool) -> list[dict]:
    out = []
    for nbytes in QUICK_MESSAGE_BYTES if quick else MESSAGE_BYTES:
        op, volume, steps = _collective_op(kind, nbytes, n, dev)
        t = _rank_times(op, 3 if quick else 5, dev)
        out.append(
            {"kind": kind, "ranks": n, "backend": dist.get_backend(), "bytes": nbytes, "volume": volume, "steps": steps}
            | {"seconds": t}
        )
        if dist.get_rank() == 0:
            _say(f"{kind} {n} ranks {nbytes / 1024:.0f} KiB: {t * 1e6:.0f} us, {volume / t / 1e9:.2f} GB/s bus")
    return out


def _hidden_share(compute, transfer, both, reps: int, dev: str, kind: str) -> float:
    """(compute + transfer - both) / min(compute, transfer) in [0, 1], each the slowest rank's
    median (the same on every rank)."""
    c, t, b = (_rank_times(fn, reps, dev) for fn in (compute, transfer, both))
    share = _round(min(1.0, max(0.0, (c + t - b) / min(c, t))))
    if dist.get_rank() == 0:
        _say(
            f"overlap {kind}: compute {c * 1e3:.1f} ms, transfer {t * 1e3:.1f} ms, both {b * 1e3:.1f} ms: "
            f"hides {share:.2f}"
        )
    return share


def _overlap_cp(dev: str, quick: bool) -> float:
    """Ring attention (``runtime.ring_attention``) forward and backward: as it runs, without its
    transfers (each rotation hands back copies of its own blocks), and its transfers alone (the
    same rotations: K/V forward, K/V with their fp32 gradients backward, the gradients home)."""
    n, group = dist.get_world_size(), dist.group.WORLD
    q, k, v = (torch.randn(1, 8, 256 if quick else 512, 64, device=dev, requires_grad=True) for _ in range(3))

    def both():
        ra.ring_attention(q, k, v, group).sum().backward()

    def compute():
        real = ra._rotate
        ra._rotate = lambda tensors, group: ([], [t.clone() for t in tensors])
        try:
            both()
        finally:
            ra._rotate = real

    kv = [k.detach(), v.detach()]
    grads = [torch.zeros_like(t, dtype=torch.float32) for t in kv]
    forward, backward, home = _ring_send(kv), _ring_send(kv + grads), _ring_send(grads)

    def transfer():
        for _ in range(n - 1):
            forward()
            backward()
        home()

    return _hidden_share(compute, transfer, both, 3 if quick else 5, dev, "cp")


def _blocking_wait(dev: str, quick: bool, reps: int = 40) -> float:
    """Microseconds a blocking collective costs beyond its own time when the ranks compute
    between collectives, as tensor-parallel layers do: a small all-reduce after a few
    milliseconds of GEMMs, against the GEMMs alone and the all-reduce alone (every rank at once
    in each). Where ranks outnumber the cores, the partner a rank waits for may not be running:
    the scheduler has to give it a core first."""
    a = torch.randn(256, 256, device=dev)
    msg = torch.randn(2**14, device=dev)

    def compute():
        for _ in range(8):
            a @ a

    def reduce():
        dist.all_reduce(msg)

    def both():
        compute()
        reduce()

    reps = reps // 4 if quick else reps

    def loop(fn):
        return lambda: [fn() for _ in range(reps)]

    t_c, t_r, t_b = (_rank_times(loop(fn), 3, dev) for fn in (compute, reduce, both))
    return max(0.0, (t_b - t_c - t_r) / reps * 1e6)


def _overlap_pp(dev: str, quick: bool) -> float:
    """A pipeline's activation send and receive (``batch_isend_irecv``, as
    ``torch.distributed.pipelining`` posts them) beside the next micro-batch's GEMMs, which it
    waits for only after them; the GEMMs sized to take about as long as the transfer."""
    act = [torch.randn((2**18 if quick else 2**20), device=dev)]
    a = torch.randn(256, 256, device=dev)
    transfer = _ring_send(act)
    once = _rank_times(lambda: a @ a, 5, dev)
    count = torch.tensor([max(1, round(_rank_times(transfer, 5, dev) / once))], device=dev)
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    gemms = int(count.item())

    def compute():
        for _ in range(gemms):
            a @ a

    def both():
        works, _ = ra._rotate(act, dist.group.WORLD)
        compute()
        for w in works:
            w.wait()

    return _hidden_share(compute, transfer, both, 3 if quick else 5, dev, "pp")


def _overlap_dp(dev: str, quick: bool) -> float:
    """Data-parallel gradient reduction as the program runs it (``runtime.reduction``: buckets
    all-reduced as the step's last backward makes their gradients final) beside that backward:
    the backward alone, the same buckets reduced after it, and both as the program runs them."""
    width = 256 if quick else 512
    layers = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(8)]).to(dev)
    x = torch.randn(128 if quick else 512, width, device=dev)
    params = list(layers.parameters())
    reduction = BucketedReduction(params, dist.group.WORLD, divide=dist.get_world_size())

    def compute():
        for p in params:
            p.grad = None
        layers(x).sum().backward()

    def transfer():
        reduction.arm()
        reduction.finish()

    def both():
        for p in params:
            p.grad = None
        reduction.arm()
        layers(x).sum().backward()
        reduction.finish()

    compute()  # gradients for ``transfer`` to reduce
    try:
        return _hidden_share(compute, transfer, both, 3 if quick else 5, dev, "dp")
    finally:
        reduction.remove()
