"""Build an emitted stage module and give it this rank's parameters.

Stage modules are constructed on the meta device (no memory), then materialised: from the
single-device model's initial state (``--init-from-model``: every rank builds the seeded model and
keeps its slices, for verification), from a checkpoint's weights (``autoshard.runtime.weights``:
each rank reads only its pieces), or by replaying, per parameter and buffer, the ops the model's
own initialisation applied to it (the stage file's ``INIT``, recorded at compile time): directly
at the local shape where the ops are element-wise, else the one full tensor, then its slice. A
constant lifted from the model's forward, which neither the model nor a checkpoint holds, always
takes the value captured with it.
"""

from __future__ import annotations

import importlib.util
import inspect
import math
import sys
import types
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from autoshard.ir.program import Tied

if TYPE_CHECKING:
    from autoshard.runtime.weights import Weights


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


def to_compute(x: torch.Tensor) -> torch.Tensor:
    """``x`` in the program's compute dtype: autocast's where it is on (bf16), else fp32. What a
    model's cast to its parameters' dtype (``h.to(hidden_states.dtype)`` after a norm's fp32
    statistics, rotary tables, routing weights) does in a program whose parameters are bf16 in
    one run and fp32 in another (``autoshard.capture.dtypes``)."""
    kind = x.device.type
    autocast = kind != "meta" and torch.is_autocast_enabled(kind)  # meta (sizes only) has no autocast
    return x.to(torch.get_autocast_dtype(kind) if autocast else torch.float32)


def load_stage_file(path: str | Path):
    """Import an emitted stage file as a module of a package that is its directory, so that its
    ``from .layers import ...`` reads the program's own ``layers.py``. Each call runs the files
    again (a program recompiled in place is read as it is now)."""
    path = Path(path).resolve()
    package = f"autoshard_program_{zlib.crc32(str(path.parent).encode()):08x}"
    for name in [n for n in sys.modules if n == package or n.startswith(f"{package}.")]:
        del sys.modules[name]
    holder = types.ModuleType(package)
    holder.__path__ = [str(path.parent)]
    sys.modules[package] = holder
    spec = importlib.util.spec_from_file_location(f"{package}.{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


# The tables a stage file and a layer class may hold (a missing one is empty). A layer class's
# names are relative to the layer (``attn.wq.weight``); a stage's, full (``model.layers.3.attn.wq.weight``).
_ROUTING_NAMES = ("bias", "router")  # the fields of a ROUTING entry that are names in the model
TABLES = {"SHARDS": dict, "ORIGIN": dict, "PARTIAL_GRADS": list, "EXPERTS": list, "ROUTING": dict, "INIT": dict}


def full_names(table: str, entries, prefix: str):
    """A layer class's ``table`` with its names under ``prefix`` (``"model.layers.3."``): the
    keys, ``ORIGIN``'s model names and ``ROUTING``'s names (its bias buffer and router module)."""
    if TABLES[table] is list:
        return [prefix + name for name in entries]
    if table == "ORIGIN":
        return {prefix + k: prefix + v if isinstance(v, str) else [prefix + x for x in v] for k, v in entries.items()}
    if table == "ROUTING":
        return {
            prefix + k: {f: prefix + x if f in _ROUTING_NAMES and x else x for f, x in v.items()}
            for k, v in entries.items()
        }
    return {prefix + k: v for k, v in entries.items()}


def stage_tables(stage: nn.Module, stage_file) -> types.SimpleNamespace:
    """The tables of built stage ``stage`` by full name: each layer's class tables under the
    layer's name, then the stage file's own (the entries where a layer differs from its kind,
    and everything outside the layers); ``__file__`` the stage file's."""
    out = {table: kind() for table, kind in TABLES.items()}
    sources = [(f"{name}.", vars(type(m))) for name, m in stage.named_modules() if name]
    for prefix, owner in [*sources, ("", vars(stage_file))]:
        for table, kind in TABLES.items():
            entries = owner.get(table)
            if not entries:
                continue
            entries = full_names(table, entries, prefix) if prefix else entries
            if kind is list:
                out[table] += [name for name in entries if name not in out[table]]
            else:
                out[table].update(entries)
    return types.SimpleNamespace(**out, __file__=stage_file.__file__)


def slice_full(full: torch.Tensor, spec: tuple, rank: int, tp: int) -> torch.Tensor:
    """Rank ``rank``'s piece of ``full``; ``spec`` = (dim, factors, index[, parts]) from a stage's
    SHARDS. With ``parts`` the dimension is those parts end to end (a fused q/k/v projection of
    unequal widths) and the piece is this rank's block of each part, in order."""
    if len(spec) > 3 and spec[3]:
        dim, parts = spec[0], spec[3]
        blocks = [p.narrow(dim, rank * (p.size(dim) // tp), p.size(dim) // tp) for p in full.split(list(parts), dim)]
        return torch.cat(blocks, dim)
    dim, factors, index = spec[:3]
    shape = list(full.shape)
    view = full.reshape(*shape[:dim], *factors, *shape[dim + 1 :])
    block = factors[index] // tp
    piece = view.narrow(dim + index, rank * block, block)
    shape[dim] //= tp
    return piece.reshape(shape)


@dataclass(frozen=True)
class Block:
    """One hyperrectangle of a rank's piece of a parameter: ``sizes`` elements starting at
    ``local`` in the piece and at ``full`` in the single-device tensor."""

    local: tuple[int, ...]
    full: tuple[int, ...]
    sizes: tuple[int, ...]


def piece_blocks(shape: tuple[int, ...], spec: tuple | None, rank: int, size: int) -> list[Block]:
    """Where rank ``rank``'s piece (``slice_full``) of a tensor of full ``shape`` lies: a list of
    blocks, each contiguous in every dimension in both the piece and the full tensor. What a
    checkpoint or a weights file reads and writes of the piece, without materialising the whole."""
    shape = tuple(shape)
    if spec is None or size == 1:
        return [Block((0,) * len(shape), (0,) * len(shape), shape)]
    dim = spec[0]
    segments = []  # (local start, full start, length) along dim
    if len(spec) > 3 and spec[3]:
        local = full = 0
        for width in spec[3]:
            segments.append((local, full + rank * (width // size), width // size))
            local, full = local + width // size, full + width
    else:
        factors, index = spec[1], spec[2]
        outer = math.prod(factors[:index])
        inner = math.prod(factors[index + 1 :])
        block = factors[index] // size * inner
        for j in range(outer):
            segments.append((j * block, j * factors[index] * inner + rank * block, block))
    merged: list[list[int]] = []  # neighbours in both the piece and the full tensor become one
    for local, full, length in segments:
        if merged and merged[-1][0] + merged[-1][2] == local and merged[-1][1] + merged[-1][2] == full:
            merged[-1][2] += length
        else:
            merged.append([local, full, length])
    out = []
    for local, full, length in merged:
        at = lambda v: tuple(v if d == dim else 0 for d in range(len(shape)))  # noqa: E731
        sizes = tuple(length if d == dim else n for d, n in enumerate(shape))
        out.append(Block(at(local), at(full), sizes))
    return out


def restrict_rows(blocks: list[Block], start: int, stop: int, dim: int = 0) -> list[Block]:
    """The blocks of rows ``start:stop`` (along ``dim``) of a piece, with local offsets counted
    from ``start``: what an FSDP shard or a ZeRO-1 rank's rows of the piece hold."""
    out = []
    put = lambda v, x: (*v[:dim], x, *v[dim + 1 :])  # noqa: E731
    for b in blocks:
        lo, hi = max(start, b.local[dim]), min(stop, b.local[dim] + b.sizes[dim])
        if lo >= hi:
            continue
        shift = lo - b.local[dim]
        out.append(Block(put(b.local, lo - start), put(b.full, b.full[dim] + shift), put(b.sizes, hi - lo)))
    return out


def unslice(pieces: list[torch.Tensor], spec: tuple) -> torch.Tensor:
    """Inverse of ``slice_full`` over all ranks' pieces, in TP rank order."""
    tp = len(pieces)
    if len(spec) > 3 and spec[3]:
        dim, parts = spec[0], spec[3]
        local = [p.split([n // tp for n in parts], dim) for p in pieces]
        return torch.cat([torch.cat([rank[i] for rank in local], dim) for i in range(len(parts))], dim)
    dim, factors, index = spec[:3]
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
    ep_rank: int = 0,
    ep: int = 1,
    weights: Weights | None = None,
    tied: Sequence[Tied] = (),
) -> nn.Module:
    """Allocate ``stage``'s local parameters and buffers on ``device`` and fill them: from
    ``full_state`` (sliced), from ``weights`` (a ``weights.Weights``: the blocks of this rank's
    piece read from the checkpoint and cast to the parameter's dtype; a buffer the checkpoint
    lacks, such as a non-persistent rotary table, replayed), or by replaying the model's own
    initialisation (``INIT``). ``tied`` (the program's ties, ``Program.tied``) lets a parameter be
    read under a name tied to it. A piece is this rank's along the group its ``SHARDS`` entry names: TP
    (``tp_rank`` of ``tp``), or EP (``ep_rank`` of ``ep``) for stacked expert weights."""
    stage_file = stage_tables(stage, stage_file)
    if weights is not None:
        _check_weights(stage, stage_file, weights, tied, tp, ep)
    stage.to_empty(device=device)
    shards, origin, inits = stage_file.SHARDS, stage_file.ORIGIN, stage_file.INIT
    with torch.no_grad():
        for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
            source = origin.get(name, name)
            spec = shards.get(source)
            rank, size = (ep_rank, ep) if piece_axis(spec) == "ep" else (tp_rank, tp)
            key = weights.find(source, tied) if weights is not None else None
            if _lifted(inits.get(name)):  # no model, nor checkpoint of it, holds a constant of its forward
                value = initial_value(inits[name], source, tuple(t.shape), spec, rank, size, seed)
            elif full_state is not None:
                value = _from_state(full_state, source, spec, rank, size)
            elif key is not None:
                value = weights.read(key, piece_blocks(weights.shape(key), spec, rank, size), tuple(t.shape), t.dtype)
            elif name in inits:
                value = initial_value(inits[name], source, tuple(t.shape), spec, rank, size, seed)
            else:
                raise ValueError(f"{name} has no initialisation in {Path(stage_file.__file__).name}; recompile")
            if tuple(value.shape) != tuple(t.shape):
                raise ValueError(
                    f"{source}: the model's piece is {tuple(value.shape)}, the program's {tuple(t.shape)}: "
                    "the model changed since this program was compiled; recompile with autoshard compile"
                )
            t.copy_(value)
    return stage


def _check_weights(stage: nn.Module, stage_file, weights: Weights, tied: Sequence[Tied], tp: int, ep: int) -> None:
    """Before anything is read: every parameter of ``stage`` is in the checkpoint (buffers may
    be replayed), at the full shape the program was compiled for."""
    shards, origin = stage_file.SHARDS, stage_file.ORIGIN
    params = {name for name, _ in stage.named_parameters()}
    missing = []
    for name, t in [*stage.named_parameters(), *stage.named_buffers()]:
        source = origin.get(name, name)
        key = weights.find(source, tied)
        if key is None:
            if name in params:
                missing.append(source.removeprefix("model."))
            continue
        spec = shards.get(source)
        expected = full_shape(tuple(t.shape), spec, ep if piece_axis(spec) == "ep" else tp)
        if weights.shape(key) != expected:
            raise ValueError(
                f"{source}: {weights.path} holds {key} as {weights.shape(key)}, the program's full shape is "
                f"{expected}: pass a checkpoint of the model this program was compiled from"
            )
    if missing:
        raise ValueError(
            f"{weights.path} has no {missing[0]} ({len(missing)} of {Path(stage_file.__file__).name}'s "
            f"{len(params)} parameters are missing): pass a checkpoint of the model this program was compiled "
            "from, its keys the model's state-dict keys"
        )


def full_shape(shape: tuple[int, ...], spec: tuple | None, size: int) -> tuple[int, ...]:
    """The single-device shape of a tensor whose piece, split ``size`` ways by ``spec``, is ``shape``."""
    if spec is None:
        return tuple(shape)
    out = list(shape)
    out[spec[0]] *= size
    return tuple(out)


def piece_axis(spec: tuple | None) -> str | None:
    """The group a ``SHARDS`` entry spreads its pieces over: "tp" (the default), "ep", or None
    for a parameter every rank holds whole."""
    if spec is None:
        return None
    return spec[4] if len(spec) > 4 else "tp"


def _from_state(full_state: dict, source: str, spec: tuple | None, tp_rank: int, tp: int) -> torch.Tensor:
    if source not in full_state:
        raise ValueError(
            f"the model has no parameter {source}: it changed since this program was compiled; "
            "recompile with autoshard compile"
        )
    value = full_state[source]
    return value if spec is None else slice_full(value, spec, tp_rank, tp)


def initial_value(entry, source: str, shape: tuple, spec: tuple | None, tp_rank: int, tp: int, seed: int):
    """This rank's initial value of a parameter from its ``INIT`` entry: a program that says
    ``"shape"`` runs at the local ``shape`` with a generator seeded by (seed, name, TP rank where
    split); any other builds the full tensor with a generator seeded by (seed, name), the same on
    every TP rank, and keeps this rank's slice. Replays run on CPU, so a GPU run starts where a CPU
    run does."""
    steps, key = (entry["steps"], entry["tied_to"]) if isinstance(entry, dict) else (entry, source)
    at_shard = at_shard_shape(steps)
    split = spec is not None and at_shard
    gen = torch.Generator(device="cpu").manual_seed(
        seed * 1_000_003 + zlib.crc32(key.encode()) + (tp_rank + 1) * 7919 * split
    )
    value = replay(steps, shape, gen)
    if spec is not None and not at_shard:
        value = slice_full(value, spec, tp_rank, tp)
    return value


def _lifted(entry) -> bool:
    """Whether an ``INIT`` entry is the captured value of a constant lifted from the model's
    forward (``autoshard.capture.init.lifted``: one ``"lifted"`` step)."""
    steps = entry["steps"] if isinstance(entry, dict) else entry
    return bool(steps) and steps[0][0] == "lifted"


def replay(steps: list, shape: tuple, generator: torch.Generator) -> torch.Tensor:
    """Run a recorded initialisation program on CPU (``autoshard.capture.init`` writes them):
    steps ``(op, *args[, kwargs])``, ``"%k"`` step k's result, ``"shape"`` the local shape,
    ``"torch.<dtype>"`` a dtype; random ops draw from ``generator``. Returns the last result."""
    results: list = []
    with torch.device("cpu"):
        for op, *args in steps:
            kwargs = args.pop() if args and isinstance(args[-1], dict) else {}
            fn, takes_generator = _replay_op(op)
            args = [_argument(a, results, shape) for a in args]
            kwargs = {k: _argument(v, results, shape) for k, v in kwargs.items()}
            if takes_generator:
                kwargs["generator"] = generator
            with torch.random.fork_rng(devices=[]):  # an nn.init function may also draw from the global generator
                torch.manual_seed(generator.initial_seed())
                results.append(fn(*args, **kwargs))
    return results[-1]


def _replay_op(op: str):
    """The callable for a step's op, and whether it draws random numbers."""
    if op in ("tensor", "lifted"):
        return torch.tensor, False
    if op.startswith("nn.init."):
        fn = getattr(nn.init, op.removeprefix("nn.init."))
        return fn, "generator" in inspect.signature(fn).parameters
    packet, _, overload = op.partition(".")
    fn = getattr(getattr(torch.ops.aten, packet), overload or "default")
    return fn, any(a.name == "generator" for a in fn._schema.arguments)


def _argument(value, results: list, shape: tuple):
    if value == "shape":
        return list(shape)
    if isinstance(value, str) and value.startswith("%"):
        index, _, part = value[1:].partition(".")
        out = results[int(index)]
        return out[int(part)] if part else out
    if isinstance(value, str) and value.startswith("torch."):
        return getattr(torch, value.removeprefix("torch."))
    if isinstance(value, (list, tuple)):
        return [_argument(v, results, shape) for v in value]
    return value


def at_shard_shape(steps) -> bool:
    """Whether an ``INIT`` program runs at a shard's own shape: it says ``"shape"`` somewhere."""
    return any(a == "shape" for a in _leaves(steps))


def _leaves(value):
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    else:
        yield value
