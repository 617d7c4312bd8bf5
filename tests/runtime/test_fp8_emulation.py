"""The plain-torch blockwise FP8 of autoshard.runtime.fp8 (DeepSeek-V3's 1x128 / 128x1 / 128x128
E4M3 scaling, fp32 products) against expectations written here: each tile's scale from its own
amax, every quantised value the nearest E4M3 value (a grid decoded here from the format's bits),
saturation, ragged and grouped tiles; ``fp8_linear`` / ``fp8_matmul`` / ``fp8_grouped_mm``,
forward and both gradients, against fp32 products of the documented dequantised operands and
against the unquantised product; the per-step weight cache and the shared input copy; the FP8
dispatch of autoshard.runtime.moe over 2 gloo ranks (bitwise the quantised rows of the plain
dispatch, its gradient straight through). The Triton kernels are tested in tests/kernels/test_fp8.py."""

import math

import pytest
import torch

from autoshard.ir.fp8 import tile_starts
from autoshard.runtime import fp8
from autoshard.runtime.fp8 import (
    dequantize_blocks,
    dequantize_cols,
    dequantize_rows,
    quantize_blocks,
    quantize_cols,
    quantize_rows,
)

TILE, MAX, EPS = 128, 448.0, 1e-12


@pytest.fixture(autouse=True)
def fresh_caches():
    """No FP8 copy of one test's tensors reaches another (ids of dead tensors are reused)."""
    fp8.new_step()
    yield
    fp8.new_step()


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _varied(m, k, seed=0):
    """Rows of very different magnitudes (1e-3 .. 1e3), so that one shared scale would be wrong."""
    return _randn(m, k, seed=seed) * torch.logspace(-3, 3, m)[:, None]


def _scale(tile: torch.Tensor) -> torch.Tensor:
    """A tile's scale as documented: max(amax, EPS) / 448, in fp32."""
    return torch.clamp(tile.float().abs().max(), min=EPS) / MAX


def _e4m3_grid() -> torch.Tensor:
    """Every finite float8_e4m3fn value, decoded from the format: 1 sign, 4 exponent bits (bias 7),
    3 mantissa bits, subnormals at exponent 0, S.1111.111 NaN and no infinities."""
    mags = []
    for e in range(16):
        for m in range(8):
            if (e, m) != (15, 7):
                mags.append(m / 8 * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    mags = torch.tensor(mags, dtype=torch.float64)
    return torch.cat([-mags, mags]).unique()


GRID = _e4m3_grid()


def test_the_grid_is_e4m3():
    """The helper's grid is what torch's e4m3 bytes decode to (so the checks below use a real grid)."""
    decoded = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).double()
    assert torch.equal(decoded[~decoded.isnan()].unique(), GRID)
    assert GRID.max().item() == MAX and GRID.numel() == 253  # +-0 merged, two NaNs left out


def _assert_nearest(q: torch.Tensor, y: torch.Tensor):
    """Every ``q`` (e4m3) is a nearest E4M3 value to ``y`` (the tile divided by its scale, fp32),
    ``y`` saturated at +-448 (ties: either neighbour)."""
    qf, yc = q.double().reshape(-1), y.double().clamp(-MAX, MAX).reshape(-1)
    assert not qf.isnan().any()
    best = torch.cat([(part[:, None] - GRID).abs().min(1).values for part in yc.split(4096)])
    bad = (qf - yc).abs() > best
    assert not bad.any(), f"{int(bad.sum())} values not rounded to nearest, e.g. {yc[bad][:3]} -> {qf[bad][:3]}"


def _assert_within_step(deq: torch.Tensor, x: torch.Tensor, s_per_elem: torch.Tensor):
    """Round to nearest E4M3: at most half a step, 2^-4 relative for normal values (|x/s| >= 2^-6),
    2^-10 * s absolute below (the subnormal spacing is 2^-9)."""
    x, deq, s = x.double(), deq.double(), s_per_elem.double()
    normal = (x / s).abs() >= 2.0**-6
    err = (deq - x).abs()
    assert (err[normal] <= 2.0**-4 * x[normal].abs() * (1 + 1e-5)).all()
    assert (err[~normal] <= 2.0**-10 * s[~normal] * (1 + 1e-5)).all()


# --- quantisation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [256, 200, 5])
def test_quantize_rows_scales_rounding_and_tile_maxima(k):
    x = _varied(24, k, seed=1)
    q, s = quantize_rows(x)
    tiles = math.ceil(k / TILE)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (24, k)
    assert s.dtype == torch.float32 and s.shape == (24, tiles)
    s_elem = torch.empty(24, k)
    for i in range(24):
        for t in range(tiles):
            cols = slice(t * TILE, min((t + 1) * TILE, k))
            tile = x[i, cols]
            assert torch.equal(s[i, t], _scale(tile)), (i, t)
            j = tile.abs().argmax()
            assert q[i, cols][j].float().item() == math.copysign(MAX, tile[j].item())  # the amax -> +-448
            s_elem[i, cols] = s[i, t]
    _assert_nearest(q, x / s_elem)
    deq = dequantize_rows(q, s)
    assert deq.dtype == torch.float32 and deq.shape == x.shape
    assert torch.equal(deq, q.float() * s_elem)
    _assert_within_step(deq, x, s_elem)


def test_quantize_rows_tile_boundary_at_128_of_a_ragged_row():
    """K = 200: the tiles are columns 0..127 and 128..199; an outlier at column 127 costs only the
    first tile its precision, one at column 128 only the second."""
    x = _randn(2, 200, seed=2)
    x[0, 127], x[1, 128] = 1000.0, -1000.0
    q, s = quantize_rows(x)
    assert torch.equal(s[0], torch.stack([_scale(x[0, :128]), _scale(x[0, 128:])]))
    assert torch.equal(s[1], torch.stack([_scale(x[1, :128]), _scale(x[1, 128:])]))
    assert s[0, 0].item() == pytest.approx(1000 / MAX) and s[1, 1].item() == pytest.approx(1000 / MAX)
    assert q[0, 127].float().item() == MAX and q[1, 128].float().item() == -MAX
    # the other tile of each row keeps the fine scale of its own values
    assert s[0, 1].item() < 5 / MAX and s[1, 0].item() < 5 / MAX
    _assert_within_step(dequantize_rows(q, s)[0, 128:], x[0, 128:], s[0, 1].expand(72))


def test_zero_tiles_and_outliers_saturate_without_nan():
    x = _randn(3, 256, seed=3)
    x[0, :128] = 0.0  # a tile of zeros
    x[1, 5] = 1e30  # an outlier in the first tile of row 1
    x[2, 130] = -3e38  # near fp32's largest, second tile of row 2
    q, s = quantize_rows(x)
    deq = dequantize_rows(q, s)
    assert not q.float().isnan().any() and deq.isfinite().all()
    # zeros: scale EPS / 448, values 0
    assert torch.equal(s[0, 0], torch.tensor(EPS, dtype=torch.float32) / MAX)
    assert (q[0, :128].float() == 0).all() and (deq[0, :128] == 0).all()
    assert torch.equal(s[0, 1], _scale(x[0, 128:]))  # the row's other tile is unaffected
    # the outlier maps to 448 * s; its tile-mates (|x| ~ 1, 1e-30 of it) vanish
    assert s[1, 0].item() == pytest.approx(1e30 / MAX, rel=1e-6)
    assert q[1, 5].float().item() == MAX and deq[1, 5].item() == pytest.approx(1e30, rel=1e-6)
    others = torch.cat([deq[1, :5], deq[1, 6:128]])
    assert (others.abs() <= 2.0**-9 * s[1, 0]).all()
    assert torch.equal(s[1, 1], _scale(x[1, 128:]))
    assert q[2, 130].float().item() == -MAX and deq[2, 130].item() == pytest.approx(-3e38, rel=1e-6)
    # a tile whose amax is below EPS (fp32 subnormals) is scaled by EPS / 448: all zero, finite
    tiny = torch.full((1, 128), 1e-40)
    tq, ts = quantize_rows(tiny)
    assert torch.equal(ts[0, 0], torch.tensor(EPS, dtype=torch.float32) / MAX) and (tq.float() == 0).all()


def test_quantize_rows_of_bf16_is_that_of_its_float_values():
    x = _varied(8, 160, seed=4).bfloat16()
    q, s = quantize_rows(x)
    q32, s32 = quantize_rows(x.float())
    assert torch.equal(q.view(torch.uint8), q32.view(torch.uint8)) and torch.equal(s, s32)


@pytest.mark.parametrize("shape", [(200, 300), (128, 128), (3, 130, 257)])
def test_quantize_blocks_one_scale_per_128x128_block(shape):
    w = _randn(*shape, seed=5)
    w.view(-1, shape[-1])[0, 0] = 50.0  # one outlier: only its block's scale grows
    q, s = quantize_blocks(w)
    *lead, n, k = shape
    nb, kb = math.ceil(n / TILE), math.ceil(k / TILE)
    assert q.dtype == torch.float8_e4m3fn and q.shape == w.shape and s.shape == (*lead, nb, kb)
    mats, qs, ss = w.reshape(-1, n, k), q.reshape(-1, n, k), s.reshape(-1, nb, kb)
    s_elem = torch.empty_like(mats)
    for g in range(mats.size(0)):
        for i in range(nb):
            for j in range(kb):
                r, c = slice(i * TILE, (i + 1) * TILE), slice(j * TILE, (j + 1) * TILE)
                assert torch.equal(ss[g, i, j], _scale(mats[g, r, c])), (g, i, j)
                s_elem[g, r, c] = ss[g, i, j]
    assert ss[0, 0, 0].item() == pytest.approx(50 / MAX)
    if nb * kb > 1:
        assert ss.reshape(-1)[1:].max().item() < 6 / MAX  # the other blocks: randn's own amax
    _assert_nearest(qs, mats / s_elem)
    deq = dequantize_blocks(q, s)
    assert deq.shape == w.shape and torch.equal(deq.reshape(-1, n, k), qs.float() * s_elem)
    _assert_within_step(deq.reshape(-1, n, k), mats, s_elem)


def test_stacked_blocks_equal_each_matrix_alone_and_transposes_share_blocks():
    w = _randn(3, 130, 257, seed=6) * torch.tensor([1e-2, 1.0, 1e2])[:, None, None]
    q, s = quantize_blocks(w)
    for g in range(3):
        qg, sg = quantize_blocks(w[g])
        assert torch.equal(q[g].view(torch.uint8), qg.view(torch.uint8)) and torch.equal(s[g], sg)
    # the 128x128 blocks of W.T are those of W: the input-gradient GEMM reuses the forward's copy
    qt, st = quantize_blocks(w.transpose(1, 2))
    assert torch.equal(qt.view(torch.uint8), q.transpose(1, 2).view(torch.uint8))
    assert torch.equal(st, s.transpose(1, 2))
    assert torch.equal(dequantize_blocks(q.transpose(1, 2), s.transpose(1, 2)), dequantize_blocks(q, s).transpose(1, 2))


def test_tile_starts():
    assert tile_starts(300, None) == [0, 128, 256]
    assert tile_starts(128, None) == [0] and tile_starts(129, None) == [0, 128] and tile_starts(0, None) == []
    offs = torch.tensor([3, 3, 133, 134], dtype=torch.int32)  # groups of 3, 0, 130 and 1 rows
    assert tile_starts(134, offs) == [0, 3, 131, 133]
    assert tile_starts(260, torch.tensor([0, 260, 260])) == [0, 128, 256]
    assert tile_starts(5, torch.tensor([0, 0, 5])) == [0]


def test_quantize_cols_tiles_restart_at_each_group():
    counts = [3, 0, 130, 1]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    m, k = sum(counts), 5
    x = _randn(m, k, seed=7) * torch.logspace(-2, 2, k)  # columns of different magnitudes
    x[0, 0] = 100.0  # group 0's tile only
    x[4, 1] = -77.0  # group 2's first tile only (rows 3..130)
    tiles = [(0, 3), (3, 131), (131, 133), (133, 134)]  # 128 rows at most, never across a group
    q, s = quantize_cols(x, offs)
    assert q.dtype == torch.float8_e4m3fn and q.shape == (k, m) and s.shape == (k, len(tiles))
    s_elem = torch.empty(m, k)
    for t, (a, b) in enumerate(tiles):
        for c in range(k):
            assert torch.equal(s[c, t], _scale(x[a:b, c])), (t, c)
        s_elem[a:b] = s[:, t]
    assert s[0, 0].item() == pytest.approx(100 / MAX) and s[1, 1].item() == pytest.approx(77 / MAX)
    assert s[0, 1].item() < 100 / MAX / 10 and s[1, 2].item() < 77 / MAX / 10  # the outliers stay in their tiles
    assert q[0, 0].float().item() == MAX and q[1, 4].float().item() == -MAX
    _assert_nearest(q.t(), x / s_elem)
    deq = dequantize_cols(q, s, offs)
    assert deq.shape == (m, k) and torch.equal(deq, q.t().float() * s_elem)
    _assert_within_step(deq, x, s_elem)
    # one group (offs None): plain 128-row tiles
    q1, s1 = quantize_cols(x)
    assert s1.shape == (k, 2)
    for c in range(k):
        assert torch.equal(s1[c, 0], _scale(x[:128, c])) and torch.equal(s1[c, 1], _scale(x[128:, c]))
    _assert_within_step(
        dequantize_cols(q1, s1), x, torch.cat([s1[:, :1].t().expand(128, k), s1[:, 1:].t().expand(6, k)])
    )


# --- the matmuls ----------------------------------------------------------------------------------


def _deq_rows(t):
    return dequantize_rows(*quantize_rows(t))


def _deq_blocks(t):
    return dequantize_blocks(*quantize_blocks(t))


def _deq_cols(t, offs=None):
    return dequantize_cols(*quantize_cols(t, offs), offs)


def _linear_reference(x, w, g):
    """fp32 forward, dX and dW of ``x @ w.T`` as documented: the forward and the input gradient on
    1x128 tiles of x / of g and 128x128 blocks of w; the weight gradient on 128x1 tiles of g and of
    x's 1x128-dequantised copy."""
    wd = _deq_blocks(w)
    y = _deq_rows(x) @ wd.t()
    gx = _deq_rows(g) @ wd
    gw = _deq_cols(g).t() @ _deq_cols(_deq_rows(x))
    return y, gx, gw


def _close(got, want, rtol=1e-5):
    """Equal to fp32 round-off, relative to the expectation's largest magnitude."""
    assert got.shape == want.shape and got.dtype == want.dtype
    err = (got.double() - want.double()).abs().max().item()
    assert err <= rtol * want.abs().max().item(), f"max error {err} vs max |want| {want.abs().max().item()}"


def _rel(got, exact):
    return ((got.double() - exact.double()).norm() / exact.double().norm()).item()


def _run_linear(x, w, g, bias=None):
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    bb = None if bias is None else bias.clone().requires_grad_()
    y = fp8.fp8_linear(xx, ww, bb)
    y.backward(g)
    return y.detach(), xx.grad, ww.grad, None if bb is None else bb.grad


def test_fp8_linear_forward_and_gradients_are_the_documented_fp8_products():
    x, w, g = _varied(70, 200, seed=8), _randn(136, 200, seed=9), _varied(70, 136, seed=10)
    b = _randn(136, seed=11)
    y, gx, gw, gb = _run_linear(x, w, g, b)
    ry, rgx, rgw = _linear_reference(x, w, g)
    _close(y, ry + b)
    _close(gx, rgx)
    _close(gw, rgw)
    assert torch.equal(gb, g.sum(0))  # the bias is not quantised
    # and it is FP8: a few percent from the unquantised product, not more
    exact_x = x.clone().requires_grad_()
    exact_w = w.clone().requires_grad_()
    ey = exact_x @ exact_w.t()
    ey.backward(g)
    for got, exact in [(y - b, ey.detach()), (gx, exact_x.grad), (gw, exact_w.grad)]:
        assert 1e-3 < _rel(got, exact) < 0.08


def test_fp8_linear_without_a_bias_and_with_leading_dimensions():
    x, w, g = _randn(2, 33, 200, seed=12), _randn(40, 200, seed=13), _randn(2, 33, 40, seed=14)
    y, gx, gw, _ = _run_linear(x, w, g)
    assert y.shape == (2, 33, 40) and gx.shape == x.shape and gw.shape == w.shape
    ry, rgx, rgw = _linear_reference(x.reshape(66, 200), w, g.reshape(66, 40))
    _close(y.reshape(66, 40), ry)
    _close(gx.reshape(66, 200), rgx)
    _close(gw, rgw)


def test_fp8_linear_dtypes_with_bf16():
    x, w, g = _randn(16, 256, seed=15), _randn(24, 256, seed=16), _randn(16, 24, seed=17)
    # bf16 operands: a bf16 output, the single rounding of the fp32 FP8 product (no autocast)
    xb, wb = x.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    y = fp8.fp8_linear(xb, wb)
    assert y.dtype == torch.bfloat16
    assert torch.equal(y, (_deq_rows(xb.detach()) @ _deq_blocks(wb.detach()).t()).bfloat16())
    y.backward(g.bfloat16())
    assert xb.grad.dtype == torch.bfloat16 and wb.grad.dtype == torch.bfloat16
    # under bf16 autocast: a bf16 output from bf16 or fp32 inputs; gradients in the inputs' dtypes
    for dtype in (torch.bfloat16, torch.float32):
        xx, ww = x.to(dtype).requires_grad_(), w.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = fp8.fp8_linear(xx, ww, torch.zeros(24))
        assert y.dtype == torch.bfloat16
        y.backward(g.bfloat16())
        assert xx.grad.dtype == dtype and ww.grad.dtype == torch.float32


def _bf16_ulp(v: torch.Tensor) -> torch.Tensor:
    return 2.0 ** (torch.floor(torch.log2(v.double().abs().clamp(min=1e-30))) - 7)


def test_fp8_linear_under_autocast_still_accumulates_in_fp32():
    """Under bf16 autocast the output is the fp32 product of the FP8 operands rounded once to bf16
    (what the kernels compute, and "fp32 accumulation" of the module's docstring), not a bf16 GEMM
    of the dequantised operands."""
    x, w = _randn(64, 256, seed=18), _randn(96, 256, seed=19)
    ref = _deq_rows(x) @ _deq_blocks(w).t()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fp8.fp8_linear(x, w)
    assert y.dtype == torch.bfloat16
    err = (y.double() - ref.double()).abs()
    bound = 0.5 * _bf16_ulp(ref) + 1e-5 * ref.abs().max().item()
    bad = err > bound
    assert not bad.any(), (
        f"{int(bad.sum())} of {y.numel()} outputs are not the bf16 rounding of the fp32 FP8 product "
        f"(max error {err.max().item():.4g}, at most half a bf16 step expected)"
    )


def test_fp8_matmul_2d_is_fp8_linear_of_the_transpose():
    x, w, g = _randn(3, 20, 200, seed=20), _randn(200, 136, seed=21), _randn(3, 20, 136, seed=22)
    xm, wm = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.fp8_matmul(xm, wm)
    y.backward(g)
    xl, wl = x.clone().requires_grad_(), w.clone().requires_grad_()
    yl = fp8.fp8_linear(xl, wl.t())
    yl.backward(g)
    assert y.shape == (3, 20, 136)
    assert torch.equal(y, yl) and torch.equal(xm.grad, xl.grad) and torch.equal(wm.grad, wl.grad)
    ry, rgx, rgw = _linear_reference(x.reshape(60, 200), w.t(), g.reshape(60, 136))
    _close(y.reshape(60, 136), ry)
    _close(wm.grad, rgw.t())


def test_fp8_matmul_stacked_experts_is_per_expert_fp8_linear():
    """[E, C, K] @ [E, K, N]: every expert alone, in all three GEMMs. C = 130 rows: expert 1's
    tokens start at row 130, so weight-gradient tiles that did not restart per expert would mix
    the two experts' tokens (and their very different magnitudes)."""
    e, c, k, n = 2, 130, 72, 40
    x = _randn(e, c, k, seed=23) * torch.tensor([1e-2, 1e2])[:, None, None]
    w = _randn(e, k, n, seed=24)
    g = _randn(e, c, n, seed=25) * torch.tensor([1e2, 1e-2])[:, None, None]
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.fp8_matmul(xx, ww)
    y.backward(g)
    assert y.shape == (e, c, n)
    for i in range(e):
        yi, gxi, gwi, _ = _run_linear(x[i], w[i].t().contiguous(), g[i])
        _close(y[i].detach(), yi)
        _close(xx.grad[i], gxi)
        _close(ww.grad[i], gwi.t())


def test_fp8_grouped_mm_is_per_group_fp8_linear():
    counts = [5, 0, 130, 3]
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    m, k, n = sum(counts), 136, 24
    x = _randn(m, k, seed=26) * torch.logspace(-2, 2, m)[:, None]
    w = _randn(len(counts), k, n, seed=27)
    g = _randn(m, n, seed=28)
    xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fp8.fp8_grouped_mm(xx, ww, offs)
    y.backward(g)
    assert y.shape == (m, n) and xx.grad.shape == x.shape and ww.grad.shape == w.shape
    starts = [0, *offs.tolist()[:-1]]
    for grp, (a, cnt) in enumerate(zip(starts, counts)):
        if cnt == 0:
            assert torch.equal(ww.grad[grp], torch.zeros(k, n))
            continue
        yg, gxg, gwg, _ = _run_linear(x[a : a + cnt], w[grp].t().contiguous(), g[a : a + cnt])
        _close(y[a : a + cnt].detach(), yg)
        _close(xx.grad[a : a + cnt], gxg)
        _close(ww.grad[grp], gwg.t())


# --- caches ---------------------------------------------------------------------------------------


def test_q_rows_reuse_until_the_tensor_changes():
    x = _randn(6, 200, seed=29)
    first = fp8._q_rows(x, reuse=True)
    assert fp8._q_rows(x, reuse=True) is first
    assert fp8._q_rows(x) is not first  # without reuse: computed again
    assert fp8._q_rows(x.clone(), reuse=True) is not first  # another tensor, same values
    x.mul_(3.0)  # in place: a version bump
    again = fp8._q_rows(x, reuse=True)
    assert again is not first
    want_q, want_s = quantize_rows(x)
    assert torch.equal(again[0].view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(again[1], want_s)
    assert not torch.equal(again[1], first[1])


def test_q_blocks_cache_lasts_until_new_step_or_an_in_place_change():
    w = _randn(130, 200, seed=30, dtype=torch.float32).requires_grad_()
    first = fp8._q_blocks(w)
    assert fp8._q_blocks(w) is first
    # an update that writes the storage without a version bump (as a ZeRO broadcast can)
    version = w._version
    w.data.copy_(_randn(130, 200, seed=31))
    assert w._version == version  # .data writes do not bump the parameter's version
    assert fp8._q_blocks(w) is first  # stale until the step ends: that is what new_step is for
    fp8.new_step()
    fresh = fp8._q_blocks(w)
    want_q, want_s = quantize_blocks(w.detach())
    assert fresh is not first
    assert torch.equal(fresh[0].view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(fresh[1], want_s)
    # an in-place change seen by autograd (a version bump) is re-quantised without new_step
    with torch.no_grad():
        w.mul_(2.0)
    bumped = fp8._q_blocks(w)
    assert bumped is not fresh and torch.equal(bumped[1], quantize_blocks(w.detach())[1])


def test_a_weight_is_quantised_once_per_step_across_micro_batches(monkeypatch):
    """The module's contract: "every micro-batch's forward and input-gradient GEMMs reuse" the
    weight's FP8 copy, made once per step (the cost model counts it as kept, fp8_weight_bytes)."""
    calls = []
    real = fp8.quantize_blocks
    monkeypatch.setattr(fp8, "quantize_blocks", lambda w: calls.append(w.shape) or real(w))
    w = _randn(40, 200, seed=32).requires_grad_()
    for mb in range(3):
        fp8.fp8_linear(_randn(8, 200, seed=33 + mb), w).sum().backward()
    assert len(calls) == 1, f"the weight was quantised {len(calls)} times in one step of 3 micro-batches"
    fp8.new_step()
    fp8.fp8_linear(_randn(8, 200, seed=40), w).sum().backward()
    assert len(calls) == 2


def test_a_weight_changed_without_a_version_bump_is_requantised_after_new_step():
    x = _randn(8, 200, seed=41)
    w = _randn(40, 200, seed=42).requires_grad_()
    fp8.fp8_linear(x, w)
    w.data.copy_(_randn(40, 200, seed=43))
    fp8.new_step()
    y = fp8.fp8_linear(x, w)
    _close(y.detach(), _deq_rows(x) @ _deq_blocks(w.detach()).t())


def _saved_fp8_storages(fn):
    """Distinct storages of the 1-byte (e4m3 / uint8) tensors autograd saves while ``fn`` runs."""
    ptrs = []

    def pack(t):
        if t.element_size() == 1:  # e4m3 (or its bytes); the fp32 scales and weights are not
            ptrs.append(t.untyped_storage().data_ptr())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return set(ptrs), out


def test_the_saved_fp8_copy_of_an_input_is_counted_by_the_hook():
    """The counting helper sees the FP8 copy a linear saves (one linear, one copy)."""
    x = _randn(8, 200, seed=44).requires_grad_()
    w = _randn(16, 200, seed=45).requires_grad_()
    ptrs, y = _saved_fp8_storages(lambda: fp8.fp8_linear(x, w))
    assert len(ptrs) == 1
    y.sum().backward()
    assert x.grad is not None and w.grad is not None


def test_two_linears_reading_one_input_keep_one_fp8_copy(monkeypatch):
    """Q, K and V (gate and up) read one input: the module's docstring promises "one copy for all the
    matmuls reading that input" (and the memory model counts one)."""
    calls = []
    real = fp8.quantize_rows
    monkeypatch.setattr(fp8, "quantize_rows", lambda t: calls.append(t.shape) or real(t))
    x = _randn(8, 200, seed=46).requires_grad_()
    wq, wk = _randn(16, 200, seed=47).requires_grad_(), _randn(24, 200, seed=48).requires_grad_()
    ptrs, (yq, yk) = _saved_fp8_storages(lambda: (fp8.fp8_linear(x, wq), fp8.fp8_linear(x, wk)))
    assert len(calls) == 1 and len(ptrs) == 1, f"{len(calls)} quantisations of x, {len(ptrs)} FP8 copies saved"
    (yq.sum() + yk.sum()).backward()


def test_an_input_changed_in_place_between_two_linears_is_quantised_again():
    x = _randn(8, 200, seed=49)
    w = _randn(16, 200, seed=50)
    fp8.fp8_linear(x, w)
    x.mul_(-2.0)
    _close(fp8.fp8_linear(x, w), _deq_rows(x) @ _deq_blocks(w).t())


# --- the FP8 dispatch over 2 gloo ranks -----------------------------------------------------------

H = 200  # two 1x128 tiles per row, the second ragged


def _dispatch_checks(rank, world):
    """On each of 2 ranks (one EP group of both, 2 experts each): the FP8 dispatch against the
    plain one, forward (bitwise), the bytes sent, and the gradient."""
    import torch.distributed as dist

    from autoshard.runtime import moe
    from autoshard.runtime.groups import set_groups

    # as tests/runtime/test_moe.py's _set_ep(2, 2): one EP group of both ranks, EDP groups of one
    ep_group = dist.new_group([0, 1])
    edp_groups = [dist.new_group([p]) for p in range(world)]
    set_groups(ep=ep_group, edp=edp_groups[rank], route=dist.group.WORLD)
    assert moe.ep_size() == 2
    failures = []

    def check(ok, what):
        if not ok:
            failures.append(f"rank {rank}: {what}")

    sent = []
    real_a2a = dist.all_to_all_single

    def spy(output, input, *args, **kwargs):
        sent.append((input.dtype, tuple(input.shape)))
        return real_a2a(output, input, *args, **kwargs)

    dist.all_to_all_single = spy
    counts = [[3, 0, 5, 2], [0, 4, 1, 0]][rank]  # rank 1 sends nothing to expert 3, none to 0
    offs = torch.tensor(counts).cumsum(0).to(torch.int32)
    rows = _randn(sum(counts), H, seed=60 + rank) * torch.logspace(-2, 2, sum(counts))[:, None]
    plain_in, fp8_in = rows.clone().requires_grad_(), rows.clone().requires_grad_()
    out, local_offs, recv = moe.dispatch(plain_in, offs)
    sent.clear()
    out8, local_offs8, recv8 = moe.dispatch(fp8_in, offs, fp8=True)
    fwd_sent = list(sent)
    check(torch.equal(local_offs8, local_offs) and torch.equal(recv8, recv), "offs / counts differ")
    check(out8.shape == out.shape and out8.dtype == out.dtype, f"shape {out8.shape} vs {out.shape}")
    check(torch.equal(out8, _deq_rows(out)), "FP8 dispatch is not the 1x128 quantisation of the plain rows")
    check(not torch.equal(out8, out), "FP8 dispatch returned the rows unquantised")
    wide = [d for d, shape in fwd_sent if shape[-1:] == (H,)]
    check(wide == [torch.uint8], f"row payloads sent {wide}, expected one uint8 payload")
    check((torch.float32, (len(rows), 2)) in fwd_sent, f"no fp32 scales [S, 2] sent: {fwd_sent}")
    weights = _randn(*out.shape, seed=70 + rank)
    (out * weights).sum().backward()
    (out8 * weights).sum().backward()
    check(torch.equal(fp8_in.grad, plain_in.grad), "the FP8 dispatch's gradient is not the plain one")
    check(plain_in.grad.abs().sum() > 0, "no gradient reached the rows")

    for dtype in (torch.float32, torch.bfloat16):
        buf = _randn(4, 3, H, seed=80 + rank, dtype=dtype) * torch.logspace(-2, 2, 3)[:, None].to(dtype)
        plain_buf, fp8_buf = buf.clone().requires_grad_(), buf.clone().requires_grad_()
        got = moe.dispatch_buffer(plain_buf)
        sent.clear()
        got8 = moe.dispatch_buffer(fp8_buf, fp8=True)
        check(got8.shape == got.shape == (2, 6, H) and got8.dtype == dtype, f"buffer {got8.shape} {got8.dtype}")
        want = _deq_rows(got.detach().reshape(-1, H)).to(dtype).view_as(got)
        check(torch.equal(got8, want), f"{dtype} FP8 buffer is not the quantisation of the plain one")
        wide = [d for d, shape in sent if shape[-1:] == (H,)]
        check(wide == [torch.uint8], f"{dtype} buffer payloads sent {wide}")
        bw = _randn(*got.shape, seed=90 + rank, dtype=dtype)
        (got * bw).sum().backward()
        (got8 * bw).sum().backward()
        check(torch.equal(fp8_buf.grad, plain_buf.grad), f"{dtype} FP8 buffer gradient differs")
    dist.all_to_all_single = real_a2a
    set_groups(ep=None, edp=None, route=None)
    return failures


def test_fp8_dispatch_over_two_gloo_ranks():
    from distributed import run

    results = run(_dispatch_checks, 2, timeout=60)
    failures = [f for per_rank in results for f in per_rank]
    assert not failures, "\n".join(failures)
