"""Published training runs that state every parallel setting and a measured speed: what the cost
model is checked against (``benchmarks/accuracy.py`` prints the comparison,
``tests/planner/test_measured.py`` guards it).

A run is predicted by pinning all of its published settings (``pins``, as ``--force`` takes them)
and letting the search fill in only what the source leaves open (ZeRO stage, recompute set, stage
balance). Step times compare directly; MFU figures only under the source's FLOP count, which
not every source states (``attention_flops``).

None of these runs was used to set a profile value: they are out-of-sample checks.
"""

from __future__ import annotations

from dataclasses import dataclass

from autoshard.cost_models import hardware
from autoshard.cost_models.analyze import ModelCost
from autoshard.plan import Plan
from autoshard.planner import Problem, parse_force, solve

# NVIDIA/dgxc-benchmarking, llama3.1/README_{405b,70b,8b}.md at commit 143b90dd91f9 (NeMo 24.09
# container, DGX H100): "Training step time (seconds per step)", the last of 50-100 steps. Their
# MFU counts full (non-causal) attention: 12*L*h^2*(1 + g/a + s/h) + 18*L*F*h + 6*V*h per token.
# The 405B recipe uses the GPT-2 BPE tokenizer as a proxy (vocabulary about 50K, not 128K): its
# output head is smaller than in examples/llama3.py, which makes our last stage slightly heavier.
_DGXC = "NVIDIA dgxc-benchmarking 24.09"


@dataclass(frozen=True)
class Run:
    name: str
    source: str
    model: str  # examples/<model>.py
    config: str
    hardware: str
    gpus: int
    seq: int
    global_batch: int  # sequences
    pins: str  # the published parallel settings, as --force takes them
    precision: str = "bf16"
    step_s: float | None = None  # measured seconds per step
    mfu: float | None = None  # published MFU
    attention_flops: str = "full"  # how the source counts attention FLOPs in its MFU: causal | full | unstated


def _dgxc(model, config, gpus, batch, tp, pp, cp, v, step, precision="bf16") -> Run:
    dp = gpus // (tp * pp * cp)
    sched = f",schedule=interleaved,v={v}" if v else ""
    return Run(
        f"{config} {precision} {gpus}",
        _DGXC,
        model,
        config,
        "h100",
        gpus,
        8192,
        batch,
        f"tp={tp},pp={pp},cp={cp},dp={dp},mbs=1{sched}" + (",fp8=on" if precision == "fp8" else ""),
        precision,
        step_s=step,
    )


RUNS: tuple[Run, ...] = (
    _dgxc("llama3", "405b", 576, 252, 8, 9, 2, 7, 17.20),
    _dgxc("llama3", "405b", 1152, 504, 8, 9, 2, 7, 17.52),
    _dgxc("llama3", "405b", 2304, 1008, 8, 9, 2, 7, 17.62),
    _dgxc("llama3", "70b", 64, 128, 4, 4, 2, 5, 14.72),
    _dgxc("llama3", "70b", 2048, 4096, 4, 4, 2, 5, 14.98),
    _dgxc("llama3", "8b", 8, 128, 1, 1, 2, 0, 12.91),
    _dgxc("llama3", "8b", 128, 2048, 1, 1, 2, 0, 13.10),
    _dgxc("llama3", "405b", 576, 252, 8, 9, 2, 7, 11.24, "fp8"),
    _dgxc("llama3", "405b", 2304, 1008, 8, 9, 2, 7, 12.35, "fp8"),
    _dgxc("llama3", "70b", 64, 128, 4, 4, 2, 5, 11.01, "fp8"),
    _dgxc("llama3", "8b", 8, 128, 1, 1, 2, 0, 9.67, "fp8"),
    # DeepSeek-V3 (arXiv 2412.19437 section 3.2; step time from the DeepSeek ISCA paper, arXiv
    # 2505.09343, read through a secondary summary): 19.926 s per step, MFU 38.94% counted causal.
    Run(
        "deepseek-v3 fp8 2048",
        "DeepSeek-V3 / ISCA 2025",
        "deepseek_v3",
        "671b",
        "h800",
        2048,
        4096,
        15360,
        "tp=1,pp=16,ep=64,dp=128,zero=1,schedule=dualpipev",
        "fp8",
        step_s=19.926,
        mfu=0.3894,
        attention_flops="causal",
    ),
    # Llama 3 (arXiv 2407.21783, Table 4): MFU only, and the paper does not say how it counts
    # attention FLOPs.
    Run("405b bf16 8192", "Llama 3 Table 4", "llama3", "405b", "h100", 8192, 8192, 2048,
        "tp=8,pp=16,cp=1,dp=64,schedule=interleaved", mfu=0.43, attention_flops="unstated"),
    Run("405b bf16 16384", "Llama 3 Table 4", "llama3", "405b", "h100", 16384, 8192, 2048,
        "tp=8,pp=16,cp=1,dp=128,schedule=interleaved", mfu=0.41, attention_flops="unstated"),
    Run("405b bf16 16384 131K", "Llama 3 Table 4", "llama3", "405b", "h100", 16384, 131072, 128,
        "tp=8,pp=16,cp=16,dp=8,schedule=interleaved", mfu=0.38, attention_flops="unstated"),
)  # fmt: skip


def predict(run: Run, cost: ModelCost) -> Plan:
    """The best plan under the run's published settings; ``cost`` is the analysed model."""
    pins = parse_force(run.pins)
    problem = Problem(cost, hardware.load(run.hardware), run.gpus, run.seq, run.global_batch, run.precision, pins)
    return solve(problem)[0]


def masked_attention_share(cost: ModelCost, seq: int) -> float:
    """The training FLOPs a count that ignores the causal mask adds, as a share of the causal count
    autoshard reports (``cost`` is the analysed model): the attention core's masked half again."""
    attention = sum(b.count * b.eval("flops_attention", 1, seq) for b in cost.all_blocks())
    return attention / cost.flops_forward(1, seq)
