"""compile never refuses its own choice: the search keeps to what the emitted program can run,
and --plan-only keeps the whole space and says what would not be emitted."""

import copy
from pathlib import Path

import pytest

from autoshard import planner, rebuild
from autoshard.compiler import compile_plan
from autoshard.cost_models import hardware
from autoshard.errors import AutoshardError
from autoshard.ir import capabilities
from autoshard.ir.plan import Plan
from autoshard.passes.contract import Refusal

from conftest import EXAMPLES, captured

SEQ = 64


def _problem(name: str, hw: str, gpus: int, batch: int, precision: str = "auto", **pins) -> planner.Problem:
    _, cost = captured(name, "tiny", SEQ)
    text = ",".join(f"{k}={v}" for k, v in pins.items())
    return planner.Problem(cost, hardware.load(hw), gpus, SEQ, batch, precision, planner.parse_force(text), name)


def _compile(name: str, problem: planner.Problem, plan_only: bool = False):
    cap, _ = captured(name, "tiny", SEQ)
    recipe = rebuild.for_file(str(EXAMPLES / f"{name}.py"), None, "tiny")
    return compile_plan(problem, copy.deepcopy(cap), recipe, plan_only)


SWEEP = [
    (name, hw, gpus)
    for name in ("gpt", "llama3", "deepseek_v3")
    for hw, gpus in (("cpu", 2), ("cpu", 8), ("h100", 16), ("h800", 16), ("a100", 4), ("b200", 32))
]


@pytest.mark.parametrize("name,hw,gpus", SWEEP, ids=[f"{n}-{h}-{g}" for n, h, g in SWEEP])
def test_compile_emits_whatever_it_chose(name, hw, gpus):
    compiled = _compile(name, _problem(name, hw, gpus, batch=2 * gpus))
    plan = compiled.plan
    assert compiled.files is not None and "train.py" in compiled.files
    assert sum(1 for f in compiled.files if f.startswith("stage")) == plan.mesh.pp * plan.virtual_stages
    assert capabilities.refusals(plan) == [] and plan.not_emitted == []


def test_the_fp8_plan_the_whole_space_prefers_is_the_one_emitted():
    """The tiny DeepSeek on 16 H800s: the whole space's best plan runs its matmuls in FP8, and
    compile now emits that plan, FP8 and expert parallelism included."""
    whole = _compile("deepseek_v3", _problem("deepseek_v3", "h800", 16, 32), plan_only=True).plan
    assert whole.precision["fp8_matmuls"] and whole.not_emitted == capabilities.refusals(whole) == []
    emitted = _compile("deepseek_v3", _problem("deepseek_v3", "h800", 16, 32))
    assert emitted.plan.precision["fp8_matmuls"] == whole.precision["fp8_matmuls"]
    assert emitted.plan.predicted.step_time_s == pytest.approx(whole.predicted.step_time_s)
    assert "rt.fp8_" in "".join(text for name, text in emitted.files.items() if name.startswith(("stage", "layers")))


def test_pinned_fp8_is_emitted():
    compiled = _compile("llama3", _problem("llama3", "h100", 8, 16, precision="fp8"))
    assert compiled.plan.precision["fp8_matmuls"] == ["attention", "mlp"]
    assert "rt.fp8_linear(" in compiled.files["layers.py"]


def test_pinned_expert_parallelism_is_emitted():
    compiled = _compile("deepseek_v3", _problem("deepseek_v3", "cpu", 4, 8, ep=2, dp=2))
    assert compiled.plan.mesh.ep == 2 and compiled.plan.not_emitted == []
    layers = compiled.files["layers.py"]
    assert "rt.moe_dispatch_buffer(" in layers and "rt.moe_combine_buffer(" in layers


def test_a_choice_a_pass_refuses_is_left_out_and_the_search_runs_again(monkeypatch):
    """A pass that cannot rewrite the model for the first plan's choice on some axis (a stand-in
    for an op it cannot split) takes that choice out of the search; compile then emits the best
    plan without it and says why."""
    from autoshard import codegen

    real, seen = codegen.program_files, []

    def refusing(plan, *args, **kwargs):
        seen.append(plan.mesh.degrees())
        if len(seen) == 1:
            axis = next(a for a in ("tp", "cp", "pp", "dp") if seen[0][a] > 1)
            raise Refusal(f"a stand-in pass cannot rewrite {axis}={seen[0][axis]}", axis, seen[0][axis])
        return real(plan, *args, **kwargs)

    monkeypatch.setattr(codegen, "program_files", refusing)
    compiled = _compile("llama3", _problem("llama3", "cpu", 8, 16))
    assert len(seen) == 2
    axis = next(a for a in ("tp", "cp", "pp", "dp") if seen[0][a] > 1)
    assert compiled.plan.mesh.degrees()[axis] != seen[0][axis]
    assert compiled.files is not None
    assert any("a stand-in pass cannot rewrite" in note for note in compiled.plan.notes)


def test_a_refusal_of_a_dimension_leaves_out_every_degree_that_does_not_divide_it():
    """A dimension that no degree but 1 and 3 divides (GPT-2's 50,257-word vocabulary divides by
    none of 2, 4, 8, 16): one refusal leaves out every such degree at once, so the next search
    does not spend a round on each (GPT-3 175B's compile refused 8 plans in a row that way); a
    refusal that names no value (the model, not the degree, is the obstacle) all but 1; a pin
    the refusal covers is reported, not searched around."""
    from autoshard.compiler import _exclude

    problem = _problem("llama3", "cpu", 8, 16)
    _exclude(problem, Refusal("3 output features do not divide by tp=2", "tp", 2, divides=3))
    assert [t for t in (1, 2, 3, 4, 8) if not problem.refused("tp", t)] == [1, 3]
    _exclude(problem, Refusal("written-out attention", "cp"))
    assert [c for c in (1, 2, 4) if not problem.refused("cp", c)] == [1]
    assert len(problem.exclusion_reasons) == 2
    pinned = _problem("llama3", "cpu", 8, 16, tp=4)
    with pytest.raises(Refusal, match="do not divide"):
        _exclude(pinned, Refusal("3 output features do not divide by tp=2", "tp", 2, divides=3))


def test_a_refusal_of_what_the_user_pinned_is_reported_not_worked_around(monkeypatch):
    from autoshard import codegen

    def refusing(plan, *args, **kwargs):
        raise Refusal("tensor parallelism cannot split this stand-in op; plan with --force tp=1", "tp", plan.mesh.tp)

    monkeypatch.setattr(codegen, "program_files", refusing)
    problem = _problem("llama3", "cpu", 4, 8, tp=2)
    with pytest.raises(Refusal, match="--force tp=1"):
        _compile("llama3", problem)


def test_a_160_layer_model_compiles_with_no_walk_recursing_on_depth(tmp_path):
    """Capture, analysis, the passes and emission walk graphs iteratively: a narrow 160-layer
    LLaMA compiles (not --plan-only) to 160 pipeline chunks with only 300 stack frames to spare,
    where one recursive call per layer (a walk back along the residual adds) would need more."""
    import inspect
    import sys

    from autoshard import cli

    out = tmp_path / "deep"
    argv = ["compile", str(EXAMPLES / "llama3.py"), "--config", "deep", "--hardware", "h100", "--gpus", "64"]
    argv += ["--seq-len", "128", "--global-batch", "64", "--force", "tp=2,pp=4", "-o", str(out)]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(len(inspect.stack()) + 300)
    try:
        assert cli.main(argv) in (None, 0)
    finally:
        sys.setrecursionlimit(limit)
    plan = Plan.load(out)
    assert sum(plan.stage_layers) == 160 and (out / "train.py").exists()
    assert len(list(out.glob("stage*.py"))) == plan.mesh.pp * plan.virtual_stages


def test_dump_passes_writes_each_pass_graph_before_and_after_it(tmp_path):
    """``--dump-passes DIR``: one readable file per pass and side, in the order the passes ran;
    the tensor-parallel pass's graph gains the collectives it inserts, and the pipeline split's
    shows the chunks. A stale dump of an earlier run is replaced."""
    (tmp_path / "09_stale.after.py").write_text("")
    problem = _problem("llama3", "cpu", 4, 16, tp=2, pp=2)
    cap, _ = captured("llama3", "tiny", SEQ)
    recipe = rebuild.for_file(str(EXAMPLES / "llama3.py"), None, "tiny")
    compile_plan(problem, copy.deepcopy(cap), recipe, dump_passes=tmp_path)
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "09_stale.after.py" not in names and len(names) % 2 == 0
    tp = [n for n in names if n.endswith("_tensor_parallel.before.py")]
    assert tp, names
    before = (tmp_path / tp[0]).read_text()
    after = (tmp_path / tp[0].replace(".before", ".after")).read_text()
    assert "reduce_from_tp" not in before and "reduce_from_tp" in after
    split = next(n for n in names if n.endswith("_pipeline_split.after.py"))
    assert "# chunk 3" in (tmp_path / split).read_text()


def test_compile_file_runs_the_whole_pipeline_with_canonicalisation_as_its_first_pass(tmp_path):
    """``compiler.compile_file`` (what ``autoshard compile`` runs) captures, analyses, searches,
    rewrites and emits; the dump starts with canonicalisation, which ran at capture on the traced
    graph, and the plan passes follow in the order of ``PASSES``."""
    from autoshard.compiler import compile_file
    from autoshard.passes import PASSES

    compiled = compile_file(
        str(EXAMPLES / "llama3.py"),
        "tiny",
        hardware="cpu",
        gpus=4,
        seq_len=SEQ,
        global_batch=8,
        pins=planner.parse_force("tp=2,pp=2"),
        dump_passes=tmp_path,
    )
    assert PASSES[0].name == "canonicalize" and PASSES[0].phase == "capture"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[:2] == ["00_canonicalize.after.py", "00_canonicalize.before.py"], names
    order = [p.name for p in PASSES]
    ran = [n.split(".")[0].split("_", 1)[1] for n in names[::2]]
    assert ran == sorted(ran, key=order.index) and "tensor_parallel" in ran
    assert compiled.plan.mesh.tp == 2 and "train.py" in compiled.files


FLAT = str(Path(__file__).parent / "models" / "flat_rows.py")


def test_a_model_no_pipeline_split_can_carry_is_a_refusal_of_pp_not_an_error(tmp_path):
    """A later chunk that reads the batch size off the token ids (which only the first chunk has)
    refuses every pipeline degree: pinned, the user reads why and what to pin; unpinned, the
    search leaves PP out and says so when nothing else fits; --plan-only records it as not
    emitted."""
    from autoshard.compiler import compile_file

    run = dict(hardware="cpu", gpus=2, seq_len=32, global_batch=4)
    with pytest.raises(Refusal, match="pipeline parallelism cannot split this model: .* only the first chunk has") as e:
        compile_file(FLAT, None, **run, pins=planner.parse_force("pp=2"))
    assert e.value.axis == "pp" and e.value.exclusion() == "*" and "--force pp=1" in str(e.value)
    with pytest.raises(AutoshardError, match="every mesh left is one the rewrite passes refused .*pipeline"):
        compile_file(FLAT, None, **run, pins=planner.parse_force("tp=1,cp=1,dp=1"))
    whole = compile_file(FLAT, None, **run, pins=planner.parse_force("tp=1,cp=1,dp=1"), plan_only=True).plan
    assert whole.mesh.pp == 2 and any("pipeline parallelism cannot split" in r for r in whole.not_emitted)


def test_a_plan_only_dry_run_rewrites_a_copy_unless_the_caller_gives_the_graph_up():
    """``compile_file`` never reads its captured graph again, so --plan-only's dry run rewrites
    it in place; ``compile_plan`` (the Python API's) rewrites a copy and leaves the caller's
    graph as captured. The plan records the same refusal either way."""
    from autoshard.capture import capture_file
    from autoshard.compiler import problem

    def graph_text(cap):
        return [(n.op, str(n.target), str(n.args)) for n in cap.graph_module.graph.nodes]

    cap = capture_file(FLAT, None, 32)
    recipe = rebuild.for_file(FLAT, None, None)
    pins = planner.parse_force("tp=1,cp=1,dp=1")
    before = graph_text(cap)
    kept = compile_plan(problem(cap, "cpu", 2, 32, 4, pins=pins), cap, recipe, plan_only=True).plan
    assert graph_text(cap) == before
    given = compile_plan(problem(cap, "cpu", 2, 32, 4, pins=pins), cap, recipe, plan_only=True, consume=True).plan
    assert kept.not_emitted == given.not_emitted
    assert any("pipeline parallelism cannot split" in r for r in kept.not_emitted)
    assert graph_text(cap) != before  # the passes ran on it before the pipeline split refused
