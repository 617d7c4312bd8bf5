"""``autoshard verify OUT``: run the emitted program on CPU processes (gloo, fp32) from the seeded
single-device initialisation, run the original model on one device with the same data and
optimizer, and compare the losses step by step and, at the end, the state dict: the parameters and
the persistent buffers (a causal mask the model keeps as a buffer), as the program saves them."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode

from autoshard import noise_scale, rebuild
from autoshard.capture import causal_lm_loss
from autoshard.errors import AutoshardError
from autoshard.ir import ops
from autoshard.ir.plan import Plan
from autoshard.ir.program import Program, Routing
from autoshard.runtime import fp8, moe
from autoshard.runtime.lamb import Lamb
from autoshard.runtime.program import global_batch
from autoshard.runtime.rebuild import Recipe
from autoshard.runtime.stages import piece_axis, unslice
from autoshard.runtime.trainer import learning_rate, step_records

LR = 1e-3
WEIGHT_DECAY = 0.1
# Adam divides each update by the gradient's running size plus eps. A parameter whose true gradient
# is zero (a key bias: softmax ignores a shift shared by all keys) gets float noise for a gradient,
# and with eps = 1e-8 Adam turns that noise into updates of size lr, different in any two runs that
# sum in a different order. eps = 1e-6 bounds that amplification to lr * noise / eps while leaving
# every real gradient's update as it was; the program's own default stays 1e-8.
ADAM_EPS = 1e-6
BALANCE_GAMMA = 1e-3  # MoE routing-bias step (the program's default, passed to it explicitly)


def _read_program(out: Path) -> tuple[Plan, Program]:
    if not out.is_dir():
        raise AutoshardError(f"{out} is not a directory; run autoshard compile ... -o {out} first")
    if not (out / "train.py").exists() or not (out / "program.json").exists():
        raise AutoshardError(f"{out} has no train.py; compile without --plan-only to emit the program")
    return Plan.load(out / "plan.json"), Program.load(out / "program.json", error=AutoshardError)


def run_distributed(
    out: Path, plan: Plan, steps: int, seed: int, work: Path, timeout: float, optim: dict | None = None
) -> list[float]:
    log, params = work / "log.jsonl", work / "params"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={plan.gpus}",
        str(out / "train.py"), "--steps", str(steps), "--seed", str(seed), "--init-from-model",
        "--lr", str(LR), "--weight-decay", str(WEIGHT_DECAY), "--adam-eps", str(ADAM_EPS),
        "--loss-log", str(log), "--save-params", str(params), "--balance-gamma", str(BALANCE_GAMMA),
        "--timeout", str(timeout),
    ]  # fmt: skip
    for name, value in (optim or {}).items():
        cmd += [f"--{name.replace('_', '-')}", str(value)]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        raise AutoshardError(f"the emitted program did not finish {steps} steps in {timeout:.0f} s") from None
    if proc.returncode != 0:
        # the ranks' own errors (Python, or a native abort's message), not torchrun's report
        marks = ("Error", "error:", "terminate called", "what():", "enforce fail", "Aborted")
        tail = [
            ln
            for ln in proc.stderr.splitlines()
            if any(m in ln for m in marks) and "ChildFailedError" not in ln and "elastic" not in ln
        ][-3:]
        raise AutoshardError(
            f"the emitted program failed (exit {proc.returncode}): {' | '.join(tail) or proc.stderr[-300:]}"
        )
    return [r["loss"] for r in sorted(step_records(log.read_text()), key=lambda r: r["step"])]


def run_reference(
    plan: Plan, program: Program, steps: int, seed: int, optim: dict | None = None, with_fp8: bool = True
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The single-device model's losses and final parameters, its matmuls in FP8 where the
    program's are (``with_fp8`` False: all in fp32)."""

    model, loss_fn = _reference_model(program, seed)
    adamw = _optimizer(model, (optim or {}).get("optimizer", "adamw"))
    losses = []
    schedule = _schedule(steps, optim or {})
    max_norm = (optim or {}).get("max_grad_norm")
    routing = program.routing
    biases = {k: model.get_buffer(_in_model(e.bias)) for k, e in routing.items() if e.bias}
    fp8_params = program.fp8.params if with_fp8 else ()
    with _counting_loads(model, routing), _fp8_matmuls(model, fp8_params):
        for step in range(steps):
            tokens = global_batch(step, plan.global_batch, plan.seq_len, program.vocab, seed)
            adamw.zero_grad(set_to_none=True)
            for group in adamw.param_groups:
                group["lr"] = learning_rate(schedule, step)
            loss = loss_fn(model, tokens)
            loss.backward()
            if max_norm:
                torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
            adamw.step()
            fp8.new_step()  # as the program does: the weights' FP8 copies are made again
            if routing:  # as the program does after each step: DeepSeek-V3's bias update
                moe.update_biases(biases, BALANCE_GAMMA)
            losses.append(loss.item())
    return losses, {f"model.{k}": v.detach() for k, v in model.state_dict().items()}


def _reference_model(program: Program, seed: int):
    """The single-device model, seeded as the program's ``--init-from-model``, in fp32 and
    training mode, and its loss: ``loss(model, tokens)``."""
    recipe = Recipe.from_dict(program.rebuild)
    torch.manual_seed(seed)
    model = rebuild.build(recipe, device="cpu").float()
    model.train()
    loss_fn = recipe.loss_function() or (lambda out, tokens: causal_lm_loss(out, tokens))

    def loss(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        out = model(tokens)
        out = out["logits"] if isinstance(out, dict) else out[0] if isinstance(out, (tuple, list)) else out
        return loss_fn(out, tokens)

    return model, loss


def measure_noise_scale(
    out: str | Path, steps: int, seed: int = 0, optim: dict | None = None, small: int = 1, data: str | None = None
) -> dict:
    """``autoshard verify --noise-scale``: the simple noise scale B_simple = tr(Sigma)/|G|^2 of
    the program's model (``noise_scale.measure``: the two-batch estimator, McCandlish et al. 2018,
    appendix A) over ``steps`` steps of the program's batches, on the single-device model with the
    verification's optimizer: at each step the squared gradient norms of ``small`` sequences
    (averaged over the global batch's pieces) and of the whole global batch, then a step with
    the global batch's gradient. Sequences are the batch's unit; tokens are sequences x seq_len.
    ``data``: token files (``train.py --data``'s), else the program's synthetic tokens."""
    plan, program = _read_program(Path(out))
    optim = {k: v for k, v in (optim or {}).items() if v is not None}
    if steps < 1:
        raise AutoshardError(f"--steps {steps}: must be at least 1")
    if plan.global_batch <= small or plan.global_batch % small:
        raise AutoshardError(
            f"the global batch of {plan.global_batch} sequences must hold several batches of {small} to compare "
            "gradient norms at two sizes; compile with --global-batch 8 or more"
        )
    model, loss = _reference_model(program, seed)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = _optimizer(model, optim.get("optimizer", "adamw"))
    schedule = _schedule(steps, optim)
    done = [0]

    def step() -> None:
        for group in opt.param_groups:
            group["lr"] = learning_rate(schedule, done[0])
        opt.step()
        done[0] += 1

    if data is not None and not Path(data).exists():
        raise AutoshardError(f"--data {data}: no such file or directory")
    path = Path(data) if data is not None else None
    batches = (global_batch(s, plan.global_batch, plan.seq_len, program.vocab, seed, path) for s in range(steps))
    found = noise_scale.measure(params, lambda tokens: loss(model, tokens), batches, small, step)
    tokens = lambda b: None if b is None else b * plan.seq_len  # noqa: E731
    return {
        "b_simple_sequences": found.b_simple,
        "b_simple_tokens": tokens(found.b_simple),
        "stderr_tokens": tokens(found.spread),
        "trace_sigma": found.trace,
        "grad_sq": found.grad_sq,
        "steps": found.samples,
        "small_sequences": found.small,
        "big_sequences": found.big,
        "seq_len": plan.seq_len,
        "optimizer": optim.get("optimizer", "adamw"),
    }


def format_noise_scale(found: dict) -> str:
    head = (
        f"simple noise scale over {found['steps']} step(s) ({found['optimizer']}), gradient norms at "
        f"{found['small_sequences']} and {found['big_sequences']} sequences of {found['seq_len']} tokens: "
        f"tr(Sigma) {found['trace_sigma']:.4g}, |G|^2 {found['grad_sq']:.4g}"
    )
    if found["b_simple_tokens"] is None:
        return head + "\n|G|^2 came out non-positive: the noise swamps the gradient; measure over more --steps"
    spread = f" +- {found['stderr_tokens']:,.0f}" if found["stderr_tokens"] is not None else ""
    return (
        f"{head}\nB_simple = {found['b_simple_tokens']:,.0f}{spread} tokens "
        f"({found['b_simple_sequences']:.2f} sequences)\n"
        f"use it: autoshard compile ... --noise-scale {found['b_simple_tokens']:.0f}"
    )


def _optimizer(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    """The program's optimizer (``--optimizer``) on one device, with the flags verify gives it:
    torch's AdamW, or the program's own LAMB (``runtime.lamb.Lamb``), each tensor's norms its own."""
    rule = Lamb if name == "lamb" else torch.optim.AdamW
    return rule(model.parameters(), lr=LR, betas=(0.9, 0.95), eps=ADAM_EPS, weight_decay=WEIGHT_DECAY)


def _schedule(steps: int, optim: dict):
    """The program's learning-rate flags for the reference (its defaults where not given)."""
    from argparse import Namespace

    return Namespace(
        lr=LR, steps=steps, warmup=optim.get("warmup", 0), lr_schedule=optim.get("lr_schedule", "constant"),
        min_lr=optim.get("min_lr", 0.0),
    )  # fmt: skip


def _in_model(name: str) -> str:
    """A traced name (``model.`` + the user's model's name) as the user's model names it."""
    return name.removeprefix("model.")


@contextlib.contextmanager
def _counting_loads(model: torch.nn.Module, routing: dict[str, Routing]):
    """Count each MoE layer's expert loads in the single-device model as the program's
    ``rt.moe_record_load`` does: the top-k over that layer's experts made inside its router
    module (``Routing.router``) is its choice."""
    if not routing:
        yield
        return
    current: list[str] = []
    hooks = []
    for key, entry in routing.items():
        module = model.get_submodule(_in_model(entry.router))
        hooks.append(module.register_forward_pre_hook(lambda m, a, key=key: current.append(key) and None))
        hooks.append(module.register_forward_hook(lambda m, a, o: current.pop() and None))

    class Loads(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func in (torch.topk, torch.Tensor.topk) and current:
                entry = routing[current[-1]]
                if args[0].size(-1) == entry.experts and out[1].size(-1) == entry.top_k:
                    moe.record_load(out[1], entry.experts, current[-1])
            return out

    try:
        with Loads():
            yield
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def _fp8_matmuls(model: torch.nn.Module, names: Sequence[str]):
    """Run the single-device model's matmuls by the weights ``names`` (the program's FP8 ones) in
    FP8, with the program's own ``autoshard.runtime.fp8`` functions: the same math, so the two
    differ only where the program's layout cuts a scaling group differently (a TP slice of a
    weight, a row-parallel input's tiles) or sums in another order."""
    if not names:
        yield
        return
    weights = {id(model.get_parameter(_in_model(n))) for n in names}

    def is_fp8(t) -> bool:
        while isinstance(t, torch.Tensor):
            if id(t) in weights:
                return True
            t = t._base
        return False

    class Fp8(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            form = ops.fp8_form(func)  # the op table's column the FP8 pass reads too
            if form == "linear" and len(args) >= 2 and is_fp8(args[1]):
                return fp8.fp8_linear(args[0], args[1], args[2] if len(args) > 2 else kwargs.get("bias"))
            if form == "product" and len(args) == 2 and not kwargs and is_fp8(args[1]):
                return fp8.fp8_matmul(args[0], args[1])
            if form == "addmm" and len(args) == 3 and not kwargs and is_fp8(args[2]):
                return fp8.fp8_addmm(*args)
            if form == "grouped" and len(args) >= 2 and is_fp8(args[1]):
                return fp8.fp8_grouped_mm(args[0], args[1], kwargs.get("offs", args[2] if len(args) > 2 else None))
            return func(*args, **kwargs)

    with Fp8():
        yield


def _saved(params_dir: Path) -> tuple[dict[str, dict[int, list[torch.Tensor]]], dict[str, tuple | None]]:
    """name -> TP rank (EP rank for stacked expert weights) -> every copy of that piece the ranks
    saved (several where pipeline chunks hold a copy of a tied parameter), and name -> how it
    was split."""

    pieces: dict[str, dict[int, list[torch.Tensor]]] = {}
    specs: dict[str, tuple | None] = {}
    for path in sorted(params_dir.glob("rank*.pt")):
        saved = torch.load(path, weights_only=False)
        for name, (tensor, spec, _chunk) in saved["params"].items():
            rank = saved.get("ep_rank", 0) if piece_axis(spec) == "ep" else saved["tp_rank"]
            pieces.setdefault(name, {}).setdefault(rank, []).append(tensor)
            specs[name] = spec
        for name, tensor in saved.get("copies", ()):
            spec = specs.get(name)
            rank = saved.get("ep_rank", 0) if piece_axis(spec) == "ep" else saved["tp_rank"]
            pieces[name][rank].append(tensor)
    return pieces, specs


def assemble(params_dir: Path) -> dict[str, torch.Tensor]:
    """Whole parameters and persistent buffers from the ranks' saved pieces (TP slices put back
    together)."""

    pieces, specs = _saved(params_dir)
    whole = {}
    for name, by_rank in pieces.items():
        spec, first = specs[name], [by_rank[r][0] for r in sorted(by_rank)]
        whole[name] = unslice(first, spec) if spec else first[0]
    return whole


def copies_apart(params_dir: Path) -> tuple[str | None, float]:
    """The parameter whose saved copies (held by several pipeline chunks: a tied embedding and
    head) differ most, and by how much: one parameter's copies must stay equal."""
    worst_name, worst = None, 0.0
    for name, by_rank in _saved(params_dir)[0].items():
        for first, *others in by_rank.values():
            for other in others:
                diff = (other - first).abs().max().item()
                if diff > worst:
                    worst_name, worst = name, diff
    return worst_name, worst


TOLERANCE = 1e-5  # fp32 programs: losses relative, parameters absolute
# FP8 programs: losses relative to the FP8-emulating single-device model. Where the layout cuts no
# scaling group (DP, ZeRO, PP) the two agree to fp32 round-off (measured about 1e-7); a TP slice of
# a weight or of a row-parallel input starts its own 128-groups, which moves losses by about 1e-5
# (measured on the tiny examples, 5 steps). Parameters: AdamW moves an element by at most about lr
# per step, so two runs whose gradients differ in one FP8 rounding can drift up to 2 lr a step.
FP8_TOLERANCE = 1e-3


def verify(
    out: str | Path,
    steps: int,
    tolerance: float | None = None,
    seed: int = 0,
    timeout: float = 600,
    optim: dict | None = None,
) -> dict:
    """``optim``: the program's optimisation flags to use on both sides (``optimizer``,
    ``max_grad_norm``, ``warmup``, ``lr_schedule``, ``min_lr``), as ``{flag name: value}``. ``tolerance``: None for
    ``TOLERANCE``, or ``FP8_TOLERANCE`` for a program with FP8 matmuls, which is compared with the
    single-device model running the same FP8 emulation (and, for information, without it)."""
    out = Path(out)
    optim = {k: v for k, v in (optim or {}).items() if v is not None}
    plan, program = _read_program(out)
    fp8 = list(program.fp8.kinds)
    if tolerance is None:
        tolerance = FP8_TOLERANCE if fp8 else TOLERANCE
    param_tolerance = max(tolerance, 2 * LR * steps) if fp8 else tolerance
    if steps < 1:
        raise AutoshardError(f"--steps {steps}: must be at least 1")
    with tempfile.TemporaryDirectory(prefix="autoshard-verify-") as tmp:
        work = Path(tmp)
        distributed = run_distributed(out, plan, steps, seed, work, timeout, optim)
        reference, ref_params = run_reference(plan, program, steps, seed, optim)
        high = run_reference(plan, program, steps, seed, optim, with_fp8=False)[0] if fp8 else None
        params = assemble(work / "params")
        apart_name, apart = copies_apart(work / "params")
    rows = _loss_rows(distributed, reference)
    params_apart = _parameters_apart(params, ref_params)
    ok = (
        len(rows) == steps
        and all(r["rel_diff"] <= tolerance for r in rows)
        and params_apart["max_param_abs_diff"] <= param_tolerance
        and apart <= tolerance
        and not [m for m in params_apart["missing_params"] if ref_params[m].is_floating_point()]
    )
    return {
        "plan": plan.mesh.product_form() + f", ZeRO-{plan.zero_stage}, {plan.schedule}",
        "steps": rows,
        **params_apart,
        "max_copy_abs_diff": apart,
        "max_copy_name": apart_name,
        "tolerance": tolerance,
        "param_tolerance": param_tolerance,
        "fp8": fp8,
        "optimizer": optim.get("optimizer", "adamw"),
        # FP8's own effect: the FP8 reference's losses against the same model in fp32
        "fp8_gap": max(_relative(a, b) for a, b in zip(reference, high)) if high else None,
        "ok": ok,
    }


def _relative(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def _loss_rows(distributed: list[float], reference: list[float]) -> list[dict]:
    """One row per step: the program's loss, the single-device model's, their relative difference."""
    return [
        {"step": step, "distributed": a, "single_device": b, "rel_diff": _relative(a, b)}
        for step, (a, b) in enumerate(zip(distributed, reference))
    ]


def _parameters_apart(params: dict[str, torch.Tensor], ref_params: dict[str, torch.Tensor]) -> dict:
    """How far the program's final parameters and persistent buffers (``params``) lie from the
    single-device model's state dict (``ref_params``): the largest difference, absolute (and
    relative to that tensor's largest entry), which tensor, and the names the program never saved.

    Parameters are compared absolutely: AdamW divides each gradient by its own running size, so
    an element whose gradient is as small as eps (1e-8) turns a 1e-7 relative difference in the
    gradient into a visible one in its update; the absolute difference stays bounded by lr."""
    worst_name, worst, worst_rel = None, 0.0, 0.0
    for name, ref in ref_params.items():
        if name not in params or not ref.is_floating_point():
            continue
        diff = (params[name] - ref).abs().max().item()
        worst_rel = max(worst_rel, diff / max(ref.abs().max().item(), 1e-12))
        if diff >= worst:
            worst_name, worst = name, diff
    return {
        "max_param_abs_diff": worst,
        "max_param_rel_diff": worst_rel,
        "max_param_name": worst_name,
        "missing_params": sorted(set(ref_params) - set(params)),
    }


def format_report(result: dict) -> str:
    lines = [
        f"verify: {result['plan']} against single-device, fp32 on CPU, "
        f"{'LAMB' if result.get('optimizer') == 'lamb' else 'AdamW'} lr {LR:g} eps {ADAM_EPS:g}",
        "",
    ]
    if result.get("fp8"):
        lines[1:1] = [
            f"FP8 matmuls ({', '.join(result['fp8'])}) emulated on both sides: 1x128 / 128x128 E4M3 scaling, fp32 "
            "accumulation, the program's own quantisation code"
        ]
    lines.append(f"{'step':>4}  {'distributed':>14}  {'single-device':>14}  {'rel. diff':>10}")
    for r in result["steps"]:
        lines.append(f"{r['step']:>4}  {r['distributed']:>14.8f}  {r['single_device']:>14.8f}  {r['rel_diff']:>10.2e}")
    lines.append("")
    lines.append(
        f"largest parameter difference after {len(result['steps'])} steps: {result['max_param_abs_diff']:.2e} "
        f"absolute ({result['max_param_name']}); {result['max_param_rel_diff']:.2e} relative to that tensor's "
        "largest entry"
    )
    if result["max_copy_name"]:
        lines.append(
            "copies of one parameter held by several pipeline chunks differ by up to "
            f"{result['max_copy_abs_diff']:.2e} ({result['max_copy_name']})"
        )
    if result["missing_params"]:
        lines.append(f"state-dict tensors the program never saved: {', '.join(result['missing_params'])}")
    if result.get("fp8_gap") is not None:
        lines.append(
            f"FP8's own effect, for information: the FP8 single-device losses differ from fp32 ones by up to "
            f"{result['fp8_gap']:.2e} relative"
        )
    verdict = "OK" if result["ok"] else "FAILED"
    bounds = f"tolerance {result['tolerance']:.0e}"
    if result.get("param_tolerance", result["tolerance"]) != result["tolerance"]:
        bounds += f" on losses (relative), {result['param_tolerance']:.0e} on parameters (absolute: 2 lr a step)"
    else:
        bounds += " (losses relative, parameters absolute)"
    lines.append(f"{verdict}: {bounds}")
    return "\n".join(lines)
