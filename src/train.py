"""Entry point: compose the config and dispatch.

    python -m src.train [overrides]                        # one trial (one QLoRA run, measured and tracked)
    python -m src.train -m hydra/sweeper=optuna [...]     # a sweep (the engine is src/sweep/)

Returns the trial's outcome; exits non-zero when the trial failed (the failure is recorded first).
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from src import quiet
from src.config import PROJECT_DIR, register_configs
from src.handoff import RUN_ENV, die_with_parent
from src.trial.attempts import RUN_DIR_ENV, drop_elastic_env

quiet.install()  # before torch, transformers, peft, bitsandbytes, optuna load: their harmless warnings (src/quiet.py)
register_configs()


@hydra.main(version_base="1.3", config_path="../conf", config_name="train")
def main(cfg: DictConfig) -> dict:
    from src import trial

    out_dir = Path(HydraConfig.get().runtime.output_dir)
    allocator_settings(cfg)
    if os.environ.get(RUN_DIR_ENV):  # an attempt of a single run, started by its supervisor's elastic agent
        _, code = trial.run_attempt(cfg, out_dir)  # its supervisor says how it went
        sys.exit(code)  # 1: the agent restarts it from the last checkpoint
    if cfg.hardware.parallelism == "data_parallel":
        if "LOCAL_RANK" in os.environ:  # a rank started by torch.distributed.run
            trial.run_rank(cfg, out_dir)  # exits with 0 (ok) or 1
        result = trial.run_data_parallel(cfg, out_dir, sys.argv[1:])
    elif os.environ.get(RUN_ENV):  # a sweep's probe: one attempt, no checkpoints
        result = trial.run(cfg, out_dir)
    else:  # a single run: checkpoints, restarts, one record (README "Production")
        result = trial.supervise(cfg, out_dir, sys.argv[1:])
        if result.get("already"):
            return result
        if result["status"] == "ok":
            _run_done(result)
    if not _said(cfg, out_dir, result):
        sys.exit(1)
    return result


def _said(cfg: DictConfig, out_dir: Path, result: dict) -> bool:
    """The outcome in two lines; whether it was ok."""
    m = result["metrics"]
    if result["status"] == "ok":
        print(f"trial ok: {m.get('tokens_per_s', float('nan')):.1f} tokens/s, {_memory(m)}")
        print(_where(cfg, out_dir, result["run_id"]))
        return True
    failure = result["failure"]
    print(f"trial failed ({failure['kind']} at step {failure['step']}): {failure['message']}", file=sys.stderr)
    if result.get("stop") and result["stop"] != failure["message"]:
        print(f"not restarted: {result['stop']}", file=sys.stderr)
    print(_where(cfg, out_dir, result["run_id"]), file=sys.stderr)
    return False


def _run_done(result: dict) -> None:
    m = result["metrics"]
    if "restarts" in m:
        print(
            f"run finished after {int(m['restarts'])} restart(s) ({m.get('lost_s', 0.0):.0f} s lost to failures); "
            f"checkpoints and adapter: {result.get('run_dir')}/"
        )


def allocator_settings(cfg: DictConfig) -> None:
    """hardware.expandable_segments=true: the caching allocator's expandable segments, set before CUDA starts (the
    allocator reads PYTORCH_CUDA_ALLOC_CONF once, at its first allocation); the user's own settings are kept."""
    if not cfg.hardware.get("expandable_segments"):
        return
    current = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    if "expandable_segments" not in current:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [current, "expandable_segments:True"]))


def _memory(m: dict) -> str:
    """Peak memory against the budget, in the words of the device the trial ran on."""
    peak = f"{m.get('peak_vram_reserved_gib', 0.0):.2f} GiB of the {m['vram_budget_gib']:g} GiB budget"
    if "host_limit_gib" in m:  # no GPU: the budget held this process (src/measure/memory.py)
        return f"peak {peak} (no GPU: this process's memory beyond its start-up)"
    return f"peak reserved {peak}"


def _where(cfg: DictConfig, out_dir: Path, run_id: str) -> str:
    """Where this trial's results went: its folder, and its MLflow experiment and run (how to open them)."""
    from src import redact

    folder = out_dir.resolve()
    with contextlib.suppress(ValueError):
        folder = folder.relative_to(Path.cwd())
    experiment = cfg.tracking.experiment
    if os.environ.get(RUN_ENV):  # launched by a sweep: the study's experiment
        try:
            from mlflow.tracking import MlflowClient

            client = MlflowClient(cfg.tracking.uri)
            experiment = client.get_experiment(client.get_run(run_id).info.experiment_id).name
        except Exception:  # noqa: BLE001 - only a message: the run id still says where it is
            pass
    tb = ", traceback.txt" if (folder / "traceback.txt").exists() else ""
    return (
        f"results: {folder}/ (result.json, train.log{tb}, .hydra/)\n"
        f"MLflow:  experiment '{experiment}', run {run_id}, in {redact.redact_text(str(cfg.tracking.uri))} "
        "(make ui: http://127.0.0.1:5000)"
    )


def missing_experiment(argv: list[str], conf_dir: Path = PROJECT_DIR / "conf") -> str | None:
    """`experiment=<name>` whose file is not in conf/experiment/: the one line that says where it comes from (Hydra's
    own error lists the options and its search path, not that `production` is written by a promotion)."""
    for arg in argv:
        key, _, name = arg.removeprefix("+").partition("=")
        if key == "experiment" and name and not (conf_dir / "experiment" / f"{name}.yaml").exists():
            if name == "production":
                return (
                    "experiment=production: conf/experiment/production.yaml does not exist yet; it is written by "
                    "python -m src.promote <study> (the best soaked setting of a sweep)"
                )
            return f"experiment={name}: conf/experiment/{name}.yaml does not exist"
    return None


if __name__ == "__main__":
    if why := missing_experiment(sys.argv[1:]):
        print(why, file=sys.stderr)
        sys.exit(2)
    if os.environ.get(RUN_DIR_ENV):  # an attempt: dies with its supervisor; trains as one plain process
        drop_elastic_env()
        die_with_parent(os.getppid())
    else:
        die_with_parent()  # a trial started by the sweep engine dies with it (src/handoff.py)
    main()
