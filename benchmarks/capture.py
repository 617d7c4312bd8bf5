"""Capture + cost time, plan time and peak memory per model, each run in a fresh process.

    python benchmarks/capture.py [--runs 3] [--only NAME]

Prints the medians of the wall time of capture (imports, build on meta, trace, propagate shapes,
analyze) and of the search (``autoshard compile --plan-only`` with the CLI's defaults: bf16, the
plan the cost model prefers), and the peak resident memory of the process. The bundled examples
are traced by ``torch.fx``; transformers' ``LlamaForCausalLM`` and ``DeepseekV3ForCausalLM`` at
the same shapes go through ``torch.export``, which traces one layer per kind and copies the rest
(``autoshard.capture.repeat``). Targets: issue #2, 405B and 671B examples under 20 s and 2 GiB;
issue #13, the transformers models under 30 s each on a 2-core machine.

This file is also the model file of the transformers cases (``CONFIGS``, ``build``,
``sample_inputs``): their published configurations.
"""

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"

# Llama 3.1 405B (arXiv 2407.21783, table 3) and DeepSeek-V3 (arXiv 2412.19437; its config.json)
CONFIGS = {
    "llama3-405b": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            vocab_size=128256,
            hidden_size=16384,
            intermediate_size=53248,
            num_hidden_layers=126,
            num_attention_heads=128,
            num_key_value_heads=8,
            max_position_embeddings=131072,
            rope_theta=500000.0,
        ),
    ),
    "deepseek-v3-671b": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        dict(
            vocab_size=129280,
            hidden_size=7168,
            intermediate_size=18432,
            moe_intermediate_size=2048,
            num_hidden_layers=61,
            first_k_dense_replace=3,
            num_attention_heads=128,
            num_key_value_heads=128,
            n_routed_experts=256,
            n_shared_experts=1,
            num_experts_per_tok=8,
            n_group=8,
            topk_group=4,
            routed_scaling_factor=2.5,
            q_lora_rank=1536,
            kv_lora_rank=512,
            qk_rope_head_dim=64,
            qk_nope_head_dim=128,
            v_head_dim=128,
        ),
    ),
}


def build(config: str):
    import transformers

    model_class, config_class, fields = CONFIGS[config]
    return getattr(transformers, model_class)(getattr(transformers, config_class)(**fields))


def sample_inputs(config: str, batch: int, seq: int) -> tuple:
    return (torch.zeros(batch, seq, dtype=torch.long),)


# name: (model file, config, seq, hardware, gpus, global batch); hardware None: capture only
CASES = {
    "llama3 405b (example)": (EXAMPLES / "llama3.py", "405b", 8192, "h100", 16384, 2048),
    "llama3 405b (transformers)": (Path(__file__), "llama3-405b", 8192, "h100", 16384, 2048),
    "deepseek_v3 671b (example)": (EXAMPLES / "deepseek_v3.py", "671b", 4096, "h800", 2048, 15360),
    "deepseek_v3 671b (transformers)": (Path(__file__), "deepseek-v3-671b", 4096, "h800", 2048, 15360),
    "gpt 175b (example)": (EXAMPLES / "gpt.py", "175b", 2048, None, 0, 0),
    "llama3 8b (example)": (EXAMPLES / "llama3.py", "8b", 8192, None, 0, 0),
}


def child(name: str) -> None:
    path, config, seq, hw, gpus, global_batch = CASES[name]
    start = time.perf_counter()
    from autoshard import planner
    from autoshard.capture import capture_file
    from autoshard.cost_models import hardware
    from autoshard.cost_models.analyze import analyze

    captured = capture_file(str(path), config, seq)
    cost = analyze(captured)
    cost.flops_per_token(seq)
    captured_at = time.perf_counter()
    plan = None
    if hw is not None:
        plan, _ = planner.solve(planner.Problem(cost, hardware.load(hw), gpus, seq, global_batch))
    done = time.perf_counter()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(
        json.dumps(
            {
                "capture": captured_at - start,
                "plan": done - captured_at if plan else None,
                "peak_bytes": peak,
                "params": cost.params,
                "tracer": captured.tracer,
                "mesh": plan.mesh.product_form() if plan else "",
            }
        )
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--only", help="run the cases whose name contains this")
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        child(args.child)
        return
    print(
        f"{'model':32s} {'params':>8s} {'tracer':>14s} {'capture s':>9s} {'plan s':>7s} {'total s':>8s} "
        f"{'peak MiB':>9s}  plan   (medians of {args.runs})"
    )
    for name in CASES:
        if args.only and args.only not in name:
            continue
        runs = []
        for _ in range(args.runs):
            out = subprocess.run(
                [sys.executable, __file__, "--child", name], capture_output=True, text=True, check=True
            )
            runs.append(json.loads(out.stdout.strip().splitlines()[-1]))
        capture = statistics.median(r["capture"] for r in runs)
        planned = [r["plan"] for r in runs if r["plan"] is not None]
        plan = statistics.median(planned) if planned else None
        total = statistics.median(r["capture"] + (r["plan"] or 0) for r in runs)
        peak = max(r["peak_bytes"] for r in runs)
        plan_text = f"{plan:7.2f}" if plan is not None else f"{'-':>7s}"
        print(
            f"{name:32s} {runs[0]['params'] / 1e9:7.1f}B {runs[0]['tracer']:>14s} {capture:9.2f} {plan_text} "
            f"{total:8.2f} {peak / 2**20:9.0f}  {runs[0]['mesh']}"
        )


if __name__ == "__main__":
    main()
