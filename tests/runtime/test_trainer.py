"""The training program in one process (a one-GPU plan on a gloo group of one): its command line,
its step records, and its losses and parameters against the single-device model. Several ranks
through torchrun: tests/test_program.py and tests/test_equivalence.py."""

import json
import math
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from autoshard.cli import main as cli
from autoshard.ir.plan import Mesh
from autoshard.runtime import program as rt
from autoshard.runtime import trainer

from conftest import EXAMPLES


@pytest.fixture(scope="module")
def one_gpu(tmp_path_factory) -> Path:
    """gpt:tiny for one process, two micro-batches of two sequences."""
    out = tmp_path_factory.mktemp("trainer") / "out"
    args = [str(EXAMPLES / "gpt.py"), "--config", "tiny", "--hardware", "cpu", "--gpus", "1", "--seq-len", "32"]
    assert cli(["compile", *args, "--global-batch", "4", "--force", "mbs=2", "-o", str(out)]) == 0
    return out


@pytest.fixture
def single_process(monkeypatch):
    """The environment torchrun gives one process."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    yield
    assert not dist.is_initialized()  # main tore its process group down


def test_command_line_defaults_and_flags():
    args = trainer.parse_args([])
    assert (args.steps, args.lr, args.weight_decay, args.adam_eps, args.seed) == (10, 3e-4, 0.1, 1e-8, 0)
    assert (args.data, args.init_from_model, args.log, args.save_params) == (None, False, None, None)
    assert (args.timeout, args.compute_dtype) == (300, "auto")
    args = trainer.parse_args(["--steps", "3", "--lr", "1e-3", "--data", "t.bin", "--init-from-model"])
    assert (args.steps, args.lr, args.data, args.init_from_model) == (3, 1e-3, Path("t.bin"), True)
    with pytest.raises(SystemExit):
        trainer.parse_args(["--compute-dtype", "fp16"])


def test_a_step_record_is_one_json_line_printed_and_appended(tmp_path, capsys):
    log = tmp_path / "loss.jsonl"
    trainer.StepLog(log).write({"step": 0, "loss": 5.5, "seconds": 0.25})
    trainer.StepLog(log).write({"step": 1, "loss": 5.25, "seconds": 0.125})
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert printed == [{"step": 0, "loss": 5.5, "seconds": 0.25}, {"step": 1, "loss": 5.25, "seconds": 0.125}]
    assert [json.loads(line) for line in log.read_text().splitlines()] == printed


@pytest.mark.parametrize(
    "schedule,v,expected",
    [("zbv", 2, [[0, 5], [1, 4], [2, 3]]), ("interleaved", 2, [[0, 3], [1, 4], [2, 5]]), ("1f1b", 1, [[0], [1], [2]])],
)
def test_chunks_of_rank_follow_the_schedule(schedule, v, expected):
    plan = SimpleNamespace(schedule=schedule, mesh=Mesh(pp=3), virtual_stages=v)  # what chunks_of_rank reads
    assert [rt.chunks_of_rank(plan, r) for r in range(3)] == expected


def test_a_wrong_world_size_stops_before_any_process_group(one_gpu, single_process, monkeypatch, capsys):
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit) as e:
        trainer.main(one_gpu, ["--steps", "1"])
    assert e.value.code == 2
    assert "the plan is for 1 processes but WORLD_SIZE is 2" in capsys.readouterr().err


def test_default_initialisation_trains_from_a_sensible_loss(one_gpu, single_process, tmp_path, capsys):
    trainer.main(one_gpu, ["--steps", "2", "--loss-log", str(tmp_path / "log")])
    printed = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert [r["step"] for r in printed] == [0, 1]
    assert all(abs(r["loss"] - math.log(256)) < 1.5 and r["seconds"] > 0 for r in printed)  # near uniform
    assert [json.loads(line) for line in (tmp_path / "log").read_text().splitlines()] == printed


def test_losses_and_parameters_match_the_single_device_model(one_gpu, single_process, tmp_path):
    from autoshard.verify import ADAM_EPS, LR, WEIGHT_DECAY, assemble, run_reference

    log, params = tmp_path / "log", tmp_path / "params"
    argv = ["--steps", "2", "--init-from-model", "--lr", str(LR), "--weight-decay", str(WEIGHT_DECAY)]
    argv += ["--adam-eps", str(ADAM_EPS), "--loss-log", str(log), "--save-params", str(params)]
    trainer.main(one_gpu, argv)
    losses = [json.loads(line)["loss"] for line in log.read_text().splitlines()]
    ref_losses, ref_params = run_reference(*rt.read_program(one_gpu), 2, 0)
    assert losses == pytest.approx(ref_losses, rel=1e-5)
    got = assemble(params)
    assert set(got) == {k for k, v in ref_params.items() if v.is_floating_point()}
    for name, value in got.items():
        torch.testing.assert_close(value, ref_params[name], rtol=0, atol=1e-5, msg=name)


def test_learning_rate_schedules():
    args = trainer.parse_args(["--lr", "1.0", "--warmup", "2", "--steps", "12", "--min-lr", "0.1"])
    assert [trainer.learning_rate(args, s) for s in (0, 1, 2)] == [0.5, 1.0, 1.0]
    args.lr_schedule = "linear"
    assert trainer.learning_rate(args, 7) == pytest.approx(0.55) and trainer.learning_rate(args, 12) == 0.1
    args.lr_schedule = "cosine"
    assert trainer.learning_rate(args, 7) == pytest.approx(0.55) and trainer.learning_rate(args, 2) == 1.0
    assert trainer.learning_rate(args, 12) == pytest.approx(0.1)


def test_gradient_clipping_matches_torch_on_one_process():
    from autoshard.runtime import state
    from autoshard.runtime.stages import Block

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    for p in params:
        p.grad = torch.randn_like(p)
    refs = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, p in zip(refs, params):
        r.grad = p.grad.clone()
    norm_ref = torch.nn.utils.clip_grad_norm_(refs, 0.5)
    held = [state.Held("w", p, tuple(p.shape), [Block((0,) * p.dim(), (0,) * p.dim(), tuple(p.shape))]) for p in params]
    entries = [state.Entry(h, p, False, True, True, True, True) for h, p in zip(held, params)]
    norm = state.clip_gradients(entries, 0.5)
    assert norm == pytest.approx(float(norm_ref))
    assert all(torch.allclose(p.grad, r.grad) for p, r in zip(params, refs))


def test_a_replicas_gradient_norm_counts_its_own_copies_without_a_collective():
    """Data parallelism alone at ZeRO-0: each replica holds every gradient whole, so the norm of
    one that is not the counted copy (dp_first False) is the single-device norm, with no
    all-reduce (none is possible here: no process group), and a later chunk's tied copy still
    does not count twice."""
    from autoshard.runtime import state
    from autoshard.runtime.stages import Block

    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(5))]
    for p in params:
        p.grad = torch.randn_like(p)
    norm_ref = float(torch.nn.utils.get_total_norm([p.grad for p in params]))
    tie = torch.nn.Parameter(params[0].detach().clone())
    tie.grad = params[0].grad.clone()
    held = [state.Held("w", p, tuple(p.shape), [Block((0,) * p.dim(), (0,) * p.dim(), tuple(p.shape))])
            for p in [*params, tie]]  # fmt: skip
    entries = [state.Entry(h, p, False, True, False, True, True) for h, p in zip(held[:2], params)]
    entries.append(state.Entry(held[2], tie, False, True, False, True, False))  # the tied copy
    assert state.clip_gradients(entries, None, replicated=True) == pytest.approx(norm_ref)
    assert state.clip_gradients(entries, None) == 0.0  # not the counted replica: it adds nothing alone


def test_the_spike_guard_waits_for_a_full_window():
    run = trainer.Run()
    assert run.spike(float("nan"), 1.0, 3.0, 3) and run.spike(3.0, float("inf"), 3.0, 3)  # not finite: always
    for loss in (3.0, 3.1, 2.9):
        assert not run.spike(loss, 1.0, 3.0, 3)
        run.advance(loss, 1, 3)
    assert not run.spike(3.2, 1.0, 3.0, 3) and run.spike(4.0, 1.0, 3.0, 3)
    assert (run.step, run.position, run.window) == (3, 3, [3.0, 3.1, 2.9])


def test_flags_that_cannot_work_together_are_one_line_errors(capsys):
    with pytest.raises(SystemExit):
        trainer.check_args(trainer.parse_args(["--spike-zscore", "3"]))
    assert "--spike-zscore rolls back to a checkpoint: give --checkpoint-dir" in capsys.readouterr().err
