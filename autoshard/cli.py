"""The ``autoshard`` command line. Bad input ends in one line on stderr and exit code 2;
``--debug`` shows the traceback instead. On a terminal, long work shows its progress on one line
of stderr (``autoshard.progress``); ``--quiet`` silences it and the informational lines, leaving
results and errors, and ``--json`` output carries no progress either.

Each command imports what it runs, inside its function: ``--help``, ``autoshard hardware`` and
argument errors answer without loading torch (a third of a second instead of two)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from autoshard import progress
from autoshard.errors import AutoshardError
from autoshard.gcpolicy import fewer_collections


def _positive(kind):
    def parse(text: str):
        try:
            value = kind(float(text)) if kind is int and "e" in text.lower() else kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a {'whole ' if kind is int else ''}number, got {text!r}"
            ) from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    parse.__name__ = f"positive {kind.__name__}"
    return parse


def _positive_list(kind):
    """A comma-separated list of positive numbers (``8192,32768``), each read as ``_positive``."""
    one = _positive(kind)

    def parse(text: str) -> list:
        return [one(x.strip()) for x in text.split(",")]

    parse.__name__ = f"list of positive {kind.__name__}s"
    return parse


def _fraction(text: str) -> float:
    value = _positive(float)(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be a fraction in (0, 1], got {text}")
    return value


class _Parser(argparse.ArgumentParser):
    """argparse, with its usage errors as one line and exit code 2."""

    def error(self, message: str):
        self.exit(2, f"autoshard: error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    """The commands and their flags. Long by nature: a table of ``add_argument`` rows, one per
    flag, read top to bottom like ``--help``; splitting it would scatter one table."""
    parser = _Parser(prog="autoshard", description=__doc__)
    _global_flags(parser, default=False)
    # after the command too; the command's parser must not overwrite a flag given before it
    # with its own default, so there it has none
    common = argparse.ArgumentParser(add_help=False)
    _global_flags(common, default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("inspect", parents=[common], help="capture a model file and print what it costs")
    p.add_argument("model", help="path/to/model.py[:builder]")
    p.add_argument("--config", help="config name passed to the builder")
    p.add_argument("--seq-len", type=_positive(int), required=True, help="sequence length, tokens")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_inspect)

    p = sub.add_parser("estimate", parents=[common], help="training FLOPs, GPU time, cost and memory")
    p.add_argument("--params", type=_positive(float), required=True, help="parameters, e.g. 2e12")
    p.add_argument("--tokens", type=_positive(float), required=True, help="training tokens, e.g. 40e12")
    p.add_argument("--hardware", required=True, help="profile name or path to a .toml profile")
    p.add_argument("--mfu", type=_fraction, default=0.5, help="model FLOPs utilisation (default 0.5)")
    p.add_argument("--gpus", type=_positive(int), help="GPUs sharing the model states")
    p.add_argument("--zero", type=int, choices=range(4), default=3, help="ZeRO stage for --gpus (default 3)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_estimate)

    p = sub.add_parser("compile", parents=[common], help="plan the parallelisation of a model (and write it)")
    p.add_argument("model", help="path/to/model.py[:builder]")
    p.add_argument("--config", help="config name passed to the builder")
    p.add_argument("--hardware", required=True, help="profile name or path to a .toml profile")
    p.add_argument("--gpus", type=_positive(int), required=True, help="GPUs to plan for")
    p.add_argument(
        "--seq-len",
        type=_positive_list(int),
        required=True,
        help="sequence length, tokens; a comma list (8192,32768,131072) with --tokens-per-stage compiles a "
        "long-context ramp: one program per stage under -o, each its own best plan, ramp.md and the driver ramp.py",
    )
    p.add_argument(
        "--global-batch",
        type=_positive(int),
        required=True,
        help="sequences per optimizer step; in a ramp, the first stage's: every stage keeps its tokens per step, "
        "so stage k's batch is this x the first length / stage k's, which must be whole (else a one-line error)",
    )
    p.add_argument(
        "--tokens-per-stage",
        type=_positive_list(float),
        metavar="T1,T2,...",
        help="a ramp's training tokens per stage, one per --seq-len (e.g. 14.8e12,2e11): each stage's steps are "
        "its tokens over the tokens per step, rounded up",
    )
    p.add_argument(
        "--precision",
        choices=("bf16", "fp8", "auto"),
        default="bf16",
        help="bf16 (default), fp8 matmuls, or auto: let the planner decide",
    )
    p.add_argument(
        "--force",
        metavar="PINS",
        help="pin fields, e.g. tp=8,pp=16,schedule=interleaved,zero=1; in a ramp, for every stage, or one set per "
        "stage separated by ';' (\"dp=2;cp=2\")",
    )
    p.add_argument(
        "--memory-headroom",
        type=_headroom,
        help="a share of each GPU's memory the plan leaves free besides the profile's reserve, for what no tracker "
        "sees (allocator fragmentation, CUDA-graph pools), e.g. 0.05; default: the profile's (0)",
    )
    p.add_argument("--compare", metavar="PINS", help="also evaluate this pinned plan and explain the difference")
    p.add_argument("--plan-only", action="store_true", help="write plan.json and plan.md only")
    p.add_argument(
        "--dump-passes",
        metavar="DIR",
        help="write each rewrite pass's graph before and after it to DIR as readable code (NN_pass.before.py)",
    )
    p.add_argument(
        "--noise-scale",
        type=_positive(float),
        metavar="TOKENS",
        help="the gradient noise scale B_noise in tokens (autoshard verify --noise-scale measures one): warn "
        "where the global batch is past this critical batch and say how many steps its size still saves",
    )
    p.add_argument(
        "--islands",
        type=int,
        default=1,
        help="DiLoCo: split the data-parallel ranks into this many islands that sync every --sync-every steps",
    )
    p.add_argument("--sync-every", type=int, help="DiLoCo: inner steps between the islands' outer steps (H)")
    p.add_argument("--outer-lr", type=float, default=0.7, help="DiLoCo: the outer Nesterov SGD's learning rate")
    p.add_argument("--outer-momentum", type=float, default=0.9, help="DiLoCo: the outer Nesterov SGD's momentum")
    p.add_argument("-o", "--out", required=True, help="output directory")
    p.set_defaults(run=_compile)

    p = sub.add_parser("compare", parents=[common], help="plan one model on several hardware profiles side by side")
    p.add_argument("model", help="path/to/model.py[:builder]")
    p.add_argument("--config", help="config name passed to the builder")
    p.add_argument("--hardware", required=True, help="profiles, comma-separated, e.g. h100,h800,b200,gb200-nvl72")
    p.add_argument(
        "--gpus", help="GPU counts, comma-separated (default: each profile's smallest power of two that fits)"
    )
    p.add_argument("--seq-len", type=_positive(int), required=True, help="sequence length, tokens")
    p.add_argument("--global-batch", type=_positive(int), required=True, help="sequences per optimizer step")
    p.add_argument("--tokens", type=_positive(float), help="training tokens: days, GPU-hours and cost for them")
    p.add_argument("--precision", choices=("bf16", "fp8", "auto"), default="bf16", help="as for compile")
    p.add_argument("--force", metavar="PINS", help="pins for every row, as for compile")
    p.add_argument("--chart", metavar="FILE", help="also draw the rows (.png or .svg; needs matplotlib)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(run=_compare)

    p = sub.add_parser("explain", parents=[common], help="why a plan is what it is (and what if ...)")
    p.add_argument("plan", help="OUT/plan.json (or the OUT directory)")
    p.add_argument(
        "--what-if",
        metavar="KEY=VALUE",
        action="append",
        help="price the plan's layout and search afresh with this changed, from the snapshot compile wrote "
        "(no capture): gpus, seq_len, global_batch, hardware=PROFILE or a profile field such as nvlink_gbps; "
        "repeat for several",
    )
    p.add_argument("--json", action="store_true", help="with --what-if: machine-readable output")
    p.set_defaults(run=_explain)

    p = sub.add_parser("verify", parents=[common], help="run an emitted program on CPU against single-device")
    p.add_argument("out", help="the directory autoshard compile wrote")
    p.add_argument("--steps", type=_positive(int), default=3, help="training steps to compare (default 3)")
    p.add_argument(
        "--tolerance",
        type=float,
        help="relative tolerance on losses (default 1e-5; 1e-3 for a program with FP8 matmuls, compared with the "
        "single-device model running the same FP8 emulation)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--timeout",
        type=_positive(float),
        help="seconds before the run counts as hung (default 600; with --at-scale 3600 per rank: a rank of a "
        "671B plan runs 120 micro-batches on one core)",
    )
    p.add_argument("--optimizer", choices=("adamw", "lamb"), help="the optimizer on both sides (default adamw)")
    p.add_argument("--max-grad-norm", type=_positive(float), help="clip the gradient norm on both sides")
    p.add_argument("--warmup", type=int, help="learning-rate warm-up steps on both sides")
    p.add_argument("--lr-schedule", choices=("constant", "cosine", "linear"), help="the schedule on both sides")
    p.add_argument("--min-lr", type=float, help="the decay's final learning rate on both sides")
    p.add_argument(
        "--at-scale",
        action="store_true",
        help="instead: run chosen ranks one optimizer step at their full shapes on fake tensors (no GPU, nothing "
        "allocated) and compare their peak memory, FLOPs and bytes per collective with the plan's",
    )
    p.add_argument(
        "--ranks",
        default="first,last,busiest",
        help="with --at-scale: first, last, busiest (by the plan's memory) and/or rank numbers, comma-separated",
    )
    p.add_argument("--memory-within", type=_positive(float), default=0.10, help="with --at-scale: peak memory bound")
    p.add_argument("--flops-within", type=_positive(float), default=0.03, help="with --at-scale: FLOPs bound")
    p.add_argument("--comm-within", type=_positive(float), default=0.10, help="with --at-scale: bytes per dimension")
    p.add_argument(
        "--noise-scale",
        action="store_true",
        help="instead: measure the simple gradient noise scale tr(Sigma)/|G|^2 of the single-device model over "
        "--steps steps of the program's batches (one sequence against the global batch), for compile --noise-scale",
    )
    p.add_argument(
        "--data", help="with --noise-scale: token files to measure on (as train.py --data; default synthetic)"
    )
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_verify)

    p = sub.add_parser("data", parents=[common], help="token files for train.py --data")
    data = p.add_subparsers(dest="data_command", metavar="COMMAND", required=True, parser_class=_Parser)
    p = data.add_parser("prepare", parents=[common], help="tokenise text files into one token file")
    p.add_argument("texts", nargs="+", metavar="TEXT_FILE", help="UTF-8 text files, each one document")
    p.add_argument("--tokenizer", required=True, help="transformers tokenizer: hub name or local directory")
    p.add_argument("-o", "--out", required=True, help="token file to write (header format, uint16 or uint32 ids)")
    eos = p.add_mutually_exclusive_group()
    eos.add_argument(
        "--append-eos", dest="append_eos", action="store_true", default=True, help="EOS after each document (default)"
    )
    eos.add_argument("--no-eos", dest="append_eos", action="store_false", help="join the documents without EOS")
    p.add_argument("--split-lines", action="store_true", help="one document per non-blank line")
    p.set_defaults(run=_data_prepare)

    p = sub.add_parser("export", parents=[common], help="a training checkpoint as a single-device state dict")
    p.add_argument("checkpoint", help="OUT/ckpt/step_N (or the checkpoint directory: its newest complete one)")
    p.add_argument("-o", "--out", required=True, help="model.safetensors (or a .pt torch file)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32", help="floating tensors' dtype")
    p.set_defaults(run=_export)

    p = sub.add_parser("export-plan", parents=[common], help="a plan as torchtitan or Megatron-LM settings")
    p.add_argument("plan", help="OUT/plan.json (or the OUT directory)")
    p.add_argument("--to", required=True, help="torchtitan (0.3.0 command-line overrides) or megatron (arguments)")
    p.add_argument("-o", "--out", required=True, help="file to write, one setting per line")
    p.add_argument("--model", help="the plan's model file (path/to/model.py[:builder]): price the approximations")
    p.add_argument("--config", help="with --model: the config name passed to the builder")
    p.set_defaults(run=_export_plan)

    p = sub.add_parser("hardware", parents=[common], help="list hardware profiles")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_hardware)

    p = sub.add_parser("calibrate", parents=[common], help="measure this machine into a hardware profile")
    p.add_argument("-o", "--out", required=True, help="profile to write, PROFILE.toml (--hardware accepts it)")
    p.add_argument("--ranks", type=_rank_counts, default=(2, 4), help="process counts to time collectives over (2,4)")
    p.add_argument("--extends", help="profile the written one extends; only measured fields are written")
    p.add_argument("--quick", action="store_true", help="fewer, smaller measurements (a test's minute)")
    p.set_defaults(run=_calibrate)
    return parser


def _global_flags(parser: argparse.ArgumentParser, default) -> None:
    parser.add_argument("--debug", action="store_true", default=default, help="show tracebacks")
    parser.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=default,
        help="no progress line and no informational lines: results and errors only",
    )


def _rank_counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected process counts like 2,4,8, got {text!r}") from None
    if any(n < 2 for n in counts):
        raise argparse.ArgumentTypeError(f"process counts must be 2 or more, got {text}")
    return counts


def _calibrate(args) -> int:
    from autoshard.calibrate import calibrate

    calibrate(args.out, args.ranks, args.extends, args.quick)
    return 0


def _inspect(args) -> int:
    from autoshard.capture import capture_file
    from autoshard.cost_models.analyze import analyze
    from autoshard.summary import format_inspection, inspect_model

    captured = capture_file(args.model, args.config, args.seq_len)
    info = inspect_model(analyze(captured), args.seq_len)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        title = args.model + (f" --config {args.config}" if args.config else "")
        print(format_inspection(info, title))
    return 0


def _estimate(args) -> int:
    from autoshard.cost_models import hardware
    from autoshard.cost_models.estimate import estimate

    hw = hardware.load(args.hardware)
    out = estimate(args.params, args.tokens, hw, args.mfu, args.gpus, args.zero)
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.params:.3g} parameters x {args.tokens:.3g} tokens on {hw.name} at {args.mfu:.0%} MFU")
    print(f"  training FLOPs (6ND)       {out['flops']:.3g}")
    print(f"  GPU-hours                  {out['gpu_hours']:,.0f}  ({out['gpu_years']:,.0f} GPU-years)")
    print(f"  cost at ${hw.price_per_gpu_hour}/GPU-hour     ${out['cost_usd']:,.0f}")
    print(f"  model states (16 B/param)  {out['model_state_bytes'] / 1e12:,.2f} TB")
    print(f"  GPUs to hold them          {out['gpus_for_model_states']:,} x {hw.hbm_gb:g} GB")
    if args.gpus:
        print(
            f"  on {args.gpus:,} GPUs, ZeRO-{args.zero}: {out['model_state_bytes_per_gpu'] / 1e9:,.2f} GB of model "
            f"states per GPU; {out['wall_clock_days']:,.1f} days of training"
        )
    return 0


def _headroom(text: str) -> float:
    value = float(text)
    if not 0 <= value < 1:
        raise argparse.ArgumentTypeError(f"{text} is not a share of memory in [0, 1), e.g. 0.05")
    return value


def _islands(args):
    """DiLoCo's flags as the plan records them; None without ``--islands`` above 1."""
    from autoshard.ir.plan import Islands

    if args.islands == 1 and args.sync_every is None:
        return None
    if args.islands == 1:
        raise AutoshardError(f"--sync-every {args.sync_every} needs --islands 2 or more (DiLoCo's islands)")
    if args.sync_every is None:
        raise AutoshardError(f"--islands {args.islands} needs --sync-every H: the inner steps between syncs")
    return Islands(args.islands, args.sync_every, args.outer_lr, args.outer_momentum)


def _compile(args) -> int:
    if len(args.seq_len) > 1 or args.tokens_per_stage is not None:
        return _compile_ramp(args)
    from autoshard import planner
    from autoshard.compiler import compile_file

    compiled = compile_file(
        args.model,
        args.config,
        hardware=args.hardware,
        gpus=args.gpus,
        seq_len=args.seq_len[0],
        global_batch=args.global_batch,
        precision=args.precision,
        pins=planner.parse_force(args.force),
        memory_headroom=args.memory_headroom,
        plan_only=args.plan_only,
        compare=planner.parse_force(args.compare) if args.compare else None,
        dump_passes=args.dump_passes,
        noise_scale=args.noise_scale,
        islands=_islands(args),
    )
    plan, extra = compiled.plan, compiled.files
    out = compiled.write(args.out)
    p = plan.predicted
    print(
        f"{plan.mesh.product_form()}, ZeRO-{plan.zero_stage}, {plan.schedule} (v={plan.virtual_stages}), "
        f"{plan.microbatches} micro-batches: {p.step_time_s:.3f} s/step, {p.mfu * 100:.1f}% MFU, "
        f"{p.memory_bytes_per_gpu['total'] / 1e9:.1f} GB/GPU"
    )
    if args.noise_scale:
        from autoshard.noise_scale import critical_batch_note

        past, note = critical_batch_note(plan.global_batch, plan.seq_len, args.noise_scale)
        print(f"warning: {note}" if past else note)
    if plan.islands is not None:
        isl = plan.islands
        print(
            f"DiLoCo: {isl.count} islands of dp={plan.mesh.dp // isl.count}, an outer step every {isl.sync_every} "
            f"steps: {isl.outer_bytes_per_step / 1e6:.3g} MB/step per GPU between islands against "
            f"{isl.sync_dp_bytes_per_step / 1e6:.3g} MB for synchronous DP ({isl.outer_s_per_step:.3g} s against "
            f"{isl.sync_dp_s_per_step:.3g} s)"
        )
    if extra:
        last = len(plan.stage_layers) - 1
        layers = " layers.py," if "layers.py" in compiled.files else ""
        progress.note(f"wrote {out}/: plan.json, plan.md, train.py, program.json, loss.py,{layers} stage0..{last}.py")
        if plan.gpus <= 8:
            progress.note(f"run: torchrun --nproc-per-node {plan.gpus} {out / 'train.py'} --steps 10")
        else:
            progress.note(
                f"run on each of {plan.gpus // 8} nodes: torchrun --nnodes {plan.gpus // 8} --nproc-per-node 8 "
                f"--rdzv-backend c10d --rdzv-endpoint HOST:29500 {out / 'train.py'} --steps 10"
            )
    else:
        progress.note(f"wrote {out / 'plan.json'} and {out / 'plan.md'}")
        for reason in plan.not_emitted:
            print(f"not emitted yet (compile without --plan-only takes the best plan without it): {reason}")
    return 0


def _compile_ramp(args) -> int:
    """``compile --seq-len A,B,... --tokens-per-stage TA,TB,...``: a long-context ramp."""
    if args.tokens_per_stage is None:
        raise AutoshardError(
            f"--seq-len {','.join(map(str, args.seq_len))} is a ramp of {len(args.seq_len)} stages: give "
            "--tokens-per-stage, one token count per stage"
        )
    for flag, value in (("--compare", args.compare), ("--dump-passes", args.dump_passes)):
        if value is not None:
            raise AutoshardError(f"{flag} goes with one --seq-len; compile the stage on its own for it")
    from autoshard import ramp

    ramp.compile_ramp(
        args.model,
        args.config,
        hardware=args.hardware,
        gpus=args.gpus,
        seq_lens=args.seq_len,
        global_batch=args.global_batch,
        tokens=args.tokens_per_stage,
        force=args.force,
        precision=args.precision,
        memory_headroom=args.memory_headroom,
        plan_only=args.plan_only,
        out=args.out,
    )
    print((Path(args.out) / "ramp.md").read_text(), end="")
    if args.plan_only:
        progress.note(f"wrote {args.out}/: ramp.md, ramp.json and each stage's plan.json and plan.md")
    else:
        progress.note(f"wrote {args.out}/: ramp.md, ramp.json, ramp.py and each stage's program")
        progress.note(f"run: python {Path(args.out) / ramp.DRIVER} [-- train.py flags for every stage]")
    return 0


def _verify(args) -> int:
    if args.at_scale:
        from autoshard import atscale

        bounds = atscale.Bounds(args.memory_within, args.flops_within, args.comm_within)
        report = atscale.verify_at_scale(args.out, args.ranks, bounds, timeout=args.timeout or 3600.0)
        print(json.dumps(report.to_dict(), indent=2) if args.json else atscale.format_report(report))
        return 0 if report.ok else 1
    from autoshard.verify import format_report, verify

    flags = {k: getattr(args, k) for k in ("optimizer", "max_grad_norm", "warmup", "lr_schedule", "min_lr")}
    if args.noise_scale:
        from autoshard.verify import format_noise_scale, measure_noise_scale

        found = measure_noise_scale(args.out, args.steps, args.seed, flags, data=args.data)
        print(json.dumps(found, indent=2) if args.json else format_noise_scale(found))
        return 0 if found["b_simple_tokens"] is not None else 1
    result = verify(args.out, args.steps, args.tolerance, args.seed, args.timeout or 600.0, flags)
    print(json.dumps(result, indent=2) if args.json else format_report(result))
    return 0 if result["ok"] else 1


def _export(args) -> int:
    from autoshard.export import export

    done = export(args.checkpoint, args.out, args.dtype)
    print(f"wrote {done['out']}: {done['tensors']} tensors, {done['elements']:,} elements from {done['checkpoint']}")
    if done["missing"]:
        shown = ", ".join(done["missing"][:3]) + (", ..." if len(done["missing"]) > 3 else "")
        print(f"not in the checkpoint (buffers that are not training state): {shown}")
    return 0


def _compare(args) -> int:
    from autoshard import compare

    hardware = compare.parse_list(args.hardware, "hardware")
    gpus = compare.parse_list(args.gpus, "gpus", int) if args.gpus else None
    if gpus and min(gpus) < 1:
        raise AutoshardError(f"--gpus {args.gpus!r}: GPU counts must be positive")
    rows = compare.compare(
        args.model,
        args.config,
        hardware,
        gpus,
        args.seq_len,
        args.global_batch,
        args.tokens,
        args.precision,
        args.force,
    )
    if args.chart:
        compare.chart(rows, args.chart, args.tokens)
    print(compare.as_json(rows, args.tokens) if args.json else compare.table(rows, args.tokens))
    return 0


def _export_plan(args) -> int:
    from autoshard.export_plan import export_plan

    done = export_plan(args.plan, args.to, args.out, args.model, args.config)
    approx = f", {len(done.notes)} approximated (see the comments)" if done.notes else ""
    print(f"wrote {args.out}: {len(done.settings)} {args.to} settings{approx}")
    return 0


def _explain(args) -> int:
    if args.what_if:
        from autoshard import whatif

        answer = whatif.ask(args.plan, args.what_if)
        print(json.dumps(answer, indent=2) if args.json else whatif.text(answer))
        return 0
    if args.json:
        raise AutoshardError("--json goes with --what-if (plan.json is the plan itself, machine-readable)")
    from autoshard.ir.plan import Plan
    from autoshard.planner.explain import rationale

    print(rationale(Plan.load(args.plan)))
    return 0


def _data_prepare(args) -> int:
    from autoshard.dataprep import prepare

    s = prepare(args.texts, args.tokenizer, args.out, args.append_eos, args.split_lines)
    files = f"{s['files']} file" + "s" * (s["files"] != 1)
    print(
        f"wrote {s['out']}: {files}, {s['documents']} documents, {s['tokens']:,} tokens, "
        f"{s['dtype']}, vocab {s['vocab']}, {s['seconds']:.1f} s"
    )
    return 0


def _hardware(args) -> int:
    from autoshard.cost_models import hardware

    profiles = [hardware.load(n) for n in hardware.known()]
    if args.json:
        print(json.dumps([p.to_dict() for p in profiles], indent=2))
        return 0
    print(
        f"{'name':12s} {'bf16 TF':>8s} {'fp8 TF':>7s} {'HBM GB':>7s} {'HBM GB/s':>9s} "
        f"{'NVLink GB/s':>12s} {'domain':>7s} {'net GB/s':>9s} {'$/h':>5s}"
    )
    for p in profiles:
        fp8 = p.peak_tflops.get("fp8")
        print(
            f"{p.name:12s} {p.peak_tflops.get('bf16', 0):8g} {fp8 if fp8 else '-':>7} {p.hbm_gb:7g} {p.hbm_gbps:9g} "
            f"{p.nvlink_gbps:12g} {p.nvlink_domain:7d} {p.network_gbps:9g} {p.price_per_gpu_hour:5g}"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    show = sys.stderr.isatty() and not args.quiet and not getattr(args, "json", False)
    try:
        # the session clears its progress line before an error below is printed; imports, capture
        # and search make objects that live on (``gcpolicy``)
        with progress.session(show, args.quiet), fewer_collections():
            return args.run(args)
    except AutoshardError as e:
        if args.debug:
            raise
        print(f"autoshard: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("autoshard: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # output piped into `head` and the like: stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0


if __name__ == "__main__":
    sys.exit(main())
