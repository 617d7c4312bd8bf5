"""The architecture matrix: transformers' decoders at tiny configs (tests/models/hf_zoo.py), each
compiled with a forced layout on ``--hardware cpu`` and run by ``autoshard verify`` against the
single-device model (fp32, gloo, relative 1e-5). Prints a markdown table: ``ok``, or the one-line
reason compile refused (a refusal the planner knows) or verify failed.

    python benchmarks/architectures.py                      # the full matrix (about 30 min here)
    python benchmarks/architectures.py --arch qwen3,gpt2 --case tp2-sp
    python benchmarks/architectures.py --moe                # the MoE matrix (tests/models/hf_moe.py):
                                                            # EP layouts of the bundled DeepSeek-V3 and
                                                            # transformers' DeepseekV3 / Mixtral, 3 steps
    python benchmarks/architectures.py --examples           # the examples' matrix
                                                            # (tests/models/examples_matrix.py): GPT,
                                                            # LLaMA and transformers' Llama, 3 steps
"""

from __future__ import annotations

import argparse
import contextlib
import io
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ZOO = ROOT / "tests" / "models" / "hf_zoo.py"
sys.path.insert(0, str(ZOO.parent))

SEQ, BATCH, STEPS = 32, 8, 2


def run_case(arch: str, case: str, work: Path, zoo=None, steps: int = STEPS) -> tuple[str, str]:
    """``(status, detail)``: status is ok, refused (compile said no) or FAIL (verify differed or
    the program crashed). ``zoo``: the module naming the models and layouts (``hf_zoo``; for
    ``hf_moe`` its ``MODELS`` give each model's file and config)."""
    import hf_zoo

    from autoshard.cli import main
    from autoshard.errors import AutoshardError
    from autoshard.verify import verify

    zoo = zoo or hf_zoo
    gpus, pins = zoo.LAYOUTS[case]
    seq = getattr(zoo, "SEQ", {}).get(arch, SEQ)
    files = getattr(zoo, "MODELS", None) or getattr(zoo, "FILES", {})
    path, config = (ROOT / files[arch][0], files[arch][1]) if arch in files else (ZOO, arch)
    out = work / f"{arch}-{case}".replace(" ", "_")
    args = ["compile", str(path), "--config", config, "--hardware", "cpu", "--gpus", str(gpus)]
    args += ["--seq-len", str(seq), "--global-batch", str(BATCH), "--force", pins, "-o", str(out)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(args)
    if rc != 0:
        return "refused", err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {rc}"
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            result = verify(out, steps=steps, tolerance=1e-5, timeout=240)
    except AutoshardError as e:
        return "FAIL", str(e)[:200]
    if result["ok"]:
        return "ok", ""
    worst = max(r["rel_diff"] for r in result["steps"])
    return "FAIL", f"loss rel {worst:.1e}, param {result['max_param_abs_diff']:.1e} ({result['max_param_name']})"


def main(argv: list[str] | None = None) -> int:
    import hf_zoo

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    which = p.add_mutually_exclusive_group()
    which.add_argument("--moe", action="store_true", help="the MoE matrix (tests/models/hf_moe.py) instead")
    which.add_argument(
        "--examples", action="store_true", help="the examples' matrix (tests/models/examples_matrix.py) instead"
    )
    p.add_argument("--arch", help="comma-separated models (default: all of the matrix)")
    p.add_argument("--case", help="comma-separated layouts (default: all)")
    a = p.parse_args(argv)
    zoo = __import__("hf_moe") if a.moe else __import__("examples_matrix") if a.examples else hf_zoo
    names = zoo.MODELS if hasattr(zoo, "MODELS") else {**zoo.ARCHITECTURES, **zoo.FILES}
    archs = a.arch.split(",") if a.arch else list(names)
    cases = a.case.split(",") if a.case else list(zoo.LAYOUTS)
    # MoE: three steps, so the routing biases move twice before the last
    steps = 3 if a.moe else getattr(zoo, "STEPS", STEPS)
    pairs = set(getattr(zoo, "PAIRS", [(arch, case) for arch in archs for case in cases]))
    table: dict[tuple[str, str], tuple[str, str]] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            for case in cases:
                if (arch, case) not in pairs:
                    table[arch, case] = ("-", "")
                    continue
                start = time.perf_counter()
                table[arch, case] = run_case(arch, case, Path(tmp), zoo, steps)
                status, detail = table[arch, case]
                took = time.perf_counter() - start
                print(f"{arch:10s} {case:8s} {status:8s} {took:5.0f} s {detail}", file=sys.stderr, flush=True)
    print(f"\n| architecture | {' | '.join(cases)} |")
    print(f"|---|{'---|' * len(cases)}")
    for arch in archs:
        print(f"| {arch} | {' | '.join(table[arch, c][0] for c in cases)} |")
    notes = [(k, v[1]) for k, v in table.items() if v[0] not in ("ok", "-")]
    for (arch, case), detail in notes:
        print(f"- {arch} {case}: {detail}")
    failed = sum(v[0] == "FAIL" for v in table.values())
    print(f"\n{sum(v[0] != '-' for v in table.values())} cases in {time.perf_counter() - t0:.0f} s: "
          f"{sum(v[0] == 'ok' for v in table.values())} ok, {failed} failed")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
