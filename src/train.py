"""Entry point: compose the config and dispatch.

    python -m src.train [overrides]                        # one trial (one QLoRA run, measured and tracked)
    python -m src.train -m hydra/sweeper=optuna [...]     # a sweep (the engine is src/sweep/)

Returns the trial's outcome; exits non-zero when the trial failed (the failure is recorded first).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from src.config import register_configs
from src.trial.handoff import die_with_parent

register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> dict:
    from src import trial

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    if cfg.hardware.parallelism == "data_parallel":
        if "LOCAL_RANK" in os.environ:  # a rank started by torch.distributed.run
            trial.run_rank(cfg, out_dir)  # exits with 0 (ok) or 1
        result = trial.run_data_parallel(cfg, out_dir, sys.argv[1:])
    else:
        result = trial.run(cfg, out_dir)
    m = result["metrics"]
    if result["status"] == "ok":
        print(
            f"trial ok: {m.get('tokens_per_s', float('nan')):.1f} tokens/s, peak reserved "
            f"{m.get('peak_vram_reserved_gib', 0):.2f} GiB of {m['vram_budget_gib']:g}, run {result['run_id']}"
        )
        return result
    failure = result["failure"]
    print(f"trial failed ({failure['kind']} at step {failure['step']}): {failure['message']}", file=sys.stderr)
    print(f"recorded in MLflow run {result['run_id']}", file=sys.stderr)
    sys.exit(1)


if __name__ == "__main__":
    die_with_parent()  # a trial started by the sweep engine dies with it (src/trial/handoff.py)
    main()
