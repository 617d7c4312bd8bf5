"""``autoshard calibrate``: a quick run on this machine writes a profile that loads, whose figures
are sane, and that a plan compiles with; the collective fit recovers known figures; bad input is
one line and leaves nothing half-written."""

import pytest

from autoshard import calibrate
from autoshard.cli import main
from autoshard.cost_models import hardware
from autoshard.errors import AutoshardError

from conftest import EXAMPLES


@pytest.fixture(scope="module")
def profile(tmp_path_factory):
    out = tmp_path_factory.mktemp("calibrate") / "here.toml"
    assert main(["calibrate", "-o", str(out), "--ranks", "2", "--quick"]) == 0
    return out


def test_a_quick_calibration_writes_a_sane_profile(profile, capsys):
    hw = hardware.load(str(profile))
    assert hw.name == "here"
    assert hw.peak_flops("bf16") > 0 and hw.peak_flops("fp32") > 0 and hw.hbm_gbps > 0
    assert hw.op_overhead_us > 0 and hw.attention_backward > 0 and hw.cores >= 1
    assert hw.optimizer_bytes_per_param > 0 and hw.attention_half_length >= 0
    assert 0 < hw.pointwise_efficiency <= 1 and hw.cores >= 1
    for share in (hw.matmul_efficiency, hw.attention_efficiency):
        assert 0 < share <= 1
    assert set(hw.collectives) == set(hardware.COLLECTIVES)
    for entry in hw.collectives.values():
        assert entry["gbps"] > 0 and entry["latency_us"] >= 0
    assert set(hw.overlap) == set(hardware.OVERLAP_KINDS)
    assert all(0 <= s <= 1 for s in hw.overlap.values())
    # the kinds the program runs blocking are 0 by construction, and the profile says why
    assert hw.overlap["tp"] == hw.overlap["ep"] == 0
    assert "tp = 0 by construction" in profile.read_text()
    assert "dp = 0 by construction" not in profile.read_text()  # measured: reduced during backward


def test_a_plan_compiles_with_the_calibrated_profile(profile, tmp_path):
    args = ["compile", str(EXAMPLES / "llama3.py"), "--config", "tiny", "--hardware", str(profile)]
    args += ["--gpus", "2", "--seq-len", "32", "--global-batch", "8", "-o", str(tmp_path / "out")]
    assert main(args) == 0
    assert (tmp_path / "out" / "plan.json").is_file()


def test_extends_writes_only_measured_fields(tmp_path, monkeypatch):
    """With ``--extends`` the profile inherits what was not measured and keeps the parent's peak,
    the measured best becoming its matmul efficiency."""
    cpu = hardware.load("cpu")
    best = cpu.peak_flops("bf16") / 2
    monkeypatch.setattr(calibrate, "measure_gemms", lambda device, quick, dtype="bf16": {(1, 1, 1): best})
    monkeypatch.setattr(calibrate, "measure_host", lambda device, quick, ranks=(): {"op_overhead_us": 7.0, "cores": 3})
    monkeypatch.setattr(calibrate, "measure_memory", lambda device, quick: 2e12)
    attention = {"attention_efficiency": 0.4, "attention_half_length": 100.0, "attention_score_ns": 2.0}
    attention |= {"attention_backward": 3.0, "attention_backward_half_length": 900.0}
    monkeypatch.setattr(calibrate, "measure_attention", lambda device, peak, quick: attention)
    monkeypatch.setattr(calibrate, "measure_optimizer", lambda device, quick, bandwidth: 70.0)
    monkeypatch.setattr(calibrate, "measure_pointwise", lambda fields, parent, quick: 0.5)
    points = [_point(kind, 2, 1e6, 1e-3) | {"backend": "gloo"} for kind in hardware.COLLECTIVES]
    monkeypatch.setattr(calibrate, "measure_distributed", lambda r, d, q: (points, {"cp": 0.5, "pp": 0.25}, 300.0))
    out = tmp_path / "mine.toml"
    calibrate.calibrate(str(out), (2,), extends="cpu")
    text = out.read_text()
    assert 'extends = "cpu"' in text and "hbm_gb " not in text and "peak_tflops" not in text
    hw = hardware.load(str(out))
    assert hw.hbm_gb == cpu.hbm_gb and hw.peak_tflops == cpu.peak_tflops
    assert hw.matmul_efficiency == pytest.approx(0.5, rel=1e-3)
    assert hw.overlap == {"dp": 0.0, "tp": 0.0, "cp": 0.5, "pp": 0.25, "ep": 0.0}
    assert hw.op_overhead_us == 7.0 and hw.cores == 3
    assert hw.attention_half_length == 100.0 and hw.attention_backward_half_length == 900.0
    assert hw.attention_backward == 3.0 and hw.optimizer_bytes_per_param == 70.0
    assert hw.pointwise_efficiency == 0.5 and hw.blocking_wait_us == 300.0


def _point(kind, ranks, volume, seconds, steps=1):
    return {"kind": kind, "ranks": ranks, "bytes": volume, "volume": volume, "steps": steps, "seconds": seconds}


def test_the_fit_recovers_bandwidth_and_latency():
    gbps, lat_us = 3.0, 40.0
    points = [
        _point("all_gather", n, v, v / (gbps * 1e9) + (n - 1) * lat_us * 1e-6, steps=n - 1)
        for n in (2, 4)
        for v in (1e4, 1e6, 1e7)
    ]
    fit = calibrate.fit_collectives(points)
    assert set(fit) == {"all_gather"}
    assert fit["all_gather"]["gbps"] == pytest.approx(gbps, rel=1e-3)
    assert fit["all_gather"]["latency_us"] == pytest.approx(lat_us, rel=1e-3)


def test_the_attention_fit_recovers_rate_half_length_and_score_time():
    """Times made by ``attention_time``'s form at calibrate's three shapes come back as its
    matmul rate, half length and time per score."""
    rate, half, per_score = 2e11, 300.0, 1e-9
    shapes = (*calibrate.ATTENTION_SHAPES, (1024, 64))

    def seconds(s, d):
        return (2 * 2 * 8 * s * s * 2 * d / 2 / rate + 2 * 8 * s * s / 2 * per_score) * (s + half) / s

    fit = calibrate._attention_fit(shapes, [seconds(s, d) for s, d in shapes])
    assert fit == pytest.approx((rate, half, per_score), rel=1e-9)


def test_bad_input_is_one_line_and_nothing_is_written(tmp_path, capsys):
    assert main(["calibrate", "-o", str(tmp_path / "x.json")]) == 2
    assert "ending in .toml" in capsys.readouterr().err
    assert main(["calibrate", "-o", str(tmp_path / "missing" / "x.toml")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["calibrate", "-o", str(tmp_path / "x.toml"), "--ranks", "1"])
    assert "2 or more" in capsys.readouterr().err
    # a profile that does not validate is never put in place, and no temporary file stays
    with pytest.raises(AutoshardError, match="overlap.cp"):
        calibrate._write(tmp_path / "x.toml", {"name": "x", "extends": "cpu", "overlap": {"cp": 2.0}}, [])
    assert list(tmp_path.iterdir()) == []


def test_the_reference_model_is_what_the_cost_model_prices():
    """The reference model captures and prices (GEMMs, attention, memory-bound ops), and
    halving the memory-bound share of the bandwidth doubles only that part."""
    from dataclasses import replace

    from autoshard.calibrate_reference import predicted_step

    cpu = hardware.load("cpu")
    seconds, pointwise = predicted_step(cpu)
    assert 0 < pointwise < seconds
    slower, pointwise2 = predicted_step(replace(cpu, pointwise_efficiency=0.5))
    assert pointwise2 == pytest.approx(2 * pointwise) and slower == pytest.approx(seconds + pointwise)
