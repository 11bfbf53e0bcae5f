#!/usr/bin/env bash
# benchmarks/memory_random_h200.py `run` as one run that may outlive a device call, through memory_h200.sh (which
# starts it in a session of its own and waits up to WAIT seconds; `... collect`, the next call on the same still-warm
# machine, waits for the rest). What it wrote comes back through $OUT.
#   here, first:  python -m benchmarks.memory_random_h200 design    (its file is committed)
#   device run (carry .whl, see gpu_wheels.sh):  WAIT=570 bash benchmarks/memory_random_h200.sh [run options]
#   then, at once:                               WAIT=570 bash benchmarks/memory_random_h200.sh collect
#   the same with the allocator's expandable segments: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True WAIT=570 \
#     bash benchmarks/memory_random_h200.sh --tag _expandable
#   here, after:  python -m benchmarks.memory_random_h200 summarize <files_at>/memory_random_raw<tag>.json [--tag ..]
#   the final judgement, a fresh random set (here first: `... design --fresh`, its file committed; ~5-6 minutes):
#     WAIT=560 bash benchmarks/memory_random_h200.sh --design fresh     -> memory_random_raw_fresh.json
#   then here: python -m benchmarks.memory_random_h200 summarize benchmarks/results/memory_model_random_raw_h200.json \
#     benchmarks/results/memory_model_random_raw_expandable_h200.json --fresh <files_at>/memory_random_raw_fresh.json
#   the two-phase form's judgement (0.10.2; the third set's design is committed; ~8 minutes on an H100, 3 slots):
#     WAIT=540 bash benchmarks/memory_random_h200.sh --design fresh3 --slots 3   -> memory_random_raw_fresh3.json
#     (FOREGROUND=1 where the device time left may not cover it: rows land in $OUT after each trial)
#   then here: python -m benchmarks.memory_random_h200 summarize benchmarks/results/memory_model_random_raw_h200.json \
#     benchmarks/results/memory_model_random_raw_expandable_h200.json benchmarks/results/memory_model_random_raw_fresh_h100.json \
#     benchmarks/results/memory_model_random_raw_fresh2_h100.json --fresh <files_at>/memory_random_raw_fresh3.json --tag _fresh3_phases --form phases
#     (the tag: memory_model_random_h200.json and its calibration file, which the maps read, keep the sum form)
MODULE=benchmarks.memory_random_h200 COPY=/tmp/memory_random_run COLLECT='memory_random_raw*.json' \
  LOGS='build.log calibration*.log held_out*.log fresh*.log pressed*.log' exec bash "$(dirname "$0")/memory_h200.sh" "$@"
