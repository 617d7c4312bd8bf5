"""ZeRO-2/3 on stacked expert weights (``program.shard_data_parallel``): FSDP2 shards them over
their expert-data-parallel ranks, as the cost model counts them. Each of 4 gloo ranks builds the
bundled DeepSeek-V3 (tiny) at EP2 x DP4 (so 2 expert-data-parallel ranks per expert) in bf16, as
the program trains on GPUs, runs one step, and counts what it holds: the expert weights' bytes,
their gradients' and their AdamW states' must be the cost model's count for them
(``cost_models.memory.sharded_state_bytes`` of the analysed model's routed-expert parameters
over EP), and the whole rank's those of plan.json's promise. Under the old program (experts left
to ZeRO-1 at every stage) a rank held its experts' fp32 gradients whole at ZeRO-2/3: twice the
count at EDP2."""

import json
import shutil

import pytest
import torch

from autoshard.cli import main
from autoshard.cost_models.memory import WEIGHT_BYTES, sharded_state_bytes
from autoshard.runtime import program as rt
from autoshard.runtime import trainer
from autoshard.runtime.state import _params, _stepped, local_of, optimizer_parts
from autoshard.verify import assemble
from tests.distributed import run, torchrun

from conftest import EXAMPLES, captured

PARTS = ("params", "grads", "optimizer")


def _compile(tmp_path, zero: int):
    out = tmp_path / f"zero{zero}"
    args = [str(EXAMPLES / "deepseek_v3.py"), "--config", "tiny", "--hardware", "cpu", "--gpus", "4"]
    args += ["--seq-len", "32", "--global-batch", "8", "--force", f"ep=2,dp=4,zero={zero}", "-o", str(out)]
    assert main(["compile", *args]) == 0
    return out


def _bytes(t) -> int:
    t = local_of(t)
    return t.numel() * t.element_size()


def _held(rank: int, world: int, out) -> dict:
    """Bytes this rank holds after one bf16 step, by part, of the experts and of everything:
    the parameters as the chunks hold them (FSDP2's fp32 shards, else the bf16 weights), their
    gradients, and the optimizer's fp32 masters (where it keeps its own) and moments."""
    plan, program = rt.read_program(out)
    args = trainer.parse_args(["--steps", "1", "--compute-dtype", "bf16", "--no-compile"])
    tr = trainer.Trainer.build(args, out, plan, program, torch.device("cpu"))
    tr.step(0)
    experts = {id(p) for p in tr.experts}
    held = {kind: dict.fromkeys(PARTS, 0) for kind in ("experts", "all")}

    def add(p, part: str, n: int) -> None:
        held["all"][part] += n
        if id(p) in experts:
            held["experts"][part] += n

    for p in tr.params:
        add(p, "params", _bytes(p))
        add(p, "grads", _bytes(p.grad))
    for opt in optimizer_parts(tr.optim):
        for p in _params(opt):
            master = _stepped(opt, p)
            add(p, "optimizer", sum(_bytes(opt.state[master][m]) for m in ("exp_avg", "exp_avg_sq")))
            if master is not p:
                add(p, "optimizer", _bytes(master))
    return held


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_each_rank_holds_the_expert_states_the_cost_model_counts(zero, tmp_path):
    out = _compile(tmp_path, zero)
    plan, _ = rt.read_program(out)
    _, cost = captured("deepseek_v3", "tiny", 32)
    experts = sum(b.params_experts * b.count for b in cost.blocks) / plan.mesh.ep  # one EP rank's
    counted = dict(sharded_state_bytes(0.0, experts, zero, plan.mesh.dp * plan.mesh.cp, plan.mesh.edp))
    promised = dict(plan.predicted.ranks[0]["memory_bytes"])
    if zero == 2:  # the bf16 weights ZeRO-2 holds whole from a forward until its backward: gone by the step's end
        counted["params"] -= WEIGHT_BYTES * experts
        promised.pop("params")
    for rank in run(_held, 4, out, timeout=120):
        for part in PARTS:
            assert rank["experts"][part] == counted[part], (zero, part)
            if part in promised:
                assert rank["all"][part] == promised[part], (zero, part)


def _train(out, work, name: str, steps: int, *extra: str) -> tuple[dict, dict]:
    args = ["--steps", str(steps), "--log-file", str(work / f"{name}.jsonl"), "--save-params", str(work / name)]
    proc = torchrun(out, 4, *args, *extra)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = map(json.loads, (work / f"{name}.jsonl").read_text().splitlines())
    return {r["step"]: r["loss"] for r in rows if "loss" in r}, assemble(work / name)


def test_a_checkpoint_of_sharded_experts_continues_under_zero1_and_exports(tmp_path):
    """Written under ZeRO-3 (experts sharded over their EDP ranks by FSDP2), continued under
    ZeRO-1 (experts whole, their optimizer rows sharded) as the uninterrupted ZeRO-3 run goes on,
    and exported to the single-device state dict of that run's parameters."""
    z3, z1 = _compile(tmp_path, 3), _compile(tmp_path, 1)
    ck = tmp_path / "ck"
    losses, params = _train(z3, tmp_path, "straight", 4, "--checkpoint-dir", str(ck), "--checkpoint-every", "2")
    half = tmp_path / "half"
    shutil.copytree(ck / "step_00000002", half / "step_00000002")
    got, got_params = _train(z1, tmp_path, "resumed", 4, "--checkpoint-dir", str(half))
    assert sorted(got) == [2, 3]
    for s in got:
        assert got[s] == pytest.approx(losses[s], rel=1e-5), s
    assert any("experts" in k for k in params)
    for k in params:
        torch.testing.assert_close(got_params[k], params[k], rtol=1e-4, atol=1e-5)
    assert main(["export", str(ck / "step_00000004"), "-o", str(tmp_path / "trained.pt")]) == 0
    trained = torch.load(tmp_path / "trained.pt")
    assert trained.keys() == {k.removeprefix("model.") for k in params}
    assert all(torch.equal(trained[k.removeprefix("model.")], v) for k, v in params.items())


@pytest.mark.parametrize(
    "shape, size, dim",
    [
        ((4, 64, 32), 2, 0),  # the experts, where the ranks divide them
        ((1, 256, 64), 2, 1),  # one local expert over 2 ranks: FSDP2 splits a later dimension evenly
        ((3, 6, 8), 4, 2),
        ((3, 5, 7), 4, 0),  # none divides: the experts, padded
    ],
)
def test_expert_stacks_split_evenly_where_they_can(shape, size, dim):
    assert rt._expert_split(shape, size) == dim
