"""autoshard: a compiler for distributed LLM training.

Python API::

    import autoshard
    captured = autoshard.capture(model, seq=8192)     # model on the meta device or live
    cost = autoshard.analyze(captured)                # per-layer FLOPs, memory, communication
    autoshard.estimate(params=2e12, tokens=40e12, hardware="h100")
    plan = autoshard.plan(model, hardware="h100", gpus=16384, seq_len=8192, global_batch=2048, tp=8)
    plan.save("out/plan.json")
"""

from __future__ import annotations

from autoshard.errors import AutoshardError

# Load the ``autoshard.plan`` module (the Plan dataclass; light: json and dataclasses only) now,
# so that importing it later cannot rebind the package attribute ``plan`` from the function
# defined below to the module.
from autoshard.plan import Plan  # noqa: E402,I001

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
    :class:`autoshard.plan.Plan`. Keyword arguments beyond the named ones pin fields exactly as
    ``compile --force`` does, e.g. ``tp=8, pp=16, schedule="interleaved", recompute="full"``.
    ``hardware`` is a profile name, a TOML path or a loaded ``Hardware``."""
    from autoshard import planner
    from autoshard.capture import capture as _capture
    from autoshard.cost_models import hardware as hw
    from autoshard.cost_models.analyze import analyze as _analyze

    profile = hardware if isinstance(hardware, hw.Hardware) else hw.load(hardware)
    for key, value in (("gpus", gpus), ("seq_len", seq_len), ("global_batch", global_batch)):
        if not isinstance(value, int) or value < 1:
            raise AutoshardError(f"{key}={value!r}: must be a positive whole number")
    pins = planner.parse_force(",".join(f"{k}={_force_text(k, v)}" for k, v in force.items()))
    cost = _analyze(_capture(model, inputs, seq=seq_len, loss=loss))
    problem = planner.Problem(cost, profile, gpus, seq_len, global_batch, precision, pins, name or type(model).__name__)
    return planner.solve(problem)[0]


def _force_text(key: str, value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, (list, tuple, set)):
        return ("-" if key == "order" else "+").join(str(x) for x in value)
    return str(value)


__all__ = ["AutoshardError", "Plan", "capture", "analyze", "estimate", "plan", "__version__"]
