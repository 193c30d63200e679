#!/usr/bin/env bash
# The CUDA path on a GPU machine, with that machine's own torch (no install): the engine's GPU tests,
# then the demo's shape for a few steps with device=cuda and device=cpu side by side.
#   bash bench/cuda_check.sh            (TAILRACE_CACHE may point at a cache holding the warm start)
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TAILRACE_CACHE=${TAILRACE_CACHE:-$PWD/.devcache}
out=${OUT:-/tmp/cuda_check}
mkdir -p "$out"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
echo "cores: $(nproc)"
timeout 240 python3 -m pytest -q -p no:cacheprovider tests/engine/test_engine_gpu.py tests/runtime/test_device.py 2>&1 | tail -15
for dev in cuda cpu; do
  echo "== device=$dev"
  timeout 150 python3 -m tailrace.cli train --device="$dev" --flow.steps=10 --eval.n=128 \
    --run-dir="$out/run_$dev" 2>&1 | grep -v "^\s*$" | tail -6
done
