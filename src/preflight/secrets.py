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
        if not isinstance(value, str) or not value or value.startswith("${"):
            continue
        what = next((name for name, p in redact.SECRET_VALUE_PATTERNS.items() if p.search(value)), None)
        if what is None and any(secret in value for secret in held):
            what = "a credential this process also holds in its environment"
        if what is None and redact.is_secret_key(key) and value.lower() not in ("none", "null"):
            what = "a credential (by its key's name)"
        if what is None:
            continue
        report.add("secrets", "error", f"{key} holds {what}. {_advice(key, what)}")


def _advice(key: str, what: str) -> str:
    if redact.is_secret_key(key):
        where = f"delete {key} from the config file or the command line"
    else:
        where = f"take it out of {key} (in the config file or on the command line)"
    if "URI" in what or key.startswith(("tracking.", "hydra.sweeper")):
        return (
            f"Credentials never go in a config or an override: {where} and hand them to the service through "
            "the environment (the MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD variables for "
            "tracking.uri; an ${oc.env:...} interpolation for hydra.sweeper.storage)."
        )
    return (
        f"Tokens never go in a config or an override: {where} and export the token as the HF_TOKEN "
        "environment variable (or run `hf auth login` once); transformers and huggingface_hub read it there."
    )
