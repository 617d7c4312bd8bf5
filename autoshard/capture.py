"""Capture: trace a model, built on the meta device, into the annotated fx graph (``autoshard.ir``).

``torch.fx.symbolic_trace`` first (readable graphs, modules kept as calls); where that fails
(HuggingFace models), ``torch.export.export(strict=False)``. The traced program is the *training*
forward: the model, then its loss (causal-LM cross-entropy on the shifted inputs unless the model
file defines ``loss``), so that the output head and the loss are costed and later placed like any
other node.

Shapes are propagated with fake tensors whose batch and sequence sizes are symbols, so every
shape is a sympy expression in ``b`` and ``s``. Repeated layers are recognised (same code, same
parameter shapes, same input shapes) and propagated once: the other copies reuse the template's
results, which is what makes a 126-layer model quick to capture.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import logging
import os
import re
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass, field

import sympy
import torch
import torch.nn.functional as F
from torch import fx, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from autoshard import modelfile
from autoshard.cost_models import ops
from autoshard.errors import AutoshardError
from autoshard.ir import B, S

BATCH_HINT = 2


@dataclass
class LayerKind:
    """Layers that are copies of one another: same code, parameter and input shapes."""

    id: int
    layers: list[int]

    @property
    def template(self) -> int:
        return self.layers[0]

    @property
    def count(self) -> int:
        return len(self.layers)


@dataclass
class Captured:
    """The traced training forward and what capture learnt about its structure."""

    graph_module: fx.GraphModule
    model: nn.Module
    tracer: str  # "symbolic_trace" or "export"
    stack_path: str | None  # module path of the repeated-layer container ("layers")
    num_layers: int
    kinds: list[LayerKind]
    input_names: list[str]
    source: str | None = None
    layer_nodes: dict[int, list[fx.Node]] = field(default_factory=dict)

    def kind_of(self, layer: int) -> LayerKind:
        return next(k for k in self.kinds if layer in k.layers)

    def region_nodes(self, region: str) -> list[fx.Node]:
        return [n for n in self.graph_module.graph.nodes if n.meta.get("region") == region]

    @property
    def parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def causal_lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; the last position has no target."""
    labels = torch.cat([tokens[:, 1:], tokens.new_full((tokens.size(0), 1), -100)], dim=1)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=-100)


class TrainingForward(nn.Module):
    """``loss(model(*inputs), *inputs)``: what autoshard traces. Use ``TrainingForward.wrap``,
    which gives ``forward`` the model's own argument names (fx cannot trace ``*args``)."""

    def __init__(self, model: nn.Module, loss=None, model_kwargs=None):
        super().__init__()
        self.model = model
        self.loss_fn = loss
        self.model_kwargs = dict(model_kwargs or {})

    @classmethod
    def wrap(cls, model: nn.Module, input_names: list[str], loss=None, model_kwargs=None) -> TrainingForward:
        args = ", ".join(input_names)
        namespace: dict = {}
        exec(f"def forward(self, {args}):\n    return self.train_step({args})\n", namespace)
        subclass = type(cls.__name__, (cls,), {"forward": namespace["forward"]})
        return subclass(model, loss, model_kwargs)

    def train_step(self, *inputs):
        out = self.model(*inputs, **self.model_kwargs)
        if isinstance(out, dict):
            out = out["logits"]
        elif isinstance(out, (tuple, list)):
            out = out[0]
        if self.loss_fn is not None:
            return self.loss_fn(out, *inputs)
        return causal_lm_loss(out, inputs[0])


# ---------------------------------------------------------------------------------------------


def capture_file(spec: str, config: str | None, seq: int, batch: int = BATCH_HINT) -> Captured:
    """Load ``model.py[:builder]``, build ``config`` on the meta device and capture it."""
    mf = modelfile.load(spec)
    model = mf.build(config)
    inputs = mf.sample_inputs(config, batch, seq)
    return capture(model, inputs, loss=mf.loss, source=str(mf.path))


def capture(
    model: nn.Module,
    inputs: tuple | None = None,
    *,
    seq: int = 128,
    loss=None,
    source: str | None = None,
) -> Captured:
    """Trace ``model`` (live or on meta) with ``inputs`` (default: token ids of shape (2, seq))."""
    if inputs is None:
        inputs = (torch.zeros(BATCH_HINT, seq, dtype=torch.long, device="meta"),)
    _check_inputs(inputs)
    names = _input_names(model, len(inputs))
    kwargs = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    wrapper = TrainingForward.wrap(model, names, loss, kwargs)
    wrapper.train()
    with _quiet():
        try:
            gm, tracer = _symbolic_trace(wrapper), "symbolic_trace"
        except Exception as fx_error:
            try:
                gm, tracer = _export(wrapper, inputs), "export"
            except Exception as export_error:
                raise AutoshardError(_trace_failure(fx_error, export_error, source)) from export_error
    stack = _layer_stack(model)
    _annotate_modules(gm, model, stack)
    layer_nodes = _layer_nodes(gm)
    if tracer == "symbolic_trace":
        keys = _propagate(gm, inputs, layer_nodes, model)
    else:
        keys = _read_export_shapes(gm, layer_nodes)
    _annotate_ops(gm)
    kinds = _group_kinds(keys)
    return Captured(
        graph_module=gm,
        model=model,
        tracer=tracer,
        stack_path=stack[0] if stack else None,
        num_layers=len(stack[1]) if stack else 0,
        kinds=kinds,
        input_names=names,
        source=source,
        layer_nodes=layer_nodes,
    )


@contextlib.contextmanager
def _quiet():
    """torch.export logs graphs and warnings while it fails; the user gets one error line."""
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(logging.NOTSET)


def _check_inputs(inputs: tuple) -> None:
    for t in inputs:
        if t.dim() < 2:
            raise AutoshardError(
                f"model input of shape {tuple(t.shape)} has no (batch, seq) dims; "
                "sample_inputs must return tensors shaped (batch, seq, ...)"
            )


def _input_names(model: nn.Module, count: int) -> list[str]:
    params = [
        p.name
        for p in inspect.signature(model.forward).parameters.values()
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    names = params[:count]
    names += [f"input_{i}" for i in range(len(names), count)]
    return [n if n.isidentifier() and n != "self" else f"input_{i}" for i, n in enumerate(names)]


class _Tracer(fx.Tracer):
    """fx's tracer, recording on each node the innermost frame of the user's code (much cheaper
    than ``record_stack_traces``, which formats a whole traceback per node)."""

    def trace(self, root, concrete_args=None):
        self._param_names: dict[int, str] | None = None
        return super().trace(root, concrete_args)

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        # fx finds a parameter's name by scanning root.named_parameters() on every access, which
        # is quadratic in the parameter count (seconds for a 61-layer model); look it up instead
        if isinstance(attr_val, torch.nn.Parameter):
            if self._param_names is None:
                self._param_names = {}
                for name, param in self.root.named_parameters():
                    self._param_names.setdefault(id(param), name)
            name = self._param_names.get(id(attr_val))
            if name is not None:
                if name not in parameter_proxy_cache:
                    parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
                return parameter_proxy_cache[name]
        return super().getattr(attr, attr_val, parameter_proxy_cache)

    def create_node(self, *args, **kwargs):
        node = super().create_node(*args, **kwargs)
        frame = sys._getframe(1)
        while frame is not None and modelfile._library_file(frame.f_code.co_filename):
            frame = frame.f_back
        if frame is not None:
            node.meta["source"] = f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"
        return node


def _symbolic_trace(wrapper: nn.Module) -> fx.GraphModule:
    tracer = _Tracer()
    graph = tracer.trace(wrapper)
    # fx's lazy GraphModule writes and compiles the Python code of the graph only when someone
    # reads ``.code`` or calls it; planning does neither (a 61-layer model's code takes 0.5 s)
    with _use_lazy_graph_module(True):
        return _make_graph_module(tracer.root, graph, "TrainingForward")


def _export(wrapper: nn.Module, inputs: tuple) -> fx.GraphModule:
    from torch.export import Dim

    batch, seq = Dim("batch", min=2), Dim("seq", min=2)
    dims = tuple({0: batch, 1: seq} for _ in inputs)
    try:
        program = torch.export.export(wrapper, inputs, strict=False, dynamic_shapes=dims)
    except Exception:
        auto = tuple({0: Dim.AUTO, 1: Dim.AUTO} for _ in inputs)
        program = torch.export.export(wrapper, inputs, strict=False, dynamic_shapes=auto)
    return program.module()


def _trace_failure(fx_error: Exception, export_error: Exception, source: str | None) -> str:
    where = modelfile.user_frame(export_error, source) if source else modelfile.user_frame(export_error)
    if where == "unknown location":
        where = modelfile.user_frame(fx_error, source) if source else modelfile.user_frame(fx_error)
    reason = modelfile._first_line(export_error).split("  (")[0].rstrip(". ")
    return (
        f"cannot trace the model at {where}: {reason} "
        f"(torch.fx: {modelfile._first_line(fx_error)}); make that code shape-static or "
        "data-independent"
    )


# ---------------------------------------------------------------------------------------------
# Structure: module paths, the layer stack, regions


def _layer_stack(model: nn.Module) -> tuple[str, list[str]] | None:
    """The ModuleList/Sequential holding most parameters, with at least two children."""
    best = None
    for path, mod in model.named_modules():
        if isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) >= 2:
            size = sum(p.numel() for p in mod.parameters())
            if best is None or size > best[0]:
                best = (size, path, [name for name, _ in mod.named_children()])
    return (best[1], best[2]) if best else None


_WRAPPER_PREFIX = "model."


def _strip(path: str) -> str:
    if path == "model":
        return ""
    return path[len(_WRAPPER_PREFIX) :] if path.startswith(_WRAPPER_PREFIX) else path


def _annotate_modules(gm: fx.GraphModule, model: nn.Module, stack) -> None:
    """module_path, module_type, layer, region and source on every node."""
    prefix = (stack[0] + ".") if stack and stack[0] else ""
    index = {name: i for i, name in enumerate(stack[1])} if stack else {}
    layer_re = re.compile(rf"^{re.escape(prefix)}([^.]+)(\.|$)")
    nodes = list(gm.graph.nodes)
    for n in nodes:
        if n.op == "get_attr":
            path = _strip(n.target.rsplit(".", 1)[0]) if "." in n.target else ""
            mtype = type(_get_module(model, path)).__name__ if path else type(model).__name__
        else:
            stack_meta = n.meta.get("nn_module_stack") or {}
            entries = [v for v in stack_meta.values() if isinstance(v, tuple) and not str(v[0]).startswith("_")]
            path = _strip(str(entries[-1][0])) if entries else ""
            raw_type = entries[-1][1] if entries else None
            mtype = (
                raw_type.__name__
                if isinstance(raw_type, type)
                else str(raw_type).rsplit(".", 1)[-1]
                if raw_type
                else ""
            )
        if n.op == "call_module":
            path = _strip(n.target)
            mtype = type(gm.get_submodule(n.target)).__name__
        n.meta["module_path"] = path
        n.meta["module_type"] = mtype
        m = layer_re.match(path) if stack else None
        n.meta["layer"] = index.get(m.group(1)) if m else None
        if "source" not in n.meta:
            n.meta["source"] = _source(n.meta.get("stack_trace"))
    first = next((i for i, n in enumerate(nodes) if n.meta["layer"] is not None and n.op != "get_attr"), None)
    last = max((i for i, n in enumerate(nodes) if n.meta["layer"] is not None and n.op != "get_attr"), default=None)
    current = None
    for i, n in enumerate(nodes):
        if n.op == "get_attr":
            continue
        if n.meta["layer"] is not None:
            n.meta["region"] = "layer"
            if n.op != "get_attr":
                current = n.meta["layer"]
        elif first is None or i < first:
            n.meta["region"] = "pre"
        elif i > last:
            n.meta["region"] = "post"
        else:  # code between two layers belongs to the one before it
            n.meta["region"] = "layer"
            n.meta["layer"] = current
    for n in nodes:  # a parameter belongs where it is used
        if n.op == "get_attr":
            users = [u for u in n.users if "region" in u.meta]
            n.meta["region"] = users[0].meta["region"] if users else "pre"
            if n.meta["layer"] is None and users:
                n.meta["layer"] = users[0].meta["layer"]


def _get_module(model: nn.Module, path: str) -> nn.Module:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return model


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _source(trace: str | None) -> str | None:
    if not trace:
        return None
    frames = _FRAME.findall(trace)
    user = [f for f in frames if not modelfile._library_file(f[0])]
    if not user:
        return None
    filename, line = user[-1]
    return f"{filename.rsplit('/', 1)[-1]}:{line}"


def _layer_nodes(gm: fx.GraphModule) -> dict[int, list[fx.Node]]:
    out: dict[int, list[fx.Node]] = defaultdict(list)
    for n in gm.graph.nodes:
        if n.meta.get("layer") is not None and n.op not in ("get_attr", "placeholder"):
            out[n.meta["layer"]].append(n)
    return dict(out)


def _structure(gm: fx.GraphModule, nodes: list[fx.Node], tensors_only: bool = False) -> tuple[tuple, list[fx.Node]]:
    """A layer's code with layer-relative names, and the outside nodes it reads, in order.

    ``tensors_only`` leaves out size arithmetic, which torch.export shares between layers."""
    if tensors_only:
        nodes = [n for n in nodes if n.meta.get("shape") is not None or "shapes" in n.meta]
    local = {n: i for i, n in enumerate(nodes)}
    external: dict[fx.Node, int] = {}  # in first-read order
    layer_path = nodes[0].meta["module_path"].split(".")
    depth = len(layer_path) - (len(layer_path) - _common_depth(nodes))

    def rel(path: str) -> str:
        return ".".join(path.split(".")[depth:])

    def arg_key(a):
        if isinstance(a, fx.Node):
            if tensors_only and a.meta.get("shape") is None and "shapes" not in a.meta:
                return "sym"
            if a in local:
                return ("L", local[a])
            if a.op == "get_attr":
                return ("P", rel(_strip(a.target)), tuple(a.meta.get("shape") or ()))
            return ("X", external.setdefault(a, len(external)))
        if isinstance(a, (list, tuple)):
            return tuple(arg_key(x) for x in a)
        if isinstance(a, dict):
            return tuple((k, arg_key(v)) for k, v in a.items())
        if isinstance(a, (int, float, bool, str, type(None), torch.dtype, torch.device)):
            return a
        return type(a).__name__

    sig = []
    for n in nodes:
        target = n.target
        if n.op == "call_module":
            mod = gm.get_submodule(n.target)
            target = (rel(_strip(n.target)), type(mod).__name__, tuple(tuple(p.shape) for p in mod.parameters()))
        elif n.op == "get_attr":
            target = rel(_strip(n.target))
        sig.append(
            (n.op, target if isinstance(target, (str, tuple)) else id(target), arg_key(n.args), arg_key(n.kwargs))
        )
    return tuple(sig), list(external)


def _common_depth(nodes: list[fx.Node]) -> int:
    """Depth of the layer's own module path (e.g. 2 for ``layers.3``)."""
    paths = [n.meta["module_path"].split(".") for n in nodes if n.meta.get("module_path")]
    common = paths[0]
    for p in paths[1:]:
        k = 0
        while k < min(len(common), len(p)) and common[k] == p[k]:
            k += 1
        common = common[:k]
    return len(common)


# ---------------------------------------------------------------------------------------------
# Shapes


class _Shapes:
    """Turns fake-tensor values into ``node.meta`` entries with shapes in B and S."""

    def __init__(self, symbols: dict):
        self.symbols = symbols
        self.storage_ids: dict[int, int] = {}
        self.cache: dict = {}

    def dim(self, d):
        if isinstance(d, int):
            return d
        expr = d.node.expr
        if expr not in self.cache:
            self.cache[expr] = sympy.sympify(expr).xreplace(self.symbols)
        return self.cache[expr]

    def record(self, node: fx.Node, value) -> None:
        if isinstance(value, torch.Tensor):
            node.meta["shape"] = tuple(self.dim(d) for d in value.shape)
            node.meta["dtype"] = value.dtype
            key = value.untyped_storage()._cdata
            node.meta["storage"] = self.storage_ids.setdefault(key, len(self.storage_ids))
        else:
            node.meta["shape"] = None
            node.meta["dtype"] = None
            node.meta["storage"] = None
            if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
                node.meta["shapes"] = [tuple(self.dim(d) for d in v.shape) for v in value]


def _shape_key(shapes: _Shapes, values) -> tuple:
    return tuple(tuple(str(shapes.dim(d)) for d in v.shape) if isinstance(v, torch.Tensor) else repr(v) for v in values)


def _propagate(gm, inputs, layer_nodes, model) -> dict[int, tuple]:
    """Fake-tensor shape propagation, batch and sequence symbolic, each layer kind once."""
    env = ShapeEnv(duck_shape=False)
    mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=True)
    device = next((p.device for p in model.parameters()), torch.device("meta"))
    first = torch.empty(inputs[0].shape, dtype=inputs[0].dtype, device=device)
    dynamic = [DimDynamic.DYNAMIC, DimDynamic.DYNAMIC] + [DimDynamic.STATIC] * (first.dim() - 2)
    fake0 = mode.from_tensor(first, symbolic_context=StatelessSymbolicContext(dynamic_sizes=dynamic))
    b_sym, s_sym = fake0.shape[0], fake0.shape[1]
    with mode:
        fakes = [fake0] + [torch.zeros((b_sym, s_sym, *t.shape[2:]), dtype=t.dtype, device=device) for t in inputs[1:]]
    shapes = _Shapes({b_sym.node.expr: B, s_sym.node.expr: S})

    structures = {i: _structure(gm, nodes) for i, nodes in layer_nodes.items()}
    first_node = {nodes[0]: i for i, nodes in layer_nodes.items()}
    keys: dict[int, tuple] = {}
    templates: dict[tuple, int] = {}
    reuse: dict[fx.Node, fx.Node] = {}

    class Propagator(fx.Interpreter):
        def run_node(self, n):
            if n in first_node:
                layer = first_node[n]
                sig, external = structures[layer]
                if all(e in self.env for e in external):
                    key = (sig, _shape_key(shapes, [self.env[e] for e in external]))
                    keys[layer] = key
                    if key in templates:
                        reuse.update(zip(layer_nodes[layer], layer_nodes[templates[key]]))
                    else:
                        templates[key] = layer
                else:
                    keys[layer] = (sig, layer)
            if n in reuse:
                src = reuse[n]
                for k in ("shape", "dtype", "storage", "shapes"):
                    if k in src.meta:
                        n.meta[k] = src.meta[k]
                return self.env[src]
            value = super().run_node(n)
            shapes.record(n, value)
            if not specialised and any(sym in env.replacements for sym in watched):
                specialised.append(n)
            return value

    watched = (b_sym.node.expr, s_sym.node.expr)
    specialised: list[fx.Node] = []
    with mode, torch.enable_grad():
        Propagator(gm, garbage_collect_values=False).run(*fakes)
    if specialised:
        n = specialised[0]
        which = "sequence" if s_sym.node.expr in env.replacements else "batch"
        raise AutoshardError(
            f"the model fixes the {which} size at {n.meta.get('source') or n.name} ({n.meta.get('op')}); "
            "write that code so its shapes follow the inputs' sizes"
        )
    return keys


def _read_export_shapes(gm: fx.GraphModule, layer_nodes) -> dict[int, tuple]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    val = placeholders[0].meta["val"]
    symbols = {}
    for d, sym in zip(val.shape[:2], (B, S)):
        if not isinstance(d, int):
            symbols[d.node.expr] = sym
    shapes = _Shapes(symbols)
    for n in gm.graph.nodes:
        shapes.record(n, n.meta.get("val"))
    keys = {}
    for i, nodes in layer_nodes.items():
        sig, external = _structure(gm, nodes, tensors_only=True)
        keys[i] = (sig, _shape_key(shapes, [e.meta.get("val") for e in external]))
    return keys


def _group_kinds(keys: dict[int, tuple]) -> list[LayerKind]:
    groups: dict[tuple, list[int]] = {}
    for layer in sorted(keys):
        groups.setdefault(keys[layer], []).append(layer)
    return [LayerKind(i, layers) for i, layers in enumerate(groups.values())]


# ---------------------------------------------------------------------------------------------


def _annotate_ops(gm: fx.GraphModule) -> None:
    params = {name for name, _ in gm.named_parameters()}
    for n in gm.graph.nodes:
        n.meta["op"] = ops.op_name(n, gm)
        if n.op == "get_attr":
            n.meta["is_param"] = n.target in params
    _requires_grad(gm, params)
    ops.classify(gm)


def _requires_grad(gm: fx.GraphModule, params: set[str]) -> None:
    """Floating outputs computed from a parameter need gradients; integer ones never do."""
    for n in gm.graph.nodes:
        dtype = n.meta.get("dtype")
        floating = dtype.is_floating_point if dtype is not None else "shapes" in n.meta
        if n.op == "get_attr":
            n.meta["requires_grad"] = n.target in params
        elif n.op == "call_module":
            owns = any(True for _ in gm.get_submodule(n.target).parameters())
            n.meta["requires_grad"] = floating and (
                owns or any(a.meta.get("requires_grad") for a in ops.tensor_args(n))
            )
        elif n.op == "placeholder":
            n.meta["requires_grad"] = False
        else:
            ins = [a for a in n.all_input_nodes]
            n.meta["requires_grad"] = floating and any(a.meta.get("requires_grad") for a in ins)
