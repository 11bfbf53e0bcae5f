#!/usr/bin/env bash
# Real CUDA faults through the sweep engine on a GPU: a trapping kernel ("unspecified launch failure"), an
# out-of-bounds store (illegal address), a device-side assert and an allocation past the 24 GiB cap (OOM),
# two trials at a time on one card. Each must be classified, the sticky ones re-run once with
# CUDA_LAUNCH_BLOCKING=1, and the sweep must go on. Writes benchmarks/results/faults_h200.json.
#   device run: bash benchmarks/faults_h200.sh      (carry .whl; GPU machine has CuPy)
set -euo pipefail
cd "$(dirname "$0")/.."
export QLORA_ROOT=${QLORA_ROOT:-/tmp/qlora} QLORA_CACHE=${QLORA_CACHE:-/tmp/qlora-cache} PYTHONUNBUFFERED=1
STUDY=faults_h200
ARGS=(model=tiny_llama fault.step=3 hydra/sweeper/sampler=grid hydra.sweeper.study_name=$STUDY
  hydra.sweeper.n_trials=5 hydra.sweeper.slots_per_gpu=2 "hydra.sweeper.enqueue_trials=[]"
  hydra.sweeper.soak_top_k=0   # the faults only: no 10-minute soak of the ok trial after them
  "fault.kind=choice(oom,launch_failure,illegal_memory_access,device_assert,none)")
python3 -m src.train -m hydra/sweeper=optuna "${ARGS[@]}"
python3 -m benchmarks.summarize $STUDY benchmarks/results/faults_h200.json --sweeps-dir "$QLORA_ROOT/sweeps" \
  --command "python -m src.train -m hydra/sweeper=optuna ${ARGS[*]}"
