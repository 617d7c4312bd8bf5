"""``autoshard verify --at-scale`` on the plans CI can afford (the full matrix is
``benchmarks/at_scale.py``): an 8B-class program (LLaMA-3 8B at 8K tokens, TP2 x PP2 x DP2 with
sequence parallelism, bf16, zero-bubble), a small MoE (DeepSeek-V3's tiny config, EP4 x PP2,
FP8) and a tiny loop of experts at ZeRO-3 under selective recomputation. Each rank named runs one
optimizer step at its full shapes on fake tensors with the fake process group, and its counters are
set beside plan.json's per-rank promise.

The 8B rank passes every bound (its parameters, gradients and optimizer states are the plan's to
the byte, its FLOPs to 0.01%). The tiny MoE's FLOPs and every dimension's bytes are the plan's;
its peak memory (0.1 GB) is not within 10%: at that size the backward's transients of the
expert dispatch, which the cost model does not price, are a quarter to a half of it, so the test
checks that ``verify`` says so (exit 1, OUT OF BOUNDS) where the bound is missed."""

import json
from pathlib import Path

import pytest

from autoshard import atscale
from autoshard.cli import main

from conftest import EXAMPLES


def _compile(tmp_path, model: str, config: str, hardware: str, gpus: int, batch: int, force: str, precision: str):
    out = tmp_path / "out"
    args = [str(EXAMPLES / model), "--config", config, "--hardware", hardware, "--gpus", str(gpus)]
    args += ["--seq-len", "8192" if config == "8b" else "4096", "--global-batch", str(batch)]
    args += ["--precision", precision, "--force", force, "-o", str(out)]
    assert main(["compile", *args]) == 0
    return out


@pytest.fixture(scope="module")
def llama8b(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("8b"), "llama3.py", "8b", "h100", 8, 32, "tp=2,pp=2,dp=2", "bf16")


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    return _compile(tmp_path_factory.mktemp("moe"), "deepseek_v3.py", "tiny", "h800", 8, 32, "ep=4,pp=2", "fp8")


@pytest.fixture(scope="module")
def moe_selective(tmp_path_factory):
    # DeepSeek-V3's full-size plan's recomputation: the activations and the norms' outputs
    force = "ep=4,pp=2,schedule=dualpipev,recompute=activation+norm_output"
    return _compile(tmp_path_factory.mktemp("moe-rc"), "deepseek_v3.py", "tiny", "h800", 8, 32, force, "fp8")


@pytest.fixture(scope="module")
def loop_zero3(tmp_path_factory):
    """A loop of experts (``tests/models/naive_moe.py``) at ZeRO-3 recomputing the norms' outputs,
    at 64 tokens, where its stacked weights' exchanges are most of the expert-parallel bytes."""
    out = tmp_path_factory.mktemp("loop-z3") / "out"
    args = [str(Path(__file__).parent / "models" / "naive_moe.py"), "--config", "tiny", "--hardware", "h100"]
    args += ["--gpus", "8", "--seq-len", "64", "--global-batch", "8", "-o", str(out)]
    assert main(["compile", *args, "--force", "ep=4,dp=8,pp=1,tp=1,zero=3,recompute=norm_output"]) == 0
    return out


def _rows(rank) -> dict:
    return {row.what.strip(): row for row in rank.rows}


def test_8b_rank_counts_states_flops_and_bytes_as_planned(llama8b):
    report = atscale.verify_at_scale(llama8b, "first", timeout=600)
    (rank,) = report.ranks
    assert rank.chosen_as == ["first"] and rank.coords["pp"] == 0
    rows = _rows(rank)
    for part in ("params", "grads", "optimizer"):
        assert rows[part].ratio == pytest.approx(1.0, abs=0.01), part
    assert rows["FLOPs"].ratio == pytest.approx(1.0, abs=0.01)
    for what, row in rows.items():
        if what.endswith("bytes sent"):
            assert row.ok(report.bounds.comm_floor_bytes), what
    assert {"tp bytes sent", "pp bytes sent", "dp bytes sent"} <= set(rows)
    # nothing allocated at full size: the whole process (torch, the traced program, the fake
    # tensors' metadata) stays below what the rank's parameters alone would take for real
    assert rank.measured.rss_bytes < rows["params"].measured
    assert rows["peak memory"].ok() and rank.ok and report.ok


def test_moe_ranks_exchange_the_planned_bytes_and_verify_says_what_misses(moe, capsys):
    report = atscale.verify_at_scale(moe, "first,busiest", timeout=600)
    assert report.ranks
    for rank in report.ranks:
        rows = _rows(rank)
        assert "ep bytes sent" in rows and "pp bytes sent" in rows
        assert rows["FLOPs"].ok(), rank.rank
        for what, row in rows.items():
            if what.endswith("bytes sent"):
                assert row.ok(report.bounds.comm_floor_bytes), (rank.rank, what)
    # the CLI on the same program: a bound it misses is a failed check, named, exit 1
    code = main(["verify", str(moe), "--at-scale", "--ranks", "first", "--json"])
    printed = json.loads(capsys.readouterr().out)
    assert code == (0 if printed["ok"] else 1)
    missed = [r["what"] for r in printed["ranks"][0]["rows"] if r["checked"] and not r["ok"]]
    assert bool(missed) == (not printed["ok"])


def test_a_tight_bound_fails_and_a_bad_rank_is_one_line(moe, capsys):
    assert main(["verify", str(moe), "--at-scale", "--ranks", "first", "--memory-within", "1e-6"]) == 1
    assert "OUT OF BOUNDS" in capsys.readouterr().out
    assert main(["verify", str(moe), "--at-scale", "--ranks", "middle"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "'middle' is not first, last, busiest" in err[0]


def test_moe_selective_recomputation_sends_and_remakes_what_the_plan_counts(moe_selective):
    """Keeping the experts while recomputing activations and norms: the experts' inputs stay as
    their FP8 copies, so the recomputation does not dispatch the tokens again (ep bytes 1.13 of
    plan before). The step runs at all: the first micro-batch's forward quantised each FP8 weight
    in the selective cache's sight, its recomputation found the copy, and the cache handed later
    calls the wrong entries (a rotary embedding's cast got a 128x128 block's layout and failed)."""
    report = atscale.verify_at_scale(moe_selective, "first", timeout=600)
    (rank,) = report.ranks
    rows = _rows(rank)
    assert rows["ep bytes sent"].ratio == pytest.approx(1.0, abs=0.03)
    assert rows["FLOPs"].ok()


def test_a_loop_of_experts_recomputing_exchanges_its_weights_again_as_planned(loop_zero3):
    """The checkpoint remakes the whole expert weights the GEMMs saved by running the stacks'
    exchange again: measured, one more exchange of every stack per layer than planned (ep bytes
    1.25 of plan at 2048 tokens and hidden 2048, 1.21 here) before the cost model counted it."""
    report = atscale.verify_at_scale(loop_zero3, "first", timeout=600)
    (rank,) = report.ranks
    rows = _rows(rank)
    assert rows["ep bytes sent"].ratio == pytest.approx(1.0, abs=0.02)
    assert rows["dp bytes sent"].ok() and rows["FLOPs"].ok()
