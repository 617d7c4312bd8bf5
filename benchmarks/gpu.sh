#!/usr/bin/env bash
# Every GPU figure the README and benchmarks/README.md wait for, in one run on one CUDA GPU (each
# step under its own time limit, so one hang costs only its share): the Triton kernels' tests on
# the GPU, then the FP8 GEMM, FlashAttention and grouped-expert GEMM benchmarks, and the emitted
# program with and without regional compilation. Output goes to
# stdout and, where $OUT is set (the device tool's folder), to $OUT/gpu.log.
#   bash benchmarks/gpu.sh
set -u
cd "$(dirname "$0")/.."
log="${OUT:-/tmp}/gpu.log"
: >"$log"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1 | tee -a "$log"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" 2>&1 | tee -a "$log"
for step in \
    "100 python -m pytest -q -x tests/kernels" \
    "100 python benchmarks/fp8.py" \
    "120 python benchmarks/attention.py" \
    "60 python benchmarks/moe.py --gpu" \
    "120 python benchmarks/regional_compile.py"; do
    limit=${step%% *}
    cmd=${step#* }
    echo "== $cmd (limit ${limit}s)" | tee -a "$log"
    timeout "$limit" $cmd 2>&1 | tee -a "$log"
    echo "== rc ${PIPESTATUS[0]}: $cmd" | tee -a "$log"
done
