"""FP8 training fidelity on CPU processes: the tiny LLaMA and the tiny DeepSeek-V3 (EP2, FP8
dispatch) compiled with one plan, FP8 matmuls on and off, trained a few hundred steps on a fixed
bigram token file (tests/test_fp8_fidelity.py, whose CI case is the LLaMA one). Prints each final
loss (mean of the last 10 steps) and the relative gap; exit 1 where a gap reaches 0.5%.

    python benchmarks/fp8_fidelity.py [--models llama3,deepseek_v3]     # about 2.5 minutes here
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    from tests.test_fp8_fidelity import BOUND, CASES, bigram_tokens, fidelity

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default=",".join(sorted(CASES)))
    a = p.parse_args()
    failed = 0
    print("| model | steps | final loss fp8 | fp32 | relative gap | seconds |")
    print("|---|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        tokens = bigram_tokens(Path(tmp) / "bigram.bin")
        for model in a.models.split(","):
            start = time.perf_counter()
            on, off, steps = fidelity(model, tokens, Path(tmp) / model)
            gap = abs(on - off) / off
            failed += gap >= BOUND
            print(
                f"| {model} | {steps} | {on:.5f} | {off:.5f} | {gap:.1e} | {time.perf_counter() - start:.0f} |",
                flush=True,
            )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
