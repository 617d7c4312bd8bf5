"""Record how a model initialises its own parameters and buffers, while it is built on meta.

The emitted program does not know layer types: it replays, per parameter, the ops the model's own
code applied to it (constructors, ``reset_parameters``, ``init_weights``, transformers'
``_init_weights``), written into each stage file as a small program of aten ops.

How the ops are seen:

* a ``TorchDispatchMode`` sees every aten op the build runs, after Python-level helpers
  (``nn.init.kaiming_uniform_``, ``xavier_normal_``) have computed their numbers: those reach
  ``uniform_``/``normal_`` with the bounds for the *full* parameter, which is what a shard needs.
  A ``TorchFunctionMode`` would see ``torch.*`` calls before they lower, but ``nn.init`` is plain
  Python (only four of its functions dispatch a torch function) and in-place tensor methods would
  arrive in many spellings; aten ops come with schemas that say which argument is written, which
  output aliases which input, and which op is pointwise.
* the ``nn.init`` functions that return early on meta tensors (``_SKIPPED_ON_META``: there is no
  data to sample) are seen by a ``TorchFunctionMode`` when they ask ``tensor.is_meta``, the
  question they return on; the asking frame's code object names the function (so references
  taken before the build count too: ``from torch.nn.init import trunc_normal_``, transformers'
  ``TORCH_INIT_FUNCTIONS``) and its arguments are read from that frame. The call is one step,
  replayed by calling the function.
* ``torch.tensor(data)`` drops its data on meta; a ``TorchFunctionMode`` keeps small constants.

transformers' ``PreTrainedModel.init_weights`` skips ``initialize_weights`` when the device context
is meta ("no point in trying to run inits"), so after the build the recorder calls
``initialize_weights()`` on the outermost modules that offer transformers' protocol for it
(``initialize_weights`` applying ``_init_weights``); its flags make a second run a no-op.

A program (``Init.steps``) is a list of steps ``(op, *args[, kwargs])``: ``op`` an aten overload
(``"uniform_"``, ``"mul_.Scalar"``), a skipped-on-meta ``"nn.init.<name>"``, ``"tensor"`` (a
constant) or ``"lifted"`` (the value of a constant torch.export lifted from the forward, which the
model does not hold: :func:`lifted`); ``"%k"`` is step k's result (``"%k.i"`` its i-th output),
``"torch.float32"`` a dtype; the last step's result is the value. Only the steps the final value
depends on are kept (a write overwritten later is dropped). Where every step is element-wise on
tensors of the parameter's shape, that shape is written ``"shape"``: the program then runs directly
at a shard's shape; otherwise it builds the full tensor, which the program cuts into shards.
"""

from __future__ import annotations

import heapq
import inspect
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from autoshard.errors import AutoshardError
from autoshard.runtime.stages import at_shard_shape

# nn.init functions that return early on a meta tensor -> whether they are element-wise (each
# element drawn on its own, so a shard can be drawn at its own shape)
_SKIPPED_ON_META = {
    nn.init.trunc_normal_: True,
    nn.init.orthogonal_: False,
    nn.init.dirac_: False,
    nn.init.sparse_: False,
}

# element-wise ops beyond those aten tags ``pointwise``: random and constant fills, copies and
# casts, and factories whose only shape is their size argument (or their input's shape)
_ELEMENTWISE = {
    *("uniform_", "normal_", "bernoulli_", "exponential_", "log_normal_", "cauchy_", "geometric_", "random_"),
    *("fill_", "zero_", "copy_", "_to_copy", "clone", "alias", "fill"),
    *("empty", "zeros", "ones", "full", "rand", "randn", "randint", "normal"),
    *("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like"),
    *("new_empty", "new_zeros", "new_ones", "new_full"),
}
# ops that read only their input's shape and dtype, not its values
_METADATA_ONLY = {
    *("empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "randint_like"),
    *("new_empty", "new_zeros", "new_ones", "new_full", "new_empty_strided"),
}
# ops that replace every element they write without reading it
_OVERWRITE = {
    *("uniform_", "normal_", "bernoulli_", "exponential_", "log_normal_", "cauchy_", "geometric_", "random_"),
    *("fill_", "zero_", "copy_"),
}
# ops whose result is their input, for the values a program computes
_IDENTITY = {"detach", "lift_fresh", "lift"}
# arguments that say where or how memory is laid out, not what the values are: the replay runs on CPU
_PLACEMENT = {"device", "layout", "pin_memory", "memory_format", "generator", "non_blocking"}
# factories whose memory holds no values yet
_UNSET = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided"}
_MAX_CONSTANT = 4096  # elements of a torch.tensor(data) constant written into a stage file


@dataclass(frozen=True)
class Init:
    """How one parameter or buffer gets its initial value: ``steps`` (module docstring), or
    ``problem``, why it cannot be replayed; ``tied_to`` names the tensor it is the same as (the
    first name the model gives it), whose seed it shares."""

    steps: list
    problem: str | None = None
    tied_to: str | None = None

    @property
    def at_shard_shape(self) -> bool:
        """Whether the program runs at a shard's own shape (it says ``"shape"``)."""
        return at_shard_shape(self.steps)

    def require(self, name: str) -> list:
        """The steps, or a one-line error naming ``name`` and the op that cannot be replayed."""
        if self.problem:
            raise AutoshardError(
                f"cannot replay the initialisation of {name}: {self.problem}; "
                "set its value with torch ops on tensors the builder makes"
            )
        return self.steps


def lifted(value: torch.Tensor) -> Init:
    """How a constant lifted from the forward (``trace.lifted_as_buffers``) is initialised: its
    value as captured, one ``"lifted"`` step, which every rank takes whatever else initialises the
    model's own tensors (the model, or a checkpoint of it, holds no such tensor)."""
    if value.numel() > _MAX_CONSTANT:
        size = f"{value.numel()} elements, over the {_MAX_CONSTANT} a stage file holds"
        return Init([], f"it is a constant of the forward of {size}")
    return Init([("lifted", value.tolist(), {"dtype": str(value.dtype)})])


def record_build(fn: Callable[..., nn.Module], *args, **kwargs) -> tuple[nn.Module, dict[str, Init]]:
    """``fn(*args, **kwargs)`` under ``torch.device('meta')``, and how the built model initialises
    each of its parameters and buffers: ``(model, {name: Init})``, every name the model gives a
    tensor (tied ones included, with ``tied_to``). Errors of ``fn`` propagate unchanged."""
    recorder = _Recorder()
    with torch.device("meta"), recorder, _TorchCalls(recorder):
        model = fn(*args, **kwargs)
        if isinstance(model, nn.Module):
            _run_deferred_init(model)
    if not isinstance(model, nn.Module):
        return model, {}
    return model, recorder.inits(model)


def _run_deferred_init(model: nn.Module) -> None:
    """transformers' protocol: ``initialize_weights`` (which applies ``_init_weights``) is skipped
    under a meta device context, so run it here, once per outermost module that has it."""
    done: list[str] = []
    for path, module in model.named_modules():
        if any(path == d or path.startswith(f"{d}.") for d in done):
            continue
        if callable(getattr(module, "initialize_weights", None)) and callable(getattr(module, "_init_weights", None)):
            module.initialize_weights()
            done.append(path)


# ---------------------------------------------------------------------------------------------
# recording


@dataclass
class _Step:
    op: str
    args: list  # encoded, refs as "%k"
    outputs: list  # tensors (kept alive so ids and storages stay unique while recording)
    inputs: list  # step indices whose tensors the step takes
    reads: set  # storages whose values it reads
    writes: dict  # storage -> whether the write replaces the whole storage without reading it
    creates: set  # storages it allocates
    elementwise: bool
    partial: bool = False  # it writes part of a tensor's memory (a view such as one row)
    problem: str | None = None


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _geometry(t: torch.Tensor) -> tuple:
    return (_storage(t), tuple(t.shape), tuple(t.stride()), t.storage_offset(), t.dtype)


def _covers_storage(t: torch.Tensor) -> bool:
    return t.storage_offset() == 0 and t.numel() * t.element_size() == t.untyped_storage().nbytes()


def _takes_generator(func) -> bool:
    return any(a.name == "generator" for a in func._schema.arguments)


def _with_generator(func):
    """The overload of a random op that takes a generator (``randn`` -> ``randn.generator``)."""
    overload = func._overloadname
    name = "generator" if overload == "default" else f"{overload}_generator"
    if overload.endswith("out"):
        name = f"{overload[: -len('out')]}generator_out"
    packet = getattr(torch.ops.aten, func._schema.name.split("::", 1)[1])
    seeded = getattr(packet, name, None) if name in packet.overloads() else None
    return seeded if seeded is not None and _takes_generator(seeded) else None


def _op_name(func) -> str:
    packet, overload = func._schema.name.split("::", 1)[1], func._overloadname
    return packet if overload == "default" else f"{packet}.{overload}"


class _Recorder(TorchDispatchMode):
    """Every aten op of the build, as steps; tensors are known by identity (or, for aliases made
    outside the dispatcher such as ``nn.Parameter`` and ``.data``, by storage and geometry)."""

    def __init__(self):
        super().__init__()
        self.steps: list[_Step] = []
        self.ref_of: dict[int, str] = {}  # id(tensor) -> "%k" / "%k.i"
        self.by_geometry: dict[tuple, str] = {}
        self.alive: list[torch.Tensor] = []  # every tensor known by id, so no id is reused

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self._record(func, args, kwargs, out)
        return out

    # -- tensors and arguments

    def ref(self, t: torch.Tensor, step: _Step) -> str | None:
        """The ref of tensor ``t``, adding a constant step for a small real tensor."""
        ref = self.ref_of.get(id(t)) or self.by_geometry.get(_geometry(t))
        if ref is None and t.device.type != "meta" and t.numel() <= _MAX_CONSTANT:
            ref = self.add_constant(t.detach().cpu(), t)
        if ref is None:
            step.problem = step.problem or (
                f"{step.op} reads a tensor of shape {tuple(t.shape)} made outside the model's construction"
            )
            return None
        step.inputs.append(int(ref[1:].split(".")[0]))
        return ref

    def add_constant(self, value: torch.Tensor, t: torch.Tensor) -> str:
        index = len(self.steps)
        self.steps.append(
            _Step(
                "tensor", [value.tolist(), {"dtype": str(value.dtype)}], [t], [], set(), {}, {_storage(t)}, t.dim() == 0
            )
        )
        self._name_outputs(index, [t])
        return f"%{index}"

    def encode(self, value, step: _Step):
        if isinstance(value, torch.Tensor):
            return self.ref(value, step)
        if isinstance(value, torch.dtype):
            return str(value)
        if isinstance(value, (list, tuple)):
            return [self.encode(v, step) for v in value]
        if isinstance(value, str) and (value.startswith(("%", "torch.")) or value == "shape"):
            step.problem = step.problem or f"{step.op} takes the string {value!r}, which a program cannot write"
            return value
        if value is None or isinstance(value, (bool, int, float, str)):
            return value
        step.problem = step.problem or f"{step.op} takes a {type(value).__name__}, which a program cannot write"
        return None

    def _name_outputs(self, index: int, outputs: list) -> None:
        for i, t in enumerate(outputs):
            ref = f"%{index}" if len(outputs) == 1 else f"%{index}.{i}"
            self.ref_of[id(t)] = ref
            self.by_geometry[_geometry(t)] = ref

    # -- one op

    def _record(self, func, args, kwargs, out) -> None:
        name = _op_name(func)
        packet = name.split(".")[0]
        outputs = _tensors([out])
        if packet in _IDENTITY and args and isinstance(args[0], torch.Tensor) and isinstance(out, torch.Tensor):
            ref = self.ref_of.get(id(args[0])) or self.by_geometry.get(_geometry(args[0]))
            if ref is not None:
                self.ref_of[id(out)] = ref
                self.alive.append(out)
                return
        if packet == "_to_copy" and set(kwargs) <= _PLACEMENT and isinstance(out, torch.Tensor):
            ref = self.ref_of.get(id(args[0])) or self.by_geometry.get(_geometry(args[0]))
            if ref is not None:  # a move between devices: the same values
                self.ref_of[id(out)] = ref
                self.alive.append(out)
                self.by_geometry[_geometry(out)] = ref
                return
        schema = func._schema
        step = _Step(
            name, [], outputs, [], set(), {}, set(), packet in _ELEMENTWISE or torch.Tag.pointwise in func.tags
        )
        if not schema.name.startswith("aten::"):
            step.problem = f"{schema.name} is not an aten op (the program replays aten ops)"
        elif torch.Tag.nondeterministic_seeded in func.tags and not _takes_generator(func):
            seeded = _with_generator(func)
            step.op = _op_name(seeded) if seeded else name
            step.problem = None if seeded else f"{name} draws random numbers from no generator a program can seed"
        written: list[tuple[torch.Tensor, bool]] = []  # (tensor, whether the op replaces its values unread)
        for i, a in enumerate(schema.arguments):
            value = args[i] if i < len(args) and not a.kwarg_only else kwargs.get(a.name)
            if isinstance(value, torch.Tensor) and a.alias_info is not None and a.alias_info.is_write:
                written.append((value, packet in _OVERWRITE or a.name == "out"))
        encoded = [self.encode(a, step) for a in args]
        extra = {k: self.encode(v, step) for k, v in kwargs.items() if k not in _PLACEMENT}
        step.args = encoded + ([extra] if extra else [])
        tensors_in = _tensors(args) + _tensors(list(kwargs.values()))
        for t in tensors_in:
            overwritten = any(t is w and whole for w, whole in written)
            if packet not in _METADATA_ONLY and not overwritten and not _is_view_of(out, t, schema):
                step.reads.add(_storage(t))
        for w, replaces in written:
            step.writes[_storage(w)] = replaces and _covers_storage(w)
            step.partial |= not _covers_storage(w)
        in_storages = {_storage(t) for t in tensors_in}
        step.creates = {_storage(o) for o in outputs if _storage(o) not in in_storages}
        index = len(self.steps)
        self.steps.append(step)
        if not written:  # an in-place op's result is the tensor it wrote, already known by its ref
            self._name_outputs(index, outputs)

    def record_call(self, fn, frame) -> None:
        """A call of a skipped-on-meta ``nn.init`` function: one step that overwrites its tensor."""
        params = list(inspect.signature(fn).parameters)
        values = {p: frame.f_locals[p] for p in params if p in frame.f_locals}
        tensor = values.pop(params[0])
        values.pop("generator", None)
        step = _Step(f"nn.init.{fn.__name__}", [], [], [], set(), {}, set(), _SKIPPED_ON_META[fn])
        step.args = [self.ref(tensor, step), {k: self.encode(v, step) for k, v in values.items()}]
        step.writes[_storage(tensor)] = _covers_storage(tensor)
        step.partial = not _covers_storage(tensor)
        self.steps.append(step)

    # -- what each tensor of the model depends on

    def inits(self, model: nn.Module) -> dict[str, Init]:
        self.touching = defaultdict(list)  # storage -> the steps that write or allocate it, in order
        for i, step in enumerate(self.steps):
            for s in {*step.writes, *step.creates}:
                self.touching[s].append(i)
        first: dict[int, str] = {}
        out = {}
        named = [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]
        for name, t in named:
            tied = first.setdefault(id(t), name)
            out[name] = self._program(t)
            if tied != name:
                out[name] = Init(out[name].steps, out[name].problem, tied)
        return out

    def _program(self, t: torch.Tensor) -> Init:
        result = self.by_geometry.get(_geometry(t))
        if result is None:
            return Init([], "its value comes from no op the model's construction ran")
        kept = self._slice(int(result[1:].split(".")[0]), _storage(t))
        problem = next((self.steps[i].problem for i, values in kept if values and self.steps[i].problem), None)
        if problem is None and not any(self.steps[i].writes or self._sets_values(self.steps[i]) for i, _ in kept):
            problem = "the model's construction never sets its value (torch.empty without an initialiser)"
        renumber = {old: new for new, (old, _) in enumerate(kept)}
        steps = [self._renumbered(self.steps[i], renumber) if values else _memory(self.steps[i]) for i, values in kept]
        result = _renumber_ref(result, renumber)
        if not steps or result != _last_result(steps, result):
            steps.append(("alias", result))
        if all(self._elementwise(self.steps[i], tuple(t.shape)) for i, values in kept if values):
            steps = [_mark_shape(s, list(t.shape)) for s in steps]
        return Init(steps, problem)

    @staticmethod
    def _sets_values(step: _Step) -> bool:
        """Whether ``step`` gives new memory values (not ``torch.empty``, not a view)."""
        return bool(step.creates) and step.op.split(".")[0] not in _UNSET

    def _slice(self, result: int, storage: int) -> list[tuple[int, bool]]:
        """The steps the final values of ``storage`` depend on, in order, each with whether its
        values are needed (walked backwards: a step is kept when its tensor is used by a kept step
        or it writes values still needed; a tensor whose values are all overwritten before being
        read is needed only as memory, so what computed it is not)."""
        need_steps, need_values, kept = {result}, set(), []
        candidates, seen = [-result], set()
        last = len(self.steps)

        def need(storages) -> None:
            for s in storages - need_values:
                need_values.add(s)
                for i in self.touching[s]:
                    if i < last:
                        heapq.heappush(candidates, -i)

        need({storage})
        while candidates:
            i = -heapq.heappop(candidates)
            if i in seen:
                continue
            seen.add(i)
            last = i
            step = self.steps[i]
            values = bool(need_values & (set(step.writes) | step.creates))
            if i not in need_steps and not values:
                continue
            if not values and step.creates and len(step.outputs) == 1:
                kept.append((i, False))
                continue
            kept.append((i, True))
            need_values -= step.creates | {s for s, whole in step.writes.items() if whole}
            need(step.reads)
            for j in step.inputs:
                need_steps.add(j)
                heapq.heappush(candidates, -j)
        return kept[::-1]

    def _elementwise(self, step: _Step, shape: tuple) -> bool:
        """Whether ``step`` computes each element of a tensor of ``shape`` on its own (so it can
        run at a shard's shape): an element-wise op whose tensors all have that shape (or none)."""
        if not step.elementwise or step.partial:
            return False
        tensors = [*step.outputs, *(self._output(i) for i in step.inputs)]
        return all(tuple(x.shape) in (shape, ()) for x in tensors if x is not None)

    def _output(self, index: int) -> torch.Tensor | None:
        outputs = self.steps[index].outputs
        return outputs[0] if len(outputs) == 1 else None

    @staticmethod
    def _renumbered(step: _Step, renumber: dict[int, int]) -> tuple:
        return (step.op, *_map_refs(step.args, renumber))


def _memory(step: _Step) -> tuple:
    """A step whose values are all overwritten before they are read, as the memory it allocates."""
    t = step.outputs[0]
    if t.is_contiguous():
        return ("empty.memory_format", list(t.shape), {"dtype": str(t.dtype)})
    return ("empty_strided", list(t.shape), list(t.stride()), {"dtype": str(t.dtype)})


def _last_result(steps: list, result: str) -> str:
    """The ref a program's last step leaves: an in-place op returns the tensor it wrote."""
    op, *args = steps[-1]
    if (op.split(".")[0].endswith("_") or op.startswith("nn.init.")) and args and isinstance(args[0], str):
        return args[0]
    return f"%{len(steps) - 1}"


def _map_refs(value, renumber: dict[int, int]):
    if isinstance(value, str) and value.startswith("%"):
        return _renumber_ref(value, renumber)
    if isinstance(value, list):
        return [_map_refs(v, renumber) for v in value]
    if isinstance(value, dict):
        return {k: _map_refs(v, renumber) for k, v in value.items()}
    return value


def _renumber_ref(ref: str, renumber: dict[int, int]) -> str:
    index, _, part = ref[1:].partition(".")
    return f"%{renumber[int(index)]}" + (f".{part}" if part else "")


def _mark_shape(step: tuple, shape: list) -> tuple:
    """The size arguments equal to the parameter's shape, as ``"shape"``."""
    op, *args = step
    return (op, *["shape" if a == shape else a for a in args])


def _tensors(values) -> list[torch.Tensor]:
    out = []
    for v in values:
        if isinstance(v, torch.Tensor):
            out.append(v)
        elif isinstance(v, (list, tuple)):
            out += _tensors(v)
    return out


def _is_view_of(out, t: torch.Tensor, schema) -> bool:
    """Whether the op's output is a view of input ``t`` (it reads no values, it aliases them)."""
    return (
        isinstance(out, torch.Tensor)
        and bool(schema.returns)
        and schema.returns[0].alias_info is not None
        and not schema.returns[0].alias_info.is_write
        and _storage(out) == _storage(t)
    )


class _TorchCalls(TorchFunctionMode):
    """What the aten ops do not show: ``torch.tensor(data)`` and its kin, whose data meta drops
    (small constants are kept as steps), and the ``_SKIPPED_ON_META`` functions, seen when they
    ask ``tensor.is_meta`` (the question they return early on), as one step each."""

    _CONSTANTS = {torch.tensor, torch.as_tensor, torch.Tensor.new_tensor}
    _CODES = {fn.__code__: fn for fn in _SKIPPED_ON_META}

    def __init__(self, recorder: _Recorder):
        super().__init__()
        self.recorder = recorder
        self.last_call = None  # the frame of the last skipped-on-meta call recorded

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func in self._CONSTANTS and isinstance(out, torch.Tensor) and out.device.type == "meta":
            self._constant(func, args, out)
        elif getattr(func, "__self__", None) is torch.Tensor.is_meta and out:
            self._skipped_call(sys._getframe(1))
        return out

    def _constant(self, func, args, out: torch.Tensor) -> None:
        data = args[1] if func is torch.Tensor.new_tensor else args[0]
        if any(x.device.type == "meta" for x in _tensors([data])):
            return
        value = data if isinstance(data, torch.Tensor) else torch.tensor(data, dtype=out.dtype, device="cpu")
        if value.numel() <= _MAX_CONSTANT:
            self.recorder.add_constant(value.detach().cpu().to(out.dtype), out)

    def _skipped_call(self, frame) -> None:
        """The outermost skipped-on-meta function among the few frames that asked."""
        for _ in range(4):
            if frame is None:
                return
            if frame.f_code in self._CODES:
                if frame is not self.last_call:
                    self.last_call = frame
                    self.recorder.record_call(self._CODES[frame.f_code], frame)
                return
            frame = frame.f_back
