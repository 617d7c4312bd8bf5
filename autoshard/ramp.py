"""A long-context ramp: one model trained at a rising sequence length, in stages, each its own
best plan (``autoshard compile --seq-len 8192,32768,131072 --tokens-per-stage ...``).

LLaMA-3 405B, say, was pre-trained at 8K and then raised to 128K in stages; at each length the
activations and attention work grow, so the best plan grows its context parallelism and shrinks
its data parallelism. The ramp searches each stage on its own (:func:`compile_ramp`) and writes
one ordinary program directory per stage (``OUT/stage1_s8192/``, ...), a table of them
(``ramp.md``, ``ramp.json``) and a driver (``ramp.py``, ``autoshard.runtime.ramp``) that runs
stage k to its last step, then stage k+1 from stage k's final checkpoint, resharded by the
trainer to the new plan.

Tokens per optimizer step stay constant across the stages: ``--global-batch`` is the first
stage's batch in sequences, and stage k's is ``global_batch * seq_len[0] / seq_len[k]``, which
must be a whole number. That keeps the step count, the learning-rate schedule and the data
position (tokens read) one sequence from the first stage to the last: step s of any stage reads
the tokens of data position s. Steps in a stage: its tokens over the tokens per step, rounded up.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from autoshard import planner
from autoshard.compiler import compile_file
from autoshard.errors import AutoshardError

SECONDS_PER_DAY = 86400.0
DRIVER = "ramp.py"


@dataclass(frozen=True)
class Stage:
    """One stage of the ramp: its sequence length, batch and the optimizer steps it trains."""

    index: int  # 1-based
    seq_len: int  # tokens per sequence
    global_batch: int  # sequences per optimizer step
    tokens: float  # training tokens asked for
    first_step: int  # the run's step this stage starts at (0-based)
    steps: int  # optimizer steps it trains: tokens / tokens per step, rounded up

    @property
    def name(self) -> str:
        """The stage's program directory under the ramp's output."""
        return f"stage{self.index}_s{self.seq_len}"

    @property
    def end_step(self) -> int:
        """The step the stage ends at (its train.py's ``--steps``)."""
        return self.first_step + self.steps


def stages(seq_lens: list[int], global_batch: int, tokens: list[float]) -> list[Stage]:
    """The ramp's stages: one per sequence length, each with the first stage's tokens per step
    (``global_batch`` sequences of ``seq_lens[0]``) and ``tokens`` to train. One-line errors for
    lists of different lengths and a batch that the tokens per step do not make whole."""
    if len(tokens) != len(seq_lens):
        raise AutoshardError(
            f"--tokens-per-stage gives {len(tokens)} token count{'s' * (len(tokens) != 1)} for {len(seq_lens)} "
            f"--seq-len stages; give one count per stage"
        )
    per_step = global_batch * seq_lens[0]
    out, first = [], 0
    for i, (seq, count) in enumerate(zip(seq_lens, tokens), start=1):
        if per_step % seq:
            raise AutoshardError(
                f"--global-batch {global_batch} at --seq-len {seq_lens[0]} is {per_step} tokens per step, "
                f"{per_step / seq:g} sequences of {seq}: the ramp keeps tokens per step constant, so give a "
                f"--global-batch that makes a whole number of sequences at every length"
            )
        steps = max(1, math.ceil(round(count / per_step, 9)))
        out.append(Stage(i, seq, per_step // seq, count, first, steps))
        first += steps
    return out


def stage_pins(text: str | None, count: int) -> list[str | None]:
    """``--force`` for a ramp: one pin set for every stage, or one per stage separated by ``;``
    (``"dp=2;cp=2"``)."""
    if text is None or ";" not in text:
        return [text] * count
    parts = [p.strip() or None for p in text.split(";")]
    if len(parts) != count:
        raise AutoshardError(
            f"--force {text!r} gives {len(parts)} pin sets for {count} --seq-len stages; give one per stage "
            "separated by ';', or one set (no ';') for every stage"
        )
    return parts


def compile_ramp(
    spec: str,
    config: str | None,
    *,
    hardware: str,
    gpus: int,
    seq_lens: list[int],
    global_batch: int,
    tokens: list[float],
    force: str | None = None,
    precision: str = "bf16",
    memory_headroom: float | None = None,
    plan_only: bool = False,
    out: str | Path,
) -> dict:
    """Search and write each stage (``compile_file`` at its sequence length and batch) under
    ``out``, then ``ramp.json``, ``ramp.md`` and, unless ``plan_only``, the driver ``ramp.py``.
    A stage that does not plan is recorded with why, the others are still written, and the
    ramp then fails with one line naming it. Returns ramp.json's content. Long because its
    keyword arguments are ``compile``'s, passed through to every stage."""
    ramp = stages(seq_lens, global_batch, tokens)
    pins = [planner.parse_force(p) for p in stage_pins(force, len(ramp))]  # bad pins fail before any search
    out = Path(out)
    rows = []
    for stage, pinned in zip(ramp, pins):
        row = {**asdict(stage), "name": stage.name, "end_step": stage.end_step}
        try:
            compiled = compile_file(
                spec,
                config,
                hardware=hardware,
                gpus=gpus,
                seq_len=stage.seq_len,
                global_batch=stage.global_batch,
                precision=precision,
                pins=pinned,
                memory_headroom=memory_headroom,
                plan_only=plan_only,
            )
        except AutoshardError as e:
            rows.append({**row, "error": str(e)})
            continue
        compiled.write(out / stage.name)
        rows.append({**row, **_plan_row(compiled.plan, stage)})
    summary = {
        "model": spec + (f" --config {config}" if config else ""),
        "hardware": hardware,
        "gpus": gpus,
        "tokens_per_step": global_batch * seq_lens[0],
        "total_steps": ramp[-1].end_step,
        "days": sum(r.get("days", 0.0) for r in rows),
        "stages": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / "ramp.json").write_text(json.dumps(summary, indent=2) + "\n")
    (out / "ramp.md").write_text(table(summary))
    failed = [r for r in rows if "error" in r]
    if failed:
        r = failed[0]
        raise AutoshardError(f"stage {r['index']} (--seq-len {r['seq_len']}) has no plan: {r['error']}")
    if not plan_only:
        (out / DRIVER).write_text(driver_source(summary))
    return summary


def _plan_row(plan, stage: Stage) -> dict:
    """What ``ramp.md`` shows of a stage's plan."""
    p, m = plan.predicted, plan.mesh
    return {
        "plan": {"tp": m.tp, "pp": m.pp, "cp": m.cp, "ep": m.ep, "dp": m.dp, "zero": plan.zero_stage,
                 "schedule": plan.schedule, "v": plan.virtual_stages, "microbatches": plan.microbatches},
        "step_time_s": p.step_time_s,
        "mfu": p.mfu,
        "memory_gb": p.memory_bytes_per_gpu["total"] / 1e9,
        "days": stage.steps * p.step_time_s / SECONDS_PER_DAY,
        "not_emitted": list(plan.not_emitted),
    }  # fmt: skip


def table(summary: dict) -> str:
    """``ramp.md``: one row per stage, then the totals and any stage that did not plan."""
    lines = [
        f"# Long-context ramp: {summary['model']} on {summary['gpus']:,} x {summary['hardware']}",
        "",
        f"{summary['tokens_per_step']:,} tokens per optimizer step in every stage; step time and MFU are the "
        "cost model's prediction for each stage's plan; days = steps x step time.",
        "",
        "| stage | seq len | batch | tokens | tp | pp | cp | dp | ZeRO | schedule | GB/GPU | step time | MFU | steps "
        "| days |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for r in summary["stages"]:
        head = f"| {r['name']} | {r['seq_len']:,} | {r['global_batch']:,} | {_count(r['tokens'])} |"
        if "error" in r:
            lines.append(head + " no plan (below) |" + " |" * 8 + f" {r['steps']:,} | |")
            continue
        p = r["plan"]
        schedule = p["schedule"] + (f" v={p['v']}" if p["v"] > 1 else "")
        lines.append(
            f"{head} {p['tp']} | {p['pp']} | {p['cp']} | {p['dp']} | {p['zero']} | {schedule} | "
            f"{r['memory_gb']:.1f} | {r['step_time_s']:.3g} s | {r['mfu'] * 100:.1f}% | {r['steps']:,} | "
            f"{r['days']:.2f} |"
        )
    unplanned = " (stages without a plan not counted)" if any("error" in r for r in summary["stages"]) else ""
    lines += ["", f"Total: {summary['total_steps']:,} steps, {summary['days']:.2f} days{unplanned}.", ""]
    for r in summary["stages"]:
        if "error" in r:
            lines.append(f"- {r['name']} has no plan: {r['error']}")
        for why in r.get("not_emitted", []):
            lines.append(f"- {r['name']} is not emitted yet: {why}")
    return "\n".join(lines).rstrip() + "\n"


def _count(tokens: float) -> str:
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M")):
        if tokens >= scale:
            return f"{tokens / scale:.3g}{suffix}"
    return f"{tokens:,.0f}"


def driver_source(summary: dict) -> str:
    """The ramp's driver, ``ramp.py``: a launcher, like each stage's train.py, whose body is
    ``autoshard.runtime.ramp.main``; it reads ramp.json beside it."""
    rows = "\n".join(
        f"    {r['name']}: steps {r['first_step']} to {r['end_step']}, {r['global_batch']} x {r['seq_len']} tokens"
        for r in summary["stages"]
    )
    return f'''"""Train {summary["model"]} through its long-context ramp on {summary["gpus"]} GPUs.

Generated by autoshard. Each stage is its own program (its train.py); the driver runs one after
the other, each resuming from the checkpoint the one before it wrote last, resharded to its plan:
{rows}
Run with
    python OUT/ramp.py [--launcher "torchrun --nnodes N --nproc-per-node 8 ..."] [-- train.py flags]
(the launcher starts train.py on every process; run the driver wherever you would run it). A
stopped ramp continues from its newest checkpoint when started again. Options: python OUT/ramp.py --help.
"""

from pathlib import Path

from autoshard.runtime import ramp

if __name__ == "__main__":
    ramp.main(Path(__file__).resolve().parent, description=__doc__)
'''


__all__ = ["Stage", "compile_ramp", "stage_pins", "stages", "table"]
