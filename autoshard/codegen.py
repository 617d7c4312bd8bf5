"""Emit: write the compiled artefacts to an output directory.

Everything is written to a temporary sibling directory first and moved into place at the end, so
a failure never leaves a half-written ``out/``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from autoshard.errors import AutoshardError
from autoshard.plan import Plan
from autoshard.planner.explain import rationale

GB = 1e9


def write_plan(plan: Plan, out: str | Path, comparison: str | None = None, extra: dict | None = None) -> Path:
    """``out/plan.json``, ``out/plan.md`` and the ``extra`` files (name -> text); replaces those
    files, keeps anything else."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise AutoshardError(f"-o {out}: exists and is not a directory; choose another path")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".autoshard-", dir=out.parent))
    except OSError as e:
        raise AutoshardError(f"cannot write to {out.parent}: {e.strerror}") from e
    try:
        files = {"plan.json": plan.to_json() + "\n", "plan.md": plan_markdown(plan, comparison), **(extra or {})}
        for name, text in files.items():
            (staging / name).write_text(text)
        out.mkdir(exist_ok=True)
        for name in files:
            os.replace(staging / name, out / name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def _table(header: list[str], rows: list[list]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(x) for x in row) + " |" for row in rows]
    return lines


def mesh_drawing(plan: Plan, domain: int) -> list[str]:
    """Which parallel coordinates the GPUs of the first NVLink domain hold, and what crosses it."""
    m = plan.mesh
    sizes = m.degrees()
    stride, strides = 1, {}
    for axis in m.order:
        strides[axis] = stride
        stride *= sizes[axis]
    lines = [f"Axes from innermost (consecutive ranks) to outermost: {' < '.join(f'{a}{sizes[a]}' for a in m.order)}."]
    inside, crossing = [], []
    for axis in m.order:
        if sizes[axis] == 1:
            continue
        span = strides[axis] * sizes[axis]
        per_node = max(1, min(sizes[axis], domain // strides[axis])) if strides[axis] < domain else 1
        (inside if span <= domain else crossing).append(
            f"{axis.upper()}{sizes[axis]}" + ("" if span <= domain else f" ({per_node} per node)")
        )
    lines.append(
        f"Inside one NVLink domain of {domain} GPUs: {', '.join(inside) or 'nothing'}; "
        f"across domains: {', '.join(crossing) or 'nothing'}."
    )
    shown = min(domain, plan.gpus)
    lines.append("")
    lines.append("```")
    lines.append(f"node 0 ({shown} GPUs)")
    for rank in range(shown):
        coords = " ".join(f"{a}{(rank // strides[a]) % sizes[a]}" for a in m.order if sizes[a] > 1)
        lines.append(f"  gpu {rank:<3d} {coords}")
    lines.append("```")
    return lines


def plan_markdown(plan: Plan, comparison: str | None = None) -> str:
    p, m = plan.predicted, plan.mesh
    mem = p.memory_bytes_per_gpu
    out = [
        f"# Plan: {plan.model.get('name', 'model')} on {plan.gpus} x {plan.hardware}",
        "",
        f"**{m.product_form()}**, ZeRO-{plan.zero_stage}, {plan.schedule} schedule "
        f"({plan.virtual_stages} virtual stage(s) per rank), {plan.microbatches} micro-batches of "
        f"{plan.microbatch_size} x {plan.seq_len} tokens, "
        f"sequence parallel {'on' if plan.sequence_parallel else 'off'}, "
        f"attention {plan.attention}, precision {plan.precision['compute']}"
        + (f" with FP8 {', '.join(plan.precision['fp8_matmuls'])}" if plan.precision["fp8_matmuls"] else "")
        + ".",
        "",
        f"Predicted step time **{p.step_time_s:.3f} s**, MFU **{p.mfu * 100:.1f}%**, {p.tokens_per_s:,.0f} tokens/s.",
        "",
        "## The mesh on the hardware",
        "",
        *mesh_drawing(plan, _domain(plan)),
        "",
        "## Where the step time goes (busiest pipeline rank)",
        "",
        *_table(
            ["part", "seconds"],
            [
                ["compute (incl. recompute)", f"{p.compute_s:.3f}"],
                ["recompute", f"{p.recompute_s:.3f}"],
                ["compute slowed by hidden communication", f"{p.overlap_s:.3f}"],
                ["pipeline bubble", f"{p.bubble_fraction * p.step_time_s:.3f}"],
            ]
            + [
                [f"{axis.upper()} communication exposed", f"{v['exposed']:.3f}"]
                for axis, v in p.comm_s.items()
                if v["total"]
            ],
        ),
        "",
        "## Communication per step",
        "",
        *_table(
            ["axis", "total s", "exposed s", "overlapped s"],
            [
                [axis.upper(), f"{v['total']:.3f}", f"{v['exposed']:.3f}", f"{v['total'] - v['exposed']:.3f}"]
                for axis, v in p.comm_s.items()
            ],
        ),
        "",
        "## Memory on the busiest GPU",
        "",
        *_table(
            ["part", "GB"],
            [[k, f"{mem[k] / GB:.2f}"] for k in ("params", "grads", "optimizer", "activations", "buffers", "total")]
            + [["usable (capacity minus reserve)", f"{p.memory_limit_bytes / GB:.2f}"]],
        ),
        "",
        "## Pipeline stages",
        "",
        _stages_text(plan),
        "",
        "## Activation checkpointing",
        "",
        *_table(["saved-tensor category", "decision"], [[k, v] for k, v in sorted(plan.checkpoint.items())]),
        "",
    ]
    if plan.alternatives:
        out += ["## Alternatives that lost", ""]
        out += _table(
            ["mesh", "schedule", "ZeRO", "step s", "MFU", "why it lost"],
            [
                [
                    " x ".join(f"{k.upper()}{v}" for k, v in a.mesh.items() if k != "order"),
                    a.schedule,
                    a.zero_stage,
                    "-" if a.step_time_s is None else f"{a.step_time_s:.3f}",
                    "-" if a.mfu is None else f"{a.mfu * 100:.1f}%",
                    a.reason,
                ]
                for a in plan.alternatives
            ],
        )
        out.append("")
    if comparison:
        out += ["## Compared with the reference plan", "", comparison, ""]
    out += ["## Rationale", "", "```", rationale(plan), "```", ""]
    return "\n".join(out)


def _domain(plan: Plan) -> int:
    from autoshard.cost_models import hardware

    try:
        return hardware.load(plan.hardware).nvlink_domain
    except AutoshardError:
        return 8


def _stages_text(plan: Plan) -> str:
    pp, v = plan.mesh.pp, plan.virtual_stages
    ranges = plan.stage_ranges()
    if pp == 1:
        return f"No pipeline: every GPU runs all {plan.model.get('layers')} layers, the embedding and the head."
    v_shape = plan.schedule in ("zbv", "dualpipev")
    lines = ["```"]
    for rank in range(pp):
        chunks = [c for c in range(pp * v) if (c if not v_shape else (c if c < pp else 2 * pp - 1 - c)) % pp == rank]
        if not v_shape:
            chunks = [c for c in range(pp * v) if c % pp == rank]
        parts = []
        for c in chunks:
            start, end = ranges[c]
            label = f"layers {start}-{end - 1}" if end > start else "no layers"
            extras = (["embedding"] if c == 0 else []) + (["head+loss"] if c == pp * v - 1 else [])
            parts.append(label + (f" + {' + '.join(extras)}" if extras else ""))
        lines.append(f"rank {rank:>3}: " + " | ".join(parts))
    lines.append("```")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# the training program


def program_files(plan: Plan, captured, model_file: str, builder: str | None, config: str | None) -> dict[str, str]:
    """Stage files, the loss, ``program.json`` and ``train.py`` for ``plan`` (file name -> text)."""
    import json

    from autoshard import passes
    from autoshard.stagecode import stage_source
    from autoshard.train_program import TRAIN_PY

    rewritten = passes.apply(captured, plan)
    split = rewritten.split
    files: dict[str, str] = {}
    chunks = []
    n = len(split.chunks)
    for c, gm in enumerate(split.chunks):
        first, last = split.layers[c]
        parts = ([f"layers {first}-{last - 1}"] if last > first else ["no repeated layers"]) + (
            ["the embedding"] if c == 0 else []
        )
        if c == n - 1:
            parts.append("the output head")
        rank = _chunk_rank(plan, c)
        doc = f"Pipeline chunk {c} of {n} (pipeline rank {rank}): {', '.join(parts)}."
        name = f"stage{c}.py"
        inits = _bare_inits(gm, captured.model, rewritten.origin)
        files[name] = stage_source(
            gm, f"Chunk{c}", doc, rewritten.notes, rewritten.shards, rewritten.origin, rewritten.partial_grads, inits
        )
        chunks.append({"file": name, "class": f"Chunk{c}", "layers": [first, last], "rank": rank})
    files["loss.py"] = stage_source(
        split.loss,
        "Loss",
        "The training loss on the last chunk's output and the micro-batch's tokens.",
        rewritten.notes,
    )
    vocab = plan.model.get("vocab")
    if not vocab:
        raise AutoshardError("the model's vocabulary size is unknown, so no synthetic data can be drawn")
    import hashlib

    program = {
        "plan_sha256": hashlib.sha256((plan.to_json() + "\n").encode()).hexdigest(),
        "model_file": str(Path(model_file).resolve()),
        "builder": builder,
        "config": config,
        "vocab": vocab,
        "chunks": chunks,
        "loss": {"file": "loss.py", "class": "Loss"},
        "target": split.target,
    }
    files["program.json"] = json.dumps(program, indent=2) + "\n"
    name = plan.model.get("name", "the model")
    title = f"Train {name} as {plan.mesh.product_form()}, ZeRO-{plan.zero_stage}, {plan.schedule}."
    files["train.py"] = TRAIN_PY.format(title=title, gpus=plan.gpus, out="OUT")
    return files


def _bare_inits(gm, model, origin: dict[str, str]) -> dict[str, tuple]:
    """Initialisers for the parameters a stage holds outside a torch.nn layer (a vocabulary-split
    embedding table, a row matmul's bias), from the layer they came from in the model: torch's own
    defaults for that layer type."""
    import math

    from torch import nn

    out = {}
    for node in gm.graph.nodes:
        if node.op != "get_attr":
            continue
        source = origin.get(node.target, node.target)
        owner_path, _, leaf = source.removeprefix("model.").rpartition(".")
        try:
            owner = model.get_submodule(owner_path)
        except AttributeError:
            continue
        if isinstance(owner, nn.Embedding) and leaf == "weight":
            out[node.target] = ("normal", 0.0, 1.0)
        elif isinstance(owner, nn.Linear):
            bound = 1 / math.sqrt(owner.in_features)
            out[node.target] = ("uniform", -bound, bound)
        elif isinstance(owner, (nn.LayerNorm, nn.RMSNorm)) or type(owner).__name__.endswith("Norm"):
            out[node.target] = ("constant", 1.0 if leaf == "weight" else 0.0)
        elif leaf not in dict(owner.named_parameters(recurse=False)):  # a buffer: its value comes from the model
            out[node.target] = ("from_model",)
        else:
            raise AutoshardError(
                f"parameter {source} of {type(owner).__name__} has no default initialiser; "
                "run the program with --init-from-model"
            )
    return out


def _chunk_rank(plan: Plan, chunk: int) -> int:
    pp = plan.mesh.pp
    if plan.schedule in ("zbv", "dualpipev"):
        return chunk if chunk < pp else 2 * pp - 1 - chunk
    return chunk % pp
