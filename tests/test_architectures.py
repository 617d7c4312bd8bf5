"""The architecture matrix's CI subset: transformers' decoders at tiny configs
(``tests/models/hf_zoo.py``), each compiled with a forced layout and verified against the
single-device model (fp32, gloo, relative 1e-5), one case per feature that needed its own rule.
The whole matrix is ``python benchmarks/architectures.py``; its table is in the README."""

import sys
from pathlib import Path

import pytest

from autoshard.cli import main
from autoshard.verify import verify

MODELS = Path(__file__).parent / "models"
sys.path.insert(0, str(MODELS))
hf_zoo = pytest.importorskip("hf_zoo")  # needs transformers, a test dependency


@pytest.mark.parametrize("arch,layout", hf_zoo.CI_SUBSET, ids=[f"{a}-{c}" for a, c in hf_zoo.CI_SUBSET])
def test_architecture_trains_as_on_one_device(arch, layout, tmp_path):
    gpus, pins = hf_zoo.LAYOUTS[layout]
    out = tmp_path / "out"
    args = [str(MODELS / "hf_zoo.py"), "--config", arch, "--hardware", "cpu", "--gpus", str(gpus)]
    assert main(["compile", *args, "--seq-len", "32", "--global-batch", "8", "--force", pins, "-o", str(out)]) == 0
    result = verify(out, steps=2, tolerance=1e-5, timeout=240)
    for row in result["steps"]:
        assert row["rel_diff"] <= 1e-5, row
    assert result["max_param_abs_diff"] <= 1e-5, result["max_param_name"]
    assert not result["missing_params"]
    assert result["ok"]
