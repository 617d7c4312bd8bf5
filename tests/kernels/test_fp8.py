"""Triton blockwise FP8 kernels (autoshard.kernels.fp8) against the torch definition in
autoshard.runtime.fp8: quantisation bit for bit (scales and e4m3 bytes), the GEMM to fp32 round-off
and against the unquantised product, and the runtime's FP8 matmul (forward and both gradients) run
on the kernels. CPU: under TRITON_INTERPRET=1 (conftest.py), with the interpreter's float casts
routed through torch (the fixture below; autoshard/kernels/README.md). GPU: run with
TRITON_INTERPRET=0 on a CUDA machine; the same tests run compiled, with GPU tolerances."""

import os

import numpy as np
import pytest
import torch

triton = pytest.importorskip("triton")

import autoshard.runtime.fp8 as ref  # noqa: E402
from autoshard.kernels import fp8 as kern  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
if not INTERPRET and not torch.cuda.is_available():
    pytest.skip("TRITON_INTERPRET is off and there is no CUDA device: the kernels cannot run", allow_module_level=True)
DEVICE = "cpu" if INTERPRET else "cuda"
GEMM_RTOL = 1e-5 if INTERPRET else 1e-3  # relative to the output's largest magnitude


@pytest.fixture(scope="module", autouse=True)
def exact_interpreter_casts():
    """Under the interpreter, do its float conversions with torch: its own fp32 -> e4m3 cast rounds
    wrongly (carries into the exponent badly, truncates subnormals) and fp32 -> bf16 truncates, while
    a GPU rounds to nearest even as torch does. Self-tested first; the original is restored after."""
    if not INTERPRET:
        yield
        return
    import triton.language as tl
    import triton.runtime.interpreter as interp

    original = getattr(interp, "_convert_float", None)
    assert original is not None, "triton's interpreter has no _convert_float to patch: update this fixture"
    torch_of = {tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2, tl.bfloat16: torch.bfloat16,
                tl.float16: torch.float16, tl.float32: torch.float32}  # fmt: skip
    bits_of = {8: torch.uint8, 16: torch.uint16, 32: torch.uint32}

    def convert(data, src, dst, rounding_mode):
        if src not in torch_of or dst not in torch_of or rounding_mode == interp._ir.ROUNDING_MODE.RTZ:
            return original(data, src, dst, rounding_mode)
        arr = np.ascontiguousarray(data)
        t = torch.from_numpy(arr.reshape(-1)).view(torch_of[src]).to(torch_of[dst])
        return t.view(bits_of[dst.primitive_bitwidth]).numpy().reshape(arr.shape)

    # the self-test: values the unpatched cast gets wrong (31.1, subnormals) and saturation at 448
    probe = torch.tensor([31.1, -31.1, 0.001, 0.0137, 447.9, 448.0, 1.0, -0.0, 3.0e-3, 240.5])
    want = probe.to(torch.float8_e4m3fn).view(torch.uint8)
    interp._convert_float = convert
    try:
        got = convert(probe.numpy(), tl.float32, tl.float8e4nv, interp._ir.ROUNDING_MODE.RTNE)
        assert torch.equal(torch.from_numpy(got), want), "the torch-routed cast does not match torch"
        q, _ = kern.quantize_rows(probe[None, :])  # and the interpreter really goes through it
        q_ref, _ = ref.quantize_rows(probe[None, :])
        assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)), "the interpreter bypasses the patch"
        yield
    finally:
        interp._convert_float = original


def _data(m, k, seed, dtype=torch.float32):
    """Rows of widely different magnitudes, plus the edge cases: a zero tile (amax clamp), a tile of
    values below EPS, outliers above 448 and at 1e30 (saturation), values that land on subnormals."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen) * torch.exp(2 * torch.randn(m, 1, generator=gen))
    if m > 0:
        x[0, : min(k, ref.TILE)] = 0.0
    if m > 1:
        x[1, : min(k, ref.TILE)] = 3e-13 * torch.randn(min(k, ref.TILE), generator=gen)
    if m > 2:
        x[2, -1] = 1e30
        x[2, 0] = 1000.0
    if m > 3:
        x[3, 0] = -5000.0  # the rest of that tile falls to e4m3 subnormals or zero
    return x.to(dtype).to(DEVICE)


def _same(got, want):
    (q, s), (q_ref, s_ref) = got, want
    assert q.shape == q_ref.shape and s.shape == s_ref.shape
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(s, s_ref), "scales differ"
    bad = (q.view(torch.uint8) != q_ref.view(torch.uint8)).sum().item()
    assert bad == 0, f"{bad} of {q.numel()} e4m3 values differ"


@pytest.mark.parametrize("m,k", [(64, 512), (67, 300), (256, 256), (1, 100)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_bit_exact(m, k, dtype):
    x = _data(m, k, 0, dtype)
    _same(kern.quantize_rows(x), ref.quantize_rows(x))
    xt = _data(k, m, 1, dtype).t()  # a transposed view
    _same(kern.quantize_rows(xt), ref.quantize_rows(xt))


def test_dequantize_rows_bit_exact():
    q, s = ref.quantize_rows(_data(67, 300, 2))
    assert torch.equal(kern.dequantize_rows(q, s), ref.dequantize_rows(q, s))


@pytest.mark.parametrize(
    "m,k,offs",
    [
        (256, 256, None),
        (67, 300, None),  # one partial tile
        (333, 200, [100, 100, 300, 333]),  # a group under 128 rows, an empty group, a 200-row group
        (300, 130, [0, 128, 129, 300]),  # empty first group, a one-row group
    ],
)
def test_quantize_cols_bit_exact_with_groups(m, k, offs):
    x = _data(m, k, 3)
    o = None if offs is None else torch.tensor(offs, dtype=torch.int32, device=DEVICE)
    got = kern.quantize_cols(x, o)
    _same(got, ref.quantize_cols(x, o))
    assert got[0].is_contiguous() and got[0].shape == (k, m)  # the transposed layout, written directly


def test_quantize_cols_edge_cases():
    x = _data(0, 40, 4)
    q, s = kern.quantize_cols(x, torch.tensor([0, 0], device=DEVICE))
    assert q.shape == (40, 0) and s.shape == (40, 0) and q.dtype == torch.float8_e4m3fn
    q, s = kern.quantize_rows(x)
    assert q.shape == (0, 40) and s.shape == (0, 1)
    with pytest.raises(ValueError, match="must end at the row count"):
        kern.quantize_cols(_data(10, 8, 4), torch.tensor([4], device=DEVICE))


@pytest.mark.parametrize(
    "shape,transpose",
    [((256, 256), False), ((200, 300), False), ((300, 200), True), ((3, 130, 260), False), ((2, 260, 130), True)],
)
def test_quantize_blocks_bit_exact(shape, transpose):
    w = _data(shape[-2] * (shape[0] if len(shape) == 3 else 1), shape[-1], 5).view(shape)
    if transpose:
        w = w.transpose(-1, -2)  # as fp8_matmul passes w.t()
    _same(kern.quantize_blocks(w), ref.quantize_blocks(w))
    wb = w.to(torch.bfloat16)
    _same(kern.quantize_blocks(wb), ref.quantize_blocks(wb))


def _operands(m, n, k, b_rows, strided, seed):
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=gen).to(DEVICE)
    w = torch.randn(n, k, generator=gen).to(DEVICE)
    aq, a_s = ref.quantize_rows(a)
    if b_rows:
        if strided:  # column slices of wider operands, as the weight gradient passes them
            pad = torch.randn(n, k + 256, generator=gen).to(DEVICE)
            pad[:, 128 : 128 + k] = w
            pq, ps = ref.quantize_rows(pad)
            big_q, big_s = ref.quantize_rows(torch.cat([torch.zeros(m, 128, device=DEVICE), a], 1))
            aq, a_s = big_q[:, 128:], big_s[:, 1:]
            bq, b_s = pq[:, 128 : 128 + k], ps[:, 1 : 1 + ref._tiles(k)]
            w = pad[:, 128 : 128 + k]
        else:
            bq, b_s = ref.quantize_rows(w)
    elif strided:  # the transposed blocks of a [K, N] weight, as the input gradient passes them
        wq, ws = ref.quantize_blocks(w.t().contiguous())
        bq, b_s = wq.t(), ws.t()
    else:
        bq, b_s = ref.quantize_blocks(w)
    return a, w, aq, a_s, bq, b_s


@pytest.mark.parametrize("m", [1, 64, 67])
@pytest.mark.parametrize("k", [512, 200])
@pytest.mark.parametrize("b_rows", [False, True])
@pytest.mark.parametrize("strided", [False, True])
def test_gemm_matches_reference_and_fp32(m, k, b_rows, strided):
    n = 256
    a, w, aq, a_s, bq, b_s = _operands(m, n, k, b_rows, strided, seed=m + k)
    want = ref.gemm_reference(aq, a_s, bq, b_s, b_rows)
    scale = want.abs().max().item()
    got = kern.gemm(aq, a_s, bq, b_s, b_rows=b_rows, out_dtype=torch.float32)
    assert got.shape == (m, n) and got.dtype == torch.float32
    assert (got - want).abs().max().item() <= GEMM_RTOL * scale
    half = kern.gemm(aq, a_s, bq, b_s, b_rows=b_rows, out_dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16
    assert ((half.float() - want).abs() <= 2**-8 * want.abs() + GEMM_RTOL * scale).all()
    exact = a @ w.t()  # the unquantised product: SQNR of the FP8 GEMM, and DeepGEMM's calc_diff
    sqnr = 10 * torch.log10(exact.pow(2).sum() / (got - exact).pow(2).sum()).item()
    diff = 1 - 2 * (got * exact).sum().item() / (got.pow(2) + exact.pow(2)).sum().item()
    assert sqnr >= 25 and diff < 1e-3, (sqnr, diff)


def test_gemm_empty_and_bad_shapes():
    aq, a_s = ref.quantize_rows(torch.zeros(0, 200, device=DEVICE))
    bq, b_s = ref.quantize_blocks(torch.randn(130, 200, device=DEVICE))
    out = kern.gemm(aq, a_s, bq, b_s, b_rows=False, out_dtype=torch.bfloat16)
    assert out.shape == (0, 130) and out.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="b_s expected"):
        kern.gemm(aq, a_s, bq, b_s, b_rows=True, out_dtype=torch.float32)


@pytest.mark.parametrize("grouped", [False, True])
def test_runtime_fp8_matmul_on_the_kernels(monkeypatch, grouped):
    """The runtime's FP8 matmul, forward and both gradients, with its kernel calls routed here (as on
    CUDA) against the same function in plain torch: quantised operands are identical, so outputs
    agree to GEMM round-off. Exercises the views the runtime passes (transposed blocks, sliced tiles)."""
    gen = torch.Generator().manual_seed(7)
    if grouped:
        x = torch.randn(333, 192, generator=gen).to(DEVICE)
        w = torch.randn(4, 192, 130, generator=gen).to(DEVICE)  # [G, K, N]
        offs = torch.tensor([100, 100, 300, 333], dtype=torch.int32, device=DEVICE)
        fn = lambda x, w: ref.fp8_grouped_mm(x, w, offs)
    else:
        x = torch.randn(67, 200, generator=gen).to(DEVICE)
        w = torch.randn(130, 200, generator=gen).to(DEVICE)  # [N, K]
        fn = lambda x, w: ref.fp8_linear(x, w)

    def run(kernels):
        monkeypatch.setattr(ref, "_kernels", (lambda t: kern) if kernels else (lambda t: None))
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = fn(xx, ww)
        gy = torch.randn(y.shape, generator=torch.Generator().manual_seed(8)).to(DEVICE)
        y.backward(gy)
        return y.detach(), xx.grad, ww.grad

    for got, want in zip(run(True), run(False)):
        assert got.shape == want.shape
        assert (got - want).abs().max().item() <= GEMM_RTOL * want.abs().max().item()


def test_benchmark_script_check_mode_runs():
    import subprocess
    import sys
    from pathlib import Path

    if not INTERPRET:
        pytest.skip("the --check run is the CPU (interpreter) path; on a GPU run the benchmark itself")
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "fp8.py"
    env = {**os.environ, "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": ""}
    proc = subprocess.run([sys.executable, str(script), "--check"], capture_output=True, text=True, env=env,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-800:]
    assert "paths work" in proc.stdout.strip().splitlines()[-1]
