"""How compile records the way to rebuild a model (``autoshard.runtime.rebuild.Recipe``, the
``rebuild`` entry of ``program.json``), checked before anything is written.

A model comes with its recipe in one of three ways, in this order:

1. a model file (the CLI): the file's builder called with the config name;
2. a builder the caller names (``builder="package.module:function"`` or ``"path/to/file.py:function"``,
   or the function itself when it is importable), with JSON-serialisable arguments;
3. a transformers model: its class called with its configuration (``type(model)(config)``), both
   recorded by import path, the configuration as its ``config.json`` values.

Anything else (a module defined in ``__main__``, a lambda) cannot be rebuilt by another process,
and compile says so and names the fix. Compile then builds the model through the recipe (recording
its initialisation, ``record``) and checks that it has the given model's parameters, so the program
and ``verify`` rebuild what was compiled.
"""

from __future__ import annotations

import importlib.machinery
import json
import sys
from collections.abc import Callable
from pathlib import Path

from torch import nn

from autoshard.capture import record_build
from autoshard.errors import AutoshardError
from autoshard.modelfile import user_frame
from autoshard.runtime.rebuild import Recipe, is_file_spec, resolve

FIX = 'pass builder="package.module:function" (an importable function that returns the model)'
LOSS_FIX = 'pass loss="package.module:function" (an importable loss(output, *inputs))'


def for_file(path: str, builder: str | None, config: str | None) -> Recipe:
    """The recipe of a model file the CLI loaded: ``builder(config)``, and the file's ``loss``."""
    function = _checked_spec(f"{Path(path).resolve()}:{builder or 'build'}", "model file")
    module = sys.modules[resolve(function).__module__]
    loss = f"{Path(path).resolve()}:loss" if callable(getattr(module, "loss", None)) else None
    return Recipe(function, () if config is None else (config,), {}, None, loss)


def for_model(
    model: nn.Module,
    builder: str | Callable | None = None,
    args: tuple | list = (),
    kwargs: dict | None = None,
    loss: str | Callable | None = None,
) -> Recipe:
    """The recipe that rebuilds ``model``: the named builder, else the transformers config."""
    loss_spec = None if loss is None else _spec(loss, "loss", LOSS_FIX)
    if builder is not None:
        _check_json(args, "builder_args")
        _check_json(kwargs or {}, "builder_kwargs")
        return Recipe(_spec(builder, "builder"), tuple(args), dict(kwargs or {}), None, loss_spec)
    config = _transformers_config(model)
    if config is None:
        raise AutoshardError(
            f"cannot record how to rebuild {type(model).__qualname__} (the program rebuilds the single-device "
            f"model for --init-from-model and verify); {FIX}"
        )
    values = json.loads(config.to_json_string(use_diff=False))  # to_dict() as transformers writes config.json
    if isinstance(getattr(config, "_attn_implementation", None), str):  # chosen at build time; to_dict drops it
        values["attn_implementation"] = config._attn_implementation
    entry = {"class": _spec(type(config), "config class"), "values": values}
    return Recipe(_spec(type(model), "model class"), (), {}, entry, loss_spec)


def build(recipe: Recipe, device: str = "meta") -> nn.Module:
    """The model the recipe builds, with a failing build as one line naming the user's code."""
    return _checked(recipe, lambda: recipe.build(device))


def record(recipe: Recipe) -> tuple[nn.Module, dict]:
    """The model the recipe builds on meta, and how it initialises its tensors: the recipe's call
    under ``autoshard.capture.record_build``, which sees the constructor run."""

    def call():
        fn, args, kwargs = recipe.call()
        return record_build(fn, *args, **kwargs)

    return _checked(recipe, call)


def _checked(recipe: Recipe, make: Callable):

    try:
        made = make()
    except Exception as e:
        text = str(e).strip().splitlines()
        raise AutoshardError(
            f"rebuilding the model with {recipe.function} raised {type(e).__name__}: "
            f"{text[0] if text else ''} (at {user_frame(e)})"
        ) from e
    model = made[0] if isinstance(made, tuple) else made
    if not isinstance(model, nn.Module):
        raise AutoshardError(f"{recipe.function} returned {type(model).__name__}, not a torch.nn.Module")
    return made


def check_same(model: nn.Module, rebuilt: nn.Module, recipe: Recipe) -> None:
    """``rebuilt`` has ``model``'s parameters and buffers (names and shapes)."""

    def tensors(m: nn.Module) -> dict:
        named = {**dict(m.named_buffers()), **dict(m.named_parameters())}
        return {k: tuple(v.shape) for k, v in named.items()}

    given, again = tensors(model), tensors(rebuilt)
    if given == again:
        return
    name = next((k for k in given if again.get(k) != given[k]), None) or next(k for k in again if k not in given)
    raise AutoshardError(
        f"{recipe.function}{_arguments(recipe)} builds a different model than the one given ({name}: "
        f"{given.get(name, 'absent')} given, {again.get(name, 'absent')} rebuilt); pass the builder and "
        "arguments that built it"
    )


def _arguments(recipe: Recipe) -> str:
    parts = [repr(a) for a in recipe.args] + [f"{k}={v!r}" for k, v in recipe.kwargs.items()]
    return "(" + ", ".join(parts) + ")" if recipe.config is None else "(config)"


def _transformers_config(model: nn.Module):
    """``model.config`` when it is a transformers configuration (transformers is imported
    already whenever the model is one of its models)."""
    transformers = sys.modules.get("transformers")
    config = getattr(model, "config", None)
    if transformers is not None and isinstance(config, transformers.PretrainedConfig):
        return config
    return None


def _spec(obj: str | Callable, what: str, fix: str = FIX) -> str:
    """The import path of ``obj`` (a ``module:name`` or ``file.py:name`` text, or a function or
    class another process can import)."""
    if isinstance(obj, str):
        where, _, name = obj.rpartition(":")
        return _checked_spec(f"{Path(where).resolve()}:{name}" if is_file_spec(obj) else obj, what, fix)
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", "")
    if not module or module == "__main__" or "<" in name:
        where = module or "no module"
        raise AutoshardError(f"{what} {name or repr(obj)} is defined in {where}, so it cannot be imported; {fix}")
    loaded = sys.modules.get(module)
    top = module.partition(".")[0]
    if importlib.machinery.PathFinder.find_spec(top) is None and getattr(loaded, "__file__", None):
        return _checked_spec(f"{Path(loaded.__file__).resolve()}:{name}", what, fix)  # a file imported by path
    return _checked_spec(f"{module}:{name}", what, fix)


def _checked_spec(spec: str, what: str, fix: str = FIX) -> str:
    try:
        obj = resolve(spec)
    except (ImportError, AttributeError) as e:
        raise AutoshardError(f"{what} {spec!r} cannot be imported ({e}); {fix}") from None
    if not callable(obj):
        raise AutoshardError(f"{what} {spec!r} is a {type(obj).__name__}, not a function; {fix}")
    return spec


def _check_json(value, what: str) -> None:
    """``value`` reads back from JSON as itself (up to tuples read as lists)."""
    try:
        same = json.loads(json.dumps(value)) == _as_json(value)
    except (TypeError, ValueError):
        same = False
    if not same:
        raise AutoshardError(f"{what} must be JSON values (text, numbers, lists, dicts): program.json records them")


def _as_json(value):
    """``value`` as JSON reads it back (tuples become lists)."""
    if isinstance(value, (list, tuple)):
        return [_as_json(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_json(v) for k, v in value.items()}
    return value
