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
from autoshard.report import plan_markdown
from autoshard.runtime.schedules import schedule


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
        rank = schedule(plan.schedule).chunk_rank(c, plan.mesh.pp)
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
