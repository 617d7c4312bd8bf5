"""Load a user's model file: ``path/to/model.py[:builder]``.

The convention: the file defines ``build(config: str) -> nn.Module`` (or the named builder) and
``sample_inputs(config: str, batch: int, seq: int) -> tuple``; optionally
``loss(output, *inputs) -> Tensor`` (default: causal-LM cross-entropy on the shifted inputs) and
``CONFIGS`` (a mapping whose keys are the valid config names).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import traceback
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from autoshard.errors import AutoshardError


@dataclass
class ModelFile:
    path: Path
    builder_name: str
    module: Any

    @property
    def configs(self) -> list[str] | None:
        configs = getattr(self.module, "CONFIGS", None)
        return list(configs) if configs is not None else None

    @property
    def loss(self) -> Callable | None:
        return getattr(self.module, "loss", None)

    def build(self, config: str | None, device: str = "meta") -> nn.Module:
        """Call the builder under ``torch.device(device)``: on meta nothing is allocated."""
        self._check_config(config)
        builder = getattr(self.module, self.builder_name)
        args = () if config is None else (config,)
        try:
            with torch.device(device):
                model = builder(*args)
        except Exception as e:
            raise AutoshardError(
                f"{self.path.name}: {self.builder_name}({config!r}) raised {type(e).__name__}: "
                f"{_first_line(e)} (at {user_frame(e, self.path)})"
            ) from e
        if not isinstance(model, nn.Module):
            raise AutoshardError(
                f"{self.path.name}: {self.builder_name}() returned {type(model).__name__}, "
                "not a torch.nn.Module; return the model"
            )
        return model

    def sample_inputs(self, config: str | None, batch: int, seq: int, device: str = "meta") -> tuple:
        fn = getattr(self.module, "sample_inputs", None)
        if fn is None:
            raise AutoshardError(
                f"{self.path.name} has no sample_inputs(config, batch, seq); define it to return "
                "the model's inputs as a tuple of tensors"
            )
        try:
            with torch.device(device):
                inputs = fn(config, batch, seq)
        except Exception as e:
            raise AutoshardError(
                f"{self.path.name}: sample_inputs({config!r}, {batch}, {seq}) raised "
                f"{type(e).__name__}: {_first_line(e)}"
            ) from e
        if isinstance(inputs, torch.Tensor):
            inputs = (inputs,)
        if not isinstance(inputs, tuple) or not all(isinstance(t, torch.Tensor) for t in inputs):
            raise AutoshardError(f"{self.path.name}: sample_inputs() must return a tuple of tensors")
        return inputs

    def _check_config(self, config: str | None) -> None:
        known = self.configs
        if known is not None and config not in known:
            raise AutoshardError(f"unknown config {config!r} for {self.path.name}; choose one of: {', '.join(known)}")


def load(spec: str) -> ModelFile:
    """Import ``path.py[:builder]`` as a module (its directory first on ``sys.path``)."""
    path_text, _, builder = spec.partition(":")
    builder = builder or "build"
    path = Path(path_text)
    if not path.is_file():
        raise AutoshardError(f"model file not found: {path_text}; pass the path to a .py file")
    name = f"autoshard_user_{path.stem}"
    spec_obj = importlib.util.spec_from_file_location(name, path)
    if spec_obj is None or spec_obj.loader is None:
        raise AutoshardError(f"cannot import {path_text}: not a Python source file")
    module = importlib.util.module_from_spec(spec_obj)
    sys.path.insert(0, str(path.resolve().parent))
    try:
        spec_obj.loader.exec_module(module)
    except Exception as e:
        raise AutoshardError(
            f"importing {path.name} raised {type(e).__name__}: {_first_line(e)} (at {user_frame(e, path)})"
        ) from e
    finally:
        sys.path.remove(str(path.resolve().parent))
    sys.modules[name] = module
    if not callable(getattr(module, builder, None)):
        raise AutoshardError(
            f"{path.name} defines no function {builder}(); define {builder}(config) returning "
            "the nn.Module, or name the builder as model.py:function"
        )
    return ModelFile(path.resolve(), builder, module)


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def user_frame(e: BaseException, path: Path | None = None) -> str:
    """``file:line: code`` of the innermost traceback frame in the user's code.

    The user's code is ``path`` when given, else the innermost frame outside torch, the
    standard library and autoshard itself.
    """
    frames = traceback.extract_tb(e.__traceback__)
    chosen = None
    for f in frames:
        ours = Path(f.filename).resolve() == Path(path).resolve() if path is not None else not _library_file(f.filename)
        if ours:
            chosen = f
    if chosen is None:
        return "unknown location"
    code = f": {chosen.line.strip()}" if chosen.line else ""
    return f"{Path(chosen.filename).name}:{chosen.lineno}{code}"


def _package_dir(module) -> str:
    return os.path.dirname(os.path.abspath(module.__file__)) + os.sep


# torch, and autoshard's three package directories (autoshard/, passes/, cost_models/)
_LIBRARY_DIRS = (
    _package_dir(torch),
    _package_dir(sys.modules[__name__]),
    _package_dir(importlib.import_module("autoshard.passes")),
    _package_dir(importlib.import_module("autoshard.cost_models")),
)
_INSTALLED = (f"{os.sep}site-packages{os.sep}", f"{os.sep}dist-packages{os.sep}")


def model_code(filename: str) -> bool:
    """Code that can write a model's ops: the user's model file or a library's (such as
    transformers' ``modeling_llama.py``), not torch's, autoshard's or generated code's."""
    return not (filename.startswith("<") or filename.startswith(_LIBRARY_DIRS))


def model_line(frames: Iterable[tuple[str, int]]) -> str | None:
    """``file:line`` of the innermost frame of the model's code among ``frames`` (filename and
    line, innermost first): the user's file or a library's modelling file (``modeling_*.py``);
    else the innermost frame of another library's helper (an attention or experts integration
    the model dispatches to); None where all are torch's, autoshard's or generated."""
    helper = None
    for filename, line in frames:
        if not model_code(filename):
            continue
        name = os.path.basename(filename)
        if name.startswith("modeling_") or not any(d in filename for d in _INSTALLED):
            return f"{name}:{line}"
        helper = helper or f"{name}:{line}"
    return helper


def _library_file(filename: str) -> bool:
    """Code of torch, autoshard (package, passes, cost models) or an installed package: not the
    user's model."""
    return not model_code(filename) or any(d in filename for d in _INSTALLED)
