#!/usr/bin/env bash
# The sweep engine on the lent H200 (issue: the sweep engine): llama3_8b_synthetic over the default space (the
# seed's four knobs), 24 GiB budget, two 24 GiB slots sharing the one card, 20 trials (the seed's setting first).
# Checkpointing is off for the whole study: with it on, every point of the four-knob space fits in 24 GiB
# (foundation_h200.json: 9.8 GiB at 2048), and this run is about the sampler meeting and leaving an OOM region.
# Writes benchmarks/results/sweep_h200.json and the study's report under benchmarks/results/sweep_h200/.
#   device run: bash benchmarks/sweep_h200.sh      (carry .whl; see benchmarks/gpu_wheels.sh)
# Throughput here is from two trials sharing a card: it is flagged as such and not a solo figure.
set -euo pipefail
cd "$(dirname "$0")/.."
export QLORA_ROOT=${QLORA_ROOT:-/tmp/qlora} QLORA_CACHE=${QLORA_CACHE:-/tmp/qlora-cache} PYTHONUNBUFFERED=1
STUDY=${STUDY:-sweep_h200}
MODEL=${MODEL:-llama3_8b_synthetic}
ARGS=(model=$MODEL data=clinical_notes preflight.max_truncated_answer_frac=1.0 hardware.vram_budget_gib=24
  trainer.gradient_checkpointing=false hydra.sweeper.study_name=$STUDY hydra.sweeper.n_trials=${N_TRIALS:-20}
  hydra.sweeper.slots_per_gpu=2)
timeout --signal=INT --kill-after=20 "${SWEEP_TIMEOUT_S:-480}" python3 -m src.train -m hydra/sweeper=optuna "${ARGS[@]}" || echo "sweep exit $?"
python3 -m benchmarks.summarize $STUDY benchmarks/results/sweep_h200.json --sweeps-dir "$QLORA_ROOT/sweeps" \
  --command "python -m src.train -m hydra/sweeper=optuna ${ARGS[*]}"
python3 -m src.report $STUDY || echo "report exit $?"
mkdir -p benchmarks/results/sweep_h200
cp "$QLORA_ROOT/sweeps/$STUDY"/{report.md,*.png} benchmarks/results/sweep_h200/ || true
