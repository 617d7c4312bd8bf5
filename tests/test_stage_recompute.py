"""A recompute set per pipeline rank: under 1F1B the first rank holds the most micro-batches in
flight, so on a device with little memory it recomputes and the last rank does not. The plan
records it (``stage_checkpoint``), plan.md and ``explain`` say it, the activation-checkpoint pass
wraps only the layers of the rank that recomputes, the program trains like the single device,
and ``verify --at-scale`` finds each rank's memory as planned.

The tiny LLaMA at 64 tokens, TP1 x PP2 x DP1, 1F1B, 8 micro-batches, on the CPU profile cut to
1.5 MB: every layer saving everything fits on the last rank only (1.49 MB beside 1.53 MB)."""

import json

import pytest

from autoshard import atscale
from autoshard.cli import main
from autoshard.errors import AutoshardError
from autoshard.ir.plan import Plan
from autoshard.verify import verify

from conftest import EXAMPLES


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    root = tmp_path_factory.mktemp("stage-rc")
    profile = root / "small.toml"
    profile.write_text('name = "small"\nextends = "cpu"\nhbm_gb = 0.0015\nmemory_reserve_gb = 0\n')
    args = [str(EXAMPLES / "llama3.py"), "--config", "tiny", "--hardware", str(profile), "--gpus", "2"]
    args += ["--seq-len", "64", "--global-batch", "8", "--force", "pp=2,tp=1,dp=1,mbs=1,schedule=1f1b"]
    assert main(["compile", *args, "-o", str(root / "out")]) == 0
    return root / "out"


def test_the_rank_holding_more_micro_batches_recomputes_more(compiled):
    plan = Plan.load(compiled)
    assert plan.stage_recompute(0) and not plan.stage_recompute(1)
    assert plan.recompute == plan.stage_recompute(0)  # ``checkpoint``: what some stage recomputes
    ranks = plan.predicted.ranks
    assert ranks[0]["flops"]["recompute"] > 0 and ranks[1]["flops"]["recompute"] == 0
    text = plan.rank_recompute_text()
    assert text.startswith("rank 0 recomputes ") and text.endswith("rank 1 saves everything")
    assert text in (compiled / "plan.md").read_text()
    stage0, stage1 = ((compiled / f"stage{i}.py").read_text() for i in range(2))
    assert "rt.Checkpoint(" in stage0 and "rt.Checkpoint(" not in stage1


def test_explain_names_each_rank_s_set(compiled, capsys):
    assert main(["explain", str(compiled)]) == 0
    assert "per pipeline rank: rank 0 recomputes" in capsys.readouterr().out


def test_the_program_trains_like_the_single_device(compiled):
    result = verify(compiled, steps=2, tolerance=1e-5, timeout=240)
    assert result["ok"] and len(result["steps"]) == 2
    assert all(row["rel_diff"] <= 1e-5 for row in result["steps"])


def test_each_rank_s_memory_is_as_planned_at_scale(compiled):
    """Peak memory within bounds on both ranks, and the rank that saves everything its FLOPs.
    (The recomputing rank's FLOPs are 1.04 of plan: the same as when every rank recomputes that
    set, a miss of the recompute FLOPs at this tiny size that per-rank sets do not change.)"""
    report = atscale.verify_at_scale(compiled, "first,last", timeout=240)
    first, last = report.ranks
    rows = {r.what.strip(): r for r in first.rows}, {r.what.strip(): r for r in last.rows}
    assert rows[0]["peak memory"].ok() and rows[1]["peak memory"].ok()
    assert rows[1]["FLOPs"].ok()
    assert rows[0]["FLOPs"].ratio == pytest.approx(1.0, abs=0.06)


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda d: d["stage_checkpoint"].pop(), "one entry per virtual stage"),
        (lambda d: d["stage_checkpoint"][1].pop(next(iter(d["checkpoint"]))), "must name the categories"),
        (lambda d: d["checkpoint"].update(dict.fromkeys(d["checkpoint"], "save")), "exactly the categories"),
    ],
)
def test_bad_stage_checkpoints_are_rejected(compiled, tmp_path, change, message):
    data = json.loads((compiled / "plan.json").read_text())
    change(data)
    (tmp_path / "plan.json").write_text(json.dumps(data))
    with pytest.raises(AutoshardError, match=message):
        Plan.load(tmp_path)


def test_a_plan_without_stage_checkpoint_loads_with_one_set_for_every_stage(compiled, tmp_path):
    data = json.loads((compiled / "plan.json").read_text())
    del data["stage_checkpoint"]
    (tmp_path / "plan.json").write_text(json.dumps(data))
    plan = Plan.load(tmp_path)
    assert plan.stage_recompute(0) == plan.stage_recompute(1) == plan.recompute
    assert plan.rank_recompute_text().startswith("every rank: recompute ")
