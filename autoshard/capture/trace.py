"""Tracing: the training forward of a model, as an fx graph.

``torch.fx.symbolic_trace`` first (readable graphs, modules kept as calls); where that fails
(HuggingFace models), ``torch.export.export(strict=False)``. What is traced is
:class:`TrainingForward`: the model, then its loss (causal-LM cross-entropy on the shifted inputs
unless the model file defines ``loss``), so that the output head and the loss are costed and later
placed like any other node. When both tracers fail, the error names the user's line.
"""

from __future__ import annotations

import contextlib
import inspect
import io
import linecache
import logging
import os
import sys
import warnings

import torch
import torch.nn.functional as F
from torch import fx, nn
from torch.fx._lazy_graph_module import _make_graph_module, _use_lazy_graph_module
from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode
from torch.overrides import TorchFunctionMode

from autoshard import modelfile
from autoshard.capture import dtypes, layercopy, repeat
from autoshard.errors import AutoshardError

BATCH_HINT = 2  # the batch size of the example inputs capture builds (any size >= 2 traces the same graph)


def causal_lm_loss(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy; the last position has no target."""
    labels = torch.cat([tokens[:, 1:], tokens.new_full((tokens.size(0), 1), -100)], dim=1)
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), labels.reshape(-1), ignore_index=-100)


def check_logits(out) -> None:
    """The default loss needs the model's output as (batch, sequence, vocabulary) logits."""
    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        what = f"a tensor of {out.dim()} dimensions" if isinstance(out, torch.Tensor) else type(out).__name__
        raise AutoshardError(
            f"the model returns {what}, where the default loss needs (batch, sequence, vocabulary) logits: return "
            "the logits (alone, first in a tuple, or as a dict's 'logits'), or define loss(output, *inputs) in "
            "the model file"
        )


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
        if isinstance(out, fx.Proxy):  # checked where shapes are known (``shapes.propagate``)
            out.node.meta["autoshard_logits"] = True
        else:
            check_logits(out)
        return causal_lm_loss(out, inputs[0])


def trace(
    model: nn.Module, inputs: tuple, loss=None, source: str | None = None, follow_bf16: bool = False
) -> tuple[fx.GraphModule, str, list]:
    """The traced training forward of ``model`` on ``inputs``: the graph, the tracer that produced
    it (``"symbolic_trace"`` or ``"export"``) and the names of the inputs. ``follow_bf16`` (a
    model on the meta device): an exported graph takes the dtype flow the model has with bf16
    parameters (``dtypes.follow``, from a second export with its parameters bf16; where that
    does not export, the graph stands as traced)."""
    _check_inputs(inputs)
    names = _input_names(model, len(inputs))
    kwargs = {"use_cache": False} if "use_cache" in inspect.signature(model.forward).parameters else {}
    wrapper = TrainingForward.wrap(model, names, loss, kwargs)
    wrapper.train()
    made = _ForwardConstants()
    with _quiet():
        try:
            gm, tracer = _symbolic_trace(wrapper), "symbolic_trace"
        except Exception as fx_error:
            try:
                with made:
                    gm, tracer = _export(wrapper, inputs, model, follow_bf16), "export"
            except Exception as export_error:
                message = _data_dependent_loop(export_error, model) or _trace_failure(fx_error, export_error, source)
                raise AutoshardError(message) from export_error
    return lifted_as_buffers(gm, wrapper, made.values), tracer, names


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
    """fx's tracer, recording on each node the innermost frame of the model's code (much cheaper
    than ``record_stack_traces``, which formats a whole traceback per node)."""

    def trace(self, root, concrete_args=None):
        self._param_names: dict[int, str] | None = None
        self._entry = sys._getframe()  # frames beyond it called the tracer: none is the model's
        self._copier = layercopy.Copier.of(root) if isinstance(root, TrainingForward) else None
        return super().trace(root, concrete_args)

    def call_module(self, m, forward, args, kwargs):
        # a repeated layer is written from the first of its kind (``layercopy``), not traced
        if self._copier is None or id(m) not in self._copier.paths:
            return super().call_module(m, forward, args, kwargs)
        return self._copier.call(
            self, m, lambda: super(_Tracer, self).call_module(m, forward, args, kwargs), args, kwargs
        )

    def getattr(self, attr, attr_val, parameter_proxy_cache):
        self.proxy_cache = parameter_proxy_cache  # a copied layer's attributes go in it (``layercopy``)
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
        source = modelfile.model_line(_frames(sys._getframe(1), self._entry))
        if source is not None:
            node.meta["source"] = source
        return node


class _ForwardConstants(TorchFunctionMode):
    """The values of the tensors the forward makes from Python data (``torch.tensor(data)``,
    ``x.new_tensor(data)``, a list index as Falcon's ``fused_qkv[..., [-2], :]``), by identity:
    torch.export lifts them into the graph as constants, which on the meta device hold no values.
    A list index is made a tensor here, as indexing would make it, so that its value is kept."""

    _FACTORIES = {torch.tensor, torch.as_tensor, torch.Tensor.new_tensor}
    _INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__}

    def __init__(self):
        super().__init__()
        self.values: dict[int, tuple[torch.Tensor, list]] = {}  # id -> (tensor, the data it was made of)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in self._INDEXING and len(args) >= 2 and isinstance(args[0], torch.Tensor):
            args = (args[0], self._index(args[0], args[1]), *args[2:])
        out = func(*args, **kwargs)
        if func in self._FACTORIES and isinstance(out, torch.Tensor):
            data = args[1] if func is torch.Tensor.new_tensor else args[0] if args else kwargs.get("data")
            if _numbers(data, (bool, int, float)):
                self.values[id(out)] = (out, data)  # kept alive, so that no other tensor takes its id
        return out

    def _index(self, x: torch.Tensor, index):
        if isinstance(index, tuple):
            return tuple(self._index(x, i) for i in index)
        if isinstance(index, list) and index and _numbers(index, (bool, int)):
            made = torch.tensor(index, device=x.device)
            self.values[id(made)] = (made, index)
            return made
        return index


def _numbers(value, kinds: tuple) -> bool:
    """Whether ``value`` is a number of ``kinds`` or a (nested) list or tuple of them (no
    tensors, no symbolic sizes: data a constant is made of)."""
    if isinstance(value, (list, tuple)):
        return all(_numbers(v, kinds) for v in value)
    return type(value) in kinds


def lifted_as_buffers(gm: fx.GraphModule, wrapper: nn.Module, values: dict) -> fx.GraphModule:
    """``gm`` with each tensor it reads that the model does not hold (a constant torch.export
    lifted from the forward) a non-persistent buffer holding its value on CPU: read off the
    tensor, or where it is on the meta device made from its data in ``values``
    (``_ForwardConstants.values``)."""
    held = {k for k, _ in wrapper.named_parameters(remove_duplicate=False)}
    held |= {k for k, _ in wrapper.named_buffers(remove_duplicate=False)}
    for n in gm.graph.nodes:
        if n.op != "get_attr" or n.target in held or _model_attribute(wrapper, n.target):
            continue
        path, _, leaf = n.target.rpartition(".")
        owner = gm.get_submodule(path)
        value = getattr(owner, leaf)
        if not isinstance(value, torch.Tensor):
            continue
        if value.device.type == "meta":
            if id(value) not in values:
                raise AutoshardError(
                    f"cannot capture the value of {n.target.removeprefix('model.')}, a tensor the model's forward "
                    "makes on the meta device from data autoshard does not see: make it with torch.tensor(data) "
                    "or register it as a buffer in the model's constructor"
                )
            value = torch.tensor(values[id(value)][1], dtype=value.dtype)
        delattr(owner, leaf)
        owner.register_buffer(leaf, value.detach().cpu().clone(), persistent=False)
    return gm


def _model_attribute(wrapper: nn.Module, target: str) -> bool:
    """Whether the model holds a tensor at ``target`` (a plain attribute, neither parameter nor
    buffer): the model's own, not a constant of its forward."""
    obj = wrapper
    for part in target.split("."):
        obj = getattr(obj, part, None)
    return isinstance(obj, torch.Tensor)


def _frames(frame, entry):
    """(filename, line) of ``frame`` and its callers up to ``entry``, innermost first."""
    while frame is not None and frame is not entry:
        yield frame.f_code.co_filename, frame.f_lineno
        frame = frame.f_back


def _symbolic_trace(wrapper: nn.Module) -> fx.GraphModule:
    tracer = _Tracer()
    graph = tracer.trace(wrapper)
    # fx's lazy GraphModule writes and compiles the Python code of the graph only when someone
    # reads ``.code`` or calls it; planning does neither (a 61-layer model's code takes 0.5 s)
    with _use_lazy_graph_module(True):
        return _make_graph_module(tracer.root, graph, "TrainingForward")


def _export(wrapper: nn.Module, inputs: tuple, model: nn.Module, follow_bf16: bool = False) -> fx.GraphModule:
    """torch.export of the training forward. With a layer stack whose layers repeat, the model
    is exported with one traced layer per kind and the rest copied (``repeat``); where the cut
    cannot stand for the whole model, or its export fails, the whole model is exported (and its
    failure is the user's error). ``follow_bf16``: see ``trace``; on the cut graph, before its
    layers are copied, so that the copies carry it (following costs a second export, and
    following the cut rather than the whole graph saves expanding and walking the second one)."""
    cut = repeat.plan(model)
    if cut is not None and cut.saves:
        try:
            with cut.passthrough():
                cut_gm = _export_program(wrapper, inputs)
        except Exception:  # the cut model does not export (NotRepeated among the reasons)
            cut_gm = None
        if cut_gm is not None:
            if follow_bf16:
                with cut.passthrough():
                    _follow_bf16(cut_gm, wrapper, inputs, model)
            try:
                return cut.expand(cut_gm, wrapper)
            except repeat.NotRepeated:
                pass
    gm = _export_program(wrapper, inputs)
    if follow_bf16:
        _follow_bf16(gm, wrapper, inputs, model)
    return gm


def _follow_bf16(gm: fx.GraphModule, wrapper: nn.Module, inputs: tuple, model: nn.Module) -> None:
    """Give the export ``gm`` of ``wrapper`` the dtype flow ``model`` has with bf16 parameters
    (``dtypes.follow``), from a second export on the meta device with its parameters bf16; a
    model that does not export so keeps its graph as traced."""
    meta = tuple(x.to("meta") if isinstance(x, torch.Tensor) else x for x in inputs)
    try:
        with dtypes.lowered(model):
            low = _export_program(wrapper, meta)
    except Exception:  # noqa: BLE001 - the fp32 graph stands as traced
        return
    dtypes.follow(gm, low)


def _export_program(wrapper: nn.Module, inputs: tuple) -> fx.GraphModule:
    from torch.export import Dim

    # seq >= 3: at 2 the loss's shifted labels have length 1, a broadcast export must guard on
    batch, seq = Dim("batch", min=2), Dim("seq", min=3)
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


def _data_dependent_loop(error: Exception, model: nn.Module) -> str | None:
    """The error for a Python loop over a tensor whose length only the data decides (``for e in
    expert_hit:``, the ids of the experts a routing hit, as ``nonzero`` gives them): no tracer can
    unroll it. It names the module whose code loops, the line, and the forms that do capture.
    None when ``error`` is not a data-dependent guard raised by iterating a tensor."""
    if not isinstance(error, GuardOnDataDependentSymNode):
        return None
    frames, tb = [], error.__traceback__
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    iterating = [i for i, (f, _) in enumerate(frames) if f.f_code.co_name == "__iter__" and _torch_tensor_file(f)]
    if not iterating or iterating[0] == 0:
        return None
    frame, line = frames[iterating[0] - 1]
    names = {id(m): name for name, m in model.named_modules()}
    owner = frame.f_locals.get("self")
    where = f"{os.path.basename(frame.f_code.co_filename)}:{line}"
    module = f"{names[id(owner)] or 'the model'} ({type(owner).__name__}, {where})" if id(owner) in names else where
    code = linecache.getline(frame.f_code.co_filename, line).strip()
    config = getattr(model, "config", None)
    option = (
        ' (transformers: config._experts_implementation = "grouped_mm")'
        if hasattr(config, "_experts_implementation")
        else ""
    )
    return (
        f"cannot trace {module}: `{code}` is a Python loop over data-dependent ids (a tensor whose length "
        "only the data decides); loop over every expert instead (for i in range(num_experts), each taking "
        f"its tokens with torch.where) or run the experts as grouped GEMMs over stacked weights{option}"
    )


def _torch_tensor_file(frame) -> bool:
    return os.path.normpath(frame.f_code.co_filename).endswith(os.path.join("torch", "_tensor.py"))
