"""The pieces of an emitted ``train.py``: the device mesh from the plan, which pipeline chunks a
rank holds, building and filling them, the pipeline schedule, data parallelism at the plan's ZeRO
stage, deterministic data, and saving parameters for verification. Depends on torch only (and on
the user's model file when ``--init-from-model`` asks for the single-device initialisation)."""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from autoshard.errors import AutoshardError, ProgramError
from autoshard.ir.plan import Mesh, Plan
from autoshard.ir.program import Program, Tied
from autoshard.ir.schedules import schedule, torch_schedule
from autoshard.runtime import data as token_data
from autoshard.runtime import fake, groups, moe, phase
from autoshard.runtime.checkpoint import Checkpoint
from autoshard.runtime.lamb import Lamb, Masters
from autoshard.runtime.rebuild import Recipe
from autoshard.runtime.reduction import BucketedReduction
from autoshard.runtime.stages import load_stage_file, materialise, put_parameter, stage_tables
from autoshard.runtime.state import kept
from autoshard.runtime.zero import BUCKET_BYTES, ShardedAdamW

# ---------------------------------------------------------------------------------------------
# mesh


@dataclass
class Ranks:
    world: int
    rank: int
    tp: int
    pp: int
    dp: int
    cp: int
    tp_size: int
    pp_size: int
    dp_size: int
    ep: int = 0  # this rank's place in its expert-parallel group
    ep_size: int = 1
    edp: int = 0  # and in its expert-data-parallel group (the ranks holding the same experts)


def read_program(here: Path) -> tuple[Plan, Program]:
    """The plan and the program in directory ``here`` (``plan.json``, ``program.json``); a missing
    or malformed file is the program's one-line error."""
    try:
        plan = Plan.load(here / "plan.json")
    except AutoshardError as e:
        raise ProgramError(str(e)) from None
    return plan, Program.load(here / "program.json")


def check_program(here: Path, plan: Plan, program: Program) -> None:
    """plan.json must be the one the stage files were generated from."""
    import hashlib

    digest = hashlib.sha256((here / "plan.json").read_bytes()).hexdigest()
    if program.plan_sha256 != digest:
        raise ProgramError(
            f"{here / 'plan.json'} changed after the program was generated; "
            "recompile (autoshard compile ... -o DIR) instead of editing the plan"
        )
    chunks = plan.mesh.pp * plan.virtual_stages
    files = [c.file for c in program.chunks] + [program.loss.file]
    if len(program.chunks) != chunks:
        raise ProgramError(f"program.json has {len(program.chunks)} pipeline chunks but the plan needs {chunks}")
    for name in dict.fromkeys(files):  # each stage file there and Python (before any process group is made)
        try:
            compile((here / name).read_text(), str(here / name), "exec")
        except OSError:
            raise ProgramError(f"{here / name} is missing; recompile with autoshard compile ... -o {here}") from None
        except (SyntaxError, ValueError) as e:
            raise ProgramError(
                f"{here / name} is not valid Python ({e.__class__.__name__}: {e.msg if hasattr(e, 'msg') else e}, "
                f"line {getattr(e, 'lineno', '?')}); recompile with autoshard compile ... -o {here}"
            ) from None


def check_world(plan: Plan) -> int:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != plan.gpus:
        raise ProgramError(
            f"the plan is for {plan.gpus} processes but WORLD_SIZE is {world}; "
            f"run torchrun --nproc-per-node {plan.gpus} (or recompile for {world} GPUs)"
        )
    return world


def build_mesh(plan: Plan, device_type: str):
    """A device mesh whose dimensions follow the plan's axis order (innermost = consecutive ranks)."""
    from torch.distributed.device_mesh import init_device_mesh

    m = plan.mesh
    names = tuple(reversed(m.order))  # the order is inside out
    shape = tuple(getattr(m, a) for a in names)
    with fake.real():  # rank indices, also when the program runs on fake tensors
        mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    coords = {a: mesh.get_local_rank(a) for a in names}
    ranks = Ranks(
        dist.get_world_size(),
        dist.get_rank(),
        coords["tp"],
        coords["pp"],
        coords["dp"],
        coords["cp"],
        m.tp,
        m.pp,
        m.dp,
    )
    groups.set_groups(
        tp=mesh["tp"].get_group() if m.tp > 1 else None,
        pp=mesh["pp"].get_group(),
        dp=mesh["dp"].get_group(),
        cp=mesh["cp"].get_group() if m.cp > 1 else None,
    )
    return mesh, ranks


def build_expert_mesh(plan: Plan, device_type: str, ranks: Ranks):
    """The (pp, edp, ep) mesh of MoE parallel folding (``expert_mesh``); sets the ``ep``, ``edp``
    and ``route`` groups and this rank's places in them."""
    with fake.real():
        experts = expert_mesh(plan, device_type)
    ep_mesh, edp_mesh = experts["ep"], experts["edp"]
    ranks.ep, ranks.ep_size, ranks.edp = ep_mesh.get_local_rank(), ep_mesh.size(), edp_mesh.get_local_rank()
    groups.set_groups(
        ep=ep_mesh.get_group() if ep_mesh.size() > 1 else None,
        edp=edp_mesh.get_group(),
        route=_flatten(experts, ("edp", "ep"), "route").get_group(),
    )
    return experts


def stage_positions(mesh: Mesh) -> torch.Tensor:
    """The global ranks as (pp, the stage's tp x cp x dp ranks): each pipeline stage's ranks
    flattened in the mesh's order (inside out, innermost fastest), as ``build_mesh`` lays them."""
    names = tuple(reversed(mesh.order))  # outermost first, as init_device_mesh lays ranks out
    grid = torch.arange(mesh.gpus).reshape([getattr(mesh, a) for a in names])
    pp = names.index("pp")
    return grid.movedim(pp, 0).reshape(mesh.pp, -1)


def expert_mesh(plan: Plan, device_type: str):
    """MoE parallel folding: a (pp, edp, ep) device mesh over the same ranks. An expert-parallel
    group is ``ep`` consecutive ranks of a stage's tp x cp x dp ranks in mesh order; the ranks at
    the same place in every EP group of the stage hold the same experts (expert data parallelism)."""
    from torch.distributed.device_mesh import DeviceMesh

    positions = stage_positions(plan.mesh)
    grid = positions.reshape(positions.size(0), -1, plan.mesh.ep)
    return DeviceMesh(device_type, grid, mesh_dim_names=("pp", "edp", "ep"))


# ---------------------------------------------------------------------------------------------
# pipeline chunks


def chunks_of_rank(plan: Plan, pp_rank: int) -> list[int]:
    """The pipeline chunks (virtual stages) pipeline rank ``pp_rank`` holds, by the plan's schedule."""
    return schedule(plan.schedule).chunks_of_rank(pp_rank, plan.mesh.pp, plan.virtual_stages)


def build_chunks(
    out: Path,
    program: Program,
    chunk_ids: list[int],
    device,
    ranks: Ranks,
    full_state=None,
    seed: int = 0,
    weights=None,
    tied: Sequence[Tied] = (),
) -> list[nn.Module]:
    """This rank's pipeline chunks, built on meta and filled (``stages.materialise``): from
    ``full_state``, from a checkpoint's ``weights`` (``weights.open_weights``; ``tied`` the
    program's ties), or by replaying the model's initialisation."""
    modules = []
    for c in chunk_ids:
        stage_file, module = _load_chunk(out, program, c)
        stage_file = stage_tables(module, stage_file)
        try:
            materialise(
                module, stage_file, device, ranks.tp, ranks.tp_size, full_state, seed, ranks.ep, ranks.ep_size,
                weights, tied,
            )  # fmt: skip
        except ValueError as e:
            raise ProgramError(str(e)) from None
        module.stage_file = stage_file
        _persistent_as_in_model(module, stage_file.ORIGIN, program.state_dict_keys)
        modules.append(module)
    return modules


def _persistent_as_in_model(chunk: nn.Module, origin: dict[str, str], keys: Sequence[str]) -> None:
    """Register the buffers of ``chunk`` that the single-device state dict lacks (``keys``:
    ``Program.state_dict_keys``) as non-persistent, as the model does (a rotary table made at
    every start) or as the program made them (a constant of the traced graph): the program keeps
    the others, the model's persistent buffers (``kept``)."""
    keys = set(keys)
    for name, buffer in list(chunk.named_buffers()):
        if origin.get(name, name) not in keys:
            owner, _, leaf = name.rpartition(".")
            chunk.get_submodule(owner).register_buffer(leaf, buffer, persistent=False)


def _load_chunk(out: Path, program: Program, c: int):
    """Chunk ``c``'s stage file and the chunk built from it on the meta device (not on fake
    tensors, also when the program runs on them: the caller places it)."""
    chunk = program.chunks[c]
    stage_file = load_stage_file(out / chunk.file)
    with fake.real(), torch.device("meta"):
        return stage_file, getattr(stage_file, chunk.class_name)()


def autocast(stages: list[nn.Module], plan: Plan, device, choice: str = "auto") -> str:
    """Run the chunks' forward (and so their backward) in the plan's compute precision under
    ``torch.autocast`` (which keeps softmax, norms and losses in fp32). ``auto`` is the plan's
    precision on GPUs and fp32 on CPUs, where verification must be exact. Returns it."""
    compute = plan.precision.get("compute", "bf16")
    dtype = {"auto": compute if device.type == "cuda" else "fp32"}.get(choice, choice)
    if dtype == "bf16":
        for module in stages:
            module.forward = torch.autocast(device.type, dtype=torch.bfloat16)(module.forward)
    return dtype


def lower_parameters(params, dtype: str) -> None:
    """Mixed precision as Megatron trains: at ``dtype`` bf16 the parameters the chunks compute with
    are bf16 (2 bytes each, and the activations they make bf16: autocast would otherwise cast an
    fp32 weight again in every micro-batch and keep each copy for its backward), their gradients
    accumulate in fp32 (``grad_dtype``), and the optimizer steps fp32 masters (``MasterAdamW``).
    FSDP2's shards (ZeRO-2/3) are masters already: those parameters are not given here."""
    if dtype != "bf16":
        return
    with torch.no_grad():
        for p in params:
            if p.dtype == torch.float32:
                p.data = p.data.to(torch.bfloat16)
                p.grad_dtype = torch.float32


class MasterAdamW(Masters, torch.optim.AdamW):
    """AdamW whose low-precision parameters are stepped through fp32 master copies it keeps (4
    bytes each, beside the two 4-byte moments): each step gives a master the parameter's fp32
    gradient, steps the masters, and writes them back rounded. (ZeRO-1 shards masters and
    moments by rows: ``zero.ShardedAdamW``.)"""

    def __init__(self, params, **kwargs):
        super().__init__(params, **kwargs)
        self._make_masters()

    @torch.no_grad()
    def step(self, closure=None):
        swapped = []
        for group in self.param_groups:
            params = group["params"]
            for i, p in enumerate(params):
                m = self.masters.get(id(p))
                if m is not None:
                    m.grad = None if p.grad is None else p.grad.float()
                    params[i] = m
                    swapped.append((params, i, p, m))
        try:
            return super().step(closure)
        finally:
            for params, i, p, m in swapped:
                params[i] = p
                p.copy_(m)
                m.grad = None

    def write_back(self) -> None:
        """Round the masters into the parameters (after a checkpoint loaded into the masters)."""
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    m = self.masters.get(id(p))
                    if m is not None:
                        p.copy_(m)


def load_loss(out: Path, program: Program, device) -> nn.Module:
    stage_file = load_stage_file(out / program.loss.file)
    return getattr(stage_file, program.loss.class_name)().to(device)


def loss_fn(loss_module: nn.Module):
    """The pipeline's ``loss_fn(output, target)`` over the emitted loss graph."""

    def fn(output, target):
        outputs = output if isinstance(output, tuple) else (output,)
        loss = loss_module(*outputs, target)
        return loss[0] if isinstance(loss, (tuple, list)) else loss

    return fn


def full_state_from_model(program: Program, seed: int) -> dict[str, torch.Tensor]:
    """The seeded single-device initialisation, named as in the traced graph (``model.*``), of the
    model ``program.json``'s ``rebuild`` recipe builds (a model file, a builder or a transformers
    config: ``autoshard.runtime.rebuild``)."""
    recipe = Recipe.from_dict(program.rebuild)
    torch.manual_seed(seed)
    try:
        model = recipe.build("cpu")
    except (ImportError, AttributeError) as e:
        raise ProgramError(f"--init-from-model: cannot rebuild the model with {recipe.function}: {e}") from None
    state = {f"model.{k}": v.detach() for k, v in model.named_buffers()}  # non-persistent ones too
    state.update({f"model.{k}": v.detach() for k, v in model.state_dict().items()})
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


def pipeline_schedule(
    plan: Plan,
    stages: list[nn.Module],
    ranks: Ranks,
    device,
    microbatches: int,
    loss,
    out: Path,
    program: Program,
    compute: str = "auto",
):
    """``torch.distributed.pipelining`` stages and the plan's schedule over them."""
    from torch.distributed.pipelining.schedules import PipelineScheduleSingle

    pp, v = plan.mesh.pp, plan.virtual_stages
    ids = chunks_of_rank(plan, ranks.pp)
    shapes = boundaries(out, program, plan, ids, device, compute) if fake.active() else {}
    for m in stages:
        _hand_on_copies(m)
    pipeline = [
        _stage_class()(m, i, pp * v, device, *shapes.get(i, (None, None)), group=groups.pp_group())
        for m, i in zip(stages, ids)
    ]
    for stage in pipeline:
        _uncounted_inference(stage)
    if schedule(plan.schedule).split_backward:  # each layer recomputed in both halves of its backward
        for m in stages:
            for layer in m.modules():
                if isinstance(layer, Checkpoint):
                    layer.split_backward = True
    cls = torch_schedule(plan.schedule, v)
    made = cls(pipeline[0] if issubclass(cls, PipelineScheduleSingle) else pipeline, microbatches, loss_fn=loss)
    if shapes:
        fake.static_pipeline(made, pipeline)
    _layerwise_gathers(made, pipeline)
    return made


class _HandOn(torch.autograd.Function):
    """Identity whose output is a tensor of its own over the input's storage (no view)."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad


def _hand_on_copies(module: nn.Module) -> None:
    """Make ``module`` (a pipeline chunk) hand on its outputs as the pipeline sends them:
    contiguous, and its inputs as tensors of their own. gloo sends and receives only contiguous
    tensors, and the neighbour's receive buffer takes the strides of the output it stands for:
    GPT-J's chunk hands on its rotary sin and cos as views of one table, split along its last
    dimension (a contiguous output is handed on as it is). A chunk passes some inputs on
    unchanged (the rotary tables a model computes once, in the first chunk), and torch's split
    backward detaches the chunk's outputs in place after its input pass: the chunk's inputs
    themselves, which its checkpointed layers recompute from in the weight pass, then without
    gradients, saving fewer tensors than the forward did (``CheckpointError`` at Mixtral 8x22B
    under zero-bubble). An alias costs no memory."""
    forward = module.forward

    def run(*args, **kwargs):
        out = forward(*args, **kwargs)
        given = {id(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}

        def own(t):
            if not isinstance(t, torch.Tensor):
                return t
            t = t.contiguous()
            return _HandOn.apply(t) if id(t) in given and t.requires_grad else t

        return tuple(own(t) for t in out) if isinstance(out, tuple) else own(out)

    module.forward = run


def _layerwise_gathers(made, pipeline) -> None:
    """Leave gathering to FSDP's own hooks, one layer at a time. torch's multi-chunk schedules
    add an UNSHARD action before a chunk's first use that gathers every FSDP unit of the chunk,
    for up to three chunks at once (RESHARD when done): at GPT-3 175B, 11 layers' weights
    gathered on a rank where the plan counts one and the next one's prefetch."""
    from torch.distributed.pipelining.schedules import RESHARD, UNSHARD

    orders = getattr(made, "pipeline_order_with_comms", None)
    if not orders or not any(getattr(stage.submod, "autoshard_zero", None) for stage in pipeline):
        return
    for rank, actions in orders.items():
        orders[rank] = [a for a in actions if a is None or a.computation_type not in (UNSHARD, RESHARD)]
    made.unsharded_stages.update(stage.stage_index for stage in pipeline)  # the schedule's check before compute


_LAZY_HOOKS = (
    "_prepare_forward_infra", "_prepare_backward_infra", "get_fwd_recv_ops", "get_bwd_recv_ops",
    "_retrieve_recv_activations", "_retrieve_recv_grads", "backward_one_chunk",
)  # fmt: skip


def _stage_class():
    """``PipelineStage`` that sends its gradients contiguous (``_ContiguousGradients``), whose
    receive buffers are made when their receive is posted and let go once read
    (``_ReceiveOnDemand``), and whose backward runs as the plan counts it (``_PlannedBackward``).
    On a torch whose stages lack the hooks of the last two, torch's own stage with the first."""
    from torch.distributed.pipelining import PipelineStage

    lazy = all(hasattr(PipelineStage, name) for name in _LAZY_HOOKS)
    mixins = (_ReceiveOnDemand, _PlannedBackward) if lazy else ()
    return type("Stage", (_ContiguousGradients, _ReduceOnLastBackward, *mixins, PipelineStage), {})


class _ContiguousGradients:
    """A ``PipelineStage`` mixin: the gradients a stage sends back are contiguous, as the
    activations it received were (``_hand_on_copies``) and as the neighbour's receive buffer is,
    made from their shapes and strides; gloo and NCCL send contiguous tensors only. A split
    backward's input pass takes them from ``torch.autograd.grad``, which returns a gradient in the
    strides its last op left (a transposed matmul's). A contiguous one is sent as it is."""

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        for op in ops:
            op.tensor = op.tensor.contiguous()
        return ops


class _ReduceOnLastBackward:
    """A ``PipelineStage`` mixin: a chunk's gradient reductions (``BucketedReduction`` s, the
    chunk's ``autoshard_reductions``) start during its last backward of the step (the schedule's
    ``last_backward``: a full backward, or a split backward's weight pass), and the schedule's
    division by the micro-batch count leaves their early parameters to them (they divide a
    gradient once it is final, before reducing it, as the schedule would have)."""

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        final = last_backward and backward_type != "input"
        reductions = getattr(self.submod, "autoshard_reductions", ()) if final else ()
        params = list(self.submod.parameters()) if reductions else []
        for r in reductions:
            r.arm(params)
        out = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        for r in reductions:
            r.ready(params)  # (a weight pass adds into ``.grad`` itself, past the hooks)
        return out

    def scale_grads(self, grad_scale_factor: int) -> None:
        early = {i for r in getattr(self.submod, "autoshard_reductions", ()) for i in r.early}
        if grad_scale_factor != 1:
            for p in self.submod.parameters():
                if p.grad is not None and id(p) not in early:
                    p.grad.div_(grad_scale_factor)


class _ReceiveOnDemand:
    """A ``PipelineStage`` mixin: torch makes one receive buffer per micro-batch, for the
    activation and for its gradient, when the pipeline starts, and keeps them all for the run:
    chunks x micro-batches x 2 boundary tensors on every rank (tens of GB at LLaMA-3 405B's 64
    micro-batches). Made on demand, a received activation lives while its micro-batch is in
    flight (autograd keeps it for the backward, as the layers' saved inputs), a received
    gradient until its backward has used it."""

    def _release(self, table) -> None:
        for infos in table.values():
            for info in infos:
                if not info.is_root_arg:
                    info.buffer = None

    def _make(self, infos) -> None:
        from torch.distributed.pipelining._utils import _make_tensor_from_meta

        for info in infos:
            if not info.is_root_arg and info.buffer is None and info.tensor_meta is not None:
                info.buffer = _make_tensor_from_meta(info.tensor_meta, self.device)

    def _prepare_forward_infra(self, *args, **kwargs):
        out = super()._prepare_forward_infra(*args, **kwargs)
        self._release(self.args_recv_info)
        return out

    def _prepare_backward_infra(self, *args, **kwargs):
        out = super()._prepare_backward_infra(*args, **kwargs)
        self._release(self.grad_recv_info)
        return out

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        self._make(self.args_recv_info[fwd_chunk_id])
        return super().get_fwd_recv_ops(fwd_chunk_id)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        if self.has_backward and not self.is_last:
            self._make(self.grad_recv_info[bwd_chunk_id])
        return super().get_bwd_recv_ops(bwd_chunk_id)

    def _retrieve_recv_activations(self, fwd_chunk_id: int):
        out = super()._retrieve_recv_activations(fwd_chunk_id)
        self._release({0: self.args_recv_info[fwd_chunk_id]})
        return out

    def _retrieve_recv_grads(self, bwd_chunk_id: int):
        out = super()._retrieve_recv_grads(bwd_chunk_id)
        self._release({0: self.grad_recv_info[bwd_chunk_id]})
        return out


class _PlannedBackward:
    """A ``PipelineStage`` mixin: a split backward's input pass computes input gradients only
    (the weight pass gathers what it needs later), the weight pass shares one recomputation per
    checkpointed layer (``weight_pass``), and an FSDP chunk reduces and lets go layer by layer
    (``_fsdp_backward``)."""

    def backward_one_chunk(self, bwd_chunk_id: int, loss=None, full_backward: bool = True, *args, **kwargs):
        if full_backward:
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, *args, **kwargs)
        with phase.input_gradients_only():
            return super().backward_one_chunk(bwd_chunk_id, loss, full_backward, *args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        zero = getattr(self.submod, "autoshard_zero", None)
        if zero is None and backward_type == "weight":
            return weight_pass(self.submod.parameters(), bwd_kwargs["param_groups"]), None
        if zero is None:
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
        return _fsdp_backward(self.submod, zero, backward_type, bwd_kwargs)


def _fsdp_backward(submod, zero: int, backward_type: str, bwd_kwargs: dict):
    """One micro-batch's backward of an FSDP chunk, as the plan counts ZeRO-2/3: each layer's
    gradients reduce-scattered (fp32) as the backward makes them, and at ZeRO-3 its gathered
    weights let go once its backward is done. torch's pipeline stage defers both to the step's
    end (no resharding, no reduction until the last micro-batch), holding every weight of the
    chunk gathered and its fp32 gradients unsharded across micro-batches: at GPT-3 175B on two
    pipeline ranks, 4 all-gathers of a chunk's weights where the plan has 6 and 1 reduce-scatter
    where it has 3. A split backward's input pass keeps both for its weight pass, which reduces
    them once it is done."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.pipelining._backward import stage_backward, stage_backward_input

    whole = backward_type != "input"
    units = [m for m in submod.modules() if isinstance(m, FSDPModule)]  # (the experts' without the chunk's)
    for unit in units:
        unit.set_is_last_backward(False)
        unit.set_reshard_after_backward(whole and zero == 3, recurse=False)
        unit.set_requires_gradient_sync(whole, recurse=False)
    args = bwd_kwargs.get("stage_output"), bwd_kwargs.get("output_grads"), bwd_kwargs.get("input_values")
    if backward_type == "full":
        out = stage_backward(*args), None
    elif backward_type == "input":
        out = stage_backward_input(*args, submod.parameters())
    else:
        out = weight_pass(submod.parameters(), bwd_kwargs["param_groups"]), None
    states = {id(s): s for m in units for s in [m._get_fsdp_state()]}
    for group in (g for state in states.values() for g in state._fsdp_param_groups):
        if backward_type == "weight":  # the input pass ran the units' post-backward hooks already
            group.post_backward()
        _drop_stray_gather(group)
    return out


def weight_pass(weights, param_groups: list[dict]):
    """A split backward's weight pass over one chunk: torch's ``stage_backward_weight`` (one
    backward call per parameter group) with the calls sharing one recomputation of each
    checkpointed layer (``GraphExecGroup``). Alone, torch's checkpoint recomputes a layer once
    per backward call and keeps each call's leftovers while the chunk's graph lives: at
    DeepSeek-V3 671B under DualPipeV the weight pass of a rank's chunk recomputed its MoE layers
    once per group and held the copies, 91 GB at the peak against the plan's 3.5. (One call for
    every group would recompute once too, but it runs again the input gradients that flow from
    one group's nodes into another's: 1.37 of the planned FLOPs at LLaMA-3 8B zero-bubble.)"""
    import torch.utils.checkpoint
    from torch.distributed.pipelining._backward import stage_backward_weight

    shared = getattr(torch.utils.checkpoint, "GraphExecGroup", None)  # torch >= 2.9
    if shared is None:
        return stage_backward_weight(weights, param_groups)
    with shared():
        return stage_backward_weight(weights, param_groups)


def _drop_stray_gather(group) -> None:
    """Let go of an all-gather FSDP's backward prefetch started for a unit whose backward is not
    next. Its prefetch follows the order of the forwards, and with several micro-batches in flight
    the chunk's first layer prefetches its last one (of the micro-batch run after): one layer's
    gathered weights held per chunk until its next backward (10 x 3.6 GB at GPT-3 175B, 10
    chunks on a rank). FSDP lets go of such strays only after the step's last backward."""
    result = getattr(group, "_all_gather_result", None)
    if result is None:
        return
    work = getattr(result, "all_gather_work", None)
    if isinstance(work, dist.distributed_c10d.Work):
        work.wait()
    if (event := getattr(result, "all_gather_event", None)) is not None:
        torch.accelerator.current_stream().wait_event(event)
    group._all_gather_result = None


def boundaries(out: Path, program: Program, plan: Plan, chunk_ids: list[int], device, compute: str) -> dict[int, tuple]:
    """Chunk -> (example inputs, example outputs) of one micro-batch, for each of ``chunk_ids``:
    what its neighbours would tell it when the pipeline starts, found by running every chunk up
    to the last of them forward, with gradients as the pipeline's own inference does (an output
    made from no parameter, such as the rotary tables, carries none), on fake tensors of this rank's shapes. Only
    a program running on fake tensors needs it (its neighbours have no fake twin to answer)."""
    x = (torch.zeros(plan.microbatch_size, plan.seq_len, dtype=torch.long, device=device),)
    out_shapes = {}
    with torch.enable_grad(), moe.uncounted():  # as torch's inference before a step: which outputs carry gradients
        for c in range(max(chunk_ids) + 1):
            _, module = _load_chunk(out, program, c)
            module.to_empty(device=device)
            _hand_on_copies(module)
            lower_parameters(list(module.parameters()), autocast([module], plan, device, compute))
            y = module(*x)
            # as the real run hands them on: what is made from the parameters carries gradients
            # back; token ids, and tables made from buffers alone (rotary cos and sin), none
            y = tuple(t.detach().requires_grad_(t.requires_grad) for t in (y if isinstance(y, tuple) else (y,)))
            if c in chunk_ids:
                out_shapes[c] = (x, y)
            x = y
    return out_shapes


def _uncounted_inference(stage) -> None:
    """On its first step a ``PipelineStage`` runs its module once to learn the shapes it sends
    (``_forward_metadata_inference``, on copies of the inputs or on empty tensors): that forward
    must not count MoE expert loads, which balancing sums as the step's."""
    infer = getattr(stage, "_forward_metadata_inference", None)
    if infer is None:  # a torch without it runs no such forward
        return

    def uncounted(*args, **kwargs):
        with moe.uncounted():
            return infer(*args, **kwargs)

    stage._forward_metadata_inference = uncounted


# ---------------------------------------------------------------------------------------------
# data parallelism


def sum_partial_gradients(stages: list[nn.Module]) -> None:
    """Sequence parallel: parameters used on sequence slices hold partial gradients; sum them
    over the TP group (one flat all-reduce)."""
    group = groups.tp_group()
    if group is None:
        return
    grads = []
    for module in stages:
        wanted = set(module.stage_file.PARTIAL_GRADS)
        for name, p in module.named_parameters():
            if name in wanted and p.grad is not None:
                grads.append(_local(p.grad))
    _all_reduce_flat(grads, group)


def expert_parameters(stages: list[nn.Module]) -> list[nn.Parameter]:
    """The stacked expert weights the chunks hold (their stage files' ``EXPERTS``)."""
    out = []
    for module in stages:
        wanted = set(module.stage_file.EXPERTS)
        out += [p for name, p in module.named_parameters() if name in wanted]
    return out


def reduce_gradients(params: list[nn.Parameter], group, divide: int, optimizer=None) -> None:
    """Sum the gradients of ``params`` over ``group`` and divide them by ``divide``: all-reduced
    in buckets (``_buckets``: the bucketing DDP does, without its hooks, which a pipeline
    schedule's split backward would fire at the wrong time), or, where ``optimizer`` is ZeRO-1's
    (``zero.ShardedAdamW``), reduce-scattered onto the rows each rank steps."""
    if isinstance(optimizer, ShardedAdamW):
        optimizer.reduce_gradients(divide)
        return
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p, dtype=getattr(p, "grad_dtype", None) or p.dtype)
        grads.append(p.grad)
    if group is None or dist.get_world_size(group) == 1:
        if divide != 1:
            for g in grads:
                g.div_(divide)
        return
    by_dtype: dict[str, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(str(g.dtype), []).append(g)
    for bucket in by_dtype.values():
        _all_reduce_flat(bucket, group, divide=divide)


def gradient_reductions(
    stages: list[nn.Module],
    plan: Plan,
    optim,
    zero_group,
    experts: Sequence[nn.Parameter],
    ties: Sequence,
    dense: bool,
    scale: int = 1,
) -> list[BucketedReduction]:
    """The step's data-parallel gradient reductions that overlap its last backward
    (``reduction.BucketedReduction``): the dense weights' over dp x cp (unless FSDP2 reduces them,
    ``dense`` False), the stacked experts' over their expert-data-parallel ranks (unless FSDP2
    shards them), both divided by dp: what ``reduce_gradients`` does after the backward. The
    sequence-parallel partial gradients and the tied copies are summed after the backward (over
    TP, over the pipeline ranks holding a copy) before their reduction: late. Each chunk is given
    them (``autoshard_reductions``), so that its pipeline stage starts them
    (``_ReduceOnLastBackward``); ``scale``: the schedule's division of the gradients."""
    expert_ids = {id(p) for p in experts}
    late = [p for t in ties for p in t.copies]
    if groups.tp_group() is not None:
        late += [p for m in stages for n, p in m.named_parameters() if n in set(m.stage_file.PARTIAL_GRADS)]
    params = [p for m in stages for p in m.parameters()]
    out = []
    cap = plan.dp_bucket_bytes
    if dense:
        mine = [p for p in params if id(p) not in expert_ids]
        out.append(_reduction(mine, zero_group, plan.mesh.dp, optim.dense, late, scale, cap))
    if experts and not shards_experts(plan):
        out.append(_reduction(list(experts), groups.edp_group(), plan.mesh.dp, optim.experts, late, scale, cap))
    for m in stages:
        m.autoshard_reductions = out
    return out


def _reduction(params, group, divide: int, optimizer, late, scale: int, cap: int = 0) -> BucketedReduction:
    sharded = optimizer if isinstance(optimizer, ShardedAdamW) else None
    return BucketedReduction(params, group, divide, sharded=sharded, late=late, scale=scale, cap=cap)


def routing_biases(stages: list[nn.Module]) -> dict[str, torch.Tensor]:
    """MoE layer -> the routing-bias buffer the chunks hold (their stage files' ``ROUTING``)."""
    out = {}
    for module in stages:
        buffers = dict(module.named_buffers())
        for layer, entry in module.stage_file.ROUTING.items():
            if entry.get("bias") is not None:
                out[layer] = buffers[entry["bias"]]
    return out


def _local(grad: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a gradient (FSDP2 keeps them as DTensors)."""
    return grad.to_local() if hasattr(grad, "to_local") else grad


def _buckets(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` in consecutive groups of at most ``BUCKET_BYTES`` (a larger one alone), as DDP
    buckets them: each group is reduced as one flat copy, a tensor alone in place."""
    out, size = [[]], 0
    for t in tensors:
        n = t.numel() * t.element_size()
        if out[-1] and size + n > BUCKET_BYTES:
            out.append([])
            size = 0
        out[-1].append(t)
        size += n
    return [b for b in out if b]


def _all_reduce_flat(grads: list[torch.Tensor], group, divide: int = 1) -> None:
    """Sum ``grads`` over ``group`` in place (then divide), bucket by bucket (a tensor alone in
    place, no copy)."""
    for bucket in _buckets(grads):
        single = len(bucket) == 1 and bucket[0].is_contiguous()
        flat = bucket[0] if single else torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        if divide != 1:
            flat.div_(divide)
        if not single:
            _unflatten(flat, bucket)


def _unflatten(flat: torch.Tensor, grads: list[torch.Tensor]) -> None:
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def shards_dense(plan: Plan) -> bool:
    """Whether FSDP2 shards the dense parameters (ZeRO-2/3 over more than one dp x cp rank)."""
    return plan.zero_stage >= 2 and plan.mesh.dp * plan.mesh.cp > 1


def shards_experts(plan: Plan) -> bool:
    """Whether FSDP2 shards the stacked expert weights (ZeRO-2/3 over more than one
    expert-data-parallel rank), as the cost model counts them (``cost_models.memory``)."""
    return plan.zero_stage >= 2 and plan.mesh.edp > 1


def held_whole(stages: list[nn.Module], plan: Plan, experts: Sequence[nn.Parameter]) -> list[nn.Parameter]:
    """The parameters FSDP2 leaves whole on this rank (``shard_data_parallel``): the ones
    ``lower_parameters`` gives the compute precision itself."""
    expert_ids = {id(p) for p in experts}
    sharded = lambda p: shards_experts(plan) if id(p) in expert_ids else shards_dense(plan)  # noqa: E731
    return [p for m in stages for p in m.parameters() if not sharded(p)]


def zero_mesh(plan: Plan, mesh):
    """The ranks ZeRO shards over: data parallel x context parallel, as the planner counts memory
    (the CP ranks of a replica hold the same parameters). A 1-D mesh."""
    if plan.mesh.cp == 1:
        return mesh["dp"]
    return _flatten(mesh, ("dp", "cp"), "dp_cp")


def _flatten(mesh, dims: tuple[str, ...], name: str):
    """``mesh[dims]`` as one dimension (DeviceMesh has no public flatten yet)."""
    with fake.real():
        return mesh[dims]._flatten(name)


def shard_data_parallel(
    stages: list[nn.Module],
    plan: Plan,
    mesh,
    experts: Sequence[nn.Parameter] = (),
    dtype: str = "fp32",
    edp_mesh=None,
) -> bool:
    """ZeRO-2/3: FSDP2 ``fully_shard`` over the dp x cp ranks, one unit per layer of each chunk
    (``layer_units``) and the chunk's own unit for the rest (ZeRO-3 frees a layer's gathered
    parameters after its forward and its backward, ZeRO-2 keeps them until the step is done).
    Returns whether FSDP owns the dense gradients' reduction. The reduction sums over dp x cp and
    divides by dp: the mean over replicas of the CP ranks' summed shares. (Forcing the sum also
    sidesteps pytorch#162338, FSDP2 on gloo summing where it should average.) Stacked expert
    weights (``experts``) are replicated over the expert-data-parallel ranks (``edp_mesh``), not
    dp x cp: FSDP2 shards them over those (``_shard_experts``), with the same reduction; with
    one such rank they stay whole (``reduce_gradients``). At ``dtype`` bf16 the shards stay fp32
    (the masters) and are gathered in bf16, the gradients reduced in fp32."""
    zero, dp = plan.zero_stage, plan.mesh.dp
    dense, sharded_experts = shards_dense(plan), shards_experts(plan) and bool(experts)
    if not dense and not sharded_experts:
        return False
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(torch.bfloat16, torch.float32) if dtype == "bf16" else MixedPrecisionPolicy()
    shard = functools.partial(_fully_shard, fully_shard, reshard_after_forward=zero == 3, mp_policy=mp, divide=dp)
    dense_mesh = zero_mesh(plan, mesh) if dense else None
    for module in stages:
        units = [*layer_units(module), module]
        if sharded_experts:
            _shard_experts(module, experts, shard, edp_mesh)
        if dense:
            ignored = {p for p in module.parameters() if any(p is e for e in experts)} or None
            for unit in units:
                shard(unit, mesh=dense_mesh, ignored_params=ignored)
            prefetch_next_layer(layer_modules(module))
        module.autoshard_zero = zero  # read by the pipeline stage (``_stage_class``)
    return dense


def prefetch_next_layer(layers: list[nn.Module]) -> None:
    """Each FSDP layer's forward starts the next layer's all-gather before its own compute, one
    layer ahead: the overlap and the gathered copies the cost model counts
    (``ZERO3_GATHERED_LAYERS``: the layer at work, the next one's gather and its copy into that
    layer's parameters). Without it FSDP gathers a layer when the forward reaches it (overlapped
    only where the host runs ahead of the device). The backward keeps FSDP's own prefetch, one
    layer ahead too (the previous one in the order of the forwards)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in layers if isinstance(m, FSDPModule)]
    for here, after in zip(units, units[1:]):
        here.set_modules_to_forward_prefetch([after])


def _fully_shard(fully_shard, unit, divide: int, **kwargs) -> None:
    """``fully_shard(unit)`` reducing gradients by a sum divided by ``divide``."""
    fully_shard(unit, **kwargs)
    head = unit[0] if isinstance(unit, list) else unit  # a list's modules share one FSDP state
    head.set_force_sum_reduction_for_comms(True)
    head.set_gradient_divide_factor(float(divide))


def _shard_experts(chunk: nn.Module, experts: Sequence[nn.Parameter], shard, edp_mesh) -> None:
    """FSDP2 over ``edp_mesh`` for each module of ``chunk`` holding stacked expert weights (the
    stage code's ``self.<layer>.<...>.experts``, a container of the weights and nothing else),
    split along ``_expert_split``, as torchtitan gives a block's experts an FSDP unit of their
    own over its dp-shard-mod-ep mesh. The stage code reads the weights as tensors of the chunk
    and never calls their module, whose FSDP hooks (gather before, free after, reduce-scatter the
    gradients once the backward is past it) fire around a call only: the module is called
    around the forward of the layer that reads its weights (or of the chunk, for weights outside
    the layers), inside that layer's own dense FSDP hooks. After ``layer_units``, so that a
    checkpointed layer's is wrapped around its checkpoint (its recomputation finds the weights
    gathered by the backward's pre-hook, as ``layer_units`` says of the dense ones); before the
    dense units, which then leave those weights to these."""
    from torch.distributed.tensor import Shard

    ids = {id(p) for p in experts}
    holders = [m for m in chunk.modules() if any(id(p) in ids for p in m.parameters(recurse=False))]
    size = edp_mesh.size()
    for holder in holders:
        own = list(holder.parameters(recurse=False))
        if holder is chunk or any(id(p) not in ids for p in own) or any(True for _ in holder.children()):
            raise ProgramError(
                f"ZeRO-2/3 cannot shard the stacked expert weights of {type(holder).__name__}: their "
                "module holds other parameters or modules too; run with --force zero=1"
            )
        shard(holder, mesh=edp_mesh, shard_placement_fn=lambda p: Shard(_expert_split(tuple(p.shape), size)))
        caller = next((m for m in layer_modules(chunk) if any(h is holder for h in m.modules())), chunk)
        holder.forward = caller.forward  # the caller's forward (or its checkpoint's), now inside the holder's hooks
        caller.forward = holder.__call__


def _expert_split(shape: tuple[int, ...], size: int) -> int:
    """The dimension FSDP2 splits a stack of experts of ``shape`` along over ``size`` ranks: the
    experts where ``size`` divides them (FSDP2 pads an uneven first dimension: one local expert
    over 8 ranks would leave one rank all of it), else the first dimension ``size`` divides
    (FSDP2 shards any other dimension evenly only), else the experts, padded."""
    return next((d for d, n in enumerate(shape) if n % size == 0), 0)


def layer_modules(chunk: nn.Module) -> list[nn.Module]:
    """The layers of ``chunk``: the instances of the emitted layer classes, which a chunk holds in
    ``nn.ModuleDict`` s keyed by layer number (``model.layers``), in order."""
    dicts = [d for d in chunk.modules() if isinstance(d, nn.ModuleDict) and all(k.isdigit() for k in d)]
    return [layer for d in dicts for layer in d.values()]


def layer_units(chunk: nn.Module) -> list[nn.Module | list[nn.Module]]:
    """What FSDP gathers together in ``chunk``: one unit per layer (the layer module), the chunk's
    own unit for the rest (parameters the stage code reads from plain containers outside the
    layers, tied ones). A layer under activation checkpointing is gathered around its
    ``Checkpoint``: FSDP's hooks outside the checkpointed region, as in torchtitan, so the
    recomputation finds the weights gathered by the backward's pre-hook and gathers nothing
    itself (hooks inside the region would run again in it, where the selective checkpoint's cache
    does not expect them). Each module the stage code calls outside the layers (``nn.Embedding``,
    the head) is a unit of its own. One chunk-wide unit would gather a whole chunk's weights at
    once (35 GB of bf16 at LLaMA-3 70B on one pipeline rank) where the plan counts one layer and
    the next one's prefetch. A module sharing a parameter with one outside it is no unit."""
    owners: dict[int, int] = {}
    for _, m in chunk.named_modules():
        for p in m.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    checkpoints = {id(c.fn): c for c in chunk.modules() if isinstance(c, Checkpoint)}
    units: list = []
    covered: set[int] = set()
    for layer in layer_modules(chunk):
        if any(owners[id(p)] > 1 for p in layer.parameters()):
            continue
        if (ckpt := checkpoints.get(id(layer))) is not None:
            object.__setattr__(ckpt, "fn", layer.forward)  # the layer's own forward, inside the region
            layer.forward = functools.partial(type(ckpt).forward, ckpt)  # FSDP's hooks, then the checkpoint
            object.__setattr__(ckpt, "forward", layer)  # not a child: the layer stays where it is
        units.append(layer)
        covered.update(id(m) for m in layer.modules())
    called = [m for m in chunk.modules() if type(m) is not nn.Module and m is not chunk and id(m) not in covered]
    called = [m for m in called if any(True for _ in m.parameters(recurse=False))]
    return units + [[m] for m in called if not any(owners[id(p)] > 1 for p in m.parameters(recurse=False))]


def compile_layers(stages: list[nn.Module], device: torch.device, enabled: bool = True) -> int:
    """Regional compilation: each layer's forward under ``torch.compile``, as torchtitan compiles
    each transformer block (the instances of one emitted class share its compiled code). On GPUs
    only, and never on fake tensors (the at-scale run counts the eager ops the plan costs); a
    layer under activation checkpointing stays eager (its selective policy decides what to keep
    op by op, which a compiled region would hide). Returns how many layers it compiled."""
    if not enabled or device.type != "cuda" or fake.active():
        return 0
    compiled = 0
    for chunk in stages:
        checkpointed = {id(c.fn) for c in chunk.modules() if isinstance(c, Checkpoint)}
        for layer in layer_modules(chunk):
            if id(layer) not in checkpointed:
                layer.forward = torch.compile(layer.forward)
                compiled += 1
    return compiled


def optimizer(
    params: list[nn.Parameter],
    zero: int,
    zero_group,
    lr: float,
    weight_decay: float,
    eps: float = 1e-8,
    experts: list[nn.Parameter] = (),
    fsdp_experts: bool = False,
    algorithm: str = "adamw",
):
    """AdamW (``algorithm`` "lamb": LAMB, ``runtime.lamb``, its trust ratios over whole tensors
    once ``Optimizers.trust_norms`` is set); for ZeRO-1 its masters and states sharded by rows
    over ``zero_group`` (dp x cp, ``zero.ShardedAdamW``).
    Stacked expert weights (``experts``, also in ``params``) are held alike only by their
    expert-data-parallel ranks: at any ZeRO stage their states are sharded over that group, by
    rows as ZeRO-1's, or, where FSDP2 shards them (``fsdp_experts``), as its shards. (Their own
    optimizer: a fused AdamW steps one mesh's DTensors.)"""
    kwargs = {"lr": lr, "betas": (0.9, 0.95), "eps": eps, "weight_decay": weight_decay}
    expert_ids = {id(p) for p in experts}
    dense = [p for p in params if id(p) not in expert_ids]
    return Optimizers(
        _adamw(dense, zero == 1, zero_group, kwargs, algorithm) if dense else None,
        _adamw(list(experts), zero >= 1 and not fsdp_experts, groups.edp_group(), kwargs, algorithm)
        if experts
        else None,
    )


def _adamw(params: list[nn.Parameter], shard: bool, group, kwargs: dict, algorithm: str = "adamw"):
    if params and (params[0].is_cuda or fake.active()):
        # one fused kernel over every tensor: the foreach implementation makes temporaries the size
        # of all the parameters it steps (a fake tensor stands for the GPU program)
        kwargs = {**kwargs, "fused": True}
    rule = Lamb if algorithm == "lamb" else torch.optim.AdamW
    if shard and group is not None and dist.get_world_size(group) > 1:
        return ShardedAdamW(params, group, rule, **kwargs)  # ZeRO-1: rows, masters and moments sharded
    if rule is Lamb:
        return Lamb(params, **kwargs)  # (keeps fp32 masters of bf16 parameters itself)
    lower = any(p.dtype != torch.float32 for p in params)
    return (MasterAdamW if lower else torch.optim.AdamW)(params, **kwargs)  # bf16 parameters: fp32 masters


class Optimizers:
    """The program's optimizer: the dense weights' and the experts' (either may be absent),
    sharded over different groups, stepped as one."""

    def __init__(self, dense, experts=None):
        self.dense, self.experts = dense, experts
        self.parts = [o for o in (dense, experts) if o is not None]
        # LAMB: (prepared) -> id of stepped tensor -> whole (||w||, ||u||), summed over every rank
        # holding a piece (``state.trust_norms``); None: each part's own, as on one device
        self.trust_norms = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.parts:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        if self.trust_norms is None:
            for o in self.parts:
                o.step()
            return
        # LAMB: every part's first pass, the whole tensors' norms in one collective, the updates
        prepared = [x for o in self.parts for x in o.prepare()]
        norms = self.trust_norms(prepared)
        for o in self.parts:
            o.apply(norms)


# ---------------------------------------------------------------------------------------------
# tied parameters


@dataclass
class Tie:
    """One parameter held as a copy by several pipeline chunks (the token embedding tied to the
    output head), or held under several names: where this rank holds its copies (one per chunk
    holding it) and the group of the pipeline ranks holding the others (None when this rank holds
    them all)."""

    names: list[str]  # the name the chunks hold first, then the model's other names for it
    held: list[tuple[nn.Module, str]]  # (chunk, name) of each copy on this rank
    group: object | None

    @property
    def copies(self) -> list[nn.Parameter]:
        """The copies as the chunks hold them now (FSDP replaces a chunk's parameters by sharded ones)."""
        return [module.get_parameter(name) for module, name in self.held]


def tied_parameters(plan: Plan, program: Program, mesh, stages: list[nn.Module], chunk_ids: list[int]) -> list[Tie]:
    """This rank's :class:`Tie` of each parameter the program records as tied (``Program.tied``:
    its names and the chunks holding it), after making the names of one chunk one parameter. Every
    rank calls it: the groups of the pipeline ranks holding a copy are made collectively, one per
    replica (same tp, cp and dp coordinates), as Megatron's embedding group. The copies start
    equal: each chunk fills its copy from the same full tensor (``--init-from-model``) or by the
    same seeded initialisation (the stage files name one parameter once)."""
    sched, pp = schedule(plan.schedule), plan.mesh.pp
    pp_dim = list(mesh.mesh_dim_names).index("pp")
    with fake.real():
        replicas = mesh.mesh.movedim(pp_dim, -1).reshape(-1, pp).tolist()  # each row: one replica's pp ranks
    me = dist.get_rank()
    made: dict[tuple[int, ...], object] = {}
    ties = []
    for entry in program.tied:
        holding = tuple(sorted({sched.chunk_rank(c, pp) for c in entry.chunks}))
        if len(holding) > 1 and holding not in made:
            made[holding] = _replica_groups(replicas, holding, me)
        chunks = [module for module, c in zip(stages, chunk_ids) if c in entry.chunks]
        held = [(module, name) for module in chunks if (name := _one_parameter(module, entry.names))]
        if held:
            ties.append(Tie(list(entry.names), held, made.get(holding)))
    return ties


def _replica_groups(replicas: list[list[int]], holding: tuple[int, ...], me: int):
    """The process group of the pipeline ranks ``holding`` in ``me``'s replica; every rank makes
    every replica's group (``new_group`` is collective)."""
    mine = None
    for row in replicas:
        ranks = [row[r] for r in holding]
        group = dist.new_group(ranks)
        if me in ranks:
            mine = group
    return mine


def _one_parameter(module: nn.Module, names: Sequence[str]) -> str | None:
    """The name under which ``module`` holds the parameter named ``names`` (None if it does not);
    where it holds several of them separately (a stage file emits a tied module's weight once per
    module), the first one is registered under the others."""
    held = dict(module.named_parameters(remove_duplicate=False))
    found = [n for n in names if n in held]
    for name in found[1:]:
        put_parameter(module, name, held[found[0]])
    return found[0] if found else None


def sum_tied_gradients(ties: list[Tie]) -> None:
    """The gradient of a tied parameter is the sum of its copies' gradients: summed over this
    rank's copies, then over the ranks holding the others, and given to every copy, so that the
    copies stay equal step after step. Under FSDP the copies are sharded alike over the same
    data-parallel ranks, so their local shards add up piece by piece."""
    for tie in ties:
        copies = tie.copies
        for p in copies:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        grads = [_local(p.grad) for p in copies]
        total = grads[0] if len(grads) == 1 else torch.stack(grads).sum(0)
        if tie.group is not None:
            dist.all_reduce(total, group=tie.group)
        for g in grads:
            g.copy_(total)


# ---------------------------------------------------------------------------------------------
# data


def global_batch(step: int, batch: int, seq: int, vocab: int, seed: int, data: Path | None = None) -> torch.Tensor:
    """The step's whole batch of token ids, the same on every rank (each takes its DP rows):
    synthetic tokens seeded by (seed, step), or samples of the token files ``data``
    (``autoshard.runtime.data``, which says how samples are ordered)."""
    return token_data.global_batch(step, batch, seq, vocab, seed, data)


def save_parameters(
    path: Path, stages: list[nn.Module], ranks: Ranks, chunk_ids: list[int], tied: Sequence[Tied] = ()
) -> None:
    """What this rank keeps (``kept``: parameters, persistent buffers, routing biases), named
    as in the single-device model, with how each was split; a tied parameter under each of its
    names (``tied``: the program's ties), and the copies a second chunk of this rank holds under
    ``copies`` (verification checks that they agree). Every rank takes part (FSDP gathers its
    shards); the first data-parallel replica writes, and for stacked expert weights the first
    rank holding them."""
    out, copies = {}, []
    first_replica = ranks.dp == 0 and ranks.cp == 0
    for module, c in zip(stages, chunk_ids):
        shards, origin = module.stage_file.SHARDS, module.stage_file.ORIGIN
        experts = set(module.stage_file.EXPERTS)
        for name, p in kept(module):
            full = p.full_tensor() if hasattr(p, "full_tensor") else p  # collective under FSDP: every rank
            if not (ranks.edp == 0 if name in experts else first_replica):
                continue  # expert weights: the first of the ranks holding them writes; the rest: the first replica
            source = origin.get(name, name)
            value = (full.detach().cpu().clone(), shards.get(source), c)
            if source in out:
                copies.append((source, value[0]))
            else:
                out[source] = value
    for entry in tied:
        held = next((n for n in entry.names if n in out), None)
        for name in entry.names if held else ():
            out.setdefault(name, out[held])
    if not out:
        return
    path.mkdir(parents=True, exist_ok=True)
    saved = {"tp_rank": ranks.tp, "tp": ranks.tp_size, "ep_rank": ranks.ep, "params": out, "copies": copies}
    torch.save(saved, path / f"rank{ranks.rank}.pt")
