"""The MoE equivalence matrix's CI subset (``tests/models/hf_moe.py``): the bundled DeepSeek-V3
(fixed-capacity experts) and transformers' DeepseekV3 and Mixtral (grouped-GEMM experts), each
compiled with a forced expert-parallel layout (EP folded into TP, DP, PP; ZeRO-1 and ZeRO-3) and
verified against the single-device model over 3 steps (fp32, gloo, relative 1e-5), routing-bias
updates included: the program's biases, updated from expert loads summed over the ranks, must
equal the single-device model's. The whole matrix is ``python benchmarks/architectures.py --moe``."""

import sys
from pathlib import Path

import pytest

from autoshard.cli import main
from autoshard.verify import verify

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "models"))
hf_moe = pytest.importorskip("hf_moe")  # needs transformers, a test dependency


@pytest.mark.parametrize(
    "model,layout", hf_moe.CI_SUBSET, ids=[f"{m}-{c}".replace(" ", "") for m, c in hf_moe.CI_SUBSET]
)
def test_moe_trains_as_on_one_device(model, layout, tmp_path):
    gpus, pins = hf_moe.LAYOUTS[layout]
    path, config = hf_moe.MODELS[model]
    out = tmp_path / "out"
    args = [str(ROOT / path), "--config", config, "--hardware", "cpu", "--gpus", str(gpus)]
    assert main(["compile", *args, "--seq-len", "32", "--global-batch", "8", "--force", pins, "-o", str(out)]) == 0
    plan = (out / "plan.md").read_text()
    ep = int(pins.split("ep=")[1].split(",")[0])
    assert f"EP{ep}" in plan
    result = verify(out, steps=3, tolerance=1e-5, timeout=300)
    for row in result["steps"]:
        assert row["rel_diff"] <= 1e-5, row
    assert result["max_param_abs_diff"] <= 1e-5, result["max_param_name"]
    assert not result["missing_params"]  # the routing biases are saved and compared too
    assert result["ok"]
