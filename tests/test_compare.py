"""``autoshard compare``: one model on several profiles and GPU counts, each row the plan that
``compile --plan-only`` writes for it, with the cost of training a token count."""

import io
import json
import shlex
from contextlib import redirect_stdout

import pytest

from autoshard.cli import main
from autoshard.ir.plan import Plan

from conftest import EXAMPLES

TINY = [str(EXAMPLES / "llama3.py"), "--config", "tiny", "--seq-len", "64", "--global-batch", "8"]


@pytest.fixture(scope="module")
def rows():
    buf = io.StringIO()
    with redirect_stdout(buf):
        code = main(["compare", *TINY, "--hardware", "cpu,h100", "--gpus", "2,4", "--tokens", "1e9", "--json"])
    assert code == 0
    return json.loads(buf.getvalue())


def test_a_row_per_profile_and_gpu_count(rows):
    data = rows
    assert data["tokens"] == 1e9
    assert [(r["hardware"], r["gpus"]) for r in data["rows"]] == [("cpu", 2), ("cpu", 4), ("h100", 2), ("h100", 4)]
    for r in data["rows"]:
        tokens_per_step = 8 * 64
        assert r["tokens_per_s"] == pytest.approx(tokens_per_step / r["step_time_s"])
        assert r["days"] == pytest.approx(1e9 / r["tokens_per_s"] / 86400)
        assert r["gpu_hours"] == pytest.approx(r["days"] * 24 * r["gpus"])
        assert r["memory_gb"] <= r["usable_gb"]


def test_each_row_is_what_its_compile_command_plans(rows, tmp_path, capsys):
    data = rows
    for r in (data["rows"][1], data["rows"][3]):
        argv = shlex.split(r["command"])
        assert argv[:2] == ["autoshard", "compile"]
        out = argv.index("-o") + 1
        argv[out] = str(tmp_path / argv[out].replace("/", "_"))
        assert main(argv[1:]) == 0
        plan = Plan.load(argv[out])
        assert plan.predicted.step_time_s == pytest.approx(r["step_time_s"], rel=1e-9)
        assert {**plan.mesh.degrees(), "schedule": plan.schedule, "zero": plan.zero_stage} == r["degrees"]
    capsys.readouterr()


def test_the_table_and_the_chart(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    chart = tmp_path / "rows.svg"
    code = main(["compare", *TINY, "--hardware", "h100,b200", "--gpus", "4", "--tokens", "1e9", "--chart", str(chart)])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith("| hardware | GPUs | plan |") and "| days | GPU-hours | cost USD |" in out
    assert "h100 x 4: autoshard compile" in out and "b200 x 4: autoshard compile" in out
    assert chart.read_text().lstrip().startswith("<?xml")


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--hardware", "h100,nosuch", "--gpus", "4"], "nosuch"),
        (["--hardware", "h100,", "--gpus", "4"], "empty item"),
        (["--hardware", "h100", "--gpus", "4,x"], "whole numbers"),
        (["--hardware", "h100", "--gpus", "0"], "positive"),
    ],
)
def test_bad_lists_are_one_line_errors(argv, message, capsys):
    assert main(["compare", *TINY, *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_row_without_a_plan_says_why_and_the_others_stand(capsys):
    code = main(["compare", *TINY, "--hardware", "h100", "--gpus", "1,2", "--force", "tp=2"])
    out = capsys.readouterr().out
    assert code == 0
    assert "| h100 | 1 | no plan: --force tp=2 does not divide --gpus 1 |" in out
    assert "| h100 | 2 | TP2 x PP1" in out
