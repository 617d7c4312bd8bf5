"""``autoshard explain PLAN --what-if``: the snapshot ``compile`` writes plans as the live cost
does, and the answers move the way the changed problem says they must."""

import gzip
import json
import pickle
import shutil
from dataclasses import replace

import pytest

from autoshard import planner, whatif
from autoshard.cli import main
from autoshard.compiler import problem as make_problem
from autoshard.cost_models import hardware

from conftest import EXAMPLES, captured

SEQ = 64


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def _round_trip(problem: planner.Problem) -> planner.Problem:
    """``problem`` as ``explain --what-if`` reads it back: frozen, written, loaded."""
    data = gzip.decompress(whatif.dumps(whatif.freeze(problem)))
    versions_size = len(pickle.dumps(whatif.versions(), protocol=pickle.HIGHEST_PROTOCOL))
    return pickle.loads(data[versions_size:])


# ---------------------------------------------------------------------------------------------
# the snapshot is faithful


CASES = {
    # dense, searched freely on a small machine (memory binds: recompute sets matter)
    "dense": ("llama3", dict(hardware="cpu", gpus=4, global_batch=8), {}),
    # MoE with expert parallelism and every kind recomputed: the replayed exchanges are priced
    "moe": ("deepseek_v3", dict(hardware="h100", gpus=8, global_batch=16), {"ep": 2, "recompute": "full"}),
    # a refusal of the passes travels with the snapshot and keeps its choice out
    "refused": ("llama3", dict(hardware="h100", gpus=8, global_batch=16), {}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_snapshot_plans_as_the_live_cost_does(case):
    name, run_, pins = CASES[case]
    cap = captured(name, "tiny", SEQ)[0]
    live = make_problem(cap, run_["hardware"], run_["gpus"], SEQ, run_["global_batch"], pins=planner.parse_force(
        ",".join(f"{k}={v}" for k, v in pins.items())), name=f"{name}:tiny")  # fmt: skip
    if case == "refused":
        live.excluded = {"tp": {2}}
        live.exclusion_reasons = ["tp=2: refused for this test"]
    loaded = _round_trip(live)
    assert loaded.cost.pre._nodes is None and all(b._nodes is None for b in loaded.cost.blocks)
    plan_live, _ = planner.solve(live)
    plan_loaded, _ = planner.solve(loaded)
    assert plan_loaded.to_json() == plan_live.to_json()
    if case == "moe":  # the pins reached the plan: the exchanges and recomputation were priced
        assert plan_live.mesh.ep == 2 and plan_live.predicted.recompute_s > 0
        assert plan_live.predicted.comm_s["ep"]["total"] > 0
    if case == "refused":
        assert plan_live.mesh.tp != 2 and any("refused for this test" in n for n in plan_loaded.notes)


def test_a_live_block_refuses_to_pickle_and_a_frozen_one_has_every_closure():
    cost = captured("llama3", "tiny", SEQ)[1]
    with pytest.raises(TypeError, match="freeze"):
        pickle.dumps(cost.blocks[0])
    frozen = cost.blocks[0].freeze()
    cats = sorted(frozen._recomputable)
    assert len(cats) >= 3
    assert len(frozen._closure) == 3 * 2 ** len(cats)  # flops, matmul parts, exchanges per subset
    with pytest.raises(KeyError, match="frozen"):
        frozen._closed("flops", frozenset({"not a category"}), lambda d: 0)


# ---------------------------------------------------------------------------------------------
# the command


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """A tiny LLaMA plan with TP and several micro-batches, compiled as a user would (``--plan-only``)."""
    out = tmp_path_factory.mktemp("whatif") / "out"
    args = ["compile", str(EXAMPLES / "llama3.py"), "--config", "tiny", "--hardware", "h100", "--gpus", "8"]
    args += ["--seq-len", "256", "--global-batch", "32", "--force", "tp=2,mbs=2", "--plan-only", "-o", str(out)]
    assert main(args) == 0
    assert (out / whatif.SNAPSHOT).is_file()
    return out


def ask(capsys, compiled, *items) -> dict:
    argv = ["explain", str(compiled)] + [x for item in items for x in ("--what-if", item)] + ["--json"]
    code, out, err = run(capsys, *argv)
    assert code == 0, err
    return json.loads(out)


def test_no_change_prices_the_plan_as_plan_json_says(capsys, compiled):
    plan = json.loads((compiled / "plan.json").read_text())
    answer = ask(capsys, compiled, f"nvlink_gbps={hardware.load('h100').nvlink_gbps}")
    for key in ("before", "same_layout", "best"):
        assert answer[key]["step_time_s"] == pytest.approx(plan["predicted"]["step_time_s"], rel=1e-9)
    assert answer["same_layout"]["layout"]["tp"] == plan["mesh"]["tp"] == 2
    assert not answer["moved"] and not any("snapshot prices" in n for n in answer["notes"])


def test_slower_nvlink_slows_the_same_layout_by_its_tp_traffic(capsys, compiled):
    answer = ask(capsys, compiled, "nvlink_gbps=5")
    before, same = answer["before"], answer["same_layout"]
    assert answer["changes"] == [{"key": "nvlink_gbps", "from": 450.0, "to": 5.0}]
    # a tiny model's TP messages are mostly latency, which NVLink's bandwidth leaves as it is
    assert same["terms_s"]["tp"] > 2 * before["terms_s"]["tp"] > 0
    assert same["step_time_s"] > before["step_time_s"]
    assert answer["moved"][0]["term"] == "tp"
    assert same["layout"] == before["layout"]


def test_twice_the_gpus_doubles_dp_and_halves_the_micro_batches(capsys, compiled):
    answer = ask(capsys, compiled, "gpus=16")
    before, same = answer["before"]["layout"], answer["same_layout"]["layout"]
    assert same["dp"] == 2 * before["dp"] and same["tp"] == before["tp"]
    assert same["microbatches"] * 2 == before["microbatches"] == 4
    assert answer["best"]["gpus"] == 16


def test_a_longer_sequence_costs_more_per_token_as_a_fresh_capture_says(capsys, compiled):
    answer = ask(capsys, compiled, "seq_len=512")
    before, same = answer["before"], answer["same_layout"]
    # attention's FLOPs grow with the sequence: more FLOPs per token, as the model at 512 has
    fresh = captured("llama3", "tiny", 512)[1].flops_per_token(512)["training"]
    assert same["training_flops_per_token"] == pytest.approx(fresh, rel=1e-12)
    assert same["training_flops_per_token"] > before["training_flops_per_token"]
    assert any("tokens per step" in n for n in answer["notes"])


def test_less_memory_than_the_plan_needs_says_it_no_longer_fits(capsys, compiled):
    plan = json.loads((compiled / "plan.json").read_text())
    need = plan["predicted"]["memory_bytes_per_gpu"]["total"]
    reserve = hardware.load("h100").memory_reserve_gb
    answer = ask(capsys, compiled, f"hbm_gb={reserve + need / 2e9}")
    same = answer["same_layout"]
    assert not same["fits"] or "no longer fits" in same.get("note", "")
    if not same["fits"]:
        assert "does not fit" in same["reason"]


def test_another_profile_and_its_price(capsys, compiled):
    answer = ask(capsys, compiled, "hardware=b200", "price_per_gpu_hour=1")
    assert answer["best"]["hardware"] == "b200"
    assert [c["key"] for c in answer["changes"]] == ["hardware", "price_per_gpu_hour"]
    same = answer["same_layout"]
    days = same["days_per_1t_tokens"]
    assert same["usd_per_1t_tokens"] == pytest.approx(days * 24 * 8 * 1.0)


def test_text_output_names_the_change_and_the_moved_term(capsys, compiled):
    code, out, _ = run(capsys, "explain", str(compiled), "--what-if", "nvlink_gbps=5")
    assert code == 0
    assert out.startswith("What if nvlink_gbps 450 -> 5:")
    assert "exposed tensor-parallel communication" in out


@pytest.mark.parametrize(
    "item,message",
    [
        ("nvlink=5", "KEY one of gpus, seq_len, global_batch, hardware, "),
        ("gpus", "expected KEY=VALUE"),
        ("gpus=1.5", "positive whole number"),
        ("nvlink_gbps=fast", "expected a number"),
        ("link_efficiency=2", "is a share"),
        ("hardware=tpu", "unknown hardware"),
    ],
)
def test_a_bad_what_if_is_one_line(capsys, compiled, item, message):
    code, out, err = run(capsys, "explain", str(compiled), "--what-if", item)
    assert code == 2 and not out
    assert message in err and err.count("\n") == 1


def test_a_plan_without_a_snapshot_or_from_another_version_asks_to_recompile(capsys, compiled, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(compiled, old)
    (old / whatif.SNAPSHOT).unlink()
    code, _, err = run(capsys, "explain", str(old), "--what-if", "gpus=16")
    assert code == 2 and "no cost.pkl" in err and "recompile" in err
    _, loaded = whatif.load(compiled)
    other = {**whatif.versions(), "sympy": "0.0"}
    (old / whatif.SNAPSHOT).write_bytes(
        gzip.compress(pickle.dumps(other) + pickle.dumps(replace(loaded, gpus=loaded.gpus)))
    )
    code, _, err = run(capsys, "explain", str(old), "--what-if", "gpus=16")
    assert code == 2 and "sympy 0.0" in err and "recompile" in err and err.count("\n") == 1


def test_a_plan_whose_ranks_recompute_different_sets_keeps_its_split_and_rechooses_the_sets(capsys, tmp_path):
    """The tiny LLaMA on 1.5 MB GPUs (``test_stage_recompute``): its first pipeline rank
    recomputes, its last does not. No ``--force`` pin says a set per rank, so the same layout
    keeps the stage split and the ranks' sets are chosen again for it: never slower than the
    plan, and the answer says where the two differ."""
    profile = tmp_path / "small.toml"
    profile.write_text('name = "small"\nextends = "cpu"\nhbm_gb = 0.0015\nmemory_reserve_gb = 0\n')
    args = [str(EXAMPLES / "llama3.py"), "--config", "tiny", "--hardware", str(profile), "--gpus", "2"]
    args += ["--seq-len", "64", "--global-batch", "8", "--force", "pp=2,tp=1,dp=1,mbs=1,schedule=1f1b"]
    assert main(["compile", *args, "--plan-only", "-o", str(tmp_path / "out")]) == 0
    capsys.readouterr()
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert plan["stage_checkpoint"]
    answer = ask(capsys, tmp_path / "out", "hbm_gb=0.0015")
    before, same = answer["before"], answer["same_layout"]
    assert same["step_time_s"] == before["step_time_s"] <= plan["predicted"]["step_time_s"] * (1 + 1e-9)
    assert same["layout"]["stage_layers"] == plan["stage_layers"]
    differs = same["step_time_s"] < plan["predicted"]["step_time_s"] * (1 - 1e-9)
    assert differs == any("recompute sets, chosen again" in n for n in answer["notes"])
