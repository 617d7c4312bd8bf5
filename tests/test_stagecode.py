"""The emitted program's code: one class per layer kind, chunks built from those classes under the
model's own names, each table only where it has entries, and files as ``ruff`` wants them."""

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoshard.cli import main
from autoshard.runtime.stages import load_stage_file, stage_tables

from conftest import EXAMPLES

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = {
    # dense: tensor and sequence parallel, two pipeline ranks
    "dense": ("llama3.py", ["--gpus", "4", "--force", "tp=2,pp=2"]),
    # MoE: expert parallel over a pipeline, every layer under selective recomputation
    "moe": ("deepseek_v3.py", ["--gpus", "8", "--force", "ep=2,pp=2,tp=2,recompute=activation"]),
}


@pytest.fixture(scope="module", params=sorted(PROGRAMS))
def program(request, tmp_path_factory):
    model, pins = PROGRAMS[request.param]
    out = tmp_path_factory.mktemp(request.param) / "out"
    args = [str(EXAMPLES / model), "--config", "tiny", "--hardware", "cpu", "--seq-len", "64", "--global-batch", "16"]
    assert main(["compile", *args, *pins, "-o", str(out)]) == 0
    return request.param, out


def _ruff(*args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "ruff", *args, "--config", str(ROOT / "pyproject.toml")]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60)


def test_the_emitted_files_pass_ruff(program):
    _, out = program
    files = [str(p) for p in sorted(out.glob("*.py"))]
    checked = _ruff("check", *files)
    assert checked.returncode == 0, checked.stdout
    formatted = _ruff("format", "--check", "--diff", *files)
    assert formatted.returncode == 0, formatted.stdout


def test_each_layer_kind_is_one_class(program):
    name, out = program
    tree = ast.parse((out / "layers.py").read_text())
    classes = [n.name for n in tree.body if isinstance(n, ast.ClassDef)]
    # DeepSeek-V3's first layer is dense, the others MoE: two kinds; every LLaMA layer is one
    assert len(classes) == (2 if name == "moe" else 1) == len(set(classes))
    program_json = json.loads((out / "program.json").read_text())
    built = []
    for chunk in program_json["chunks"]:
        text = (out / chunk["file"]).read_text()
        assert "def layer_" not in text and "getattr(self.model.layers" not in text
        built += re.findall(r"\b(" + "|".join(classes) + r")\(", text)
    assert set(built) == set(classes)


def test_the_chunks_hold_the_models_names(program):
    """State-dict names are the single-device model's (checkpoints, resharding, export and
    --init-from read them), and every parameter has its tables' entries by that full name."""
    _, out = program
    program_json = json.loads((out / "program.json").read_text())
    keys = set(program_json["state_dict_keys"])
    for chunk in program_json["chunks"]:
        stage_file = load_stage_file(out / chunk["file"])
        with torch.device("meta"):
            module = getattr(stage_file, chunk["class"])()
        tables = stage_tables(module, stage_file)
        for name, _ in [*module.named_parameters(), *module.named_buffers()]:
            source = tables.ORIGIN.get(name, name)
            assert f"model.{source}" in keys or source in keys, name
            assert name in tables.INIT, name
        first, last = chunk["layers"]
        layers = {int(n.split(".")[2]) for n, _ in module.named_parameters() if n.startswith("model.layers.")}
        assert layers == set(range(first, last))


def test_names_match_their_calls_and_no_table_is_empty(program):
    name, out = program
    code = "\n".join(p.read_text() for p in sorted(out.glob("*.py")))
    assert not re.search(r"\b(\w+?)(_\d+)? = \{\}|\b(\w+?)(_\d+)? = \[\]", code)
    assert not re.search(r"\bcopy_to_tp(_\d+)? = rt\.gather", code)
    assert not re.search(r"\breduce_from_tp(_\d+)? = rt\.reduce_scatter", code)
    if name == "dense":  # sequence parallel: the row matmuls' partial sums are reduce-scattered
        assert "all-reduced by reduce_from_tp" not in code
        assert "partial sums reduce-scattered by reduce_scatter_to_sp" in code
    else:  # the key a MoE layer counts its loads under is its own name, passed to its class
        assert 'self.layer = f"{name}.ffn.experts"' in (out / "layers.py").read_text()
