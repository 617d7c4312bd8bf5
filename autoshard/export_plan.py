"""``autoshard export-plan``: a plan as the settings of another trainer, torchtitan or Megatron-LM.

A plan is worth having even where the program autoshard emits is not what runs: the same mesh,
schedule, stage split, recompute set and precision can be handed to an established trainer. Each
target is a function ``plan -> Export``: the settings it writes and, in words, every choice of
the plan that the trainer cannot state exactly, with what the export writes instead. Those notes
go into the file as comments and onto stderr. Given the plan's model file (``--model``), the
approximations the search can pin (ZeRO-2 for ZeRO-1, interleaved 1F1B for another schedule) are
priced: the search runs with the plan's every choice pinned, once as it is and once with the
trainer's choice instead. The rest (an op-level recompute policy, a split torchtitan chooses) are
said in words only: no pin states them.

torchtitan 0.3.0 reads no TOML file: its trainer takes ``--module M --config F`` (a Python
function returning ``Trainer.Config``) and overrides on the command line, ``--section.field
value``, checked by tyro against the config dataclasses (``torchtitan/config/configs.py``,
``Trainer.Config``). The export is those overrides, one per line. Field names were read from
torchtitan 0.3.0's ``ParallelismConfig``, ``TrainingConfig`` and its ``activation-checkpoint``
subcommands (``torchtitan/distributed/activation_checkpoint.py``).

Megatron-LM's names were checked against the parser of megatron-core 0.19.2
(``megatron.training.arguments.add_megatron_arguments``), built under Python 3.12's ``typing``.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from autoshard import compiler
from autoshard.capture import capture_file
from autoshard.errors import AutoshardError, check_output_file
from autoshard.ir.plan import Plan
from autoshard.ir.schedules import SCHEDULES
from autoshard.planner import Planner, parse_force


@dataclass
class Export:
    """What a target writes: ``settings`` as (flag, value or None for a switch), and ``notes``,
    one per choice of the plan the target states only approximately."""

    settings: list[tuple[str, str | None]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    # (index into ``notes``, the ``--force`` pins changed to state what the trainer runs instead)
    pricable: list[tuple[int, dict]] = field(default_factory=list)

    def set(self, flag: str, value: object = None) -> None:
        self.settings.append((flag, None if value is None else str(value)))

    def approximate(self, note: str, runs: dict | None = None) -> None:
        """A choice stated only approximately; ``runs``: what the trainer runs, as pins changed
        from the plan's (``{}``: the plan's pins as they are, which state per-rank recompute sets
        as their union; None: no pin states it)."""
        if runs is not None:
            self.pricable.append((len(self.notes), runs))
        self.notes.append(note)

    def flags(self) -> dict[str, str | None]:
        return dict(self.settings)


# -- torchtitan 0.3.0 ------------------------------------------------------------------------


def torchtitan(plan: Plan) -> Export:
    """The command-line overrides of torchtitan 0.3.0's ``Trainer.Config`` that run the plan."""
    e = Export()
    m = plan.mesh
    e.set("--parallelism.tensor_parallel_degree", m.tp)
    e.set(f"--parallelism.{'' if plan.sequence_parallel else 'no_'}enable_sequence_parallel")
    e.set("--parallelism.context_parallel_degree", m.cp)
    e.set("--parallelism.expert_parallel_degree", m.ep)
    if m.etp != 1:
        e.approximate(f"expert tensor parallelism etp={m.etp}: torchtitan 0.3.0 has no such degree; experts follow tp")
    _tt_data_parallel(plan, e)
    _tt_pipeline(plan, e)
    _tt_batch(plan, e)
    if plan.precision.get("fp8_matmuls"):
        e.approximate(
            "FP8 matmuls (" + "+".join(plan.precision["fp8_matmuls"]) + "): torchtitan 0.3.0 sets FP8 by a model "
            "converter in the --config function (Float8LinearConverter, e.g. llama3_405b, deepseek_v3_671b_float8), "
            "not on the command line; pick such a config. Its recipe is torchao's, not autoshard's 1x128 blockwise"
        )
    if m.cp > 1 and plan.attention == "allgather-kv":
        e.approximate(
            "context parallel attention all-gathers K/V in the plan; torchtitan's runs a ring", {"attention": "ring"}
        )
    _tt_checkpoint(plan, e)  # a subcommand: it comes last on the command line
    return e


def _tt_data_parallel(plan: Plan, e: Export) -> None:
    """ZeRO-0 is DDP (replicate); ZeRO-2/3 are FSDP2 (shard), resharding after forward or not.
    torchtitan has no ZeRO-1, and folds experts over the shard group only."""
    dp, zero = plan.mesh.dp, plan.zero_stage
    shard = zero > 0 or plan.mesh.ep > 1
    if zero == 1:
        e.approximate(
            "ZeRO-1 (optimizer states sharded, parameters whole): torchtitan has no ZeRO-1; FSDP with "
            "reshard_after_forward=never (ZeRO-2) instead, which shards gradients as well and all-gathers "
            "parameters before use",
            {"zero": 2},
        )
    elif zero == 0 and shard and dp > 1:
        e.approximate(
            "ZeRO-0 with expert parallelism: torchtitan takes EP ranks from the FSDP shard group, so data "
            "parallelism is FSDP (ZeRO-2) instead of replication",
            {"zero": 2},
        )
    e.set("--parallelism.data_parallel_shard_degree", dp if shard else 1)
    e.set("--parallelism.data_parallel_replicate_degree", 1 if shard else dp)
    if shard:
        e.set("--parallelism.fsdp_reshard_after_forward", "always" if zero == 3 else "never")


def _tt_pipeline(plan: Plan, e: Export) -> None:
    """The schedule as torch's class name (torchtitan passes it to ``get_schedule_class``) and the
    plan's split as the modules of each chunk, in model order."""
    m = plan.mesh
    e.set("--parallelism.pipeline_parallel_degree", m.pp)
    if m.pp == 1:
        return
    e.set("--training.disable_cuda_graphs")  # torchtitan refuses CUDA graphs under PP
    name = SCHEDULES[plan.schedule].torch_class(plan.virtual_stages).removeprefix("Schedule")
    e.set("--parallelism.pipeline_parallel_schedule", name)
    e.set("--parallelism.pipeline_parallel_microbatch_size", plan.microbatch_size)
    chunks = _tt_chunks(plan)
    if not all(chunks):
        e.approximate(
            f"stage_layers {plan.stage_layers}: a chunk holding no module cannot be written on torchtitan's command "
            "line (module_fqns_per_model_part); torchtitan splits the layers itself, which the plan did not price"
        )
        return
    e.set("--parallelism.module_fqns_per_model_part", " ".join(",".join(c) for c in chunks))


def _tt_chunks(plan: Plan) -> list[list[str]]:
    """Module names of each chunk in torchtitan's decoder models (tok_embeddings, layers.N, norm,
    output): the embedding with the first chunk, the norm and head with the last, as autoshard
    places them."""
    chunks = []
    for i, (start, end) in enumerate(plan.stage_ranges()):
        names = ["tok_embeddings"] if i == 0 else []
        names += [f"layers.{n}" for n in range(start, end)]
        if i == len(plan.stage_layers) - 1:
            names += ["norm", "output"]
        chunks.append(names)
    return chunks


def _tt_batch(plan: Plan, e: Export) -> None:
    """``local_batch_size`` is per data-parallel rank: with PP, one step's micro-batches (the
    schedule splits them); without, one micro-batch, torchtitan accumulating gradients over the
    rest to reach ``global_batch_size``."""
    per_rank = plan.microbatches * plan.microbatch_size
    e.set("--training.local_batch_size", per_rank if plan.mesh.pp > 1 else plan.microbatch_size)
    e.set("--training.global_batch_size", plan.global_batch)
    e.set("--training.seq_len", plan.seq_len)


def _tt_checkpoint(plan: Plan, e: Export) -> None:
    """Nothing recomputed: none; everything: full; a subset: torchtitan's op-level selective
    policy, which chooses its own set."""
    recompute = plan.recompute
    if plan.stage_checkpoint:
        e.approximate(
            f"per-rank recompute sets ({plan.rank_recompute_text()}): torchtitan applies one policy to every "
            "rank; the union, which recomputes more on the ranks that saved",
            {},
        )
    if not recompute:
        e.set("activation-checkpoint:none")
    elif recompute == set(plan.checkpoint):
        e.set("activation-checkpoint:full")
    else:
        e.approximate(
            f"recompute {'+'.join(sorted(recompute))}, save {'+'.join(sorted(set(plan.checkpoint) - recompute))}: "
            "torchtitan's selective policy saves by op (matmul outputs every other one, attention, collectives) "
            "instead of by tensor kind"
        )
        e.set("activation-checkpoint:selective")


# -- Megatron-LM / NeMo ----------------------------------------------------------------------

# autoshard's saved-tensor kind -> the --recompute-modules entry that drops it, and whether the
# module drops that kind alone (False: it recomputes more than the kind)
MEGATRON_MODULES = {
    "attention": ("core_attn", True),
    "norm_output": ("layernorm", True),
    "norm_input": ("layernorm", False),
    "activation": ("mlp", False),
    "linear_output": ("mlp", False),
    "experts": ("moe", False),
    "dropout_mask": ("core_attn", False),
}


def megatron(plan: Plan) -> Export:
    """Megatron-LM's training arguments (megatron-core 0.19) that run the plan."""
    e = Export()
    m = plan.mesh
    e.set("--tensor-model-parallel-size", m.tp)
    e.set("--pipeline-model-parallel-size", m.pp)
    e.set("--context-parallel-size", m.cp)
    if m.ep > 1 or plan.model.get("experts"):
        e.set("--expert-model-parallel-size", m.ep)
        e.set("--expert-tensor-parallel-size", m.etp)
    if plan.sequence_parallel and m.tp > 1:
        e.set("--sequence-parallel")
    if m.cp > 1:
        e.set("--cp-comm-type", "all_gather" if plan.attention == "allgather-kv" else "p2p")
    _mg_pipeline(plan, e)
    _mg_zero(plan, e)
    _mg_recompute(plan, e)
    _mg_precision(plan, e)
    e.set("--num-layers", sum(plan.stage_layers))
    e.set("--seq-length", plan.seq_len)
    e.set("--micro-batch-size", plan.microbatch_size)
    e.set("--global-batch-size", plan.global_batch)
    return e


def _mg_pipeline(plan: Plan, e: Export) -> None:
    """Even chunks: a layer count per virtual stage; v=1 with only the ends differing: the first
    and last stage counts; anything else: the layout string, one ``|``-separated entry per chunk
    in model order (E embedding, t a layer, L the head). Megatron places chunk c on rank c % pp
    and runs interleaved 1F1B."""
    pp, v, layers = plan.mesh.pp, plan.virtual_stages, plan.stage_layers
    if pp == 1:
        return
    sched = SCHEDULES[plan.schedule]
    if plan.schedule not in ("1f1b", "interleaved"):
        e.approximate(
            f"schedule {plan.schedule}: Megatron-LM runs 1F1B / interleaved 1F1B only; interleaved 1F1B over the "
            "same chunks" + (", chunk c on rank c % pp instead of the V" if sched.v_shape else ""),
            {"schedule": "interleaved"},
        )
        if sched.overlaps_ep and plan.mesh.ep > 1:
            e.set("--overlap-moe-expert-parallel-comm")  # its expert all-to-all overlap, DualPipeV's gain
    middle = layers[1:-1]
    if len(set(layers)) == 1:
        if v > 1:
            e.set("--num-layers-per-virtual-pipeline-stage", layers[0])
    elif v == 1 and len(set(middle)) <= 1:
        e.set("--decoder-first-pipeline-num-layers", layers[0])
        if pp > 2:  # with two stages the last takes what the first leaves
            e.set("--decoder-last-pipeline-num-layers", layers[-1])
    else:
        last = len(layers) - 1
        chunks = [("E" if i == 0 else "") + "t" * n + ("L" if i == last else "") for i, n in enumerate(layers)]
        e.set("--pipeline-model-parallel-layout", "|".join(chunks))


def _mg_zero(plan: Plan, e: Export) -> None:
    """ZeRO-1 is the distributed optimizer; ZeRO-2/3 are Megatron-FSDP's sharding strategies."""
    zero = plan.zero_stage
    if zero == 1:
        e.set("--use-distributed-optimizer")
    elif zero > 1:
        e.set("--use-megatron-fsdp")
        e.set("--data-parallel-sharding-strategy", "optim_grads" if zero == 2 else "optim_grads_params")


def _mg_recompute(plan: Plan, e: Export) -> None:
    """Everything recomputed: full recompute of every layer; a subset: the selective modules that
    drop those kinds (``MEGATRON_MODULES``)."""
    recompute = plan.recompute
    if plan.stage_checkpoint:
        e.approximate(
            f"per-rank recompute sets ({plan.rank_recompute_text()}): Megatron applies one set to every rank; "
            "the union, which recomputes more on the ranks that saved",
            {},
        )
    if not recompute:
        return
    if recompute == set(plan.checkpoint):
        e.set("--recompute-granularity", "full")
        e.set("--recompute-method", "uniform")
        e.set("--recompute-num-layers", 1)
        return
    experts = bool(plan.model.get("experts"))
    modules, loose = [], []
    for kind in sorted(recompute):
        module, exact = MEGATRON_MODULES[kind]
        if kind == "activation" and experts:
            module, exact = "moe_act", True
        if module not in modules:
            modules.append(module)
        if not exact:
            loose.append(f"{kind} -> {module}")
    if loose:
        e.approximate("recompute modules drop more than the plan's kinds: " + ", ".join(loose))
    e.set("--recompute-granularity", "selective")
    e.set("--recompute-modules", " ".join(modules))
    if "moe_act" in modules:
        e.set("--moe-grouped-gemm")  # Megatron recomputes the expert activation only with grouped GEMMs


def _mg_precision(plan: Plan, e: Export) -> None:
    """bf16 compute; FP8 as E4M3 with blockwise scales, the format autoshard's plan priced."""
    e.set("--bf16")
    fp8 = plan.precision.get("fp8_matmuls") or []
    if fp8:
        e.set("--fp8-format", "e4m3")
        e.set("--fp8-recipe", "blockwise")
        e.approximate(
            "FP8 matmuls " + "+".join(fp8) + ": Megatron casts every Transformer Engine linear layer, "
            "not a chosen subset"
        )


# -- pricing the approximations -------------------------------------------------------------


def plan_pins(plan: Plan) -> dict:
    """The plan's choices as ``--force`` pins (``parse_force``'s names): the search, so pinned,
    evaluates exactly this plan; with per-rank recompute sets, their union on every rank."""
    m = plan.mesh
    text = (
        f"tp={m.tp},pp={m.pp},cp={m.cp},ep={m.ep},dp={m.dp},zero={plan.zero_stage},schedule={plan.schedule},"
        f"v={plan.virtual_stages},microbatches={plan.microbatches},mbs={plan.microbatch_size},"
        f"recompute={'+'.join(sorted(plan.recompute)) or 'none'},"
        f"fp8={'+'.join(plan.precision.get('fp8_matmuls') or []) or 'off'},attention={plan.attention},"
        f"order={'-'.join(m.order)},stage_layers={'+'.join(map(str, plan.stage_layers))},"
        f"sp={'on' if plan.sequence_parallel else 'off'}"
    )
    return parse_force(text)


def price(plan: Plan, exp: Export, model: str, config: str | None) -> None:
    """Append to each pricable note the cost model's step time for what the trainer runs, beside
    the plan's: ``model`` is captured again (the plan holds only its name) and the search runs
    with every choice pinned, once as the plan is (the reference; per-rank recompute sets, which
    no pin states, are priced against plan.json's own prediction) and once per approximation."""
    if not exp.pricable:
        return
    captured = capture_file(model, config, plan.seq_len)
    pins = plan_pins(plan)
    precision = "auto" if plan.precision.get("fp8_matmuls") else "bf16"
    problem = compiler.problem(captured, plan.hardware, plan.gpus, plan.seq_len, plan.global_batch, precision, pins)
    base = Planner(problem, alternatives=1).run().best.step_time_s
    for index, runs in exp.pricable:
        ref = base if runs else plan.predicted.step_time_s
        try:
            t = Planner(replace(problem, forced={**pins, **runs}), alternatives=1).run().best.step_time_s
            priced = f"{t:.3f} s/step against the plan's {ref:.3f} ({(t / ref - 1) * 100:+.1f}%) by the cost model"
        except AutoshardError as err:
            priced = f"the cost model finds no such plan ({err})"
        exp.notes[index] += f"; {priced}"


# -- the command -----------------------------------------------------------------------------

TARGETS = {"torchtitan": torchtitan, "megatron": megatron}


def render(plan: Plan, to: str, exp: Export) -> str:
    """The file: a header saying how to use it, the approximations as comments, then one setting
    per line (a value with spaces is several arguments, e.g. a list)."""
    m = plan.mesh
    use = {
        "torchtitan": "torchrun ... -m torchtitan.train --module MODEL --config CONFIG $(grep -v '^#' THIS_FILE)",
        "megatron": "torchrun ... pretrain_gpt.py MODEL_ARGS $(grep -v '^#' THIS_FILE)",
    }[to]
    lines = [
        f"# autoshard plan for {plan.model.get('name', 'model')} on {plan.gpus} x {plan.hardware}: "
        f"{m.product_form()}, ZeRO-{plan.zero_stage}, {plan.schedule} (v={plan.virtual_stages}), "
        f"{plan.microbatches} micro-batches, {plan.predicted.step_time_s:.3f} s/step predicted",
        f"# use: {use}",
    ]
    lines += [f"# approximated: {note}" for note in exp.notes]
    lines += [flag if value is None else f"{flag} {value}" for flag, value in exp.settings]
    return "\n".join(lines) + "\n"


def export_plan(
    source: str | Path, to: str, out: str | Path, model: str | None = None, config: str | None = None
) -> Export:
    """Write ``plan``'s settings for ``to`` to ``out`` (whole or not at all); the approximations
    go to stderr as well, priced by the cost model where ``model`` (the plan's model file) is
    given and the trainer's choice can be pinned."""
    if to not in TARGETS:
        raise AutoshardError(f"--to {to}: unknown target; choose one of {', '.join(TARGETS)}")
    plan = Plan.load(source)
    check_output_file(out)
    exp = TARGETS[to](plan)
    if model:
        price(plan, exp, model, config)
    out = Path(out)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(render(plan, to, exp))
    tmp.replace(out)
    for note in exp.notes:
        print(f"autoshard: {to} approximates: {note}", file=sys.stderr)
    return exp
