"""Python source for one rewritten graph: a module file a person can read and the training program
imports. The forward is fx's generated code, with the decision behind each rewritten line as a
comment; ``__init__`` builds the submodules at their local (sharded) shapes; ``SHARDS`` says how
each parameter is cut out of the single-device model's."""

from __future__ import annotations

import json
import math
import re
import types

import torch
from torch import fx, nn

import autoshard.runtime as runtime
from autoshard.errors import AutoshardError
from autoshard.runtime.checkpoint import Checkpoint

_RUNTIME_EXPORTS = {getattr(runtime, name): name for name in runtime.__all__}


def _imports(globals_: dict, body: str) -> tuple[list[str], dict[str, str]]:
    """Import lines for the names fx's code uses, and renames to apply to the code."""
    lines, renames = [], {}
    used = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", body))
    for name, obj in sorted(globals_.items()):
        if name not in used or name == "torch" or obj is torch or getattr(obj, "__module__", None) == "builtins":
            continue
        if obj in _RUNTIME_EXPORTS if _hashable(obj) else False:
            renames[name] = f"rt.{_RUNTIME_EXPORTS[obj]}"
        elif isinstance(obj, types.ModuleType):
            lines.append(f"import {obj.__name__}" + (f" as {name}" if name != obj.__name__ else ""))
        elif isinstance(obj, float) and (math.isinf(obj) or math.isnan(obj)):
            lines.append(f'{name} = float("{obj}")')
        elif callable(obj) and getattr(obj, "__module__", None) and "." not in obj.__qualname__:
            module = obj.__module__
            lines.append(
                f"from {module} import {obj.__qualname__}" + (f" as {name}" if name != obj.__qualname__ else "")
            )
        else:
            raise AutoshardError(f"cannot emit a reference to {obj!r} ({name}) in generated code")
    return lines, renames


def _hashable(obj) -> bool:
    try:
        hash(obj)
        return True
    except TypeError:
        return False


_CONSTRUCTORS = {
    nn.Linear: lambda m: f"{m.in_features}, {m.out_features}, bias={m.bias is not None}",
    nn.Embedding: lambda m: f"{m.num_embeddings}, {m.embedding_dim}",
    nn.LayerNorm: lambda m: (
        f"{tuple(m.normalized_shape)}, eps={m.eps}, elementwise_affine={m.elementwise_affine}, "
        f"bias={getattr(m, 'bias', None) is not None}"
    ),
    nn.RMSNorm: lambda m: f"{tuple(m.normalized_shape)}, eps={m.eps}, elementwise_affine={m.elementwise_affine}",
}


def _constructor(target: str, module: nn.Module) -> str:
    kind = type(module)
    if kind in _CONSTRUCTORS:
        args = _CONSTRUCTORS[kind](module)
    elif kind.__module__.startswith("torch.nn") and not any(True for _ in module.parameters()):
        args = module.extra_repr()
    else:
        raise AutoshardError(
            f"cannot emit module {target} of type {kind.__name__}: only torch.nn layers are rebuilt in generated code"
        )
    text = f"nn.{kind.__name__}({args})"
    with torch.device("meta"):
        rebuilt = eval(text, {"nn": nn})  # noqa: S307 - our own constructor text, checked below
    want = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in rebuilt.state_dict().items()}
    if want != got:
        raise AutoshardError(f"cannot rebuild {target} ({kind.__name__}): {got} != {want}")
    return text


def stage_source(
    gm: fx.GraphModule,
    class_name: str,
    doc: str,
    notes: dict[str, str] | None = None,
    shards: dict | None = None,
    origin: dict[str, str] | None = None,
    partial_grads: list[str] | None = None,
    inits: dict | None = None,
    experts: list[str] | None = None,
    routing: dict | None = None,
) -> str:
    """The module file for ``gm``: ``class_name(nn.Module)`` plus ``SHARDS``, ``ORIGIN``,
    ``PARTIAL_GRADS``, ``EXPERTS``, ``ROUTING`` and ``INIT`` (``inits``: stage name ->
    ``autoshard.capture.init.Init``)."""
    notes = notes or {}

    graphs = [("forward", gm)]
    for node in gm.graph.nodes:
        if node.op == "call_module" and isinstance(gm.get_submodule(node.target), Checkpoint):
            graphs.append((f"layer_{node.target.rsplit('_', 1)[-1]}", gm.get_submodule(node.target).fn))
    methods, imports = [], []
    for method, g in graphs:
        code = g.graph.python_code(root_module="self")
        body = code.src
        more, renames = _imports(code.globals, body)
        imports += [x for x in more if x not in imports]
        for old, new in renames.items():
            body = body.replace(old, new)
        body = body.replace("def forward(self", f"def {method}(self", 1)
        lines = []
        for line in body.strip("\n").splitlines():
            name = line.strip().split(" = ", 1)[0] if " = " in line else None
            if name in notes:
                line = f"{line}  # {notes[name]}"
            lines.append(f"    {line}".rstrip())
        methods.append("\n".join(lines))
    forward = "\n\n".join(methods)
    init = []
    built: set[str] = set()
    for _, g in graphs:
        for node in g.graph.nodes:
            if node.op != "call_module" or node.target in built:
                continue
            built.add(node.target)
            module = g.get_submodule(node.target)
            if isinstance(module, Checkpoint):
                layer = node.target.rsplit("_", 1)[-1]
                text = f"rt.Checkpoint(self.layer_{layer}, recompute={module.recompute}"
                text += f", fp8_saved={module.fp8_saved})" if module.fp8_saved else ")"
            else:
                text = _constructor(node.target, module)
            init.append(f'        rt.put_module(self, "{node.target}", {text})')
    for node in [n for _, g in graphs for n in g.graph.nodes]:
        if node.op != "get_attr":
            continue
        owner, _, _ = node.target.rpartition(".")
        if owner in built:
            continue
        if node.target in built:
            continue
        built.add(node.target)
        root = node.graph.owning_module
        value = _attr(root, node.target)
        owned = owner and isinstance(_attr(root, owner), nn.Module) and type(_attr(root, owner)) in _CONSTRUCTORS
        if owned:
            built.add(owner)
            init.append(f'        rt.put_module(self, "{owner}", {_constructor(owner, _attr(root, owner))})')
        elif isinstance(value, nn.Parameter):
            empty = f"torch.empty({tuple(value.shape)}, dtype={value.dtype})"
            init.append(f'        rt.put_parameter(self, "{node.target}", nn.Parameter({empty}))')
        elif isinstance(value, torch.Tensor):
            init.append(
                f'        rt.put_buffer(self, "{node.target}", torch.empty({tuple(value.shape)}, dtype={value.dtype}))'
            )
        else:
            raise AutoshardError(f"cannot emit attribute {node.target} of type {type(value).__name__}")
    names = {k for _, g in graphs for k, _ in [*g.named_parameters(), *g.named_buffers()]}
    shard_lines = [
        f'    "{k}": {_shard_tuple(v)},'
        for k, v in sorted((shards or {}).items())
        if k in names or k in (origin or {}).values()
    ]
    expert_lines = [f'    "{k}",' for k in sorted(experts or []) if k in names]
    routing_lines = [
        f'    "{k}": {v!r},' for k, v in sorted((routing or {}).items()) if any(_routed_here(k, g) for _, g in graphs)
    ]
    origin_lines = [f'    "{k}": "{v}",' for k, v in sorted((origin or {}).items()) if k in names]
    partial_lines = [f'    "{k}",' for k in sorted(partial_grads or []) if k in names]
    init_lines = _init_lines(sorted(names), inits)
    return "\n".join(
        [
            f'"""{doc}\n\nGenerated by autoshard from plan.json: change the plan and recompile rather than edit '
            'this file."""',
            "",
            "import torch",
            "from torch import nn",
            "",
            "import autoshard.runtime as rt",
            *imports,
            "",
            "# parameter -> (dimension, that dimension viewed as factors, factor split over the TP ranks"
            "[, or the unequal parts laid end to end along it, each split][, the group split over: ep])",
            "SHARDS = {",
            *shard_lines,
            "}",
            "# parameter -> its name in the single-device model, where the two differ",
            "ORIGIN = {",
            *origin_lines,
            "}",
            "# parameters used on sequence slices: their gradients are summed over the TP group",
            "PARTIAL_GRADS = [",
            *partial_lines,
            "]",
            "# stacked expert weights: this rank holds its EP rank's experts; gradients summed over the",
            "# expert-data-parallel ranks (those holding the same experts)",
            "EXPERTS = [",
            *expert_lines,
            "]",
            "# MoE layer -> its experts, top-k and routing bias (a buffer updated after each step from the",
            "# layer's expert loads, or None): what the program balances and logs",
            "ROUTING = {",
            *routing_lines,
            "}",
            "# parameter -> the ops the model's own initialisation applies to it, replayed when the program",
            '# starts without --init-from-model: "%k" is the result of step k, the last one the value; a',
            '# program that says "shape" runs at the shape of this rank, any other builds the full tensor,',
            "# which SHARDS then cuts; random ops draw from a generator seeded by the name (tied_to if tied)",
            "INIT = {",
            *init_lines,
            "}",
            "",
            "",
            f"class {class_name}(nn.Module):",
            "    def __init__(self):",
            "        super().__init__()",
            *(init or ["        pass"]),
            "",
            forward,
            "",
        ]
    )


def _init_lines(names: list[str], inits: dict | None) -> list[str]:
    """``INIT``'s entries for the stage's tensors ``names``: a clear error for one whose
    initialisation was not recorded or cannot be replayed."""
    if names and inits is None:
        raise AutoshardError(
            "the model's initialisation was not recorded: build it with autoshard.capture.record_build "
            "(or run the program with --init-from-model)"
        )
    lines = []
    for name in names:
        if name not in inits:
            raise AutoshardError(f"no recorded initialisation for {name}: the model's construction did not create it")
        init = inits[name]
        steps = _literal(init.require(name))
        value = steps if init.tied_to is None else f'{{"tied_to": "{init.tied_to}", "steps": {steps}}}'
        lines.append(f'    "{name}": {value},')
    return lines


def _literal(value) -> str:
    """``value`` (steps of lists, tuples, dicts, numbers, strings) as Python source."""
    if isinstance(value, float) and not math.isfinite(value):
        return f'float("{value}")'
    if isinstance(value, tuple):
        return "(" + ", ".join(_literal(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    if isinstance(value, list):
        return "[" + ", ".join(_literal(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{_literal(k)}: {_literal(v)}" for k, v in value.items()) + "}"
    return json.dumps(value) if isinstance(value, str) else repr(value)


def _attr(gm: nn.Module, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _shard_tuple(v) -> str:
    """A ``SHARDS`` entry: (dim, factors, index[, parts][, axis]); the axis only where it is not tp."""
    axis = getattr(v, "axis", "tp")
    parts = tuple(v.parts) if v.parts or axis != "tp" else None
    tail = (f", {parts}" if parts is not None else "") + (f", {axis!r}" if axis != "tp" else "")
    return f"({v.dim}, {tuple(v.factors)}, {v.index}{tail})"


def _routed_here(key: str, gm) -> bool:
    """A MoE layer's routing entry belongs to the chunk that counts its loads (in ``gm``, one of
    the chunk's graphs: its own or a checkpointed layer's, where a recomputed layer counts them;
    reading the chunk's graph alone left every recomputed MoE layer out, its routing bias never
    updated nor saved)."""
    return any(n.op == "call_function" and n.args[2:3] == (key,) for n in gm.graph.nodes)
