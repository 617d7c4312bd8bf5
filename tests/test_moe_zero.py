"""ZeRO-2/3 with the stacked expert weights sharded over their expert-data-parallel ranks
(``runtime.program.shard_data_parallel``), in each form the experts come in: the bundled
DeepSeek-V3's fixed-capacity buffers, transformers' grouped GEMMs (Mixtral, DeepseekV3) and Llama
4's batched experts beside a shared one. Each compiled at EP2 x DP4 (2 ranks per expert to shard
over) and verified against the single-device model over 3 steps (fp32, gloo, relative 1e-5),
routing biases included. (The bundled DeepSeek-V3 at ZeRO-3 is in tests/test_moe_matrix.py.)"""

import sys
from pathlib import Path

import pytest

from autoshard.cli import main
from autoshard.verify import verify

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "models"))
hf_moe = pytest.importorskip("hf_moe")  # needs transformers, a test dependency

CASES = [("deepseek_v3 (example)", 2), ("mixtral", 3), ("deepseek_v3", 3), ("llama4", 3)]


@pytest.mark.parametrize("model,zero", CASES, ids=[f"{m}-zero{z}".replace(" ", "") for m, z in CASES])
def test_sharded_experts_train_as_on_one_device(model, zero, tmp_path):
    path, config = hf_moe.MODELS[model]
    out = tmp_path / "out"
    args = [str(ROOT / path), "--config", config, "--hardware", "cpu", "--gpus", "4", "--seq-len", "32"]
    assert main(["compile", *args, "--global-batch", "8", "--force", f"ep=2,dp=4,zero={zero}", "-o", str(out)]) == 0
    assert f"EP2 x DP4**, ZeRO-{zero}" in (out / "plan.md").read_text()
    result = verify(out, steps=3, tolerance=1e-5, timeout=300)
    assert all(row["rel_diff"] <= 1e-5 for row in result["steps"]), result["steps"]
    assert result["max_param_abs_diff"] <= 1e-5, result["max_param_name"]
    assert not result["missing_params"]
    assert result["ok"]
