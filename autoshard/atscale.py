"""``autoshard verify OUT --at-scale``: run chosen ranks of an emitted program at their real shapes
on fake tensors and hold what they do against what the plan promised.

Each chosen rank runs in a process of its own (``python -m autoshard.atscale``): the "fake"
process-group backend (``torch.testing._internal.distributed.fake_pg.FakeStore``) gives it a
world of ``plan.gpus`` ranks with no peers, ``FakeTensorMode`` gives every tensor its shape and
no data, and the program's own trainer (``autoshard.runtime.trainer.Trainer``) builds the rank's
part of the plan and runs one optimizer step of the plan's schedule: every micro-batch, the
recompute set, the ZeRO stage, FP8, the expert dispatch (routing taken as balanced, as the
planner takes it: ``autoshard.runtime.fake``). Three counters watch the step:

- :class:`MemoryCounter`, live and peak bytes by what holds them (parameters, gradients,
  optimizer states, activations by the op that made them, module buffers, FP8 weight copies,
  the rest). torch's ``MemTracker`` cannot do this job: it refuses a module whose forward runs
  more than once a step ("multiple iterative calls"), which a pipeline stage does once per
  micro-batch.
- ``torch.utils.flop_counter.FlopCounterMode``, taught the ops it has no formula for (the
  flash-attention kernel, its backward and CPU twin, the FP8 GEMM, grouped GEMMs).
- :class:`CommCounter`, the bytes each collective hands over, by kind and process group.

The prediction is the plan's (``plan.json``'s ``predicted.ranks``: one entry per pipeline rank).
"""

from __future__ import annotations

import functools
import weakref
from collections import defaultdict
from dataclasses import dataclass, field

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode

from autoshard import progress
from autoshard.cost_models.comm import wire_bytes
from autoshard.errors import AutoshardError
from autoshard.ir.plan import GRID_AXES, Mesh, Plan
from autoshard.ir.schedules import schedule
from autoshard.runtime import attention, fp8, groups, trainer  # noqa: F401 (attention and fp8 register the autoshard ops)
from autoshard.runtime import program as rt
from autoshard.runtime.state import make_optimizer_states, optimizer_parts
from autoshard.verify import _read_program

POLL_S = 0.5  # how often ``verify_at_scale`` looks up from waiting on a rank, to update the progress line

# ---------------------------------------------------------------------------------------------
# memory

MEMORY_PARTS = ("params", "grads", "optimizer", "activations", "fp8_weights", "buffers", "other")


def _storage(t: torch.Tensor):
    """The untyped storage behind ``t`` (a DTensor's local shard's), or None."""
    local = getattr(t, "_local_tensor", None)
    t = local if local is not None else t
    try:
        return t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None


class MemoryCounter(TorchDispatchMode):
    """Live bytes of every storage this rank holds, by part, and their sum at its peak.

    A storage's part is decided where it is made: parameters, module buffers, gradients and
    optimizer states are named (``hold``, the gradient hooks, the optimizer's step); what the
    forward of a pipeline chunk makes and keeps is an activation (saved for backward: the
    forward's short-lived temporaries are gone before the peak they could not hold up), filed
    under the op that made it; what the backward and the schedule make (gradients of
    activations, recomputation, receive buffers, gathered weights) is "other"; weights a chunk
    still holds gathered when its forward ends (ZeRO-2 keeps them to the step's end) are
    parameters. A storage is counted once, however many tensors view it."""

    def __init__(self):
        super().__init__()
        self.live: dict[str, int] = dict.fromkeys(MEMORY_PARTS, 0)
        self.by_op: dict[tuple[str, str], int] = defaultdict(int)  # live bytes by (part, the op that made them)
        self.peak = 0
        self.at_peak: dict[str, int] = dict(self.live)
        self.ops_at_peak: dict[str, int] = {}
        self.part_peaks: dict[str, int] = dict(self.live)  # each part's own largest, whenever it was
        self.ops_at_activation_peak: dict[str, int] = {}
        self._info: dict[int, list] = {}  # id(storage) -> [part, bytes, op]
        self._refs: dict[int, weakref.ref] = {}
        self.forward_depth = 0
        self.in_optimizer = False
        self._handles = []
        self._params: list[torch.Tensor] = []

    # -- what holds what ------------------------------------------------------------------

    def _add(self, st, part: str, op: str = "") -> None:
        key = id(st)
        if key in self._info:
            return
        nbytes = st.nbytes()
        self._info[key] = [part, nbytes, op]
        self.live[part] += nbytes
        self.by_op[(part, op)] += nbytes
        self._refs[key] = weakref.ref(st, lambda _, key=key: self._gone(key))
        self._update_peak()

    def _gone(self, key: int) -> None:
        part, nbytes, op = self._info.pop(key)
        self._refs.pop(key, None)
        self.live[part] -= nbytes
        self.by_op[(part, op)] -= nbytes

    def file(self, t: torch.Tensor, part: str) -> None:
        """Count ``t``'s storage under ``part`` (moving it there if it was counted elsewhere)."""
        st = _storage(t)
        if st is None:
            return
        info = self._info.get(id(st))
        if info is None:
            self._add(st, part)
            return
        if info[0] != part:
            self.live[info[0]] -= info[1]
            self.by_op[(info[0], info[2])] -= info[1]
            info[0] = part
            self.live[part] += info[1]
            self.by_op[(part, info[2])] += info[1]

    def hold(self, modules, optimizers, fp8_weights=()) -> None:
        """Count what the rank holds before the step: the chunks' parameters and buffers, their
        gradients where present, the optimizers' states; and watch what comes later: gradients
        (as they accumulate), optimizer states (made in ``step``), activations (made in a
        chunk's forward)."""
        for m in modules:
            for p in m.parameters():
                self._params.append(p)
                self.file(p, "params")
                if p.grad is not None:
                    self.file(p.grad, "grads")
                self._handles.append(p.register_post_accumulate_grad_hook(lambda p: self.file(p.grad, "grads")))
            for b in m.buffers():
                self.file(b, "buffers")
            self._handles.append(m.register_forward_pre_hook(self._enter_forward))
            self._handles.append(m.register_forward_hook(self._leave_forward, always_call=True))
        for opt in optimizers:
            self._file_states(opt)
            for master in getattr(opt, "masters", {}).values():  # fp32 masters of bf16 parameters
                self.file(master, "optimizer")
        self._handles.append(register_optimizer_step_pre_hook(self._enter_step))
        self._handles.append(register_optimizer_step_post_hook(self._leave_step))

    def _file_states(self, opt) -> None:
        for state in opt.state.values():
            for v in state.values():
                if isinstance(v, torch.Tensor):
                    self.file(v, "optimizer")

    def _enter_forward(self, module, args):
        self.forward_depth += 1

    def _leave_forward(self, module, args, out):
        self.forward_depth -= 1
        for p in module.parameters():  # weights ZeRO-2 gathered and keeps (FSDP swaps them in): parameters
            self.file(p, "params")

    def _enter_step(self, opt, args, kwargs):
        self.in_optimizer = True
        for group in opt.param_groups:  # gradients set rather than accumulated (a split backward, FSDP)
            for p in group["params"]:
                if p.grad is not None:
                    self.file(p.grad, "grads")

    def _leave_step(self, opt, args, kwargs):
        self.in_optimizer = False
        self._file_states(opt)

    def release(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    # -- the peak ---------------------------------------------------------------------------

    def _file_grads(self) -> None:
        """Gradients set rather than accumulated (a split backward's weight pass, FSDP's reduced
        shards) are found where they are, as each new peak is recorded."""
        for p in self._params:
            g = p.grad
            if g is not None:
                st = _storage(g)
                info = self._info.get(id(st)) if st is not None else None
                if info is not None and info[0] != "grads":
                    self.file(g, "grads")

    def _update_peak(self) -> None:
        for part, n in self.live.items():
            if n > self.part_peaks[part]:
                self.part_peaks[part] = n
                if part == "activations":
                    self.ops_at_activation_peak = {k[1]: v for k, v in self.by_op.items() if v and k[0] == part}
        total = sum(self.live.values())
        if total > self.peak:
            self._file_grads()
            self.peak = total
            self.at_peak = dict(self.live)
            self.ops_at_peak = {k: v for k, v in self.by_op.items() if v}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.in_optimizer:
            part = "optimizer"
        elif self.forward_depth > 0 and torch._C._current_graph_task_id() == -1:
            part = "activations"  # made by a chunk's forward (not its recomputation in backward)
        else:
            part = "other"
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                st = _storage(t)
                if st is not None and id(st) not in self._info:
                    self._add(st, part, func.overloadpacket.__name__)
        return out

    # FSDP frees a gathered parameter by resizing its storage to nothing and gathers it again by
    # resizing it back, with no op a dispatch mode sees (as torch's MemTracker, watch resize_)
    def __enter__(self):
        self._resize = torch.UntypedStorage.resize_
        resize, counter = self._resize, self

        @functools.wraps(resize)
        def resize_(st, size):
            out = resize(st, size)
            counter._resized(st)
            return out

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*args)

    def _resized(self, st) -> None:
        info = self._info.get(id(st))
        if info is None:
            return
        delta = st.nbytes() - info[1]
        info[1] += delta
        self.live[info[0]] += delta
        self.by_op[(info[0], info[2])] += delta
        self._update_peak()


# ---------------------------------------------------------------------------------------------
# communication

c10d = torch.ops.c10d
_functional = torch.ops._c10d_functional
_autograd = torch.ops._c10d_functional_autograd


def _nbytes(t) -> int:
    return sum(x.numel() * x.element_size() for x in tree_leaves(t) if isinstance(x, torch.Tensor))


def _group(arg):
    """A c10d op's process-group argument (boxed) or a functional collective's group name."""
    from torch._C._distributed_c10d import ProcessGroup, _resolve_process_group

    return _resolve_process_group(arg) if isinstance(arg, str) else ProcessGroup.unbox(arg)


# op -> (kind, index of its process group argument, what it hands over): "in" the tensors it
# sends (the argument at index 0 or 1), "out" what it gathers (index 0 or the result).
_COLLECTIVES = {
    c10d.allreduce_.default: ("all_reduce", 1, ("arg", 0)),
    c10d.broadcast_.default: ("broadcast", 1, ("arg", 0)),
    c10d.reduce_.default: ("reduce", 1, ("arg", 0)),
    c10d.allgather_.default: ("all_gather", 2, ("arg", 0)),
    c10d._allgather_base_.default: ("all_gather", 2, ("arg", 0)),
    c10d.reduce_scatter_.default: ("reduce_scatter", 2, ("arg", 1)),
    c10d._reduce_scatter_base_.default: ("reduce_scatter", 2, ("arg", 1)),
    c10d.alltoall_.default: ("all_to_all", 2, ("arg", 1)),
    c10d.alltoall_base_.default: ("all_to_all", 2, ("arg", 1)),
    c10d.send.default: ("send", 1, ("arg", 0)),
    c10d.recv_.default: ("recv", 1, ("arg", 0)),
    _functional.all_reduce.default: ("all_reduce", 2, ("arg", 0)),
    _functional.all_reduce_.default: ("all_reduce", 2, ("arg", 0)),
    _functional.all_gather_into_tensor.default: ("all_gather", 2, ("out", None)),
    _functional.reduce_scatter_tensor.default: ("reduce_scatter", 3, ("arg", 0)),
    _functional.all_to_all_single.default: ("all_to_all", 3, ("arg", 0)),
    _autograd.all_to_all_single.default: ("all_to_all", 3, ("arg", 0)),
    _autograd.all_gather_into_tensor.default: ("all_gather", 2, ("out", None)),
    _autograd.reduce_scatter_tensor.default: ("reduce_scatter", 3, ("arg", 0)),
}


class CommCounter(TorchDispatchMode):
    """Bytes each collective of this rank hands over, by (process group name, kind): an
    all-reduce's or a broadcast's buffer, an all-gather's gathered result, a reduce-scatter's
    input before scattering, an all-to-all's or a send's tensors sent, a receive's buffer (the
    sizes the cost model's formulas take, ``cost_models.comm``)."""

    def __init__(self, names: dict[str, str]):
        super().__init__()
        self.names = names  # process group name -> the mesh dimension it is
        self.bytes: dict[tuple[str, str], int] = defaultdict(int)
        self.calls: dict[tuple[str, str], int] = defaultdict(int)
        self.wire: dict[str, float] = defaultdict(float)  # dimension -> bytes sent (``comm.wire_bytes``)
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        entry = _COLLECTIVES.get(func)
        if entry is not None and not self.paused:
            kind, at, (where, index) = entry
            group = _group(args[at])
            name = self.names.get(group.group_name, group.group_name)
            size = _nbytes(out if where == "out" else args[index])
            self.bytes[(name, kind)] += size
            self.calls[(name, kind)] += 1
            self.wire[name] += wire_bytes(kind, size, group.size())
        return out


# ---------------------------------------------------------------------------------------------
# FLOPs: formulas for the ops torch's counter does not know


def _causal_pairs(sq: int, sk: int, causal: bool) -> int:
    """Query-key pairs attention computes: all of them, or, causal with the queries the tail of
    the keys (the kernels' convention: query i sees keys up to i + sk - sq), those it sees."""
    if not causal:
        return sq * sk
    if sk >= sq:
        return sq * (sk - sq + 1) + sq * (sq - 1) // 2
    return sk * (sk + 1) // 2


def _attention_flops(q, k, v, causal: bool) -> int:
    """Forward FLOPs of attention (two matmuls over the pairs it computes)."""
    b, h, sq, d = q
    sk, dv = k[2], v[3]
    return 2 * b * h * _causal_pairs(sq, sk, causal) * (d + dv)


# FlashAttention's backward recomputes the scores: five matmuls to the forward's two
FLASH_BACKWARD_MATMULS = 2.5


def _flash_flop(q, k, v, causal, scale, *args, out_shape=None, **kwargs) -> int:
    return _attention_flops(q, k, v, causal)


def _flash_backward_flop(q, k, v, out, lse, do, causal, scale, *args, out_shape=None, **kwargs) -> int:
    return int(FLASH_BACKWARD_MATMULS * _attention_flops(q, k, v, causal))


def _sdpa_cpu_flop(q, k, v, dropout=0.0, is_causal=False, *args, out_shape=None, **kwargs) -> int:
    return _attention_flops(q, k, v, is_causal)


def _sdpa_cpu_backward_flop(grad, q, k, v, out, lse, dropout=0.0, is_causal=False, *args, out_shape=None, **kw) -> int:
    return int(FLASH_BACKWARD_MATMULS * _attention_flops(q, k, v, is_causal))


def _grouped_mm_flop(a, b, *args, out_shape=None, **kwargs) -> int:
    """``_grouped_mm``: each row multiplies its group's matrix (2-D x 3-D), a contraction split
    into groups (2-D x 2-D, the weights' gradient) or a batch of products (3-D x 3-D)."""
    if len(a) == 2 and len(b) == 3:
        return 2 * a[0] * a[1] * b[2]
    if len(a) == 2 and len(b) == 2:
        return 2 * a[0] * a[1] * b[1]
    if len(a) == 3 and len(b) == 3:
        return 2 * a[0] * a[1] * a[2] * b[2]
    return 2 * a[-2] * a[-1] * b[-1]


def _fp8_mm_flop(xq, xs, wq, ws, offs, rows, out_dtype, experts, *args, out_shape=None, **kwargs) -> int:
    """The FP8 forward GEMM: each row of ``xq`` times one matrix of ``wq`` ``[G, N, K]``."""
    return 2 * xq[0] * xq[1] * wq[-2]


def flop_formulas() -> dict:
    """Op -> FLOP formula (over argument shapes) for the ops ``FlopCounterMode`` has none for."""

    aten = torch.ops.aten
    out = {
        torch.ops.autoshard.flash_attention: _flash_flop,
        torch.ops.autoshard.flash_attention_backward: _flash_backward_flop,
        torch.ops.autoshard.fp8_mm: _fp8_mm_flop,
        aten._scaled_dot_product_flash_attention_for_cpu: _sdpa_cpu_flop,
        aten._scaled_dot_product_flash_attention_for_cpu_backward: _sdpa_cpu_backward_flop,
    }
    if hasattr(aten, "_grouped_mm"):
        out[aten._grouped_mm] = _grouped_mm_flop
    return out


class FlopCounter(FlopCounterMode):
    """``FlopCounterMode`` without its module tracker, whose backward hooks on a pipeline stage's
    input (a leaf tensor) break ``torch.autograd.grad``, which the split backward of the
    zero-bubble schedules runs; the totals are the same."""

    def __enter__(self):
        self.flop_counts.clear()
        self.mode = _FlopCounterMode(self)
        self.mode.__enter__()
        return self

    def __exit__(self, *args):
        mode, self.mode = self.mode, None
        return mode.__exit__(*args)


@dataclass
class Measured:
    """What one rank did in one optimizer step."""

    rank: int
    coords: dict
    peak_bytes: int = 0
    memory_bytes: dict = field(default_factory=dict)  # part -> bytes live at the peak
    activations_by_op: dict = field(default_factory=dict)  # "part:op" -> bytes live at the peak
    part_peaks: dict = field(default_factory=dict)  # part -> its own largest live bytes in the step
    activations_at_their_peak: dict = field(default_factory=dict)  # op -> bytes, when activations peaked
    flops: int = 0
    comm_bytes: dict = field(default_factory=dict)  # mesh dimension -> kind -> bytes
    comm_calls: dict = field(default_factory=dict)
    comm_wire_bytes: dict = field(default_factory=dict)  # mesh dimension -> bytes sent
    seconds: float = 0.0
    rss_bytes: int = 0


# ---------------------------------------------------------------------------------------------
# one rank


def coordinates(mesh: Mesh, rank: int) -> dict[str, int]:
    """The rank's place on each mesh axis (``mesh.order`` lists them innermost first)."""
    out, stride = {}, 1
    for axis in mesh.order:
        size = getattr(mesh, axis)
        out[axis] = (rank // stride) % size
        stride *= size
    return out


def rank_at(mesh: Mesh, **coords: int) -> int:
    """The global rank at these mesh coordinates (0 on every axis not given)."""
    rank, stride = 0, 1
    for axis in mesh.order:
        rank += coords.get(axis, 0) * stride
        stride *= getattr(mesh, axis)
    return rank


def _dimension(mesh: Mesh, members: list[int]) -> str:
    """The mesh dimension a process group spans, from which coordinates vary among its ranks:
    ``tp``, ``cp``, ``pp``, ``dp`` (dp x cp too: ZeRO and FSDP shard over both, and the cost model
    counts that traffic as data parallelism's), else ``mixed``. A group of every rank is named
    by its coordinates too (ZeRO's dp x cp group is the world where nothing else splits it); the
    default group is ``world`` where its ranks vary in several dimensions (``group_names``)."""
    varying = {a for a in GRID_AXES if len({coordinates(mesh, r)[a] for r in members}) > 1}
    if len(varying) == 1:
        return varying.pop()
    if varying == {"dp", "cp"}:
        return "dp"
    return "mixed" if varying else "self"


def group_names(mesh: Mesh) -> dict[str, str]:
    """Process group name -> the mesh dimension its traffic is counted under, for every group
    this process has made: the program's named groups as ``runtime.groups`` holds them (the
    expert-parallel group is ``ep``; the expert-data-parallel and routing groups are data
    parallelism's), the rest by the coordinates their ranks vary in (``_dimension``)."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d_py

    names = {}
    for pg in list(c10d_py._world.pg_names):
        names[pg.group_name] = _dimension(mesh, dist.get_process_group_ranks(pg))
    if dist.group.WORLD is not None:  # a mesh dimension spanning every rank reuses it
        label = _dimension(mesh, list(range(mesh.gpus)))
        names[dist.group.WORLD.group_name] = "world" if label in ("mixed", "self") else label
    labels = {"tp": "tp", "cp": "cp", "pp": "pp", "dp": "dp", "ep": "ep", "edp": "dp", "route": "dp"}
    for axis, label in labels.items():
        pg = groups._GROUPS.get(axis)
        if pg is not None:
            names[pg.group_name] = label
    return names


def _optimizers(optim) -> list:

    return optimizer_parts(optim)


def measure(out, rank: int, compute: str = "bf16") -> Measured:
    """Run rank ``rank`` of the program in directory ``out`` for one optimizer step on fake
    tensors over a fake process group of the plan's size, and count what it did. One rank per
    process: it makes the process group."""
    import os
    import resource
    import time
    from pathlib import Path

    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    out = Path(out)
    plan, program = rt.read_program(out)
    os.environ["WORLD_SIZE"] = str(plan.gpus)
    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=plan.gpus)
    try:
        args = trainer.parse_args(["--steps", "1", "--compute-dtype", compute, "--no-compile"])  # eager, as counted
        with FakeTensorMode(allow_non_fake_inputs=True):
            tr = trainer.Trainer.build(args, out, plan, program, torch.device("cpu"))
            make_optimizer_states(tr.optim)  # a step after the first: the states exist
            memory = MemoryCounter()
            memory.hold(tr.stages, _optimizers(tr.optim))
            comm = CommCounter(group_names(plan.mesh))
            flops = FlopCounter(display=False, custom_mapping=flop_formulas())
            with memory, flops, comm:
                tr.step(0)
            memory.release()
        result = Measured(rank, coordinates(plan.mesh, rank))
        result.peak_bytes = memory.peak
        result.memory_bytes = dict(memory.at_peak)
        result.activations_by_op = {
            f"{part}:{op}": n for (part, op), n in sorted(memory.ops_at_peak.items(), key=lambda kv: -kv[1])
        }
        result.part_peaks = dict(memory.part_peaks)
        result.activations_at_their_peak = dict(sorted(memory.ops_at_activation_peak.items(), key=lambda kv: -kv[1]))
        result.flops = flops.get_total_flops()
        for (dim, kind), n in comm.bytes.items():
            result.comm_bytes.setdefault(dim, {})[kind] = n
            result.comm_calls.setdefault(dim, {})[kind] = comm.calls[(dim, kind)]
        result.comm_wire_bytes = dict(comm.wire)
        result.seconds = time.perf_counter() - start
        result.rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        return result
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------------
# predicted against measured


@dataclass(frozen=True)
class Bounds:
    """How far a measurement may lie from the plan's figure, relative to the plan's: peak
    memory, FLOPs, and each mesh dimension's bytes on the wire. A communication difference
    smaller than ``comm_floor_bytes`` passes whatever its ratio (a loss or a norm all-reduced, a
    routing count exchanged: control messages the cost model does not price)."""

    memory: float = 0.10
    flops: float = 0.03
    comm: float = 0.10
    comm_floor_bytes: float = 2**20


@dataclass
class Row:
    what: str
    predicted: float
    measured: float
    bound: float | None = None  # None: shown, not checked

    @property
    def ratio(self) -> float | None:
        return self.measured / self.predicted if self.predicted else None

    def ok(self, floor: float = 0.0) -> bool:
        if self.bound is None or abs(self.measured - self.predicted) <= floor:
            return True
        return abs(self.measured - self.predicted) <= self.bound * abs(self.predicted)


@dataclass
class RankReport:
    rank: int
    coords: dict
    chosen_as: list[str]
    rows: list[Row]
    measured: Measured
    ok: bool


MEMORY_ROWS = (  # (row, predicted part, measured parts)
    ("params", "params", ("params",)),
    ("grads", "grads", ("grads",)),
    ("optimizer", "optimizer", ("optimizer",)),
    ("activations", "activations", ("activations",)),
    ("fp8 weight copies", "fp8_weights", ("fp8_weights",)),
    ("buffers and the rest", "buffers", ("buffers", "other")),
)


def compare(promised: dict, measured: Measured, bounds: Bounds) -> list[Row]:
    """The rows of one rank: peak memory (checked) and its parts, FLOPs (checked), and each mesh
    dimension's wire bytes (checked) with its collectives' bytes handed over."""
    pm, mm = promised["memory_bytes"], measured.memory_bytes
    rows = [Row("peak memory", pm["total"], measured.peak_bytes, bounds.memory)]
    for label, part, parts in MEMORY_ROWS:
        rows.append(Row(f"  {label}", pm.get(part, 0.0), sum(mm.get(p, 0) for p in parts)))
    rows.append(Row("FLOPs", promised["flops"]["total"], measured.flops, bounds.flops))
    dims = sorted(set(promised["comm_wire_bytes"]) | set(measured.comm_wire_bytes) - {"world"})
    for dim in dims:
        rows.append(
            Row(f"{dim} bytes sent", promised["comm_wire_bytes"].get(dim, 0.0), measured.comm_wire_bytes.get(dim, 0.0),
                bounds.comm)
        )  # fmt: skip
        kinds = sorted(set(promised["comm_bytes"].get(dim, {})) | set(measured.comm_bytes.get(dim, {})))
        for kind in kinds:
            rows.append(
                Row(f"  {kind}", promised["comm_bytes"].get(dim, {}).get(kind, 0.0),
                    measured.comm_bytes.get(dim, {}).get(kind, 0.0))
            )  # fmt: skip
    return rows


def chosen_ranks(plan: Plan, spec: str) -> dict[int, list[str]]:
    """Global rank -> why it was chosen, from ``first,last,busiest`` and/or rank numbers: the
    rank holding the first chunk, the one holding the last (with the loss), and the one the
    plan says needs the most memory (each at TP, CP and DP coordinate 0)."""

    pp = plan.mesh.pp
    sched = schedule(plan.schedule)
    chunks = pp * plan.virtual_stages
    ranks = plan.predicted.ranks
    named = {
        "first": sched.chunk_rank(0, pp),
        "last": sched.chunk_rank(chunks - 1, pp),
        "busiest": max(range(len(ranks)), key=lambda r: ranks[r]["memory_bytes"]["total"]) if ranks else 0,
    }
    out: dict[int, list[str]] = {}
    for word in (w.strip() for w in spec.split(",") if w.strip()):
        if word in named:
            out.setdefault(rank_at(plan.mesh, pp=named[word]), []).append(word)
        elif word.isdigit() and int(word) < plan.gpus:
            out.setdefault(int(word), []).append("asked")
        else:
            raise AutoshardError(
                f"--ranks {spec}: {word!r} is not first, last, busiest or a rank below {plan.gpus}; "
                "e.g. --ranks first,last,busiest or --ranks 0,17"
            )
    return out


@dataclass
class AtScaleReport:
    out: str
    plan: str  # the plan in a line
    bounds: Bounds
    ranks: list[RankReport]

    @property
    def ok(self) -> bool:
        return all(r.ok for r in self.ranks)

    def to_dict(self) -> dict:
        return {
            "out": self.out,
            "plan": self.plan,
            "ok": self.ok,
            "bounds": self.bounds.__dict__,
            "ranks": [
                {
                    "rank": r.rank,
                    "coords": r.coords,
                    "chosen_as": r.chosen_as,
                    "ok": r.ok,
                    "rows": [
                        {
                            "what": x.what.strip(),
                            "predicted": x.predicted,
                            "measured": x.measured,
                            "ratio": x.ratio,
                            "checked": x.bound is not None,
                            "ok": x.ok(self._floor(x)),
                        }
                        for x in r.rows
                    ],  # fmt: skip
                    "activations_by_op": r.measured.activations_by_op,
                    "seconds": r.measured.seconds,
                    "rss_bytes": r.measured.rss_bytes,
                }
                for r in self.ranks
            ],
        }

    def _floor(self, row: Row) -> float:
        return self.bounds.comm_floor_bytes if "bytes" in row.what else 0.0


def _fmt(row: Row) -> str:
    if "FLOP" in row.what:
        unit, scale = "TFLOP", 1e12
    else:
        unit, scale = "GB", 1e9
    return f"{row.predicted / scale:10.2f} {row.measured / scale:10.2f} {unit:5s}"


def format_report(report: AtScaleReport) -> str:
    """The table ``autoshard verify --at-scale`` prints."""
    b = report.bounds
    lines = [
        f"{report.out}: {report.plan}",
        f"one optimizer step per rank on fake tensors; bounds: peak memory {b.memory:.0%}, FLOPs {b.flops:.0%}, "
        f"bytes per dimension {b.comm:.0%}",
    ]
    for r in report.ranks:
        where = ", ".join(f"{k}={v}" for k, v in r.coords.items())
        lines += ["", f"rank {r.rank} ({where}; {', '.join(r.chosen_as)}): {'OK' if r.ok else 'FAILED'}"]
        lines.append(f"  {'':28s} {'predicted':>10s} {'measured':>10s}        ratio")
        for row in r.rows:
            ratio = f"{row.ratio:6.3f}" if row.ratio is not None else "     -"
            flag = "" if row.bound is None else ("  ok" if row.ok(report._floor(row)) else "  OUT OF BOUNDS")
            lines.append(f"  {row.what:28s} {_fmt(row)} {ratio}{flag}")
        top = list(r.measured.activations_by_op.items())[:6]
        if top:
            shown = ", ".join(f"{k} {v / 1e9:.2f}" for k, v in top)
            lines.append(f"  at the peak, by part and op (GB): {shown}")
        lines.append(f"  {r.measured.seconds:.1f} s, {r.measured.rss_bytes / 1e9:.2f} GB resident")
    lines.append("")
    lines.append("OK: the program does what the plan promises" if report.ok else "FAILED: see OUT OF BOUNDS above")
    return "\n".join(lines)


def _failure(stderr: str) -> str:
    """The line of a failed rank's output that names its error (torch prefixes each line of a
    rank's traceback with ``[rankN]:``)."""
    import re

    lines = [re.sub(r"^\[rank\d+\]:\s*", "", line).strip() for line in stderr.splitlines()]
    lines = [line for line in lines if line]
    named = [line for line in lines if re.match(r"^[\w.]*(Error|Exception|Interrupt)\b", line)]
    return (named or lines or ["(no output)"])[-1]


def verify_at_scale(
    out,
    ranks: str = "first,last,busiest",
    bounds: Bounds = Bounds(),
    jobs: int | None = None,
    timeout: float = 3600.0,
) -> AtScaleReport:
    """Run the chosen ranks of the program in ``out`` (a directory ``autoshard compile`` wrote)
    one optimizer step each on fake tensors, ``jobs`` processes at a time (default: the CPU
    count, at most 2), and compare each with its pipeline rank's promise in ``plan.json``."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    out = Path(out)
    plan, _ = _read_program(out)
    promised = plan.predicted.ranks
    if not promised:
        raise AutoshardError(f"{out / 'plan.json'} has no per-rank predictions; recompile it with this autoshard")
    chosen = chosen_ranks(plan, ranks)
    jobs = jobs or max(1, min(2, os.cpu_count() or 1))
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "TORCH_CPP_LOG_LEVEL": "ERROR"}
    pending, running, done = list(chosen), {}, {}

    def show() -> None:
        stages = plan.mesh.pp
        where = (f"rank {r} (pipeline stage {coordinates(plan.mesh, r)['pp']} of {stages})" for r in running)
        progress.update(replaying=", ".join(where), done=f"{len(done)} of {len(chosen)}")

    with progress.stage("verify at scale"):
        while pending or running:
            while pending and len(running) < jobs:
                rank = pending.pop(0)
                cmd = [sys.executable, "-m", "autoshard.atscale", str(out), str(rank)]
                running[rank] = subprocess.Popen(
                    cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
                )
            show()
            rank, proc = next(iter(running.items()))
            stdout, stderr = _wait(proc, rank, timeout, show)
            del running[rank]
            if proc.returncode != 0:
                raise AutoshardError(f"rank {rank} failed on fake tensors: {_failure(stderr)[:300]}")
            done[rank] = Measured(**json.loads(stdout.strip().splitlines()[-1]))
    reports = []
    for rank, why in chosen.items():
        m = done[rank]
        rows = compare(promised[m.coords["pp"]], m, bounds)
        floor = lambda row: bounds.comm_floor_bytes if "bytes" in row.what else 0.0  # noqa: E731
        reports.append(RankReport(rank, m.coords, why, rows, m, all(row.ok(floor(row)) for row in rows)))
    line = (
        f"{plan.mesh.product_form()}, ZeRO-{plan.zero_stage}, {plan.schedule} (v={plan.virtual_stages}), "
        f"{plan.microbatches} micro-batches of {plan.microbatch_size}"
    )
    return AtScaleReport(str(out), line, bounds, reports)


def _wait(proc, rank: int, timeout: float, tick) -> tuple[str, str]:
    """``proc.communicate()`` within ``timeout`` seconds, calling ``tick`` every ``POLL_S`` while
    it waits (a rank of a large plan takes minutes: the progress line's clock keeps moving)."""
    import subprocess
    import time

    deadline = time.monotonic() + timeout
    while True:
        try:
            return proc.communicate(timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            if time.monotonic() >= deadline:
                proc.kill()
                raise AutoshardError(
                    f"rank {rank} did not finish its step on fake tensors in {timeout:.0f} s"
                ) from None
            tick()


def main(argv: list[str] | None = None) -> None:
    """``python -m autoshard.atscale OUT RANK``: measure one rank, print it as one JSON line."""
    import dataclasses
    import json
    import sys

    args = sys.argv[1:] if argv is None else argv
    measured = measure(args[0], int(args[1]))
    print(json.dumps(dataclasses.asdict(measured)))


if __name__ == "__main__":
    main()
