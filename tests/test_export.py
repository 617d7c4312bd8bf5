"""``autoshard export-plan``: a plan as torchtitan 0.3.0 overrides and Megatron-LM arguments.

The torchtitan export is read back by torchtitan's own ConfigManager (installed on the fly); the
Megatron arguments are checked against the names and choices of megatron-core 0.19.2's parser,
recorded below (``MEGATRON_PARSER``), since that release needs Python 3.12 and Transformer Engine
to import."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest

from autoshard import cli
from autoshard.errors import AutoshardError
from autoshard.export_plan import export_plan, megatron, plan_pins, price, torchtitan
from autoshard.ir.plan import Plan
from autoshard.ir.schedules import SCHEDULES

GOLDEN = Path(__file__).parent / "golden"
TORCHTITAN = "torchtitan==0.3.0"
# what ``import torchtitan.models.llama3.config_registry`` needs beyond torch and this
# environment's usual packages, installed without their own dependencies
TORCHTITAN_DEPS = ["tyro", "docstring-parser", "typeguard", "spmd-types", "tensorboard", "torchdata", "datasets"]
TORCHTITAN_DEPS += ["multiprocess", "pyarrow", "dill", "xxhash"]

# megatron-core 0.19.2, megatron.training.arguments.add_megatron_arguments(ArgumentParser()):
# each flag the export may write -> its choices (None: any value; "switch": takes no value).
# Read by building that parser under Python 3.12 (pip download megatron-core==0.19.2 --no-deps).
MEGATRON_PARSER = {
    "--tensor-model-parallel-size": None,
    "--pipeline-model-parallel-size": None,
    "--context-parallel-size": None,
    "--expert-model-parallel-size": None,
    "--expert-tensor-parallel-size": None,
    "--sequence-parallel": "switch",
    "--cp-comm-type": None,
    "--num-layers-per-virtual-pipeline-stage": None,
    "--decoder-first-pipeline-num-layers": None,
    "--decoder-last-pipeline-num-layers": None,
    "--pipeline-model-parallel-layout": None,
    "--overlap-moe-expert-parallel-comm": "switch",
    "--use-distributed-optimizer": "switch",
    "--use-megatron-fsdp": "switch",
    "--data-parallel-sharding-strategy": ("no_shard", "optim", "optim_grads", "optim_grads_params"),
    "--recompute-granularity": ("full", "selective"),
    "--recompute-method": ("uniform", "block"),
    "--recompute-num-layers": None,
    "--recompute-modules": None,
    "--moe-grouped-gemm": "switch",
    "--bf16": "switch",
    "--fp8-format": ("e4m3", "hybrid"),
    "--fp8-recipe": ("tensorwise", "delayed", "mxfp8", "blockwise", "custom"),
    "--num-layers": None,
    "--seq-length": None,
    "--micro-batch-size": None,
    "--global-batch-size": None,
}
# TransformerConfig.recompute_modules' allowed entries (megatron-core 0.19.2)
MEGATRON_RECOMPUTE_MODULES = {"core_attn", "moe_act", "layernorm", "mla_up_proj", "mlp", "moe", "shared_experts"}


def golden(name: str) -> Plan:
    return Plan.from_dict(json.loads((GOLDEN / f"{name}.json").read_text())["plan"], name)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """The brief's tiny plan: llama3 tiny on 8 CPU ranks, pp=2 and tp=2 pinned."""
    out = tmp_path_factory.mktemp("tiny")
    argv = ["compile", "examples/llama3.py", "--config", "tiny", "--hardware", "cpu", "--gpus", "8"]
    argv += ["--seq-len", "64", "--global-batch", "16", "--force", "pp=2,tp=2", "-o", str(out)]
    assert cli.main(argv) == 0
    return out


def _values(text: str) -> dict[str, str | None]:
    """flag -> value (None for a switch) of an exported file, comments left out."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            flag, _, value = line.partition(" ")
            out[flag] = value or None
    return out


def test_tiny_plan_degrees(tiny, tmp_path):
    plan = Plan.load(tiny)
    cli.main(["export-plan", str(tiny), "--to", "torchtitan", "-o", str(tmp_path / "tt.args")])
    tt = _values((tmp_path / "tt.args").read_text())
    m = plan.mesh
    assert tt["--parallelism.tensor_parallel_degree"] == str(m.tp) == "2"
    assert tt["--parallelism.pipeline_parallel_degree"] == str(m.pp) == "2"
    dp = int(tt["--parallelism.data_parallel_shard_degree"]) * int(tt["--parallelism.data_parallel_replicate_degree"])
    assert dp == m.dp and m.tp * m.pp * m.cp * dp == 8
    assert int(tt["--training.global_batch_size"]) == 16 and tt["--training.seq_len"] == "64"
    cli.main(["export-plan", str(tiny / "plan.json"), "--to", "megatron", "-o", str(tmp_path / "mg.args")])
    mg = _values((tmp_path / "mg.args").read_text())
    assert (mg["--tensor-model-parallel-size"], mg["--pipeline-model-parallel-size"]) == ("2", "2")
    assert mg["--micro-batch-size"] == str(plan.microbatch_size) and mg["--global-batch-size"] == "16"


def test_golden_deepseek_v3_both_targets():
    """DeepSeek-V3 on 2048 H800s: PP16 DualPipeV, EP16, CP2, ZeRO-1, FP8, uneven stages."""
    plan = golden("deepseek_v3_671b_2k_h800")
    mg = megatron(plan).flags()
    assert mg["--pipeline-model-parallel-size"] == "16" and mg["--expert-model-parallel-size"] == "16"
    assert mg["--context-parallel-size"] == "2" and "--use-distributed-optimizer" in mg
    assert (mg["--fp8-format"], mg["--fp8-recipe"]) == ("e4m3", "blockwise")
    layout = mg["--pipeline-model-parallel-layout"].split("|")
    assert [c.count("t") for c in layout] == plan.stage_layers
    assert layout[0].startswith("E") and layout[-1].endswith("L")
    exp = torchtitan(plan)
    tt = exp.flags()
    assert tt["--parallelism.expert_parallel_degree"] == "16" and tt["--parallelism.context_parallel_degree"] == "2"
    assert tt["--parallelism.pipeline_parallel_schedule"] == "DualPipeV"
    chunks = tt["--parallelism.module_fqns_per_model_part"].split(" ")
    assert [sum(n.startswith("layers.") for n in c.split(",")) for c in chunks] == plan.stage_layers
    assert chunks[-1] == "norm,output"  # the last chunk holds the head alone
    assert any("ZeRO-1" in n for n in exp.notes) and any("FP8" in n for n in exp.notes)


@pytest.mark.parametrize("name", sorted(p.stem for p in GOLDEN.glob("*.json")))
def test_megatron_names_are_the_parsers(name):
    """Every flag written is one megatron-core 0.19.2's parser has, with a value it accepts."""
    plan = golden(name)
    for flag, value in megatron(plan).settings:
        assert flag in MEGATRON_PARSER, flag
        kind = MEGATRON_PARSER[flag]
        assert (value is None) == (kind == "switch"), flag
        if isinstance(kind, tuple):
            assert value in kind, (flag, value)
        if flag == "--recompute-modules":
            assert set(value.split()) <= MEGATRON_RECOMPUTE_MODULES
    flags = megatron(plan).flags()
    assert int(flags["--tensor-model-parallel-size"]) * int(flags["--pipeline-model-parallel-size"]) == (
        plan.mesh.tp * plan.mesh.pp
    )


def test_approximations_are_comments_and_stderr(tmp_path, capsys):
    """DualPipeV, which Megatron-LM lacks, is said in the file and on stderr."""
    golden("deepseek_v3_671b_2k_h800").save(tmp_path / "plan.json")
    out = tmp_path / "mg.args"
    assert cli.main(["export-plan", str(tmp_path), "--to", "megatron", "-o", str(out)]) == 0
    comments = [line for line in out.read_text().splitlines() if line.startswith("# approximated:")]
    err = capsys.readouterr().err
    assert any("dualpipev" in c for c in comments) and "dualpipev" in err
    assert "--overlap-moe-expert-parallel-comm" in out.read_text().splitlines()


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["missing-dir", "--to", "megatron"], "plan not found"),
        (["BAD_JSON", "--to", "megatron"], "not valid JSON"),
        (["TINY", "--to", "deepspeed"], "unknown target"),
    ],
)
def test_bad_input_is_one_line_and_writes_nothing(tiny, tmp_path, capsys, argv, expected):
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    argv = [{"BAD_JSON": str(bad), "TINY": str(tiny)}.get(a, a) for a in argv]
    argv[0] = argv[0] if argv[0] != "missing-dir" else str(tmp_path / "missing")
    out = tmp_path / "out.args"
    assert cli.main(["export-plan", *argv, "-o", str(out)]) == 2
    err = capsys.readouterr().err
    assert expected in err and err.count("\n") == 1 and "Traceback" not in err
    assert not out.exists() and not list(tmp_path.glob(".out.args*"))


def test_unknown_target_from_python():
    with pytest.raises(AutoshardError, match="unknown target"):
        export_plan("anything", "deepspeed", "x")


def _torchtitan_site() -> Path:
    """torchtitan 0.3.0 and what its config registry imports, installed once per machine into
    the temporary directory; skips where pip cannot fetch them (no network or index)."""
    site = Path(tempfile.gettempdir()) / "autoshard-tests-torchtitan-0.3.0"
    if (site / ".complete").exists():
        return site
    cmd = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), TORCHTITAN]
    done = subprocess.run(cmd + TORCHTITAN_DEPS, capture_output=True, text=True, timeout=600)
    if done.returncode:
        pytest.skip(f"cannot install {TORCHTITAN} with pip: {done.stderr.strip().splitlines()[-1:]}")
    (site / ".complete").write_text("")
    return site


LOAD = textwrap.dedent(
    """
    import json, shlex, sys
    from torchtitan.config import ConfigManager
    text = open(sys.argv[1]).read()
    args = shlex.split(" ".join(l for l in text.splitlines() if not l.startswith("#")))
    c = ConfigManager().parse_args(["--module", "llama3", "--config", sys.argv[2], *args])
    p, t = c.parallelism, c.training
    print(json.dumps({
        "tp": p.tensor_parallel_degree, "pp": p.pipeline_parallel_degree, "cp": p.context_parallel_degree,
        "ep": p.expert_parallel_degree, "dp": p.data_parallel_shard_degree * p.data_parallel_replicate_degree,
        "schedule": p.pipeline_parallel_schedule, "parts": p.module_fqns_per_model_part,
        "global_batch": t.global_batch_size, "seq": t.seq_len, "ac": type(c.activation_checkpoint).__qualname__,
    }))
    """
)


@pytest.mark.parametrize("name", ["llama3_405b_16k_h100", "deepseek_v3_671b_2k_h800"])
def test_torchtitan_reads_the_export(name, tmp_path):
    """torchtitan's own ConfigManager parses the overrides onto its llama3_debugmodel config and
    its validation passes; the degrees it reads are the plan's."""
    site = _torchtitan_site()
    plan = golden(name)
    out = tmp_path / "tt.args"
    export_plan_from(plan, tmp_path, out)
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    run = subprocess.run(
        [sys.executable, "-c", LOAD, str(out), "llama3_debugmodel"],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    m = plan.mesh
    assert (got["tp"], got["pp"], got["cp"], got["ep"], got["dp"]) == (m.tp, m.pp, m.cp, m.ep, m.dp)
    assert (got["global_batch"], got["seq"]) == (plan.global_batch, plan.seq_len)
    if got["parts"] is not None:
        assert [sum(n.startswith("layers.") for n in part) for part in got["parts"]] == plan.stage_layers


def export_plan_from(plan: Plan, where: Path, out: Path) -> None:
    """Export a plan held in memory, through the same path as the command (a plan.json)."""
    plan.save(where / "plan.json")
    export_plan(where, "torchtitan", out)


def test_megatron_first_and_last_stage_counts():
    """One chunk per rank, only the ends differing: the first/last counts, the middle stages
    taking the rest evenly, as Megatron splits it."""
    plan = golden("llama3_405b_131k_h100")  # PP8: 15 layers on each middle stage
    pp, layers = plan.mesh.pp, sum(plan.stage_layers)
    middle = layers // pp
    ends = [layers - middle * (pp - 1) + 1] + [middle] * (pp - 2) + [middle - 1]
    plan = replace(plan, schedule="1f1b", virtual_stages=1, stage_layers=ends)
    flags = megatron(plan).flags()
    first, last = int(flags["--decoder-first-pipeline-num-layers"]), int(flags["--decoder-last-pipeline-num-layers"])
    assert (first, last) == (plan.stage_layers[0], plan.stage_layers[-1]) and first != last
    assert first + last + middle * (pp - 2) == layers == int(flags["--num-layers"])
    assert "--pipeline-model-parallel-layout" not in flags and "--num-layers-per-virtual-pipeline-stage" not in flags


def test_approximations_priced_with_the_model(tiny, tmp_path):
    """With the model file, a pinnable approximation carries the cost model's step time for what
    the trainer runs beside the plan's own, re-evaluated: the same as plan.json's."""
    plan = Plan.load(tiny)
    exp = megatron(plan)
    assert exp.pricable, "the tiny plan's schedule is one Megatron lacks"
    price(plan, exp, "examples/llama3.py", "tiny")
    index, runs = exp.pricable[0]
    assert runs == {"schedule": "interleaved"}
    match = re.search(r"([\d.]+) s/step against the plan's ([\d.]+) \(([+-][\d.]+)%\)", exp.notes[index])
    assert match, exp.notes[index]
    ours, base = float(match[1]), float(match[2])
    assert base == pytest.approx(plan.predicted.step_time_s, abs=1e-3)
    assert float(match[3]) == pytest.approx((ours / base - 1) * 100, abs=0.2)


def test_plan_pins_state_the_plan():
    plan = golden("deepseek_v3_671b_2k_h800")
    pins = plan_pins(plan)
    assert (pins["pp"], pins["ep"], pins["cp"], pins["schedule"], pins["zero"]) == (16, 16, 2, "dualpipev", 1)
    assert list(pins["stage_layers"]) == plan.stage_layers and pins["recompute"] == plan.recompute
    assert set(pins["fp8"]) == set(plan.precision["fp8_matmuls"]) and list(pins["order"]) == plan.mesh.order


def test_per_rank_recompute_sets_are_an_approximation():
    """Rank 0 recomputing and the rest saving: both trainers take one set, the union, and say so;
    the note is priced against plan.json's own prediction (pins state the union only)."""
    plan = golden("deepseek_v3_671b_2k_h800")
    table = SCHEDULES[plan.schedule]
    keep = {k: "save" for k in plan.checkpoint}
    per_stage = [plan.checkpoint if table.chunk_rank(i, plan.mesh.pp) == 0 else keep for i in range(32)]
    plan = replace(plan, stage_checkpoint=per_stage)
    assert not plan._stage_checkpoint_problems()
    for target in (torchtitan, megatron):
        exp = target(plan)
        notes = [i for i, n in enumerate(exp.notes) if n.startswith("per-rank recompute sets (rank 0 recomputes")]
        assert len(notes) == 1 and (notes[0], {}) in exp.pricable
