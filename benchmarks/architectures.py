"""The architecture matrix: transformers' decoders at tiny configs (tests/models/hf_zoo.py), each
compiled with a forced layout on ``--hardware cpu`` and run by ``autoshard verify`` against the
single-device model (fp32, gloo, relative 1e-5). Prints a markdown table: ``ok``, or the one-line
reason compile refused (a refusal the planner knows) or verify failed.

    python benchmarks/architectures.py                      # the full matrix (about 30 min here)
    python benchmarks/architectures.py --arch qwen3,gpt2 --case tp2-sp
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


def run_case(arch: str, case: str, work: Path) -> tuple[str, str]:
    """``(status, detail)``: status is ok, refused (compile said no) or FAIL (verify differed or
    the program crashed)."""
    import hf_zoo

    from autoshard.cli import main
    from autoshard.errors import AutoshardError
    from autoshard.verify import verify

    gpus, pins = hf_zoo.LAYOUTS[case]
    out = work / f"{arch}-{case}"
    args = ["compile", str(ZOO), "--config", arch, "--hardware", "cpu", "--gpus", str(gpus)]
    args += ["--seq-len", str(SEQ), "--global-batch", str(BATCH), "--force", pins, "-o", str(out)]
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(args)
    if rc != 0:
        return "refused", err.getvalue().strip().splitlines()[-1] if err.getvalue().strip() else f"exit {rc}"
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            result = verify(out, steps=STEPS, tolerance=1e-5, timeout=240)
    except AutoshardError as e:
        return "FAIL", str(e)[:200]
    if result["ok"]:
        return "ok", ""
    worst = max(r["rel_diff"] for r in result["steps"])
    return "FAIL", f"loss rel {worst:.1e}, param {result['max_param_abs_diff']:.1e} ({result['max_param_name']})"


def main(argv: list[str] | None = None) -> int:
    import hf_zoo

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default=",".join(hf_zoo.ARCHITECTURES))
    p.add_argument("--case", default=",".join(hf_zoo.LAYOUTS))
    a = p.parse_args(argv)
    archs, cases = a.arch.split(","), a.case.split(",")
    table: dict[tuple[str, str], tuple[str, str]] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for arch in archs:
            for case in cases:
                table[arch, case] = run_case(arch, case, Path(tmp))
                status, detail = table[arch, case]
                print(f"{arch:10s} {case:8s} {status:8s} {detail}", file=sys.stderr, flush=True)
    print(f"\n| architecture | {' | '.join(cases)} |")
    print(f"|---|{'---|' * len(cases)}")
    for arch in archs:
        print(f"| {arch} | {' | '.join(table[arch, c][0] for c in cases)} |")
    notes = [(k, v[1]) for k, v in table.items() if v[0] != "ok"]
    for (arch, case), detail in notes:
        print(f"- {arch} {case}: {detail}")
    failed = sum(v[0] == "FAIL" for v in table.values())
    print(f"\n{len(table)} cases in {time.perf_counter() - t0:.0f} s: "
          f"{sum(v[0] == 'ok' for v in table.values())} ok, {failed} failed")  # fmt: skip
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
