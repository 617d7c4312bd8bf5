"""Build an emitted stage module and give it this rank's parameters.

Stage modules are constructed on the meta device (no memory), then materialised: either from the
single-device model's initial state (``--init-from-model``: every rank builds the seeded model and
keeps its slices, for verification) or directly at the local shapes, each module initialised by its
own ``reset_parameters`` from a generator seeded by the parameter's name (and TP rank for split
ones), with the fan-in correction a row-parallel slice needs so its scale matches the full layer's.
"""

from __future__ import annotations

import importlib.util
import math
import sys
import zlib
from pathlib import Path

import torch
from torch import nn


def _parent(root: nn.Module, path: str) -> tuple[nn.Module, str]:
    """The module that holds ``path``'s last name, creating plain ``nn.Module`` containers on the
    way (a stage keeps the single-device model's dotted names: ``model.layers.0.attn.wq``)."""
    *parents, leaf = path.split(".")
    node = root
    for name in parents:
        if not hasattr(node, name):
            node.add_module(name, nn.Module())
        node = getattr(node, name)
    return node, leaf


def put_module(root: nn.Module, path: str, module: nn.Module) -> None:
    """``root.<path> = module``, for a dotted ``path``."""
    node, leaf = _parent(root, path)
    node.add_module(leaf, module)


def put_parameter(root: nn.Module, path: str, param: nn.Parameter) -> None:
    """Register ``param`` at the dotted ``path`` under ``root``."""
    node, leaf = _parent(root, path)
    node.register_parameter(leaf, param)


def put_buffer(root: nn.Module, path: str, value: torch.Tensor) -> None:
    """Register buffer ``value`` at the dotted ``path`` under ``root``."""
    node, leaf = _parent(root, path)
    node.register_buffer(leaf, value)


def size_of(x: torch.Tensor, dim: int) -> int:
    """``x.size(dim)``, as a function a generated graph can call."""
    return x.size(dim)


def load_stage_file(path: str | Path):
    """Import an emitted stage file as a module."""
    path = Path(path)
    name = f"autoshard_stage_{path.stem}_{abs(hash(str(path.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def slice_full(full: torch.Tensor, spec: tuple, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full``; ``spec`` = (dim, factors, index) from a stage's SHARDS."""
    dim, factors, index = spec
    shape = list(full.shape)
    view = full.reshape(*shape[:dim], *factors, *shape[dim + 1 :])
    block = factors[index] // tp
    piece = view.narrow(dim + index, rank * block, block)
    shape[dim] //= tp
    return piece.reshape(shape)


def unslice(pieces: list[torch.Tensor], spec: tuple) -> torch.Tensor:
    """Inverse of ``slice_full`` over all ranks' pieces, in TP rank order."""
    dim, factors, index = spec
    tp = len(pieces)
    local = list(factors)
    local[index] //= tp
    views = [p.reshape(*p.shape[:dim], *local, *p.shape[dim + 1 :]) for p in pieces]
    whole = torch.cat(views, dim=dim + index)
    shape = list(pieces[0].shape)
    shape[dim] *= tp
    return whole.reshape(shape)


def materialise(
    stage: nn.Module,
    stage_file,
    device: torch.device,
    tp_rank: int,
    tp: int,
    full_state: dict[str, torch.Tensor] | None = None,
    seed: int = 0,
) -> nn.Module:
    """Allocate ``stage``'s local parameters on ``device`` and fill them."""
    stage.to_empty(device=device)
    shards, origin = stage_file.SHARDS, stage_file.ORIGIN
    with torch.no_grad():
        if full_state is not None:
            for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
                source = origin.get(name, name)
                if source not in full_state:
                    raise ValueError(
                        f"the model has no parameter {source}: it changed since this program was compiled; "
                        "recompile with autoshard compile"
                    )
                value = full_state[source]
                if source in shards:
                    value = slice_full(value, shards[source], tp_rank, tp)
                if tuple(value.shape) != tuple(t.shape):
                    raise ValueError(
                        f"{source}: the model's piece is {tuple(value.shape)}, the program's {tuple(t.shape)}: "
                        "the model changed since this program was compiled; recompile with autoshard compile"
                    )
                t.copy_(value)
            return stage
        for path, module in stage.named_modules():
            if not hasattr(module, "reset_parameters"):
                continue
            own = [f"{path}.{n}" if path else n for n, _ in module.named_parameters(recurse=False)]
            split = [origin.get(n, n) in shards for n in own]
            key = zlib.crc32(path.encode()) + (tp_rank + 1) * 7919 * any(split)
            gen_state = torch.random.get_rng_state()
            torch.manual_seed(seed * 1_000_003 + key)
            module.reset_parameters()
            torch.random.set_rng_state(gen_state)
            for (name, p), is_split in zip(module.named_parameters(recurse=False), split):
                spec = shards.get(origin.get(f"{path}.{name}" if path else name, ""))
                if is_split and spec and spec[0] == 1 and p.dim() == 2:  # fan-in was split: rescale
                    p.mul_(1.0 / math.sqrt(tp))
        params = {**dict(stage.named_parameters()), **dict(stage.named_buffers())}
        for name, spec in getattr(stage_file, "INIT", {}).items():
            p = params[name]
            if spec[0] == "from_model":
                what = "buffer" if name in dict(stage.named_buffers()) else "parameter"
                raise ValueError(
                    f"{what} {origin.get(name, name)} takes its initial value from the model's own code, which the "
                    "program does not replay per shard yet: run with --init-from-model (each rank builds the "
                    "model file's seeded initialisation and keeps its slices)"
                )
            split = origin.get(name, name) in shards
            gen = torch.Generator(device="cpu").manual_seed(
                seed * 1_000_003 + zlib.crc32(name.encode()) + (tp_rank + 1) * 7919 * split
            )
            kind, *args = spec
            value = torch.empty(p.shape, dtype=p.dtype)
            if kind == "normal":
                value.normal_(args[0], args[1], generator=gen)
            elif kind == "uniform":
                value.uniform_(args[0], args[1], generator=gen)
            else:
                value.fill_(args[0])
            p.copy_(value)
    return stage
