"""The secrets check: a credential in the config (a token, a password in a URI) is refused; it belongs in the
environment (HF_TOKEN, MLFLOW_TRACKING_PASSWORD) or the user's `hf auth login`."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from src import redact
from src.config import flatten
from src.preflight.report import Report


def check_secrets(cfg: DictConfig, report: Report) -> None:
    """Refuse any config value that is, or looks like, a credential. Values are read before interpolation:
    `${oc.env:HF_TOKEN}` is the environment's and allowed; a literal token is the config file's (or the
    command line's, which Hydra saves with the run) and is not. The message never repeats the value."""
    tree = OmegaConf.to_container(cfg, resolve=False)
    hydra_cfg = tree.pop("hydra", None) if isinstance(tree, dict) else None
    if isinstance(hydra_cfg, dict) and "sweeper" in hydra_cfg:  # e.g. an Optuna storage URL with a password
        tree["hydra"] = {"sweeper": hydra_cfg["sweeper"]}  # (overrides are checked where they landed)
    held = redact.secret_values()
    for key, value in flatten(tree, into_lists=True).items():
        message = redact.refusal(key, value, held)
        if message:
            report.add("secrets", "error", message)
