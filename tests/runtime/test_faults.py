"""Bad luck, as a user meets it (torchrun, gloo, fp32, the tiny example at DP2 ZeRO-1): a loss
that is not finite, a spike that comes back, a checkpoint directory that is a checkpoint, taken,
unwritable or damaged, weights that are not weights, a program directory or model that cannot
work, data that cannot feed the run. Each case ends with nothing lost and one line said, and each
test bounds its processes' time so a loop or a hang fails it."""

from __future__ import annotations

import fcntl
import json
import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from autoshard.runtime import durable
from tests.distributed import torchrun

ROOT = Path(__file__).parents[2]


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("faults") / "dp2"
    cmd = [sys.executable, "-m", "autoshard", "compile", "examples/llama3.py", "--config", "tiny", "--hardware", "cpu"]
    cmd += ["--gpus", "2", "--seq-len", "64", "--global-batch", "8", "--force", "dp=2,zero=1", "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return out


def _run(program: Path, *args: str, env: dict | None = None, timeout: float = 120.0):
    return torchrun(program, 2, *args, env=env, timeout=timeout)


def _lines(proc) -> list[dict]:
    return [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]


def _steps(proc) -> list[dict]:
    return [r for r in _lines(proc) if "loss" in r and "event" not in r]


def _events(proc, name: str) -> list[dict]:
    return [r for r in _lines(proc) if r.get("event") == name]


def _one_line(proc, text: str) -> None:
    """The run failed with ``text`` in a ``train.py: error:`` line and no frame of ours."""
    assert proc.returncode != 0
    errors = [x for x in proc.stderr.splitlines() if x.startswith("train.py: error:")]
    assert errors and all(text in x for x in errors), proc.stderr[-3000:]
    assert "autoshard/runtime/" not in proc.stderr, proc.stderr[-3000:]


def _weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    from autoshard.export import single_device_state

    return single_device_state(checkpoint)[0]


# -- 1. a loss that is not finite ------------------------------------------------------------


def test_a_non_finite_loss_without_a_guard_stops_before_any_checkpoint_of_it(program, tmp_path):
    ck = tmp_path / "ck"
    proc = _run(program, "--steps", "8", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
                env={"AUTOSHARD_FAULT": "nan:1:3"})  # fmt: skip
    _one_line(proc, "step 3: the loss is nan")
    assert [s for s, _ in durable.checkpoints(ck)] == [2]  # none written from step 3 on
    assert all(bool(torch.isfinite(t).all()) for t in _weights(ck / "step_00000002").values())


def test_a_non_finite_loss_is_a_spike_and_rolls_back(program, tmp_path):
    ck = tmp_path / "ck"
    proc = _run(program, "--steps", "8", "--checkpoint-dir", str(ck), "--checkpoint-every", "2", "--keep", "2",
                "--spike-zscore", "3", "--spike-window", "3", env={"AUTOSHARD_FAULT": "nan:1:3"})  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    back = _events(proc, "loss spike: rolled back")
    assert [(r["step"], r["to_step"]) for r in back] == [(3, 2)]
    steps = _steps(proc)
    assert steps[-1]["step"] == 7 and all(math.isfinite(r["loss"]) for r in steps)
    newest = durable.find(ck)
    assert newest.name == "step_00000008"
    assert all(bool(torch.isfinite(t).all()) for t in _weights(newest).values())


# -- 2. a rollback that cannot loop ------------------------------------------------------------


def test_a_spike_rolls_back_strictly_before_it_and_the_run_ends(program, tmp_path):
    # step 3's update takes a 1000x learning rate: step 4's loss spikes, and step_4 (written after
    # step 3) holds the damage, so the rollback goes to step_2 (it used to take step_4, forever)
    ck = tmp_path / "ck"
    proc = _run(program, "--steps", "12", "--lr", "0.05", "--checkpoint-dir", str(ck), "--checkpoint-every", "2",
                "--keep", "2", "--spike-zscore", "3", "--spike-window", "3", env={"AUTOSHARD_FAULT": "lr:0:3"},
                timeout=150)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    back = _events(proc, "loss spike: rolled back")
    assert back and all(r["to_step"] < r["step"] for r in back)
    assert (back[0]["step"], back[0]["to_step"]) == (4, 2)
    assert len(back) <= 3 and _steps(proc)[-1]["step"] == 11
    assert (ck / "step_00000004.rolled-back").is_dir()  # the abandoned one, set aside, not resumed from


def test_rollbacks_in_one_region_go_further_back_and_are_bounded():
    from autoshard.errors import ProgramError
    from autoshard.runtime.trainer import MAX_ROLLBACKS, rollback_before

    assert rollback_before([], 10, 3) == 10
    assert rollback_before([{"step": 10, "to_step": 8}], 11, 3) == 8  # the same trouble: older than 8
    assert rollback_before([{"step": 10, "to_step": 8}], 20, 3) == 20  # a window later: a new spike
    region = [{"step": 10, "to_step": 8 - i} for i in range(MAX_ROLLBACKS)]
    with pytest.raises(ProgramError):
        rollback_before(region, 11, 3)


# -- 3, 4, 7. where checkpoints go ---------------------------------------------------------------


def test_a_checkpoint_given_as_the_checkpoint_directory_is_refused(program, tmp_path):
    ck = tmp_path / "ck"
    assert _run(program, "--steps", "2", "--checkpoint-dir", str(ck)).returncode == 0
    inside = ck / "step_00000002"
    proc = _run(program, "--steps", "4", "--checkpoint-dir", str(inside))
    _one_line(proc, f"give the directory holding it: --checkpoint-dir {ck}")
    assert not list(inside.glob("step_*"))


def test_a_second_run_on_a_directory_in_use_is_refused_and_a_dead_holders_lock_is_not(program, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    with open(ck / durable.LOCK, "a+") as f:  # a run holding the directory
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        f.write("pid 12345 on elsewhere, since then\n")
        f.flush()
        proc = _run(program, "--steps", "2", "--checkpoint-dir", str(ck))
    _one_line(proc, "another run writes its checkpoints there (pid 12345 on elsewhere")
    assert not _steps(proc) and not durable.checkpoints(ck)
    proc = _run(program, "--steps", "2", "--checkpoint-dir", str(ck))  # the holder is gone: its lock with it
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [s for s, _ in durable.checkpoints(ck)] == [2]


@pytest.mark.parametrize("where", ["file", "proc"])
def test_an_unusable_checkpoint_location_is_found_before_the_first_step(program, tmp_path, where):
    target = tmp_path / "a-file" if where == "file" else Path("/proc/autoshard-checkpoints")
    if where == "file":
        target.write_text("")
    proc = _run(program, "--steps", "2", "--checkpoint-dir", str(target))
    _one_line(proc, f"--checkpoint-dir {target}:")
    assert not _steps(proc)


def test_a_checkpoint_that_cannot_be_written_is_one_line_and_the_one_before_stays(program, tmp_path):
    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "step_00000004").write_text("")  # what DCP must make a directory of: the write fails
    proc = _run(program, "--steps", "6", "--checkpoint-dir", str(ck), "--checkpoint-every", "2")
    _one_line(proc, f"writing checkpoint {ck / 'step_00000004'} failed (FileExistsError")
    assert [s for s, _ in durable.checkpoints(ck)] == [2]


# -- 5, 6. damage ------------------------------------------------------------------------------


def test_damage_inside_a_file_is_found_and_the_run_resumes_from_the_intact_one(program, tmp_path):
    ck = tmp_path / "ck"
    assert _run(program, "--steps", "4", "--checkpoint-dir", str(ck), "--checkpoint-every", "2").returncode == 0
    data = next((ck / "step_00000004").glob("*.distcp"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2 : len(raw) // 2 + 4096] = b"\x7f" * 4096  # the same size, other bytes
    data.write_bytes(bytes(raw))
    proc = _run(program, "--steps", "6", "--checkpoint-dir", str(ck))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "does not match its checksum" in proc.stderr
    assert [r["step"] for r in _events(proc, "resumed")] == [2]
    assert (ck / "step_00000004.damaged").is_dir() and _steps(proc)[0]["step"] == 2


def test_damaged_newest_checkpoints_are_set_aside_one_by_one(program, tmp_path):
    ck = tmp_path / "ck"
    proc = _run(program, "--steps", "4", "--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--keep", "0")
    assert proc.returncode == 0
    shard = next((ck / "step_00000004").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    (ck / "step_00000003" / ".metadata").unlink()
    (ck / "step_00000002" / "trainer.json").unlink()
    proc = _run(program, "--steps", "5", "--checkpoint-dir", str(ck))
    assert proc.returncode == 0, proc.stderr[-3000:]
    warned = [x for x in proc.stderr.splitlines() if x.startswith("warning: checkpoint")]
    assert len(warned) == 3, proc.stderr[-3000:]
    assert [r["step"] for r in _events(proc, "resumed")] == [1]
    assert sorted(p.name for p in ck.glob("*.damaged")) == [f"step_0000000{i}.damaged" for i in (2, 3, 4)]


# -- 8. --init-from ------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["int64", "nan"])
def test_init_from_refuses_weights_that_are_not_finite_floating_point(tmp_path, bad):
    from autoshard.errors import ProgramError
    from autoshard.runtime.stages import Block
    from autoshard.runtime.weights import open_weights

    t = torch.arange(12).reshape(3, 4)
    t = t if bad == "int64" else t.float().masked_fill(t == 5, float("nan"))
    torch.save({"w": t}, tmp_path / "w.pt")
    w = open_weights(tmp_path / "w.pt")
    with pytest.raises(ProgramError):
        w.read("w", [Block((0, 0), (0, 0), (3, 4))], (3, 4), torch.float32)


# -- 9. one line where a traceback was ----------------------------------------------------------


BROKEN = {  # what is broken -> what the one line says
    "program.json": "is not readable JSON",
    "program-key": "program.json: missing key vocab; recompile",
    "stage": "is not valid Python",
    "fault": "AUTOSHARD_FAULT",
    "lr": "--lr must be a finite number",
    "log-file": "--log-file",
    "save-params": "--save-params",
}


@pytest.mark.parametrize("damage", list(BROKEN))
def test_a_broken_program_directory_flag_or_fault_is_one_line_before_any_process_group(program, tmp_path, damage):
    import os
    import shutil

    out = tmp_path / "out"
    shutil.copytree(program, out)
    env, args = {}, []
    if damage == "program.json":
        (out / "program.json").write_text("{not json")
    elif damage == "program-key":
        (out / "program.json").write_text((out / "program.json").read_text().replace('"vocab"', '"vocabulary"'))
    elif damage == "stage":
        next(out.glob("stage*.py")).write_text("x = (\n")
    elif damage == "fault":
        env = {"AUTOSHARD_FAULT": "kill:one"}
    elif damage == "lr":
        args = ["--lr", "nan"]
    elif damage == "log-file":
        args = ["--log-file", str(tmp_path)]  # a directory
    else:
        args = ["--save-params", str(out / "plan.json")]  # a file
    proc = subprocess.run([sys.executable, str(out / "train.py"), *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **env})  # fmt: skip
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.startswith("train.py: error:") and BROKEN[damage] in proc.stderr


MODELS = {
    "not-logits": "def forward(self, x):\n        h = self.emb(x)\n        for l in self.layers:\n"
    "            h = h + l(h)\n        return h.mean(-1)\n",
    "no-stack": "def forward(self, x):\n        return self.head(torch.relu(self.emb(x)))\n",
}


@pytest.mark.parametrize("kind", list(MODELS))
def test_a_model_autoshard_cannot_train_is_one_line(tmp_path, kind):
    src = (
        "import torch\nfrom torch import nn\n\nclass M(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.emb = nn.Embedding(64, 16)\n"
        "        self.layers = nn.ModuleList([nn.Linear(16, 16) for _ in range(2)])\n"
        "        self.head = nn.Linear(16, 64)\n\n    " + MODELS[kind] + "\n\n"
        "def build(config=None):\n    return M()\n\n"
        "def sample_inputs(config, batch, seq):\n    return (torch.randint(0, 64, (batch, seq)),)\n"
    )
    (tmp_path / "m.py").write_text(src)
    cmd = [sys.executable, "-m", "autoshard", "compile", str(tmp_path / "m.py"), "--hardware", "cpu", "--gpus", "2"]
    cmd += ["--seq-len", "16", "--global-batch", "4", "-o", str(tmp_path / "out")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    expected = {"not-logits": "(batch, sequence, vocabulary) logits", "no-stack": "no stack of repeated layers"}
    assert expected[kind] in proc.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("where", ["directory", "missing-parent-unwritable"])
def test_export_and_data_prepare_check_their_output_first(program, tmp_path, capsys, where):
    from autoshard.cli import main as cli

    target = tmp_path / "x.safetensors" if where == "directory" else Path("/proc/autoshard/x.bin")
    if where == "directory":
        target.mkdir()
    text = tmp_path / "doc.txt"
    text.write_text("hello\n")
    # the output is checked before the tokenizer is even looked for (there is none at this path)
    assert cli(["data", "prepare", str(text), "--tokenizer", str(tmp_path / "no-tokenizer"), "-o", str(target)]) == 2
    assert f"-o {target}" in capsys.readouterr().err
    ck = tmp_path / "ck"
    assert _run(program, "--steps", "1", "--checkpoint-dir", str(ck)).returncode == 0
    assert cli(["export", str(ck), "-o", str(target)]) == 2
    err = capsys.readouterr().err
    assert f"-o {target}" in err and "Traceback" not in err


# -- 10. the smaller ones ------------------------------------------------------------------------


def test_a_timeout_names_the_rank_that_did_not_arrive(program):
    proc = _run(program, "--steps", "4", "--timeout", "5", env={"AUTOSHARD_FAULT": "hang:1:1"})
    _one_line(proc, "rank 1 last reported step 1")


def test_resuming_with_another_seed_says_so(program, tmp_path):
    ck = tmp_path / "ck"
    assert _run(program, "--steps", "2", "--checkpoint-dir", str(ck)).returncode == 0
    proc = _run(program, "--steps", "3", "--checkpoint-dir", str(ck), "--seed", "1")
    assert proc.returncode == 0 and "warning: resumed with other data" in proc.stderr
    assert _events(proc, "data flags differ from the checkpoint's")[0]["changed"] == {"--seed": [0, 1]}


def test_data_is_checked_at_the_start(program, tmp_path):
    # raw int32 ids (no header: not checked when written) with one beyond the vocabulary at the end
    ids = np.zeros(64 * 64, dtype="<i4")
    ids[-1] = 10**6
    ids.tofile(tmp_path / "bad.bin")
    proc = _run(program, "--steps", "1", "--data", str(tmp_path / "bad.bin"))
    _one_line(proc, "token id 1000000 is outside the model's vocabulary")
    assert not _steps(proc)
    np.zeros(64 * 4, dtype="<i4").tofile(tmp_path / "small.bin")  # 4 sequences, a batch is 8
    proc = _run(program, "--steps", "1", "--data", str(tmp_path / "small.bin"))
    assert proc.returncode == 0 and "fewer than one global batch of 8" in proc.stderr


@pytest.mark.parametrize("field", ["matmul_efficiency = 1.5", "link_efficiency = nan", "hbm_gbps = inf"])
def test_hardware_profiles_refuse_impossible_numbers(tmp_path, field):
    from autoshard.errors import AutoshardError
    from cost_models import hardware

    (tmp_path / "hw.toml").write_text(f'extends = "h100"\n{field}\n')
    with pytest.raises(AutoshardError, match=field.split()[0]):
        hardware.load(str(tmp_path / "hw.toml"))
