"""The Plan: JSON round trip, consistency checks, and the compile/explain command line."""

import json
import subprocess
import sys

import pytest

from autoshard.cli import main
from autoshard.errors import AutoshardError
from autoshard.ir.plan import Plan

from conftest import EXAMPLES

TINY = [str(EXAMPLES / "llama3.py"), "--config", "tiny", "--hardware", "h100", "--seq-len", "64"]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    code = main(["compile", *TINY, "--gpus", "8", "--global-batch", "16", "--plan-only", "-o", str(out)])
    assert code == 0
    return out


def test_compile_writes_a_plan_that_round_trips(compiled):
    plan = Plan.load(compiled / "plan.json")
    again = Plan.from_dict(json.loads(plan.to_json()))
    assert again == plan
    assert plan.mesh.gpus == 8 and sum(plan.stage_layers) == 2
    assert plan.predicted.memory_bytes_per_gpu["total"] <= plan.predicted.memory_limit_bytes
    md = (compiled / "plan.md").read_text()
    for section in (
        "The mesh on the hardware",
        "Where the step time goes",
        "Memory on the busiest GPU",
        "Alternatives that lost",
        "Rationale",
    ):
        assert section in md


def test_explain_prints_the_rationale(compiled, capsys):
    assert main(["explain", str(compiled / "plan.json")]) == 0
    out = capsys.readouterr().out
    assert "Plan: TP" in out and "Memory on the busiest GPU" in out and "Why not:" in out


def test_force_pins_fields(tmp_path):
    code = main(
        [
            "compile",
            *TINY,
            "--gpus",
            "8",
            "--global-batch",
            "16",
            "--plan-only",
            "--force",
            "tp=2,pp=2,schedule=1f1b,zero=1",
            "-o",
            str(tmp_path),
        ]
    )
    assert code == 0
    plan = Plan.load(tmp_path)
    assert (plan.mesh.tp, plan.mesh.pp, plan.schedule, plan.zero_stage) == (2, 2, "1f1b", 1)
    assert plan.forced == {"tp": 2, "pp": 2, "schedule": "1f1b", "zero": 1}


def _edit(path, change):
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda d: d.update(version=99), "plan format version 99"),
        (lambda d: d["mesh"].update(tp=d["mesh"]["tp"] * 2), "inconsistent plan: tp*pp*cp*dp"),
        (lambda d: d.update(stage_layers=[5] * len(d["stage_layers"])), "inconsistent plan: stage_layers sum"),
        (lambda d: d.update(schedule="gpipe"), "schedule 'gpipe'"),
        (lambda d: d.pop("mesh"), "missing field(s) mesh"),
    ],
)
def test_bad_plans_are_rejected(compiled, tmp_path, change, message):
    path = tmp_path / "plan.json"
    path.write_text((compiled / "plan.json").read_text())
    _edit(path, change)
    with pytest.raises(AutoshardError, match=message.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        Plan.load(path)


def _run(*argv):
    proc = subprocess.run([sys.executable, "-m", "autoshard", *argv], capture_output=True, text=True)
    return proc.returncode, proc.stderr


def _in_process(argv, capsys):
    """``autoshard argv`` run by ``cli.main`` in this process: its exit code and stderr."""
    from autoshard.cli import main

    capsys.readouterr()
    try:
        code = main(argv)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--gpus", "13", "--global-batch", "27"], "13 GPUs admit no factorisation"),
        (
            # TP4 (2 key/value heads shared), PP4, CP2 leave DP2 at the least on 64 GPUs
            ["--gpus", "64", "--global-batch", "1", "--seq-len", "4"],
            "--global-batch 1 is smaller than the smallest data-parallel degree",
        ),
        (["--gpus", "8", "--global-batch", "8", "--force", "tp=3"], "--force tp=3 does not divide --gpus 8"),
        (
            ["--gpus", "8", "--global-batch", "8", "--seq-len", "30", "--force", "cp=4"],
            "--seq-len 30 is not divisible by 2*cp",
        ),
        (["--gpus", "8", "--global-batch", "8", "--force", "tp=8"], "--force tp=8 does not divide the model's heads"),
        (["--gpus", "8", "--global-batch", "8", "--force", "warp=2"], "--force: unknown field 'warp'"),
        (["--gpus", "8", "--global-batch", "8", "--force", "dp=3"], "--force dp=3 does not divide --gpus 8"),
        (["--gpus", "0", "--global-batch", "8"], "argument --gpus: must be positive"),
    ],
)
def test_compile_bad_input(tmp_path, capsys, extra, message):
    args = [a for a in TINY]
    if "--seq-len" in extra:  # the case's own sequence length replaces the default
        i = args.index("--seq-len")
        del args[i : i + 2]
    argv = ["compile", *args, *extra, "--plan-only", "-o", str(tmp_path / "out")]
    if extra[1] == "13":  # one case as a user meets it, a process of its own
        code, err = _run(*argv)
    else:
        code, err = _in_process(argv, capsys)
    assert code == 2, err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()  # nothing half-written


def test_nothing_fits_names_a_gpu_count_that_would(tmp_path):
    profile = tmp_path / "tiny.toml"
    profile.write_text('name = "small"\nextends = "h100"\nhbm_gb = 0.0003\nmemory_reserve_gb = 0\n')
    args = [
        str(EXAMPLES / "llama3.py"),
        "--config",
        "tiny",
        "--hardware",
        str(profile),
        "--seq-len",
        "64",
        "--gpus",
        "1",
        "--global-batch",
        "8",
        "--plan-only",
        "-o",
        str(tmp_path / "out"),
    ]
    code, err = _run("compile", *args)
    assert code == 2
    assert "nothing fits on 1 x small" in err and "smallest GPU count that fits is" in err


def test_explain_missing_plan(tmp_path):
    code, err = _run("explain", str(tmp_path / "nope"))
    assert code == 2 and "plan not found" in err


def test_python_api_plans_a_live_module_and_honours_pins(tmp_path):
    import llama3
    import torch

    import autoshard

    torch.manual_seed(0)
    model = llama3.build("tiny")  # a live CPU module: planned without moving it anywhere
    plan = autoshard.plan(model, hardware="h100", gpus=8, seq_len=64, global_batch=16)
    assert isinstance(plan, autoshard.Plan) and plan.mesh.gpus == 8
    pinned = autoshard.plan(model, hardware="h100", gpus=8, seq_len=64, global_batch=16, tp=2, pp=2, recompute="full")
    assert (pinned.mesh.tp, pinned.mesh.pp) == (2, 2)
    assert set(pinned.checkpoint.values()) == {"recompute"}
    assert pinned.predicted.step_time_s >= plan.predicted.step_time_s
    assert Plan.load(pinned.save(tmp_path / "api")) == pinned
    with pytest.raises(AutoshardError, match="tp=3 does not divide"):
        autoshard.plan(model, hardware="h100", gpus=8, seq_len=64, global_batch=16, tp=3)
