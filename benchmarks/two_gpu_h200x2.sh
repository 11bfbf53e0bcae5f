#!/usr/bin/env bash
# Two cards, each capped at 24 GiB (issue: two GPUs), on an nvidia-h200-x2 machine:
#   (a) a sweep with two trials at once, one per card (NVML utilisation of both cards sampled meanwhile);
#   (b) one model-parallel trial of llama3_8b_synthetic over both cards (the seed's device_map="auto");
#   (c) one data-parallel trial (torch.distributed.run, a 4-bit replica per card): per-card peaks, tokens/s vs (b).
# Writes benchmarks/results/two_gpu_h200x2.json.   device run (kind nvidia-h200-x2): bash benchmarks/two_gpu_h200x2.sh
set -euo pipefail
cd "$(dirname "$0")/.."
export QLORA_ROOT=${QLORA_ROOT:-/tmp/qlora} QLORA_CACHE=${QLORA_CACHE:-/tmp/qlora-cache} PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # the machine's rule
COMMON=(model=llama3_8b_synthetic data=clinical_notes preflight.max_truncated_answer_frac=1.0 data.max_seq_length=1024)
python3 -m src.models "${COMMON[@]}" hydra.run.dir=$QLORA_ROOT/prepare
nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv,noheader -l 1 > $QLORA_ROOT/nvml_a.csv &
SMI=$!
python3 -m src.train -m hydra/sweeper=optuna "${COMMON[@]}" hydra.sweeper.study_name=two_cards \
  hydra.sweeper.n_trials=4 "hydra.sweeper.trial_overrides=['trainer.max_steps=6']" "lora.r=choice(8,16,32,64)"
kill $SMI
python3 -m src.train "${COMMON[@]}" trainer=probe hardware.parallelism=model_parallel hydra.run.dir=$QLORA_ROOT/mp || true
python3 -m src.train "${COMMON[@]}" trainer=probe hardware.parallelism=data_parallel model.device_map=null hydra.run.dir=$QLORA_ROOT/dp || true
python3 - <<'PY'
import json, os, pathlib
root = pathlib.Path(os.environ["QLORA_ROOT"])
from benchmarks.summarize import trials
from src.tracking import system_tags
out = {
    "machine": system_tags(),
    "a_sweep_two_at_once": trials(f"sqlite:///{root}/sweeps/two_cards/optuna.db", "two_cards"),
    "a_nvml_samples": (root / "nvml_a.csv").read_text().splitlines(),
    "b_model_parallel": json.loads((root / "mp" / "result.json").read_text()),
    "c_data_parallel": json.loads((root / "dp" / "result.json").read_text()),
}
pathlib.Path("benchmarks/results/two_gpu_h200x2.json").write_text(json.dumps(out, indent=2, default=str))
print("wrote benchmarks/results/two_gpu_h200x2.json")
PY
