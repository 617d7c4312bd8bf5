"""The emitted program's bad inputs and failures: clear one-line errors, exit 2, never a hang."""

import json
import os
import re
import subprocess
import sys

import pytest

from autoshard.cli import main
from autoshard.errors import AutoshardError, ProgramError
from autoshard.ir.plan import Plan
from autoshard.ir.program import Chunk, Fp8, Loss, Program, Routing, Tied
from autoshard.runtime.trainer import step_records
from autoshard.verify import verify

from conftest import EXAMPLES


@pytest.fixture(scope="module")
def program(tmp_path_factory):
    out = tmp_path_factory.mktemp("prog") / "out"
    args = [str(EXAMPLES / "gpt.py"), "--config", "tiny", "--hardware", "cpu", "--gpus", "2"]
    args += ["--seq-len", "32", "--global-batch", "4", "--force", "pp=2", "-o", str(out)]
    assert main(["compile", *args]) == 0
    return out


def _torchrun(out, nproc, *extra, timeout=120):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    cmd += [str(out / "train.py"), *(extra or ("--steps", "1"))]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def test_compile_writes_the_program_files(program):
    names = {p.name for p in program.iterdir()}
    assert {"plan.json", "plan.md", "train.py", "program.json", "loss.py", "layers.py", "stage0.py"} <= names
    assert "class Chunk0(nn.Module)" in (program / "stage0.py").read_text()
    text = (program / "stage1.py").read_text()
    assert "class Chunk1(nn.Module)" in text and "from .layers import Block" in text
    # a layer is an instance of the layer class, keyed by its index in the model (which layer this
    # chunk holds depends on the schedule the search picks for this profile)
    held = re.search(r'nn.ModuleDict\(\{"(\d+)": Block\(\)\}\)', text)
    assert held and f'self.model.layers["{held.group(1)}"](' in text
    layers = (program / "layers.py").read_text()
    assert layers.count("class Block(nn.Module)") == 1 and "INIT = {" in layers
    import ast

    for name in ("train.py", "stage0.py", "layers.py", "loss.py"):
        tree = ast.parse((program / name).read_text())
        modules = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        modules |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
        foreign = {m for m in modules if m.split(".")[0] not in sys.stdlib_module_names and m.split(".")[0] != "torch"}
        assert {m for m in foreign if not m.startswith("autoshard.runtime")} == set(), name


def test_stage_files_call_only_the_public_runtime(program):
    import ast

    import autoshard.runtime as rt

    for path in program.glob("*.py"):
        tree = ast.parse(path.read_text())
        imported = [n for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module.startswith("autoshard")]
        assert [a.name for n in imported for a in n.names if a.name.startswith("_")] == [], path.name
        used = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and getattr(n.value, "id", "") == "rt"}
        assert used <= set(rt.__all__), path.name


def test_train_py_is_a_launcher_with_the_plan_header(program):
    text = (program / "train.py").read_text()
    assert text.startswith('"""Train gpt:tiny as ') and "torchrun --nproc-per-node 2 OUT/train.py" in text
    assert "trainer.main(Path(__file__).resolve().parent" in text and len(text.splitlines()) < 25
    cmd = [sys.executable, str(program / "train.py"), "--help"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert proc.returncode == 0 and "--nnodes N" in proc.stdout
    flags = ["--steps", "--lr", "--weight-decay", "--adam-eps", "--seed", "--data", "--init-from-model"]
    flags += ["--loss-log", "--save-params", "--timeout", "--compute-dtype", "--no-compile"]
    assert [f for f in flags if f not in proc.stdout] == []


def test_wrong_world_size_is_a_clear_error(program):
    proc = _torchrun(program, 1)
    assert proc.returncode != 0
    assert "the plan is for 2 processes but WORLD_SIZE is 1" in proc.stderr


def test_edited_plan_is_refused(program, tmp_path):
    import shutil

    copy = tmp_path / "edited"
    shutil.copytree(program, copy)
    (copy / "plan.json").write_text((copy / "plan.json").read_text().replace('"zero_stage": 0', '"zero_stage": 1'))
    proc = _torchrun(copy, 2)
    assert proc.returncode != 0 and "changed after the program was generated" in proc.stderr


# -- program.json: the typed Program ----------------------------------------------------------


def test_program_json_loads_as_the_program_and_writes_back_byte_for_byte(program):
    loaded = Program.load(program / "program.json")
    assert loaded.to_json() == (program / "program.json").read_text()
    assert Program.from_dict(loaded.to_dict()) == loaded
    plan = Plan.load(program)
    assert [c.file for c in loaded.chunks] == [f"stage{c}.py" for c in range(plan.mesh.pp * plan.virtual_stages)]
    assert loaded.loss == Loss("loss.py", "Loss") and loaded.plan_sha256 == _plan_digest(program)
    assert Program.load(program) == loaded  # the directory holding it


def _plan_digest(out) -> str:
    import hashlib

    return hashlib.sha256((out / "plan.json").read_bytes()).hexdigest()


def test_every_kind_of_entry_round_trips():
    made = Program(
        plan_sha256="0" * 64,
        rebuild={"function": "model.py:build", "args": ["tiny"], "kwargs": {}, "config": None, "loss": None},
        vocab=256,
        chunks=(Chunk("stage0.py", "Chunk0", (0, 2), 0), Chunk("stage1.py", "Chunk1", (2, 4), 1)),
        loss=Loss("loss.py", "Loss"),
        target=None,
        tied=(Tied(("model.embed.weight", "model.head.weight"), (0, 1)),),
        routing={
            "model.layers.1.ffn.experts": Routing(8, 2, "model.layers.1.ffn.bias", "model.layers.1.ffn"),
            "model.layers.3.ffn.experts": Routing(8, 2, None, "model.layers.3.ffn"),
        },
        fp8=Fp8(("attention",), ("model.layers.0.attn.wq.weight",)),
        state_dict_keys=("model.embed.weight",),
        peak_flops=None,
    )
    text = made.to_json()
    assert Program.from_dict(json.loads(text)) == made
    assert Program.from_dict(json.loads(text)).to_json() == text


# what is damaged -> what the one line names (each also says to recompile)
DAMAGED = {
    "missing": (lambda p: p.pop("vocab"), "missing key vocab"),
    "missing-nested": (lambda p: p["chunks"][1].pop("class"), "missing key chunks[1].class"),
    "wrong-type": (lambda p: p.update(vocab="256"), 'vocab is "256", expected a positive integer'),
    "wrong-nested": (lambda p: p["chunks"][0].update(layers=[0]), "chunks[0].layers is [0], expected [first, last]"),
    "unknown": (lambda p: p.update(extra=1), "unknown key extra (written by another autoshard version?)"),
    "not-an-object": (lambda p: p.update(loss=["loss.py"]), 'loss is ["loss.py"], expected an object'),
}


@pytest.mark.parametrize("damage", list(DAMAGED))
def test_a_malformed_program_json_is_one_line_naming_the_file_the_key_and_the_fix(program, tmp_path, capsys, damage):
    spoil, expected = DAMAGED[damage]
    data = json.loads((program / "program.json").read_text())
    spoil(data)
    path = tmp_path / "program.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ProgramError) as e:
        Program.load(path)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert err == f"train.py: error: {path}: {expected}; recompile with autoshard compile ... -o {tmp_path}\n"
    with pytest.raises(AutoshardError, match=re.escape(f"{path}: {expected}; recompile")):
        Program.load(path, error=AutoshardError)  # as autoshard verify reads it


def test_a_missing_or_unreadable_program_json_is_one_line(tmp_path, capsys):
    with pytest.raises(ProgramError):
        Program.load(tmp_path / "program.json")
    assert capsys.readouterr().err == (
        f"train.py: error: {tmp_path / 'program.json'} is missing; recompile with autoshard compile ... -o {tmp_path}\n"
    )
    (tmp_path / "program.json").write_text("[1, 2]")
    with pytest.raises(AutoshardError, match="program.json: the file is not a JSON object; recompile"):
        Program.load(tmp_path, error=AutoshardError)


def test_a_rank_that_dies_takes_the_others_down(program, tmp_path):
    import shutil

    copy = tmp_path / "dies"
    shutil.copytree(program, copy)
    stage = copy / "stage1.py"
    text = stage.read_text().replace(
        "    def forward(self, ",
        "    def forward(self, *a, **k):\n        raise SystemExit(7)\n\n    def _unused(self, ",
        1,
    )
    stage.write_text(text)
    with pytest.raises(AutoshardError, match="the emitted program failed"):
        verify(copy, steps=1, tolerance=1e-5, timeout=120)


def test_verify_needs_an_emitted_program(tmp_path):
    with pytest.raises(AutoshardError, match="is not a directory"):
        verify(tmp_path / "missing", steps=1, tolerance=1e-5)
    assert main(["compile", str(EXAMPLES / "gpt.py"), "--config", "tiny", "--hardware", "cpu", "--gpus", "2",
                 "--seq-len", "32", "--global-batch", "4", "--plan-only", "-o", str(tmp_path / "p")]) == 0  # fmt: skip
    with pytest.raises(AutoshardError, match="has no train.py"):
        verify(tmp_path / "p", steps=1, tolerance=1e-5)


def test_fp8_without_fp8_units_is_refused_at_compile_and_nothing_is_written(tmp_path, capsys):
    args = [str(EXAMPLES / "llama3.py"), "--config", "tiny", "--hardware", "cpu", "--gpus", "2"]
    args += ["--seq-len", "64", "--global-batch", "8", "--precision", "fp8", "-o", str(tmp_path / "o")]
    assert main(["compile", *args]) == 2
    assert "no FP8 peak" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_default_initialisation_trains_from_a_sensible_loss(program):
    import math

    proc = _torchrun(program, 2, "--steps", "2")
    assert proc.returncode == 0, proc.stderr[-500:]
    losses = [r["loss"] for r in step_records(proc.stdout)]
    assert len(losses) == 2
    assert all(math.isfinite(x) and abs(x - math.log(256)) < 1.5 for x in losses)  # near uniform over 256 tokens


def test_token_file_and_bf16_compute(program, tmp_path):
    import array
    import math
    import random

    data = tmp_path / "tokens.bin"
    rng = random.Random(0)
    data.write_bytes(array.array("i", [rng.randrange(256) for _ in range(10_000)]).tobytes())
    proc = _torchrun(program, 2, "--steps", "2", "--data", str(data), "--compute-dtype", "bf16")
    assert proc.returncode == 0, proc.stderr[-500:]
    losses = [r["loss"] for r in step_records(proc.stdout)]
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def test_zero3_under_a_split_backward_schedule_is_refused(tmp_path, capsys):
    args = [str(EXAMPLES / "gpt.py"), "--config", "tiny", "--hardware", "cpu", "--gpus", "4", "--seq-len", "32"]
    args += ["--global-batch", "8", "--force", "pp=2,dp=2,zero=3,schedule=zero-bubble", "-o", str(tmp_path / "o")]
    assert main(["compile", *args]) == 2
    assert "--force pp=2,dp=2,zero=3,schedule=zero-bubble: ZeRO-3 under" in capsys.readouterr().err


def test_context_parallel_shards_a_sliding_window_shorter_than_the_sequence(tmp_path):
    """Gemma 3's sliding layers see 256 positions: causal at 32 tokens, a window at 512, which
    context parallelism's attention call carries."""
    pytest.importorskip("transformers")
    model = EXAMPLES.parent / "tests" / "models" / "hf_zoo.py"
    args = [str(model), "--config", "gemma3", "--hardware", "cpu", "--gpus", "2", "--seq-len", "512"]
    args += ["--global-batch", "4", "--force", "cp=2", "-o", str(tmp_path / "o")]
    assert main(["compile", *args]) == 0
    code = "".join(p.read_text() for p in (tmp_path / "o").glob("*.py"))
    assert re.search(r"rt\.cp_attention\([^)]*, 256\)", code)
