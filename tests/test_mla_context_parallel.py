"""Context parallelism over multi-head latent attention, end to end: the bundled DeepSeek-V3 at
``tiny`` (values' heads of 16, queries' and keys' of 24) compiled at CP2 with ring attention, the
variant whose output once took the queries' head size, and verified against the single-device
model (gloo, fp32, relative 1e-5). CI runs this one case; all-gather-KV and CP2 x TP2 verify the
same way (about 20 s each)."""

from pathlib import Path

from autoshard.cli import main
from autoshard.verify import verify

ROOT = Path(__file__).resolve().parents[1]


def test_deepseek_v3_trains_at_cp2_with_ring_attention_as_on_one_device(tmp_path):
    out = tmp_path / "out"
    args = [str(ROOT / "examples" / "deepseek_v3.py"), "--config", "tiny", "--hardware", "cpu", "--gpus", "2"]
    args += ["--seq-len", "64", "--global-batch", "4", "--force", "cp=2,attention=ring", "-o", str(out)]
    assert main(["compile", *args]) == 0
    assert "CP2" in (out / "plan.md").read_text()
    result = verify(out, steps=2, tolerance=1e-5, timeout=120)
    for row in result["steps"]:
        assert row["rel_diff"] <= 1e-5, row
    assert result["max_param_abs_diff"] <= 1e-5, result["max_param_name"]
    assert not result["missing_params"]
    assert result["ok"]
