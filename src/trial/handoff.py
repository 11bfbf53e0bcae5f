"""What a trial process and the sweep engine that launched it tell each other: files in the trial's folder and
environment variables. Both sides read the names here.
"""

from __future__ import annotations

RESULT_FILE = "result.json"  # the trial's outcome (status, metrics, failure), written last
PROGRESS_FILE = "progress.json"  # phase, step and time at every step: the engine's stall watchdog reads it
STARTED_ENV = "QLORA_TRIAL_STARTED"  # the launcher's clock at launch (epoch seconds): start-up counts from it
RUN_ENV = "MLFLOW_RUN_ID"  # the MLflow run the engine created for the trial (MLflow's own variable)
TRIAL_ENV = "QLORA_OPTUNA_TRIAL"  # the Optuna trial number
