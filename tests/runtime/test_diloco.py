"""DiLoCo islands in emitted programs (``autoshard compile --islands K --sync-every H``), run as
users run them (torchrun, gloo, fp32, the tiny LLaMA on CPU processes: 2 islands of one rank, or
of two ranks running synchronous DP inside):

- with a sync every step, outer learning rate 1 and no outer momentum, the outer step averages
  the islands' parameters after every inner step. Averaging parameters equals averaging gradients
  only for an inner optimizer linear in the gradient; AdamW with ``eps`` far above the root of its
  second moment (``--adam-eps 1e8``) is one (momentum SGD at ``lr/eps``), and there the islands
  equal synchronous DP to fp32 rounding; with AdamW as usual they do not (the check has teeth);
- 2 islands syncing every 10 steps for 200 steps end within a stated margin of synchronous DP's
  loss at the same tokens, and the bytes the program hands to the island all-reduce (its step
  log's ``island_bytes``) are a tenth of the gradient bytes synchronous DP all-reduces across
  the same two ranks (``dp_bytes``);
- bad flags are one-line errors.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from autoshard.cli import main
from autoshard.verify import assemble
from tests.distributed import torchrun

ROOT = Path(__file__).parents[2]
MODEL = ["examples/llama3.py", "--config", "tiny", "--hardware", "cpu", "--seq-len", "32", "--global-batch", "8"]
BASE = [*MODEL, "--gpus", "2", "--force", "dp=2"]


def _compile(out: Path, gpus: int, *flags: str) -> Path:
    cmd = [sys.executable, "-m", "autoshard", "compile", *MODEL, "--gpus", str(gpus), "--force", f"dp={gpus},zero=0"]
    proc = subprocess.run([*cmd, *flags, "-o", str(out)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    return out


def _train(out: Path, work: Path, name: str, *args: str) -> tuple[list[dict], dict]:
    log = work / f"{name}.jsonl"
    gpus = json.loads((out / "plan.json").read_text())["gpus"]
    proc = torchrun(out, gpus, "--log-file", str(log), "--save-params", str(work / name), *args, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [r for r in map(json.loads, log.read_text().splitlines()) if "loss" in r]
    return lines, assemble(work / name)


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    root = tmp_path_factory.mktemp("diloco")
    # a learnable stream: each id follows from the one before (x -> 3x + 7 mod 256) 80% of the time
    rng = np.random.default_rng(0)
    ids = np.empty(1 << 16, dtype=np.int32)
    ids[0] = 1
    noise = rng.integers(0, 256, ids.size)
    keep = rng.random(ids.size) < 0.8
    for i in range(1, ids.size):
        ids[i] = (3 * ids[i - 1] + 7) % 256 if keep[i] else noise[i]
    ids.tofile(root / "tokens.bin")
    every1 = ["--islands", "2", "--sync-every", "1", "--outer-lr", "1", "--outer-momentum", "0"]
    return {
        "root": root,
        "data": str(root / "tokens.bin"),
        "sync": _compile(root / "sync", 2),
        "every10": _compile(root / "every10", 2, "--islands", "2", "--sync-every", "10"),
        # 4 ranks in 2 islands of 2: synchronous DP inside each island, the replicas' shares
        "sync4": _compile(root / "sync4", 4),
        "every1": _compile(root / "every1", 4, *every1),
    }


def _params(out: Path) -> int:
    return json.loads((out / "plan.json").read_text())["model"]["params"]


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_sync_every_step_equals_synchronous_dp(work):
    """H=1, outer lr 1, momentum 0, a linear inner optimizer, 2 islands of 2 ranks: the same
    parameters as synchronous DP over the 4 ranks after 6 steps, within 2e-6 (fp32: the islands
    sum parameters, DP sums gradients, in other orders), and each rank sends half the model
    between islands per step (ZeRO-0's two replicas split it), where DP's all-reduce takes it
    whole."""
    root, steps = work["root"], ["--steps", "6", "--data", work["data"], "--weight-decay", "0"]
    linear = [*steps, "--lr", "1e6", "--adam-eps", "1e8"]  # AdamW as momentum SGD at lr 1e-2
    sync_log, sync = _train(work["sync4"], root, "sync-linear", *linear)
    isl_log, isl = _train(work["every1"], root, "every1-linear", *linear)
    assert _max_diff(sync, isl) < 2e-6
    assert [r["loss"] for r in isl_log] == pytest.approx([r["loss"] for r in sync_log], abs=1e-5)
    assert sync_log[-1]["dp_bytes"] == isl_log[-1]["dp_bytes"] == 6 * 4 * _params(work["every1"])
    assert isl_log[-1]["island_bytes"] * 2 == sync_log[-1]["dp_bytes"]


def test_sync_every_step_is_not_synchronous_dp_under_adamw(work):
    """The same runs with AdamW as usual: averaging parameters is not averaging gradients, and
    the comparison above sees the difference."""
    root, steps = work["root"], ["--steps", "6", "--data", work["data"], "--weight-decay", "0"]
    adam = [*steps, "--lr", "1e-2"]
    _, sync = _train(work["sync4"], root, "sync-adam", *adam)
    _, isl = _train(work["every1"], root, "every1-adam", *adam)
    assert _max_diff(sync, isl) > 1e-4


def test_two_islands_train_like_synchronous_dp_with_a_tenth_of_the_bytes(work):
    """2 islands, H=10, 200 steps at the same tokens as synchronous DP: the mean loss of the last
    20 steps within 0.15 nats of DP's (both well below the first steps'), and a tenth of DP's
    bytes between the two ranks."""
    root, args = work["root"], ["--steps", "200", "--data", work["data"], "--lr", "3e-3"]
    sync_log, _ = _train(work["sync"], root, "sync-200", *args)
    isl_log, _ = _train(work["every10"], root, "every10-200", *args)
    tail = lambda log: sum(r["loss"] for r in log[-20:]) / 20  # noqa: E731
    assert tail(sync_log) < sync_log[0]["loss"] - 1.0
    assert abs(tail(isl_log) - tail(sync_log)) < 0.15, (tail(isl_log), tail(sync_log))
    dp_bytes, island_bytes = sync_log[-1]["dp_bytes"], isl_log[-1]["island_bytes"]
    assert "dp_bytes" not in isl_log[-1]  # inside an island of one rank nothing is reduced
    assert dp_bytes == 200 * 4 * _params(work["sync"])
    assert island_bytes * 10 == dp_bytes
    # the plan's price (a ring over 2 islands sends what it is handed) is what the program sent
    islands = json.loads((work["every10"] / "plan.json").read_text())["islands"]
    assert islands["outer_bytes_per_step"] * 200 == pytest.approx(island_bytes)
    assert islands["sync_dp_bytes_per_step"] * 200 == pytest.approx(dp_bytes)


def test_resume_between_syncs_is_exact(work):
    """A run of 2 islands (H=10) resumed from its checkpoint at step 15, between syncs (each
    island's own parameters and AdamW states, the outer state), through the sync after step 20,
    ends where the uninterrupted run does, bit for bit."""
    root, args = work["root"], ["--steps", "24", "--data", work["data"], "--lr", "3e-3"]
    ck = root / "resume-ck"
    straight_log, straight = _train(work["every10"], root, "straight", *args, "--checkpoint-dir", str(ck),
                                    "--checkpoint-every", "15", "--keep", "0")  # fmt: skip
    shutil.copytree(ck, root / "resume-ck2")
    shutil.rmtree(root / "resume-ck2" / "step_00000024")
    resumed_log, resumed = _train(work["every10"], root, "resumed", *args, "--checkpoint-dir", str(root / "resume-ck2"))
    assert [r["step"] for r in resumed_log] == list(range(15, 24))
    assert [r["loss"] for r in resumed_log] == [r["loss"] for r in straight_log[15:]]
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)


@pytest.mark.parametrize("wan_gbps, wan_latency_ms, chosen", [(0.001, 30, True), (100.0, 0.001, False)])
def test_compile_trains_islands_where_the_profile_link_between_them_is_slow(
    tmp_path, capsys, monkeypatch, wan_gbps, wan_latency_ms, chosen
):
    """A profile whose 4 GPUs sit 2 by 2 on either side of a link: islands (dp outermost, so each
    is 2 consecutive ranks) where synchronous DP over the link would outlast the step's compute,
    synchronous DP where it fits behind it; the plan says why."""
    monkeypatch.chdir(ROOT)
    profile = tmp_path / "wan.toml"
    link = f"wan_gbps = {wan_gbps}\nwan_latency_ms = {wan_latency_ms}\nwan_island_gpus = 2\n"
    profile.write_text(f'name = "wan"\nextends = "cpu"\n{link}')
    args = ["compile", *MODEL[:3], "--hardware", str(profile), *MODEL[5:], "--gpus", "4", "--plan-only"]
    assert main([*args, "-o", str(tmp_path / "out")]) == 0
    plan = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert (plan["islands"] is not None) == chosen
    assert any("The run spans 2 islands" in n for n in plan["notes"])
    assert plan["mesh"]["dp"] % 2 == 0
    active = [a for a in plan["mesh"]["order"] if plan["mesh"][a] > 1]
    assert active[-1] == "dp"


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--islands", "3", "--sync-every", "4"], "--islands 3 does not divide --gpus 2"),
        (["--islands", "2", "--sync-every", "4", "--force", "dp=1"], "--islands 2 does not divide the pinned dp=1"),
        (["--islands", "2"], "--islands 2 needs --sync-every H"),
        (["--sync-every", "5"], "--sync-every 5 needs --islands 2 or more"),
        (["--islands", "2", "--sync-every", "4", "--force", "order=dp-tp-cp-pp"], "pin an order with dp last"),
        (["--islands", "0", "--sync-every", "5"], "--islands 0: give a whole number of islands"),
        (["--islands", "2", "--sync-every", "0"], "--sync-every 0: give a whole number of steps"),
        (["--islands", "2", "--sync-every", "4", "--outer-lr", "-1"], "--outer-lr -1.0: give a finite"),
        (["--islands", "2", "--sync-every", "4", "--outer-momentum", "1"], "--outer-momentum 1.0: give a momentum"),
    ],
)
def test_bad_flags_are_one_line_errors(tmp_path, capsys, monkeypatch, flags, message):
    monkeypatch.chdir(ROOT)
    assert main(["compile", *BASE, *flags, "--plan-only", "-o", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1, err
