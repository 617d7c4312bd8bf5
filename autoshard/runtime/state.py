"""Training checkpoints with ``torch.distributed.checkpoint`` (DCP), in the single-device model's
coordinates, so that a checkpoint written under one plan loads under any other plan of the model.

Every tensor a rank holds (a parameter's piece, its AdamW moments, a routing bias) is described to
DCP as the blocks it covers of the full single-device tensor (:class:`Pieces`, built from the stage
files' ``SHARDS`` by ``stages.piece_blocks`` and, under FSDP, the shard's rows). DCP writes each
block once (the copy that counts: one replica of each) and, on load, reads into each rank exactly
the parts of the saved blocks its own pieces overlap: resharding across TP, PP, CP, EP, DP, ZeRO and
GPU counts is DCP's overlap planning, not code of ours. DTensor cannot describe these pieces (a
fused q/k/v projection's TP piece is several blocks of the full tensor), so ``Pieces`` speaks DCP's
sharded-tensor protocol (``__create_write_items__``, ``__create_chunk_list__``,
``__get_tensor_shard__``) itself.

A checkpoint is a directory ``DIR/step_NNNNNNNN`` (the optimizer steps done): DCP's files, each
rank's RNG state, ``trainer.json`` (step, data position, loss window, what wrote it), every file's
checksum and, written last, ``COMPLETE`` (``autoshard.runtime.durable``: only a directory with
``COMPLETE`` whose files match their checksums counts).
"""

from __future__ import annotations

import io
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from autoshard.ir.program import Tied
from autoshard.runtime import fake
from autoshard.runtime.stages import Block, full_shape, piece_axis, piece_blocks, restrict_rows

FORMAT = 1


# ---------------------------------------------------------------------------------------------
# what a rank holds, in full-tensor coordinates


class Pieces(torch.Tensor):
    """A rank's blocks of one full single-device tensor, as DCP's planners see a sharded tensor:
    the global shape is the full one, each block is a chunk at its offset. It holds no storage
    of its own; DCP only asks for the chunks and for each block's tensor (a view of the rank's
    local tensor to load into, or a copy of it to save)."""

    @staticmethod
    def __new__(cls, shape: tuple[int, ...], blocks: list[tuple[Block, torch.Tensor]], dtype: torch.dtype):
        self = torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device="cpu")
        self.blocks = blocks
        return self

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise NotImplementedError(f"Pieces is only a checkpoint description; {func} is not defined on it")

    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        props = TensorProperties(dtype=self.dtype)
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(b.full)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(b.full), sizes=torch.Size(b.sizes)),
                    properties=props,
                    size=self.size(),
                ),
            )
            for b, _ in self.blocks
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(b.full), sizes=torch.Size(b.sizes)) for b, _ in self.blocks]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for b, t in self.blocks:
            if torch.Size(b.full) == index.offset:
                return t
        raise ValueError(f"{index.fqn}: no block at {tuple(index.offset)}")


@dataclass
class Held:
    """One tensor of this rank, where it lies in the single-device model: ``key`` (the model's
    name; a tied parameter's first name), the full ``shape``, and the ``blocks`` of ``local``
    (this rank's tensor: a TP or EP piece, or an FSDP shard of one)."""

    key: str
    local: torch.Tensor
    shape: tuple[int, ...]
    blocks: list[Block]

    def pieces(self, copy: bool, tensor: torch.Tensor | None = None) -> Pieces:
        """The DCP view of ``tensor`` (default ``local``, or a same-shaped optimizer moment):
        copies of its blocks to save, or views of them to load into."""
        t = self.local if tensor is None else tensor
        out = []
        for b in self.blocks:
            view = t.detach()[tuple(slice(o, o + n) for o, n in zip(b.local, b.sizes))]
            out.append((b, view.detach().clone() if copy else view))
        return Pieces(self.shape, out, t.dtype)


def local_of(t: torch.Tensor) -> torch.Tensor:
    """This rank's tensor of a parameter, gradient or moment (FSDP2 keeps them as DTensors)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _fsdp_rows(t: torch.Tensor) -> tuple[int, int, int] | None:
    """The rows of the unsharded tensor an FSDP2 DTensor's local shard holds: (first, end, their
    dimension; 0 but for stacked experts split along another, ``program._expert_split``)."""
    if not hasattr(t, "device_mesh"):
        return None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    with fake.real():  # it reads the mesh's rank tensor
        sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    (dim,) = [p.dim for p in t.placements if p.is_shard()]
    return offsets[dim], offsets[dim] + sizes[dim], dim


@dataclass
class Entry:
    """A parameter or buffer of this rank and which of its replicas this copy is: whether it is
    the copy that counts (once per full-tensor block: for saving and for the gradient norm) is
    ``tie_first and (edp_first if expert else tp_first and dp_first)``."""

    held: Held
    param: torch.Tensor
    expert: bool  # stacked expert weights: replicas are the expert-data-parallel ranks
    tp_first: bool  # split over TP, or this is TP rank 0's copy
    dp_first: bool  # FSDP-sharded over dp x cp, or this is the first dp x cp replica's copy
    edp_first: bool  # FSDP-sharded over the expert-data-parallel ranks, or the first one's copy
    tie_first: bool  # not a tied parameter's copy in a later chunk
    stepped: torch.Tensor | None = None  # ZeRO-1's fp32 rows of it, whose gradient is the reduced one

    @property
    def counted(self) -> bool:
        return self.tie_first and (self.edp_first if self.expert else self.tp_first and self.dp_first)

    @property
    def grad(self) -> torch.Tensor | None:
        """The reduced gradient this rank holds of it: ZeRO-1's rows', else the parameter's."""
        g = self.stepped.grad if self.stepped is not None else self.param.grad
        return None if g is None else local_of(g)


def kept(chunk: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a program keeps of pipeline chunk ``chunk`` (saves for verification, checkpoints,
    exports), by the chunk's names: its parameters, the buffers the single-device model's state
    dict has (those ``program.build_chunks`` leaves persistent, as the model does: a causal mask
    held as a buffer, not a rotary table made again at every start) and MoE routing biases (the
    stage file's ``ROUTING``: trained state, whatever the model registers them as)."""
    biases = {e["bias"] for e in getattr(chunk.stage_file, "ROUTING", {}).values() if e.get("bias")}
    buffers = [(n, b) for n, b in chunk.named_buffers() if n in biases or _persistent(chunk, n)]
    return [*chunk.named_parameters(), *buffers]


def _persistent(chunk: nn.Module, name: str) -> bool:
    """Whether buffer ``name`` of ``chunk`` is in its state dict (torch asks no hooks this way)."""
    owner, _, leaf = name.rpartition(".")
    return leaf not in chunk.get_submodule(owner)._non_persistent_buffers_set


def entries(stages: list[nn.Module], chunk_ids: list[int], ranks, tied: Sequence[Tied]) -> list[Entry]:
    """What this rank keeps (``kept``: parameters, persistent buffers, routing biases), each once
    (a parameter two chunks of this rank share is listed once), in full-tensor coordinates. A tied
    parameter's copies are one key (its first name) and count on the first chunk holding it only."""
    canonical, first_chunk = {}, {}
    for entry in tied:
        for name in entry.names:
            canonical[name] = entry.names[0]
            first_chunk[name] = min(entry.chunks)
    out, seen = [], set()
    for module, c in zip(stages, chunk_ids):
        sf = module.stage_file
        shards, origin = sf.SHARDS, sf.ORIGIN
        experts = set(getattr(sf, "EXPERTS", ()))
        for name, p in kept(module):
            if id(p) in seen:
                continue
            seen.add(id(p))
            source = origin.get(name, name)
            spec = shards.get(source)
            rows = _fsdp_rows(p)
            axis = piece_axis(spec)
            rank, size = (ranks.ep, ranks.ep_size) if axis == "ep" else (ranks.tp, ranks.tp_size)
            full = full_shape(tuple(p.shape), spec, size)  # p.shape: the piece's (an FSDP DTensor's global)
            blocks = piece_blocks(full, spec, rank, size)
            if rows is not None:
                blocks = restrict_rows(blocks, *rows)
            held = Held(canonical.get(source, source), local_of(p), full, blocks)
            out.append(
                Entry(
                    held,
                    p,
                    expert=name in experts,
                    tp_first=axis == "tp" or ranks.tp == 0,
                    dp_first=rows is not None or (ranks.dp == 0 and ranks.cp == 0),
                    edp_first=rows is not None or ranks.edp == 0,
                    tie_first=source not in first_chunk or c == first_chunk[source],
                )
            )
    return out


# ---------------------------------------------------------------------------------------------
# the gradient norm over every shard


def clip_gradients(items: list[Entry], max_norm: float | None, replicated: bool = False, group=None) -> float:
    """The global L2 norm of the gradients, each full tensor counted once over every parallel
    dimension (one all-reduce of this rank's counted squares), and, with ``max_norm``, every
    gradient scaled as ``torch.nn.utils.clip_grad_norm_`` scales the single-device model's.
    ``replicated``: every rank holds every gradient whole and reduced (data parallelism alone at
    ZeRO-0, as under DDP); each computes the same norm from its own copies, with no collective
    in the step (the reduced gradients agree bit for bit over the replicas). ``group``: the ranks
    that hold the model between them (default: all; one DiLoCo island's)."""
    mine = _counts_here(replicated)
    counted = [e.grad.detach() for e in items if mine(e) and e.grad is not None]
    device = counted[0].device if counted else next((e.param.device for e in items), torch.device("cpu"))
    total = torch.zeros((), dtype=torch.float64, device=device)  # on the device the backend reduces (NCCL: GPU)
    # each tensor's norm in its own precision (no fp64 copy of it), in one foreach call per dtype
    # as clip_grad_norm_ computes them; their squares summed in fp64
    by_dtype: dict = {}
    for g in counted:
        by_dtype.setdefault(g.dtype, []).append(g)
    for grads in by_dtype.values():
        total += torch.stack(torch._foreach_norm(grads)).double().square().sum()
    if dist.is_initialized() and not replicated:
        dist.all_reduce(total, group=group)
    norm = fake.value(total.sqrt())
    if max_norm is not None and max_norm > 0:
        coef = min(1.0, max_norm / (norm + 1e-6))
        if coef < 1.0:
            torch._foreach_mul_([e.grad for e in items if e.grad is not None], coef)
    return norm


def _counts_here(replicated: bool):
    """Whether this rank's copy of an entry is the one a norm over every shard counts: once per
    full-tensor block over the world, or, ``replicated`` (every rank holds every tensor whole),
    once on each rank, which then needs no collective."""
    return (lambda e: e.tie_first and (e.expert or e.tp_first)) if replicated else (lambda e: e.counted)


def trust_norms(items: list[Entry], optim, prepared: list, keys: Sequence[str], replicated: bool = False) -> dict:
    """LAMB's per-tensor norms (``runtime.lamb``), each over the WHOLE single-device tensor:
    ``prepared`` is what the optimizer parts' ``prepare`` returned (stepped tensor, this rank's
    squared norms of its ``w`` and ``u``). Squares of the copies that count (as the gradient norm
    counts them: one copy of each TP, EP, ZeRO-1 row or FSDP shard block, a tensor replicated
    over TP or DP once) are added into one vector indexed by the model's state-dict ``keys``,
    the same on every rank, and summed by one all-reduce over the world. Returns id of stepped
    tensor -> (||w||, ||u||)."""
    mine = _counts_here(replicated)
    entry_of = {id(_stepped(opt, e.param)): e for e, opt in _optimized(items, optim)}
    index = {k: i for i, k in enumerate(keys)}
    device = prepared[0][1].device if prepared else next((e.param.device for e in items), torch.device("cpu"))
    total = torch.zeros(2 * len(keys), dtype=torch.float64, device=device)  # (NCCL reduces on the GPU)
    where = {}
    for w, w_sq, u_sq in prepared:
        e = entry_of[id(w)]
        at = where[id(w)] = 2 * index[e.held.key]
        if mine(e):
            total[at] += w_sq
            total[at + 1] += u_sq
    if dist.is_initialized() and not replicated:
        dist.all_reduce(total)
    norms = total.sqrt().tolist()
    return {i: (norms[at], norms[at + 1]) for i, at in where.items()}


# ---------------------------------------------------------------------------------------------
# optimizer states


def checkpoint_bytes(items: list[Entry]) -> float:
    """About what this rank writes of a checkpoint: the counted blocks of its tensors, and for
    trained parameters two fp32 AdamW moments of them."""
    total = 0.0
    for e in items:
        if not e.counted:
            continue
        n = sum(math.prod(b.sizes) for b in e.held.blocks)
        total += n * e.held.local.element_size() + (8 * n if isinstance(e.param, nn.Parameter) else 0)
    return total


def optimizer_parts(optim) -> list:
    """The optimizers behind the program's (AdamW, ``program.MasterAdamW``, ``zero.ShardedAdamW``)."""
    return list(getattr(optim, "parts", [optim]))


def _stepped(opt: torch.optim.Optimizer, p: torch.Tensor) -> torch.Tensor:
    """The tensor ``opt`` steps for parameter ``p`` and keys its states by: ``p``'s fp32 master
    (or ZeRO-1's fp32 rows of it) where the optimizer keeps one, else ``p``."""
    master = getattr(opt, "master", None)
    return master(p) if master is not None else p


def _moments(opt: torch.optim.Optimizer, p: torch.Tensor, create: bool) -> dict | None:
    p = _stepped(opt, p)
    state = opt.state.get(p)
    if not state and create:
        state = opt.state[p] = {
            "step": torch.tensor(0.0, dtype=torch.float32),  # as AdamW makes it (a constant, on fake tensors too)
            "exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format),
        }
    return state or None


MOMENTS = ("exp_avg", "exp_avg_sq")


def optim_state(items: list[Entry], optim, copy: bool = True) -> dict:
    """The optimizer's states to save, in DCP form: copies (or views) of the ones that count."""
    out = {}
    for e, opt in _optimized(items, optim):
        if not e.counted:
            continue
        st = opt.state.get(_stepped(opt, e.param))
        if st:
            for m in MOMENTS:
                out[f"optim/{m}/{e.held.key}"] = e.held.pieces(copy, local_of(st[m]))
            out[f"optim/step/{e.held.key}"] = st["step"].detach().clone()
    return out


def _params(opt) -> list[torch.Tensor]:
    """The parameters ``opt`` steps (ZeRO-1's: the full parameters whose rows it steps)."""
    if hasattr(opt, "params"):
        return list(opt.params)
    return [p for group in opt.param_groups for p in group["params"]]


def _optimized(items: list[Entry], optim):
    """(entry, the optimizer holding its states)."""
    by_param = {id(e.param): e for e in items}
    for opt in optimizer_parts(optim):
        for p in _params(opt):
            if id(p) in by_param:
                yield by_param[id(p)], opt


def use_stepped(items: list[Entry], optim) -> None:
    """What a checkpoint holds of a parameter is what the optimizer steps for it: the fp32
    master of a low-precision parameter (``program.MasterAdamW``; ``write_back`` rounds it into
    the parameter after a load), or ZeRO-1's fp32 rows of it (``zero.ShardedAdamW``), which
    every rank of the group holds a different part of, so each rank's counts (saved once, in the
    norm once), as an FSDP shard's does."""
    for opt in optimizer_parts(optim):
        masters = getattr(opt, "masters", {})
        rows = getattr(opt, "rows_of", None)
        for e in items:
            master = masters.get(id(e.param))
            if master is None:
                continue
            if rows is None:
                e.held = Held(e.held.key, master, e.held.shape, e.held.blocks)
                continue
            if e.param.dim() == 0:
                continue  # a scalar: one rank's row, the first replica's copy counts as before
            e.held = Held(e.held.key, master, e.held.shape, restrict_rows(e.held.blocks, *rows(e.param)))
            e.stepped = master
            if e.expert:
                e.edp_first = True
            else:
                e.dp_first = True


def write_back(optim) -> None:
    """Round every fp32 master into its parameter (after a checkpoint was loaded into them)."""
    for opt in optimizer_parts(optim):
        if hasattr(opt, "write_back"):
            opt.write_back()


def make_optimizer_states(optim) -> None:
    """Make (zero) the AdamW states of every parameter of ``optim`` that has none yet, as any
    step after the first finds them (AdamW makes them in its first step)."""
    for opt in optimizer_parts(optim):
        for p in _params(opt):
            _moments(opt, p, create=True)


def load_targets(items: list[Entry], optim, saved: dict) -> list[dict]:
    """Views of everything this rank holds, to load a checkpoint into, as DCP load passes
    (``split_duplicates``: a tied parameter's copies in two chunks of this rank share a key).
    Optimizer states the optimizer has not made yet are made (zero) first, where the checkpoint
    (``saved``: its keys) has them."""
    out: dict[str, list] = {}
    for e in items:
        out.setdefault(f"model/{e.held.key}", []).append(e.held.pieces(False))
    for e, opt in _optimized(items, optim):
        if f"optim/exp_avg/{e.held.key}" not in saved:
            continue
        st = _moments(opt, e.param, create=True)
        for m in MOMENTS:
            out.setdefault(f"optim/{m}/{e.held.key}", []).append(e.held.pieces(False, local_of(st[m])))
        out.setdefault(f"optim/step/{e.held.key}", []).append(st["step"])
    return split_duplicates(out)


def local_state(items: list[Entry], optim, create: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of the training state as this rank holds it (no resharding: a host-memory
    snapshot of the same plan, ``runtime.tiers``), by a name unique on this rank: its tensor of
    each parameter (what the optimizer steps: an fp32 master or ZeRO-1's rows where it keeps
    them; ``write_back`` after copying into them) and buffer, and their AdamW states (made, zero,
    with ``create``). The tensors themselves: copy out of them or into them."""
    index = {id(e.param): i for i, e in enumerate(items)}
    out = {f"{i}/model/{e.held.key}": e.held.local for i, e in enumerate(items)}
    for e, opt in _optimized(items, optim):
        st = _moments(opt, e.param, create)
        if st:
            i = index[id(e.param)]
            for m in (*MOMENTS, "step"):
                out[f"{i}/optim/{m}/{e.held.key}"] = local_of(st[m])
    return out


# ---------------------------------------------------------------------------------------------
# the checkpoint's contents


def model_state(items: list[Entry], copy: bool, save: bool | None = None) -> dict:
    """What the program keeps (``kept``) in DCP form (``model/<name>``): to save (the counted ones:
    copies for a background write, views for one inside the step, ``copy=False, save=True``),
    or views of every one to load into."""
    save = copy if save is None else save
    return {f"model/{e.held.key}": e.held.pieces(copy) for e in items if e.counted or not save}


def rng_state() -> dict:
    """This process's random-number generators."""
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def split_duplicates(state: dict[str, list]) -> list[dict]:
    """Load passes: a key this rank holds several times (a tied parameter's copies in two of its
    chunks) goes into a pass of its own for each copy (a state dict names a key once)."""
    passes: list[dict] = []
    for key, values in state.items():
        for i, v in enumerate(values):
            if len(passes) <= i:
                passes.append({})
            passes[i][key] = v
    return passes


# ---------------------------------------------------------------------------------------------
# loading (the directory, its marker and checksums: ``autoshard.runtime.durable``)


def load(path: Path, passes: list[dict]) -> None:
    """Fill the state dicts of ``passes`` (``split_duplicates``) from checkpoint ``path``; every
    rank makes the same number of DCP loads."""
    import torch.distributed.checkpoint as dcp

    count = torch.tensor([len(passes)])
    dist.all_reduce(count, op=dist.ReduceOp.MAX)
    for i in range(int(count)):
        dcp.load(passes[i] if i < len(passes) else {}, checkpoint_id=str(path))


def saved_keys(path: Path) -> dict[str, tuple[int, ...] | None]:
    """The checkpoint's keys, with their full shapes (None for objects)."""
    from torch.distributed.checkpoint import FileSystemReader

    md = FileSystemReader(str(path)).read_metadata()
    return {k: tuple(v.size) if hasattr(v, "size") else None for k, v in md.state_dict_metadata.items()}


def object_state(value) -> io.BytesIO:
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return buf
