#!/usr/bin/env bash
# The CUDA path on a GPU machine, with that machine's own torch (no install), as one prepared run:
#   tests    the engine's GPU tests: CUDA against the CPU, speculation lossless with every drafter,
#            LoRA rows of several adapters in one forward against each adapter alone, an MoE's recorded
#            routes; the trainer's: routing replay and the load-balancing loss on CUDA
#   spec     bench/spec.py on CUDA (bf16): rollouts with and without history drafts, epochs 1 and 2,
#            and the plain engine built batch-invariant (off-inv: the reference the tokens must equal)
#   toggle   bench/spec.py --batches on CUDA: the toggle at fixed active batches (fp32; bf16 at 16, 64)
#   pieces   bench/spec_pieces.py on CUDA: verify steps, drafts attended one by one vs together
#   tenants  bench/tenants.py on CUDA, a 150M-parameter random model (hidden 1024, 12 layers, bf16),
#            with the per-token gathered adapter terms and with the per-slot groups
#   tenants_rl  bench/tenants_rl.py on CUDA: 8 tenants training their LoRA adapters together vs one by one
#   lora_policies  bench/policies.py --device=cuda: 8 LoRA tenants as policies of one run, each trainer a
#            process of its own beside the engine (#19's 2.5x), against the same 8 runs one after another
#   train    the demo's shape for 10 steps with device=cuda
#   bash bench/cuda_check.sh                   STAGES=tests,spec bash bench/cuda_check.sh
# TAILRACE_CACHE may point at a cache holding the warm start (carry it: building it takes minutes).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 TAILRACE_CACHE=${TAILRACE_CACHE:-$PWD/.devcache}
out=${OUT:-/tmp/cuda_check}
stages=${STAGES:-tests,spec,toggle,pieces,tenants,tenants_rl,lora_policies,train}
mkdir -p "$out"
has() { [[ ",$stages," == *",$1,"* ]]; }
stamp() { echo "== $1 ($(date +%T), ${SECONDS}s)"; }
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), torch.cuda.get_device_name(0) if torch.cuda.is_available() else '')"
echo "cores: $(nproc)"
if has tests; then
  stamp tests
  timeout 130 python3 -m pytest -q -p no:cacheprovider -rf tests/engine/test_engine_gpu.py \
    tests/trainer/test_trainer_gpu.py tests/runtime/test_device.py 2>&1 | tail -30
fi
if has spec; then  # bf16: exactness at batch 64 (it broke there before the batch-invariant fix)
  stamp spec
  timeout 150 python3 bench/spec.py --device cuda --dtype bf16 --drafters off,off-inv,history --rounds 2 \
    --out "$out/spec.json" 2>&1 | tail -12
fi
if has toggle; then
  stamp toggle
  timeout 60 python3 bench/spec.py --device cuda --dtype fp32 --drafters off,history,quant8 --batches 1,4,16,64 \
    --rounds 3 --max-new 128 --out "$out/toggle.json" 2>&1 | tail -6
  timeout 60 python3 bench/spec.py --device cuda --dtype bf16 --drafters off,off-inv,history --batches 16,64 \
    --rounds 3 --max-new 128 --out "$out/toggle_bf16.json" 2>&1 | tail -4
fi
if has pieces; then
  stamp pieces
  timeout 90 python3 bench/spec_pieces.py --device cuda --batches 8,64 --turns 1 2>&1 | tail -6
fi
if has tenants; then
  stamp "tenants (gathered)"
  timeout 150 python3 bench/tenants.py --device cuda --dtype bf16 --hidden 1024 --layers 12 --tenants 1,4,8 \
    --repeats 2 --out "$out/tenants.json" 2>&1 | grep -v "^\s*$" | head -8
  stamp "tenants (grouped)"
  timeout 50 python3 bench/tenants.py --device cuda --dtype bf16 --hidden 1024 --layers 12 --tenants 8 \
    --repeats 1 --lora-terms grouped --out "$out/tenants_grouped.json" 2>&1 | grep -v "^\s*$" | head -6
fi
if has tenants_rl; then
  stamp tenants_rl
  timeout 240 python3 bench/tenants_rl.py --device cuda --tenants 8 --steps 6 --eval-n 256 --slots 512 \
    --out "$out/tenants_rl.json" 2>&1 | grep -v "^\s*$" | tail -8
fi
if has lora_policies; then  # turns: one trainer step at a time; fifo: the 8 trainers step at once on the GPU
  stamp lora_policies
  timeout 420 python3 bench/policies.py --tag lora8cuda --policies 8 --steps 6 --seeds 0 --eval-every 6 \
    --eval-n 128 --share turns,fifo -- --train.lora.rank=8 --device=cuda 2>&1 | grep -v "^\s*$" | tail -6
fi
if has train; then
  stamp "train device=cuda"
  timeout 60 python3 -m tailrace.cli train --device=cuda --flow.steps=10 --eval.n=128 \
    --run-dir=/tmp/run_cuda 2>&1 | grep -v "^\s*$" | tail -5
fi
stamp done
