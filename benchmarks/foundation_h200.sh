#!/usr/bin/env bash
# The foundation figures on the lent H200 (issue: a QLoRA trial that runs, measures and records):
# llama3_8b_synthetic at max_seq_length 512/1024/2048, gradient checkpointing on/off, capped at 24 GiB and
# uncapped (141 GiB >= the card), one trial at a time (throughput with the card to itself), as a grid study
# through the project's own sweep engine. Writes benchmarks/results/foundation_h200.json (and copies to $OUT).
#   device run: bash benchmarks/foundation_h200.sh      (carry .whl; see benchmarks/gpu_wheels.sh)
set -euo pipefail
cd "$(dirname "$0")/.."
export QLORA_ROOT=${QLORA_ROOT:-/tmp/qlora} QLORA_CACHE=${QLORA_CACHE:-/tmp/qlora-cache} PYTHONUNBUFFERED=1
STUDY=foundation_h200
ARGS=(model=llama3_8b_synthetic data=clinical_notes preflight.max_truncated_answer_frac=1.0
  hydra/sweeper/sampler=grid hydra.sweeper.study_name=$STUDY hydra.sweeper.n_trials=12 hydra.sweeper.n_jobs=1
  "hydra.sweeper.enqueue_trials=[]" hydra.sweeper.launch_blocking_rerun=false "hydra.sweeper.trial_overrides=['trainer.max_steps=6','trainer.warmup_steps=0']"
  "data.max_seq_length=choice(512,1024,2048)"
  "trainer.gradient_checkpointing=choice(true,false)" "hardware.vram_budget_gib=choice(24,141)")
python3 -m src.train -m hydra/sweeper=optuna "${ARGS[@]}"
python3 -m benchmarks.summarize $STUDY benchmarks/results/foundation_h200.json --sweeps-dir "$QLORA_ROOT/sweeps" \
  --command "python -m src.train -m hydra/sweeper=optuna ${ARGS[*]}"
