"""autoshard: a compiler for distributed LLM training.

Python API::

    import autoshard
    captured = autoshard.capture(model, seq=8192)     # model on the meta device or live
    cost = autoshard.analyze(captured)                # per-layer FLOPs, memory, communication
    autoshard.estimate(params=2e12, tokens=40e12, hardware="h100")
    plan = autoshard.plan(model, hardware="h100", gpus=16384, seq_len=8192, global_batch=2048, tp=8)
    plan.save("out/plan.json")

    program = autoshard.compile(model, hardware="cpu", gpus=2, seq_len=32, global_batch=8, out="out/",
                                builder="my_models:build", builder_args=["tiny"], pp=2)
    program.plan, program.out, program.files          # the Plan, the directory written, file name -> text
    program.write("elsewhere/")                       # the same program again; out=None writes nothing

``compile`` writes what ``autoshard compile`` writes (plan.json, plan.md, stage files, loss.py,
program.json, train.py). The program must rebuild the single-device model (``--init-from-model``,
``autoshard verify``), so ``program.json`` records how: a transformers model by its class and
config; any other model by ``builder="package.module:function"`` (or ``"path/to/file.py:function"``,
or the function itself) with ``builder_args`` / ``builder_kwargs`` (JSON values). A model with
neither is refused before anything is written.
"""

from __future__ import annotations

from autoshard.errors import AutoshardError

# Load the ``autoshard.ir.plan`` module (the Plan dataclass; light: json and dataclasses only) now,
# so that importing it later cannot rebind the package attribute ``plan`` from the function
# defined below to the module.
from autoshard.ir.plan import Plan  # noqa: E402,I001

__version__ = "0.1.0"


def capture(model, inputs=None, *, seq: int = 128, loss=None):
    """Trace ``model`` (see ``autoshard.capture.capture``)."""
    from autoshard.capture import capture as _capture

    return _capture(model, inputs, seq=seq, loss=loss)


def analyze(captured):
    """Cost a captured model (see ``autoshard.cost_models.analyze``)."""
    from autoshard.cost_models.analyze import analyze as _analyze

    return _analyze(captured)


def estimate(params: float, tokens: float, hardware: str = "h100", mfu: float = 0.5, gpus=None, zero: int = 3):
    """6ND FLOPs, GPU-hours, cost and model-state memory (see ``autoshard.cost_models.estimate``)."""
    from autoshard.cost_models import hardware as hw
    from autoshard.cost_models.estimate import estimate as _estimate

    return _estimate(params, tokens, hw.load(hardware), mfu, gpus, zero)


def plan(
    model,
    *,
    hardware="h100",
    gpus: int,
    seq_len: int,
    global_batch: int,
    precision: str = "bf16",
    inputs=None,
    loss=None,
    name: str | None = None,
    **force,
):
    """Search the parallel plan for ``model`` (a live or meta ``nn.Module``) and return the best
    :class:`autoshard.ir.plan.Plan`. Keyword arguments beyond the named ones pin fields exactly as
    ``compile --force`` does, e.g. ``tp=8, pp=16, schedule="interleaved", recompute="full"``.
    ``hardware`` is a profile name, a TOML path or a loaded ``Hardware``."""
    from autoshard import planner

    args = (hardware, gpus, seq_len, global_batch, precision, name, force)
    problem, _ = _problem(model, inputs, loss, *args)
    return planner.solve(problem)[0]


def compile(
    model,
    inputs=None,
    *,
    hardware="h100",
    gpus: int,
    seq_len: int,
    global_batch: int,
    out="out/",
    precision: str = "bf16",
    loss=None,
    builder=None,
    builder_args: tuple | list = (),
    builder_kwargs: dict | None = None,
    name: str | None = None,
    **force,
):
    """Plan ``model`` (a live or meta ``nn.Module``) as :func:`plan` does, emit the program for
    the plan and write it to ``out`` (``None``: keep it in memory); returns the
    :class:`autoshard.compiler.Compiled` (``.plan``, ``.files``, ``.out``, ``.write(dir)``).

    The program rebuilds the model from ``builder`` (``"package.module:function"``,
    ``"path/to/file.py:function"`` or an importable function, called with ``builder_args`` and
    ``builder_kwargs``) or, for a transformers model, from its config; ``loss`` (a function or
    such a name) must be importable too. The model is captured as the recipe builds it, on meta,
    with the initialisation its constructor records (replayed per shard by the program)."""
    from autoshard import rebuild
    from autoshard.compiler import compile_plan

    recipe = rebuild.for_model(model, builder, builder_args, builder_kwargs, loss)
    rebuilt, inits = rebuild.record(recipe)
    rebuild.check_same(model, rebuilt, recipe)
    args = (hardware, gpus, seq_len, global_batch, precision, name or type(model).__name__, force)
    problem, captured = _problem(rebuilt, _on_meta(inputs), recipe.loss_function(), *args, inits=inits)
    compiled = compile_plan(problem, captured, recipe)
    if out is not None:
        compiled.write(out)
    return compiled


def _problem(model, inputs, loss, hardware, gpus, seq_len, global_batch, precision, name, force, inits=None):
    """The pipeline's first steps for the API (``compiler.problem``): ``model`` captured and its
    problem for the search; returns both."""
    from autoshard import compiler, planner
    from autoshard.capture import capture as _capture

    pins = planner.parse_force(",".join(f"{k}={_force_text(k, v)}" for k, v in force.items()))
    compiler.check_run(gpus, seq_len, global_batch)  # before a capture at a nonsense length
    captured = _capture(model, inputs, seq=seq_len, loss=loss, inits=inits)
    return compiler.problem(captured, hardware, gpus, seq_len, global_batch, precision, pins, name), captured


def _on_meta(inputs):
    """Example inputs on the meta device, where the rebuilt model is."""
    if inputs is None:
        return None
    import torch

    inputs = (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    return tuple(t.to("meta") if isinstance(t, torch.Tensor) else t for t in inputs)


def _force_text(key: str, value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple, set)):
        return ("-" if key == "order" else "+").join(str(x) for x in value)
    return str(value)


__all__ = ["AutoshardError", "Plan", "capture", "analyze", "estimate", "plan", "compile", "__version__"]
