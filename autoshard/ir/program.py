"""The Program: what ``program.json`` holds beside the stage files, the facts of one emitted
program that the plan does not say (its pipeline chunks and the stage files building them, the
loss, tied parameters, MoE routing, the FP8 matmuls, how to rebuild the single-device model).
``autoshard.codegen`` writes it from a ``Program`` (``to_dict``); the runtime, ``autoshard
verify`` and the at-scale check read it back (``Program.load``), so that a malformed or foreign
file is one line naming the file, the key and the fix, never a ``KeyError`` in the middle of a
run."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from autoshard.errors import ProgramError


@dataclass(frozen=True)
class Chunk:
    """One pipeline chunk (virtual stage) of the program."""

    file: str  # its stage file, beside program.json (``stage0.py``)
    class_name: str  # the ``nn.Module`` class in that file that builds it (the JSON key ``class``)
    layers: tuple[int, int]  # [first, last) of the repeated layers it holds
    rank: int  # the pipeline rank holding it (the schedule's chunk-to-rank map)


@dataclass(frozen=True)
class Loss:
    """The loss module, run as ``loss_fn(output, target)`` on the last chunk's output."""

    file: str  # its file, beside program.json (``loss.py``)
    class_name: str  # the ``nn.Module`` class in that file (the JSON key ``class``)


@dataclass(frozen=True)
class Tied:
    """One parameter with several names, or held as a copy by several chunks (the token embedding
    tied to the output head): one parameter whose copies' gradients are summed."""

    names: tuple[str, ...]  # the name the chunks hold it by first, then the model's other names for it
    chunks: tuple[int, ...]  # the pipeline chunks holding a copy


@dataclass(frozen=True)
class Routing:
    """One MoE layer's routing: what balancing updates and what verification replays."""

    experts: int  # routed experts in the layer
    top_k: int  # experts each token is sent to
    bias: str | None  # the routing-bias buffer (DeepSeek-V3's, nudged toward balance after each step); None: none
    router: str  # the module path where the top-k choice is made (verification counts its loads there)


@dataclass(frozen=True)
class Fp8:
    """The program's FP8 matmuls."""

    kinds: tuple[str, ...]  # the matmul kinds running in FP8 (``autoshard.ir.MATMUL_KINDS``)
    params: tuple[str, ...]  # the single-device model's weights they multiply by (verification's reference)


@dataclass(frozen=True)
class Program:
    """``program.json``; its keys in the order of these fields."""

    plan_sha256: str  # sha256 of plan.json's bytes as emitted: the program refuses an edited plan
    # how the program rebuilds the single-device model (``--init-from-model``, ``autoshard verify``):
    # ``autoshard.runtime.rebuild.Recipe``'s dict (function, args, kwargs, config, loss)
    rebuild: dict
    vocab: int  # vocabulary size: synthetic tokens are drawn below it, token files checked against it
    chunks: tuple[Chunk, ...]  # the pipeline chunks, in pipeline order (chunk c is ``chunks[c]``)
    loss: Loss
    target: str | None  # the model input the loss reads as its target (the token ids)
    tied: tuple[Tied, ...]  # parameters held by several chunks or under several names
    routing: dict[str, Routing]  # MoE layer (its experts' module path) -> its routing; empty: no MoE
    fp8: Fp8
    state_dict_keys: tuple[str, ...]  # the single-device state dict's names (``autoshard export`` writes these)
    peak_flops: float | None  # FLOP/s per GPU at the plan's compute precision, for the step log's MFU; None: unknown

    # -- serialisation ---------------------------------------------------------------------

    def to_dict(self) -> dict:
        """The JSON object, keys in field order (``program.json`` is ``json.dumps`` of it)."""
        return {
            "plan_sha256": self.plan_sha256,
            "rebuild": self.rebuild,
            "vocab": self.vocab,
            "chunks": [
                {"file": c.file, "class": c.class_name, "layers": list(c.layers), "rank": c.rank} for c in self.chunks
            ],
            "loss": {"file": self.loss.file, "class": self.loss.class_name},
            "target": self.target,
            "tied": [{"names": list(t.names), "chunks": list(t.chunks)} for t in self.tied],
            "routing": {
                k: {"experts": r.experts, "top_k": r.top_k, "bias": r.bias, "router": r.router}
                for k, r in self.routing.items()
            },
            "fp8": {"kinds": list(self.fp8.kinds), "params": list(self.fp8.params)},
            "state_dict_keys": list(self.state_dict_keys),
            "peak_flops": self.peak_flops,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_dict(cls, data: object, source: str = "program.json", error: type[Exception] = ProgramError) -> Program:
        """The program ``data`` (``program.json`` parsed) describes. A missing, unknown or
        ill-typed key raises ``error`` (default: the program's own one-line exit; the CLI's
        commands pass ``AutoshardError``) naming ``source``, the key, and that recompiling writes
        a good file."""
        read = _Reader(source, error)
        top = read.object(data, "", "program")
        read.object(top["rebuild"], "rebuild.", "rebuild")
        chunks = [read.object(c, f"chunks[{i}].", "chunk") for i, c in enumerate(top["chunks"])]
        loss = read.object(top["loss"], "loss.", "loss")
        tied = [read.object(t, f"tied[{i}].", "tied") for i, t in enumerate(top["tied"])]
        routing = {k: read.object(r, f"routing.{k}.", "routing") for k, r in top["routing"].items()}
        fp8 = read.object(top["fp8"], "fp8.", "fp8")
        return cls(
            plan_sha256=top["plan_sha256"],
            rebuild=top["rebuild"],
            vocab=top["vocab"],
            chunks=tuple(Chunk(c["file"], c["class"], tuple(c["layers"]), c["rank"]) for c in chunks),
            loss=Loss(loss["file"], loss["class"]),
            target=top["target"],
            tied=tuple(Tied(tuple(t["names"]), tuple(t["chunks"])) for t in tied),
            routing={k: Routing(r["experts"], r["top_k"], r["bias"], r["router"]) for k, r in routing.items()},
            fp8=Fp8(tuple(fp8["kinds"]), tuple(fp8["params"])),
            state_dict_keys=tuple(top["state_dict_keys"]),
            peak_flops=top["peak_flops"],
        )

    @classmethod
    def load(cls, path: str | Path, error: type[Exception] = ProgramError) -> Program:
        """Read ``path`` (``program.json``, or the directory holding it); ``error`` as in ``from_dict``."""
        path = Path(path)
        if path.is_dir():
            path = path / "program.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise error(f"{path} is missing; recompile with autoshard compile ... -o {path.parent}") from None
        except (OSError, ValueError) as e:
            raise error(
                f"{path} is not readable JSON ({e}); recompile with autoshard compile ... -o {path.parent}"
            ) from None
        return cls.from_dict(data, str(path), error)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _is_str(v) -> bool:
    return isinstance(v, str)


def _is_dict(v) -> bool:
    return isinstance(v, dict)


def _is_list(v) -> bool:
    return isinstance(v, list)


def _list_of(check: Callable[[object], bool], non_empty: bool = False) -> Callable[[object], bool]:
    return lambda v: _is_list(v) and all(check(x) for x in v) and (len(v) > 0 or not non_empty)


def _or_none(check: Callable[[object], bool]) -> Callable[[object], bool]:
    return lambda v: v is None or check(v)


def _positive(v) -> bool:
    return _is_int(v) and v > 0


# Each JSON object of program.json: its keys, in the file's order, and what each value must be (in
# words, and the check). The nested objects are read with their own rows.
SCHEMA: dict[str, dict[str, tuple[str, Callable[[object], bool]]]] = {
    "program": {
        "plan_sha256": ("a text", _is_str),
        "rebuild": ("an object", _is_dict),
        "vocab": ("a positive integer", _positive),
        "chunks": ("a non-empty list", lambda v: _is_list(v) and len(v) > 0),
        "loss": ("an object", _is_dict),
        "target": ("a text or null", _or_none(_is_str)),
        "tied": ("a list", _is_list),
        "routing": ("an object", _is_dict),
        "fp8": ("an object", _is_dict),
        "state_dict_keys": ("a list of texts", _list_of(_is_str)),
        "peak_flops": ("a number or null", _or_none(_is_number)),
    },
    "rebuild": {
        "function": ("a text", _is_str),
        "args": ("a list", _is_list),
        "kwargs": ("an object", _is_dict),
        "config": ("an object or null", _or_none(_is_dict)),
        "loss": ("a text or null", _or_none(_is_str)),
    },
    "chunk": {
        "file": ("a text", _is_str),
        "class": ("a text", _is_str),
        "layers": ("[first, last]", lambda v: _list_of(_is_int)(v) and len(v) == 2),
        "rank": ("an integer", _is_int),
    },
    "loss": {"file": ("a text", _is_str), "class": ("a text", _is_str)},
    "tied": {
        "names": ("a non-empty list of texts", _list_of(_is_str, non_empty=True)),
        "chunks": ("a non-empty list of integers", _list_of(_is_int, non_empty=True)),
    },
    "routing": {
        "experts": ("a positive integer", _positive),
        "top_k": ("a positive integer", _positive),
        "bias": ("a text or null", _or_none(_is_str)),
        "router": ("a text", _is_str),
    },
    "fp8": {"kinds": ("a list of texts", _list_of(_is_str)), "params": ("a list of texts", _list_of(_is_str))},
}


@dataclass
class _Reader:
    """Checks JSON objects against their ``SCHEMA`` rows; every error names ``source`` and the key."""

    source: str
    error: type[Exception]

    def fail(self, what: str) -> NoReturn:
        where = Path(self.source).parent
        out = "OUT" if str(where) == "." else where
        raise self.error(f"{self.source}: {what}; recompile with autoshard compile ... -o {out}")

    def object(self, data: object, path: str, kind: str) -> dict:
        """``data``, checked to hold exactly the keys of ``SCHEMA[kind]``, each value of its kind;
        ``path`` names ``data`` in the messages (``chunks[0].``; empty at the top)."""
        rows = SCHEMA[kind]
        if not isinstance(data, dict):
            self.fail(f"{path.rstrip('.') or 'the file'} is not a JSON object")
        missing = [k for k in rows if k not in data]
        if missing:
            self.fail(f"missing key {path}{missing[0]}")
        unknown = [k for k in data if k not in rows]
        if unknown:
            self.fail(f"unknown key {path}{unknown[0]} (written by another autoshard version?)")
        for key, (what, check) in rows.items():
            if not check(data[key]):
                self.fail(f"{path}{key} is {_short(data[key])}, expected {what}")
        return data


def _short(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."
