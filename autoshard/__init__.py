"""autoshard: a compiler for distributed LLM training.

Python API::

    import autoshard
    captured = autoshard.capture(model, seq=8192)     # model on the meta device or live
    cost = autoshard.analyze(captured)                # per-layer FLOPs, memory, communication
    autoshard.estimate(params=2e12, tokens=40e12, hardware="h100")
"""

from __future__ import annotations

from autoshard.errors import AutoshardError

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


__all__ = ["AutoshardError", "capture", "analyze", "estimate", "__version__"]
