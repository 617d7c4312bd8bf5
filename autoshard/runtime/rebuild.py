"""The recipe that rebuilds the single-device model: ``program.json``'s ``rebuild`` entry.

The program needs the model it was compiled from twice: ``--init-from-model`` slices its seeded
initialisation, and ``autoshard verify`` trains it on one device beside the program. Every way a
model reaches autoshard is recorded in one shape::

    {"function": SPEC, "args": [...], "kwargs": {...}, "config": null | CONFIG, "loss": null | SPEC}

``SPEC`` names a Python object: ``path/to/model.py:name`` (a model file: the CLI's ``model.py
--config NAME`` is ``{"function": "/abs/model.py:build", "args": ["NAME"]}``) or
``package.module:name`` (an importable builder, or a model class). ``CONFIG`` is a transformers
configuration, ``{"class": SPEC, "values": {...}}`` with the values its ``config.json`` holds; it
is rebuilt with the class's ``from_dict`` and passed as the first argument, so a transformers
model is rebuilt as ``type(model)(config)``. ``loss`` names the single-device loss
``loss(output, *inputs)`` (null: causal-LM cross-entropy); the program runs its traced copy
(``loss.py``), verify runs this one.

Depends on torch only: a transformers class is imported by its name, like any other.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn


@dataclass(frozen=True)
class Recipe:
    """``function(*args, **kwargs)``, with ``config`` (when recorded) rebuilt and put first."""

    function: str
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)
    config: dict | None = None
    loss: str | None = None

    def to_dict(self) -> dict:
        return {
            "function": self.function,
            "args": list(self.args),
            "kwargs": dict(self.kwargs),
            "config": self.config,
            "loss": self.loss,
        }

    @classmethod
    def from_dict(cls, entry: dict) -> Recipe:
        return cls(entry["function"], tuple(entry["args"]), dict(entry["kwargs"]), entry["config"], entry["loss"])

    def call(self) -> tuple[Callable, tuple, dict]:
        """The builder and the arguments that rebuild the model (what a recording build calls)."""
        args = self.args
        if self.config is not None:
            args = (resolve(self.config["class"]).from_dict(dict(self.config["values"])), *args)
        return resolve(self.function), args, self.kwargs

    def build(self, device: str | torch.device = "meta") -> nn.Module:
        """The model, built under ``torch.device(device)``: on meta nothing is allocated."""
        fn, args, kwargs = self.call()
        with torch.device(device):
            return fn(*args, **kwargs)

    def loss_function(self) -> Callable | None:
        return resolve(self.loss) if self.loss else None


def resolve(spec: str) -> object:
    """The object ``spec`` names: ``path/to/file.py:name`` or ``package.module:name`` (a dotted
    name after the colon reaches into classes). Raises ImportError or AttributeError."""
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ImportError(f"{spec!r} is not 'package.module:name' or 'path/to/file.py:name'")
    obj = _load_file(Path(where)) if where.endswith(".py") else importlib.import_module(where)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def is_file_spec(spec: str) -> bool:
    return spec.rpartition(":")[0].endswith(".py")


def _load_file(path: Path):
    """The module of a model file: the one already imported from it, else imported now (its
    directory first on ``sys.path``, as the CLI imports it)."""
    path = path.resolve()
    for module in list(sys.modules.values()):
        file = getattr(module, "__file__", None)
        if file and file.endswith(".py") and Path(file).resolve() == path:
            return module
    spec = importlib.util.spec_from_file_location(f"autoshard_user_model_{path.stem}", path)
    if spec is None or spec.loader is None or not path.is_file():
        raise ImportError(f"model file {path} not found")
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(path.parent))
    sys.modules[spec.name] = module
    return module
