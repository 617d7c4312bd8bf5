"""The example GPT with its output head tied to its token embedding the way hand-written models
tie them (``head.weight = embed.weight``): captured by torch.fx, the tie is two modules sharing one
parameter, not one parameter read twice."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))

import gpt  # noqa: E402

CONFIGS = {"tiny": "tiny"}


def build(config: str = "tiny"):
    model = gpt.build(config)
    model.head.weight = model.embed.weight
    return model


sample_inputs = gpt.sample_inputs
