#!/usr/bin/env bash
# benchmarks/eager_attention_memory.py on the device: one Llama-3-8B eager attention block, bytes a score at its
# peak, by length, with and without checkpointing (~1 minute with the wheels' install).
#   device run: bash benchmarks/eager_attention_memory.sh     (carry .whl; see benchmarks/gpu_wheels.sh)
#   then here:  copy <files_at>/eager_attention_memory.json to benchmarks/results/eager_attention_memory_<card>.json
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_stack.sh  # the stack as wheels, QLORA_ROOT, QLORA_CACHE
export OUT=${OUT:-$QLORA_ROOT/out}
mkdir -p "$OUT"
python3 -m benchmarks.eager_attention_memory 2>&1 | tail -60
