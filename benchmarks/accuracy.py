"""The cost model against measured training runs (``autoshard.planner.measured``).

    python benchmarks/accuracy.py

Each run's published parallel settings are pinned and the rest is searched; the predicted step
time is set beside the measured one. Runs that publish only an MFU are compared in MFU, under
both ways of counting attention FLOPs where the source does not say which it used.
"""

import statistics
import time
from pathlib import Path

from autoshard.capture import capture_file
from autoshard.cost_models.analyze import analyze
from autoshard.planner.measured import RUNS, masked_attention_share, predict

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def main() -> None:
    start = time.perf_counter()
    costs: dict = {}
    print(f"{'source':31s} {'run':22s} {'measured s':>10s} {'predicted s':>11s} {'pred/meas':>9s}  plan filled in")
    errors: dict[str, list[float]] = {}
    mfu_rows = []
    for run in RUNS:
        key = (run.model, run.config, run.seq)
        if key not in costs:
            costs[key] = analyze(capture_file(str(EXAMPLES / f"{run.model}.py"), run.config, run.seq))
        cost = costs[key]
        plan = predict(run, cost)
        pred = plan.predicted
        dropped = "+".join(k for k, v in plan.checkpoint.items() if v == "recompute") or "none"
        filled = f"ZeRO-{plan.zero_stage}, recompute {dropped}"
        if run.step_s is not None:
            ratio = pred.step_time_s / run.step_s
            errors.setdefault(run.precision, []).append(ratio)
            print(f"{run.source:31s} {run.name:22s} {run.step_s:10.2f} {pred.step_time_s:11.2f} {ratio:9.3f}  {filled}")
        else:
            mfu_rows.append((run, pred.mfu, masked_attention_share(cost, run.seq)))
    for precision, ratios in errors.items():
        print(
            f"  {precision}: median predicted/measured {statistics.median(ratios):.3f}, "
            f"range {min(ratios):.3f}-{max(ratios):.3f} over {len(ratios)} runs"
        )
    print()
    print(f"{'source':31s} {'run':22s} {'published MFU':>13s} {'as causal':>9s} {'predicted':>9s} {'pred/pub':>16s}")
    for run, mfu, share in mfu_rows:
        causal = run.mfu / (1 + share) if run.attention_flops != "causal" else run.mfu
        ratios = f"{mfu / run.mfu:.2f}" + (f" / {mfu / causal:.2f}" if run.attention_flops == "unstated" else "")
        published = f"{run.mfu * 100:12.1f}% {causal * 100:8.1f}%"
        print(f"{run.source:31s} {run.name:22s} {published} {mfu * 100:8.1f}% {ratios:>16s}")
    print(
        "  (autoshard counts causal attention; 'as causal' is the published MFU re-counted that way if the\n"
        "   source counted full attention; pred/pub gives both readings where the source does not say)"
    )
    print(f"\n{time.perf_counter() - start:.0f} s")


if __name__ == "__main__":
    main()
