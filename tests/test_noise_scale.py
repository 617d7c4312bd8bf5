"""The critical batch (``autoshard.noise_scale``): the step and token factors of McCandlish et al.
(2018), the two-batch estimator of the simple noise scale against a linear regression whose
noise scale is known in closed form, and the commands: ``compile --noise-scale`` warns in its
output and plan.md, ``verify --noise-scale`` measures a program's model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from autoshard.cli import main
from autoshard.noise_scale import critical_batch_note, doubling_ratio, estimate, measure, steps_factor

ROOT = Path(__file__).resolve().parents[1]


def test_steps_saved_by_doubling_follow_the_formula():
    assert doubling_ratio(1e6, 1e6) == pytest.approx(2 / 3)  # at B_noise doubling saves a third, not half
    assert doubling_ratio(1e3, 1e9) == pytest.approx(0.5, abs=1e-5)  # far below: half
    assert doubling_ratio(1e9, 1e3) == pytest.approx(1.0, abs=1e-5)  # far above: nothing
    assert steps_factor(2e6, 1e6) == 1.5
    past, note = critical_batch_note(1024, 4096, 1e6)  # 4.2M tokens against B_noise 1M
    assert past and "4.2x the critical batch" in note and "0.84 of the steps" in note
    within, note = critical_batch_note(64, 4096, 1e6)
    assert not within and "within the critical batch" in note


def _linear_regression(d: int, sigma: float, batches: int, big: int, seed: int = 0):
    """y = x.w* + sigma eps, x ~ N(0, I_d), loss 0.5 (x.w - y)^2 at w = w* + e, |e| = 1. A sample's
    gradient is x (x.e - sigma eps): G = e and, by Isserlis' theorem, Sigma = (|e|^2 + sigma^2) I +
    e e^T, so B_simple = tr(Sigma) / |G|^2 = d (1 + sigma^2) + 1."""
    g = torch.Generator().manual_seed(seed)
    w_star = torch.randn(d, generator=g)
    e = torch.randn(d, generator=g)
    w = torch.nn.Parameter(w_star + e / e.norm())

    def data():
        for _ in range(batches):
            x = torch.randn(big, d, generator=g)
            yield x, x @ w_star + sigma * torch.randn(big, generator=g)

    return w, (lambda part: 0.5 * (part[0] @ w - part[1]).square().mean()), data(), d * (1 + sigma**2) + 1


@pytest.mark.parametrize("sigma", [1.0, 3.0])
def test_the_two_batch_estimate_finds_a_known_noise_scale(sigma):
    w, loss, data, truth = _linear_regression(d=8, sigma=sigma, batches=300, big=256)
    found = measure([w], loss, data, small=16)
    # measured over seeds 0-3 at both noise levels (17 and 81): within 3.6%, and within 1.6 of the
    # estimate's own standard errors (about 1.2% and 2.5%)
    assert found.b_simple == pytest.approx(truth, rel=0.08), (found, truth)
    assert abs(found.b_simple - truth) <= 4 * found.spread, (found, truth)
    assert found.samples == 300 and found.small == 16 and found.big == 256


def test_the_estimate_needs_two_batch_sizes():
    with pytest.raises(ValueError):
        estimate([(2.0, 1.0)], small=8, big=8)
    assert estimate([(1.0, 2.0)], small=1, big=8).b_simple is None  # tr(Sigma) < 0: too few samples
    assert estimate([(2.0, 0.0)], small=1, big=8).b_simple is None  # |G|^2 < 0: the noise swamps it


def test_compile_warns_and_verify_measures(tmp_path, capsys):
    out = tmp_path / "out"
    args = [str(ROOT / "examples/llama3.py"), "--config", "tiny", "--hardware", "cpu", "--gpus", "2"]
    args += ["--seq-len", "64", "--global-batch", "8", "--force", "dp=2,zero=1", "--noise-scale", "128"]
    assert main(["compile", *args, "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "warning: Critical batch (warning): global batch 512 tokens" in printed
    assert "4.0x the critical batch" in printed and "0.83 of the steps" in printed  # (1 + 1/4) / (1 + 1/2)
    assert "4.0x the critical batch" in (out / "plan.md").read_text()
    assert main(["verify", str(out), "--noise-scale", "--steps", "3"]) == 0
    printed = capsys.readouterr().out
    assert "B_simple = " in printed and "tokens" in printed and "--noise-scale" in printed
