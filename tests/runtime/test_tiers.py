"""Checkpoint tiers and slow ranks, run as users run them (torchrun, gloo, fp32, the tiny example
at DP2 ZeRO-1): a killed rank's job resumes from the host-memory snapshot where every rank's is
intact, from disk where one rank's is damaged, from the mirror where the local directory is gone,
each ending equal to the uninterrupted run; a slow rank is named, and with --drop-stragglers the
attempt ends, its host recorded, and the restarted attempt resumes and ends equal too."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from autoshard.runtime import durable
from autoshard.runtime.tiers import EXCLUDED, Stragglers
from autoshard.verify import assemble
from tests.distributed import torchrun

ROOT = Path(__file__).parents[2]
STEPS, DISK_EVERY, KILLED_AT = 14, 6, 11  # disk at step 6, snapshots every step: the kill at 11 is 5 newer


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("tiers") / "dp2"
    cmd = [sys.executable, "-m", "autoshard", "compile", "examples/llama3.py", "--config", "tiny", "--hardware", "cpu"]
    cmd += ["--gpus", "2", "--seq-len", "64", "--global-batch", "8", "--force", "dp=2,zero=1", "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return out


def _log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def _losses(log: list[dict]) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in log if "loss" in r and "event" not in r}


def _events(log: list[dict], name: str) -> list[dict]:
    return [r for r in log if r.get("event") == name]


def _train(program: Path, work: Path, name: str, *extra: str, ok: bool = True, **kw):
    args = ["--steps", str(STEPS), "--log-file", str(work / f"{name}.jsonl"), "--save-params", str(work / name)]
    proc = torchrun(program, 2, *args, *extra, **kw)
    if ok:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def _same_as(straight, work: Path, name: str) -> list[dict]:
    """The run's log, after checking its losses and parameters equal the uninterrupted run's."""
    losses, params = straight
    log = _log(work / f"{name}.jsonl")
    got = [(r["step"], r["loss"]) for r in log if "loss" in r and "event" not in r]
    assert got and all(loss == losses[s] for s, loss in got), (got, losses)
    assert max(s for s, _ in got) == STEPS - 1
    again = assemble(work / name)
    assert again.keys() == params.keys() and all(torch.equal(again[k], params[k]) for k in params)
    return log


@pytest.fixture(scope="module")
def straight(program, tmp_path_factory):
    work = tmp_path_factory.mktemp("straight")
    _train(program, work, "straight", "--checkpoint-dir", str(work / "ck"), "--checkpoint-every", str(DISK_EVERY))
    return _losses(_log(work / "straight.jsonl")), assemble(work / "straight")


def _tiered(work: Path) -> list[str]:
    return ["--checkpoint-dir", str(work / "ck"), "--snapshot-every", "1", "--snapshot-dir", str(work / "shm"),
            "--mirror-dir", str(work / "mirror")]  # fmt: skip


def test_a_killed_rank_resumes_from_the_host_memory_snapshot(program, straight, tmp_path):
    (tmp_path / "shm").mkdir()
    env = {"AUTOSHARD_FAULT": f"kill:1:{KILLED_AT}"}  # SIGKILL rank 1 in step 11; torchrun restarts both
    _train(program, tmp_path, "killed", *_tiered(tmp_path), "--checkpoint-every", str(DISK_EVERY),
           restarts=1, env=env, timeout=240)  # fmt: skip
    log = _same_as(straight, tmp_path, "killed")
    (resumed,) = _events(log, "resumed")
    # the snapshot after step 10 or 11 (one in flight at the kill may be cut short); disk had 6
    assert resumed["tier"] == "memory" and resumed["step"] in (KILLED_AT - 1, KILLED_AT), resumed
    assert not list((tmp_path / "shm").rglob("*.pt"))  # the run ended: its snapshots went with it


@pytest.fixture(scope="module")
def killed(program, tmp_path_factory) -> Path:
    """A first attempt killed at step 11 without a restart: disk and mirror at step 6, each rank's
    snapshots of steps 10 and 11 in host memory."""
    work = tmp_path_factory.mktemp("killed")
    (work / "shm").mkdir()
    proc = _train(program, work, "first", *_tiered(work), "--checkpoint-every", str(DISK_EVERY), ok=False,
                  env={"AUTOSHARD_FAULT": f"kill:1:{KILLED_AT}"})  # fmt: skip
    assert proc.returncode != 0
    assert [s for s, _ in durable.checkpoints(work / "mirror")] == [DISK_EVERY]
    assert len(list((work / "shm").rglob("*.rank00001.complete"))) == 2
    shutil.copytree(work / "mirror", work / "mirror-at-kill")  # (the disk test's run mirrors more)
    return work


def test_a_damaged_snapshot_on_one_rank_resumes_from_disk(straight, killed, program):
    for snapshot in (killed / "shm").rglob("*.rank00001.pt"):  # rank 1's host lost its memory's contents
        data = bytearray(snapshot.read_bytes())
        data[len(data) // 2] ^= 0xFF
        snapshot.write_bytes(bytes(data))
    _train(program, killed, "again", *_tiered(killed))
    log = _same_as(straight, killed, "again")
    (said,) = _events(log, "host-memory snapshot incomplete")
    assert said["ranks_without_it"] == [1] and said["using"] is None
    (resumed,) = _events(log, "resumed")
    assert (resumed["tier"], resumed["step"]) == ("disk", DISK_EVERY)


def test_without_the_local_directory_the_run_resumes_from_the_mirror(straight, killed, program, tmp_path):
    mirror = shutil.copytree(killed / "mirror-at-kill", tmp_path / "mirror")  # the first attempt's: step 6
    _train(program, tmp_path, "mirrored", "--checkpoint-dir", str(tmp_path / "ck"), "--mirror-dir", str(mirror))
    log = _same_as(straight, tmp_path, "mirrored")
    (resumed,) = _events(log, "resumed")
    assert (resumed["tier"], resumed["step"]) == ("mirror", DISK_EVERY)
    assert [e["step"] for e in _events(log, "mirrored checkpoint")] == [STEPS]


def test_a_slow_rank_is_named_and_dropped_and_the_restart_resumes(straight, program, tmp_path):
    ck = tmp_path / "ck"
    args = ["--checkpoint-dir", str(ck), "--straggler-window", "4", "--drop-stragglers"]
    proc = _train(program, tmp_path, "slow", *args, restarts=1, env={"AUTOSHARD_FAULT": "slow:1:3"}, timeout=240)
    log = _same_as(straight, tmp_path, "slow")
    restart = next(i for i, r in enumerate(log) if r.get("event") == "excluded hosts")
    (named,) = _events(log[:restart], "straggler")  # the first attempt's; the restart runs without the fault
    # (on a loaded machine the restart may find a slow rank too: on the excluded host, it trains on)
    assert all(e.get("already_excluded") for e in _events(log[restart:], "straggler"))
    host = socket.gethostname()
    assert named["rank"] == 1 and named["host"] == host and named["factor"] > 1.5, named
    assert f"rank 1 on host {host} computed" in proc.stderr and "--drop-stragglers ends this attempt" in proc.stderr
    assert (ck / EXCLUDED).read_text().split() == [host]
    assert _events(log, "excluded hosts") == [{"event": "excluded hosts", "hosts": [host], "ranks_on_them": [0, 1]}]
    (resumed,) = _events(log, "resumed")
    assert resumed["tier"] == "disk" and resumed["step"] == named["step"] + 1  # checkpointed as it ended


def test_a_rank_is_named_once_it_stays_slow_over_the_window_and_again_after_it_recovered():
    watch = Stragglers(1.5, 3, ["a", "b", "c", "d"])
    slow, fine = [1.0, 2.0, 1.1, 0.9], [1.0, 1.0, 1.0, 1.0]  # rank b at 2x the others' median (1.0), or not
    times = [fine, slow, fine, fine, slow, slow, slow, fine, fine, slow, slow]
    found = [watch.observe(step, t) for step, t in enumerate(times)]
    # one slow step in a window of 3 is noise; two name it (step 5), once; two fine ones clear it
    assert [step for step, events in enumerate(found) if events] == [5, 10]
    (event,) = found[5]
    assert (event["rank"], event["host"], event["factor"], event["window"]) == (1, "b", 2.0, 3)


@pytest.mark.parametrize(
    "argv,said",
    [
        (["--snapshot-every", "2"], "--snapshot-every works with the disk checkpoints: give --checkpoint-dir too"),
        (["--checkpoint-dir", "ck", "--snapshot-every", "2", "--snapshot-dir", "/no/such"], "--snapshot-dir /no/such"),
        (["--drop-stragglers"], "--drop-stragglers works with the disk checkpoints"),
        (["--straggler-factor", "0.5"], "--straggler-factor must be a finite number above 1"),
        (["--checkpoint-dir", "ck", "--mirror-dir", "m", "--mirror-every", "0"], "--mirror-every must be at least 1"),
    ],
)
def test_tier_flags_that_cannot_work_are_one_line(argv, said, capsys):
    from autoshard.runtime.trainer import check_tier_args, parse_args

    with pytest.raises(SystemExit) as e:
        check_tier_args(parse_args(argv))
    assert e.value.code == 2 and said in capsys.readouterr().err
