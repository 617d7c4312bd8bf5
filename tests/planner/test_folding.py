"""MoE parallel folding: expert layers take their EP groups from a stage's tp x cp x dp ranks
(flattened in the mesh order, pp skipped), the search offers every EP degree that folding allows,
the placements put the EP and EDP groups on the links those ranks sit on, the layer costs split
the routed tokens among TP ranks, and an impossible pin says which rule it breaks."""

import json

import pytest

from autoshard.cost_models import comm, hardware
from autoshard.cost_models.layers import LayerCosts
from autoshard.errors import AutoshardError
from autoshard.ir.plan import Mesh, Plan
from autoshard.planner import Problem, parse_force
from autoshard.planner.candidates import Candidate, check_problem, meshes
from autoshard.planner.costs import placements
from autoshard.runtime.program import stage_positions

from conftest import captured

H100 = hardware.load("h100")


@pytest.fixture(scope="module")
def tiny():
    return captured("deepseek_v3", "tiny", 64)[1]


def test_ep_folds_over_tensor_parallel_ranks_too(tiny):
    """8 experts on 8 GPUs: TP2 x DP4 offers EP8, more than the 4 DP ranks; every offered EP
    divides the experts and the stage's tp*cp*dp."""
    offered = meshes(Problem(tiny, H100, 8, 64, 8))
    assert (2, 1, 1, 8, 4) in offered
    assert (4, 2, 1, 4, 1) in offered  # EP over TP alone
    assert any(ep > dp * cp for _, _, cp, ep, dp in offered)
    for tp, _, cp, ep, dp in offered:
        assert tiny.facts["experts"] % ep == 0 and (tp * cp * dp) % ep == 0


def _layout(ranks: list[int], domain: int) -> tuple[int, int, int]:
    per = {}
    for r in ranks:
        per[r // domain] = per.get(r // domain, 0) + 1
    return len(ranks), max(per.values()), len(per)


@pytest.mark.parametrize(
    "tp,pp,cp,ep,dp,order",
    [
        (2, 16, 1, 64, 32, ("tp", "dp", "pp", "cp")),  # NVIDIA's H100 recipe: EP over all of TP2 x DP32
        (2, 16, 1, 2, 32, ("tp", "dp", "pp", "cp")),  # EP is the TP pair; EDP strides over DP
        (2, 16, 1, 8, 32, ("dp", "pp", "tp", "cp")),  # pp between dp and tp: skipped by the fold
        (4, 2, 2, 16, 8, ("cp", "tp", "dp", "pp")),
    ],
)
def test_expert_groups_sit_where_the_program_builds_them(tp, pp, cp, ep, dp, order):
    """The cost model's EP and EDP groups span the NVLink domains that the emitted program's
    groups (``runtime.program.stage_positions``: EP = ep consecutive positions) span."""
    c = Candidate(tp, pp, cp, ep, dp, 1, (), "flash", frozenset(), order=order)
    where = placements(c, order, H100)
    ranks = stage_positions(Mesh(tp, pp, cp, ep, dp, list(order)))[0].tolist()
    d = H100.nvlink_domain
    got = lambda w: (w.size, w.per_domain, w.domains)  # noqa: E731
    assert got(where["ep"]) == _layout(ranks[:ep], d)
    assert got(where["edp"]) == _layout(ranks[::ep], d)
    assert where["edp"].size == c.edp == tp * cp * dp // ep


@pytest.fixture(scope="module")
def full():
    return captured("deepseek_v3", "671b", 4096)[1]


def test_routed_tokens_split_among_tp_ranks_with_or_without_sp(full):
    """The tokens each TP rank's experts compute are its 1/tp share whether or not SP splits them
    (the same expert GEMMs and all-to-all); without SP the expert-parallel pass shares the routed
    rows among TP ranks and all-reduces them back, forward and backward, with or without EP."""
    moe = next(i for i, blk in enumerate(full.blocks) if blk.params_experts)
    sp, no_sp = LayerCosts(full, 4096, H100, True), LayerCosts(full, 4096, H100, False)
    where = placements(Candidate(2, 1, 1, 2, 2, 1, (), "flash", frozenset()), ("tp", "dp", "cp", "pp"), H100)
    args = (moe, 2, 2, 1, 2, "flash", (), where["tp"], where["cp"], where["ep"])
    assert no_sp._gemms(moe, 2, 2, 1, (), 2, True) == sp._gemms(moe, 2, 2, 1, (), 2, True)
    assert no_sp.comm(*args)[3] == pytest.approx(sp.comm(*args)[3])
    assert sp.comm(*args)[3] > 0
    one_rank = placements(Candidate(1, 1, 1, 2, 4, 1, (), "flash", frozenset()), ("tp", "dp", "cp", "pp"), H100)
    args1 = (moe, 2, 1, 1, 2, "flash", (), one_rank["tp"], one_rank["cp"], where["ep"])
    assert sp.comm(*args)[3] < sp.comm(*args1)[3]  # half the tokens each
    # without EP too: the pass shares the routed rows among the TP ranks
    assert no_sp._gemms(moe, 2, 2, 1, (), 1, True) == sp._gemms(moe, 2, 2, 1, (), 1, True)
    blk = full.blocks[moe]
    routed = sum(2 * float(fn(2, 4096)) for c, fn in blk._compiled["collectives"] if c.axis == "ep")
    rejoin = 2 * comm.all_reduce(routed, where["tp"].placement(), H100)
    no_ep = (moe, 2, 2, 1, 1, "flash", (), where["tp"], where["cp"], where["ep"])
    assert routed > 0 and no_sp.comm(*no_ep)[0] >= rejoin
    assert no_sp.comm(*args)[0] == pytest.approx(no_sp.comm(*no_ep)[0])  # the same with or without EP
    assert sp.comm(*args)[0] == pytest.approx(sp.comm(*no_ep)[0])


def test_nvidia_h100_recipe_mesh_is_offered(full):
    """TP2 PP16 EP64 DP32 on 1,024 GPUs: EP64 folds over the stage's 2 x 32 ranks."""
    pins = parse_force("tp=2,pp=16,ep=64,dp=32")
    problem = Problem(full, H100, 1024, 4096, 8192, "bf16", pins)
    check_problem(problem)
    assert meshes(problem) == [(2, 16, 1, 64, 32)]


@pytest.mark.parametrize(
    "force,message",
    [
        ("tp=2,pp=2,ep=8,dp=2", "ep=8 does not divide the tp*cp*dp ranks of a pipeline stage"),
        ("tp=2,pp=2,ep=8,dp=2", "leave stages of 4 ranks"),
        ("ep=3", "does not divide the model's 8 experts"),
        ("tp=2,pp=2,dp=4", "tp*pp*dp = 16 does not divide --gpus 8"),
        ("tp=2,pp=2,cp=1,dp=1", "tp*pp*cp*dp = 4 is not --gpus 8"),
    ],
)
def test_an_impossible_pin_names_the_rule_it_breaks(tiny, force, message):
    with pytest.raises(AutoshardError) as e:
        check_problem(Problem(tiny, H100, 8, 64, 8, "bf16", parse_force(force)))
    assert message in str(e.value)
    assert "power-of-two" not in str(e.value)


def test_mesh_records_expert_tensor_parallelism_and_old_plans_load(tmp_path):
    m = Mesh(tp=2, pp=16, ep=64, dp=32, order=["tp", "dp", "pp", "cp"])
    assert (m.etp, m.edp) == (1, 1)
    plan = Plan.load(_a_plan(tmp_path))
    data = plan.to_dict()
    assert data["mesh"]["etp"] == 1
    del data["mesh"]["etp"]  # a plan.json written before etp existed
    (tmp_path / "old.json").write_text(json.dumps(data))
    assert Plan.load(tmp_path / "old.json").mesh.etp == 1
    data["mesh"] |= {"ep": 4, "etp": 3}  # 12 does not divide the stage's 8 ranks
    (tmp_path / "bad.json").write_text(json.dumps(data))
    with pytest.raises(AutoshardError, match="does not divide a stage's tp\\*cp\\*dp"):
        Plan.load(tmp_path / "bad.json")


def _a_plan(tmp_path):
    from autoshard.planner import solve

    cost = captured("deepseek_v3", "tiny", 64)[1]
    plan, _ = solve(Problem(cost, H100, 8, 64, 8, "bf16", parse_force("tp=2,ep=8,dp=4")), alternatives=1)
    assert (plan.mesh.tp, plan.mesh.ep, plan.mesh.dp, plan.mesh.edp) == (2, 8, 4, 1)
    return plan.save(tmp_path / "plan.json")
