#!/usr/bin/env bash
# Start-up under contention (benchmarks/NOTES.md §5b): 10 short trials, 5 at once on the card, forked from the
# warm interpreter, each profiling its start-up call by call (measure.profile_startup=true), so that the
# per-trial fixed cost of the map (5 trials starting together) can be read phase by phase.
# Writes benchmarks/results/startup_contention_h200.json (phases per trial) and the profiles under sweeps/init.
#   device run: bash benchmarks/startup_h200.sh      (carry .whl; see benchmarks/gpu_wheels.sh)
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_stack.sh  # the stack as wheels, QLORA_ROOT, QLORA_CACHE
MODEL=${MODEL:-llama3_8b_synthetic}
OUT_JSON=${OUT_JSON:-benchmarks/results/startup_contention_h200.json}
python3 -m src.models model=$MODEL || exit 4
ARGS=(hydra/sweeper=optuna hydra/sweeper/sampler=grid model=$MODEL data=clinical_notes hardware.vram_budget_gib=24
  preflight.max_truncated_answer_frac=1.0 hydra.sweeper.slots_per_gpu=5 hydra.sweeper.n_trials=10
  hydra.sweeper.preload=true hydra.sweeper.launch_blocking_rerun=false hydra.sweeper.study_name=init
  hydra.sweeper.progress=false 'hydra.sweeper.enqueue_trials=[]'
  'hydra.sweeper.trial_overrides=["trainer.max_steps=3","trainer.warmup_steps=0","measure.warmup_steps=1"]'
  measure.profile_startup=true model.upcast_non_quantized=false 'data.max_seq_length=choice(1024,2048)'
  'trainer.per_device_train_batch_size=choice(1,2)' 'trainer.packing=choice(false,true)'
  "${ATTN:-model.attn_implementation=choice(sdpa,varlen)}")
timeout -s INT "${T:-200}" python3 -m src.train -m "${ARGS[@]}"
python3 -m benchmarks.summarize init "$OUT_JSON" --sweeps-dir "$QLORA_ROOT/sweeps" \
  --command "bash benchmarks/startup_h200.sh: python -m src.train -m ${ARGS[*]}"
