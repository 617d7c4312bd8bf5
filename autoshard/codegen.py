"""Emit: the program files for a plan (one stage file per pipeline chunk, the loss, ``program.json``
and the ``train.py`` launcher) and writing them, with ``plan.json`` and ``plan.md`` (``report.py``),
to an output directory.

Everything is written to a temporary sibling directory first and moved into place at the end, so
a failure never leaves a half-written ``out/``.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

from torch import fx

from autoshard.cost_models import hardware
from autoshard.errors import AutoshardError
from autoshard.ir.plan import Plan
from autoshard.ir.program import Chunk, Fp8, Loss, Program, Routing, Tied
from autoshard.ir.schedules import schedule
from autoshard.passes.contract import Decisions, decisions
from autoshard.report import plan_markdown
from autoshard.stagecode import program_sources


def write_plan(plan: Plan, out: str | Path, comparison: str | None = None, extra: dict | None = None) -> Path:
    """``out/plan.json``, ``out/plan.md`` with its pictures and the ``extra`` files (name -> text,
    or bytes); replaces those files, keeps anything else."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise AutoshardError(f"-o {out}: exists and is not a directory; choose another path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".autoshard-", dir=out.parent))
    except OSError as e:
        raise AutoshardError(f"cannot write to {out.parent}: {e.strerror}") from e
    try:
        files = {
            "plan.json": plan.to_json() + "\n",
            "plan.md": plan_markdown(plan, comparison, staging),
            **(extra or {}),
        }
        for name, content in files.items():
            if isinstance(content, bytes):
                (staging / name).write_bytes(content)
            else:
                (staging / name).write_text(content)
        out.mkdir(exist_ok=True)
        for path in staging.iterdir():  # the files and plan.md's pictures
            os.replace(path, out / path.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


# ---------------------------------------------------------------------------------------------
# the training program


def program_files(plan: Plan, rewritten: fx.GraphModule, captured, rebuild) -> dict[str, str]:
    """Stage files, the loss, ``program.json`` and ``train.py`` for ``plan`` (file name -> text),
    from the graph the passes made of ``captured`` (``rewritten``: what they decided is on its
    nodes' ``meta`` and in ``passes.decisions(rewritten)``, the chunks included); ``program.json``
    records ``rebuild`` (``autoshard.runtime.rebuild.Recipe``), how the program rebuilds the
    single-device model."""
    done = decisions(rewritten)
    split = done.split
    n = len(split.chunks)
    docs, chunks = [], []
    for c in range(n):
        rank = schedule(plan.schedule).chunk_rank(c, plan.mesh.pp)
        docs.append(f"Pipeline chunk {c} of {n} (pipeline rank {rank}): {_chunk_parts(split, c)}.")
        chunks.append(Chunk(f"stage{c}.py", f"Chunk{c}", tuple(split.layers[c]), rank))
    inits = _stage_inits(captured, done.origin)
    files = program_sources(split.chunks, split.loss, docs, done, inits)
    vocab = plan.model.get("vocab")
    if not vocab:
        raise AutoshardError("the model's vocabulary size is unknown, so no synthetic data can be drawn")
    program = Program(
        plan_sha256=hashlib.sha256((plan.to_json() + "\n").encode()).hexdigest(),
        rebuild=rebuild.to_dict(),
        vocab=vocab,
        chunks=tuple(chunks),
        loss=Loss("loss.py", "Loss"),
        target=split.target,
        tied=tuple(Tied(tuple(t["names"]), tuple(t["chunks"])) for t in split.tied),
        routing={k: Routing(r["experts"], r["top_k"], r["bias"], r["router"]) for k, r in done.routing.items()},
        fp8=Fp8(tuple(plan.precision.get("fp8_matmuls") or ()), tuple(_fp8_params(done))),
        state_dict_keys=tuple(f"model.{k}" for k in captured.model.state_dict()),
        peak_flops=_peak_flops(plan),
    )
    files["program.json"] = program.to_json()
    files["train.py"] = train_launcher(plan)
    return files


def _chunk_parts(split, c: int) -> str:
    """What chunk ``c`` holds, in words."""
    first, last = split.layers[c]
    n = len(split.chunks)
    parts = [f"layers {first}-{last - 1}" if last - first > 1 else f"layer {first}"] if last > first else []
    parts += (["no repeated layers"] if last == first else []) + (["the embedding"] if c == 0 else [])
    if c == n - 1:
        parts.append("the output head")
    for tie in split.tied:  # one parameter with a copy in each chunk reading it
        if c in tie["chunks"] and len(tie["chunks"]) > 1:
            others = [str(o) for o in tie["chunks"] if o != c]
            chunk_s = "chunk" if len(others) == 1 else "chunks"
            parts.append(f"a copy of {tie['names'][0]} (tied: gradients summed with {chunk_s} {', '.join(others)})")
    return ", ".join(parts)


def train_launcher(plan: Plan) -> str:
    """``train.py``: the plan's header (what it trains, how to launch it) over a call into
    ``autoshard.runtime.trainer``, the same program for every plan."""
    name = plan.model.get("name", "the model")
    title = f"Train {name} as {plan.mesh.product_form()}, ZeRO-{plan.zero_stage}, {plan.schedule}."
    n = plan.gpus
    return f'''"""{title}

Generated by autoshard for {n} processes. Run with
    torchrun --nproc-per-node {n} OUT/train.py --steps 10        (one node)
    torchrun --nnodes N --nproc-per-node {n}/N --rdzv-endpoint HOST:29500 OUT/train.py   (N nodes)
on GPUs (NCCL, bf16 compute with fp32 master weights) or CPUs (gloo, fp32). It reads plan.json and
program.json beside it and the stage files they name; the training loop is
autoshard/runtime/trainer.py. Options: python OUT/train.py --help.
"""

from pathlib import Path

from autoshard.runtime import trainer

if __name__ == "__main__":
    trainer.main(Path(__file__).resolve().parent, description=__doc__)
'''


def _peak_flops(plan: Plan) -> float | None:

    try:
        return hardware.load(plan.hardware).peak_flops(plan.precision.get("compute", "bf16"))
    except AutoshardError:  # a profile given as a file that moved since: the log leaves MFU out
        return None


def _fp8_params(done: Decisions) -> list[str]:
    """The model's names of the weights the FP8 pass put under FP8 matmuls (through the renames)."""
    out = set()
    for name in done.fp8_params:
        source = done.origin.get(name, name)
        out.update(source if isinstance(source, (list, tuple)) else [source])
    return sorted(out)


def _stage_inits(captured, origin: dict[str, str]) -> dict | None:
    """How the model initialises each tensor a stage may hold, by the stage's name (a name the
    passes changed reads its model tensor's through ``origin``); None where it was not recorded."""
    if captured.inits is None:
        return None
    return {**captured.inits, **{k: captured.inits[v] for k, v in origin.items() if v in captured.inits}}
