"""The emitted program trains exactly like the single-device model (GPT and LLaMA examples, and a
HuggingFace ``LlamaForCausalLM`` captured through torch.export): ``autoshard compile`` (plans
forced on ``--hardware cpu``) then ``autoshard verify`` (gloo processes, fp32, 3 steps), which
compares every step's loss (relative 1e-5) and the parameters after the steps (1e-5).

The CI subset of ``tests/models/examples_matrix.py``, each layout's rule once; the whole matrix is
``python benchmarks/architectures.py --examples``."""

import sys
from pathlib import Path

import pytest

from autoshard.cli import main
from autoshard.verify import verify

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "models"))
import examples_matrix as matrix  # noqa: E402


@pytest.mark.parametrize("model,case", matrix.CI_SUBSET, ids=[f"{m}-{c}" for m, c in matrix.CI_SUBSET])
def test_emitted_program_matches_single_device(model, case, tmp_path):
    if model == "hf_llama":
        pytest.importorskip("transformers")  # a test dependency: pip install -e '.[test]'
    path, config = matrix.MODELS[model]
    gpus, pins = matrix.LAYOUTS[case]
    out = tmp_path / "out"
    args = [str(ROOT / path), "--config", config, "--hardware", "cpu", "--gpus", str(gpus)]
    args += ["--seq-len", str(matrix.SEQ[model]), "--global-batch", "8", "--force", pins, "-o", str(out)]
    assert main(["compile", *args]) == 0
    result = verify(out, steps=matrix.STEPS, tolerance=1e-5, timeout=240)
    assert len(result["steps"]) == matrix.STEPS
    for row in result["steps"]:
        assert row["rel_diff"] <= 1e-5, row
    assert result["max_param_abs_diff"] <= 1e-5, result["max_param_name"]
    assert not result["missing_params"]
    assert result["ok"]
