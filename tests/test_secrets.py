"""Secrets: a credential in the config is refused with a message naming the environment variable to use, and
no credential (planted in the environment and in overrides) reaches MLflow, the sweeps folder or the logs."""

from __future__ import annotations

import logging
import os
import random
import sqlite3
import string
import subprocess
import sys
from pathlib import Path

import pytest

from src import preflight, redact, tracking
from src.config import PROJECT_DIR
from tests.conftest import compose_cfg, sweep_argv


def _fake_token(rng: random.Random) -> str:
    return "hf_" + "".join(rng.choice(string.ascii_letters) for _ in range(30))


@pytest.fixture
def tokens() -> dict[str, str]:
    rng = random.Random()
    return {"env": _fake_token(rng), "key": _fake_token(rng), "prompt": _fake_token(rng)}


# ---- redaction ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "token: {v}",  # YAML
        "- +model.token={v}",  # a Hydra override, as overrides.yaml keeps it
        '{{"hf_token": "{v}"}}',  # JSON
        "{{'password': '{v}'}}",  # a Python repr
        "tracking.api_key = {v}",
        "https://user:{v}@mlflow.example.com/api",  # a password inside a URI
        "postgresql://optuna:{v}@db:5432/optuna",
    ],
)
def test_secret_values_are_redacted_in_any_text(text: str) -> None:
    secret = "s3cr3t-Value-9f8e7d6c"  # shaped like nothing in particular: found by its key or place
    redacted = redact.redact_text(text.format(v=secret))
    assert secret not in redacted and redact.REDACTED in redacted


def test_redaction_is_linear_in_the_text_and_still_redacts() -> None:
    """A 100,000-character system prompt (a run of key characters, as a pasted document holds) is redacted in well
    under a second, and the credentials inside a long text are still found (#30.18: it was quadratic, minutes)."""
    import time

    secret = "s3cr3t-Value-9f8e7d6c"
    for text in ("a" * 100_000, "tokentoken" * 10_000, "x_token " * 12_500):
        start = time.perf_counter()
        assert redact.redact_text(text) == text
        assert time.perf_counter() - start < 2.0, text[:20]
    text = (
        "passage " * 6_000 + f"hf_token={secret} " + "b" * 50_000 + f" {{'password': '{secret}'}} a=b=api_key={secret}"
    )
    start = time.perf_counter()
    redacted = redact.redact_text(text)
    assert time.perf_counter() - start < 2.0
    assert secret not in redacted and redacted.count(redact.REDACTED) == 3


def test_tokens_and_environment_secrets_are_redacted(monkeypatch: pytest.MonkeyPatch, tokens: dict) -> None:
    monkeypatch.setenv("HF_TOKEN", tokens["env"])
    monkeypatch.setenv("WANDB_API_KEY", "plain-looking-value-123")
    text = f"loaded with {tokens['env']}, prompt: {tokens['prompt']}, wandb plain-looking-value-123"
    assert redact.redact_text(text) == "loaded with ***, prompt: ***, wandb ***"


def test_ordinary_values_are_left_alone() -> None:
    text = (
        "tokens_per_s=812.5 max_tokens: 64 pad_token: <|finetune_right_pad_id|> tokenizer: fast "
        "author: me token: null hf_token: ${oc.env:HF_TOKEN} uri=sqlite:///mlruns/mlflow.db"
    )
    assert redact.redact_text(text) == text
    params = tracking.params(
        {"model": {"token": "abc123def456", "pad_token": "<pad>"}, "trainer": {"max_steps": 8}, "data": {"x": None}}
    )
    assert params == {"model.token": "***", "model.pad_token": "<pad>", "trainer.max_steps": "8", "data.x": "None"}


def test_log_records_are_redacted_on_every_handler(tokens: dict, tmp_path: Path) -> None:
    handler = logging.FileHandler(tmp_path / "job.log")
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        redact.redact_logging()
        logging.getLogger("some.library").warning("auth with %s", tokens["key"])
        try:
            raise RuntimeError(f"bad token {tokens['prompt']}")
        except RuntimeError:
            logging.getLogger("other").exception("failed")
    finally:
        root.removeHandler(handler)
        handler.close()
    written = (tmp_path / "job.log").read_text()
    assert "auth with ***" in written and "bad token ***" in written
    assert tokens["key"] not in written and tokens["prompt"] not in written


# ---- refusal -----------------------------------------------------------------------------------------------


def _secret_findings(overrides: list[str]) -> list[preflight.Finding]:
    report = preflight.Report()
    preflight.check_secrets(compose_cfg(overrides), report)
    return report.findings


def test_a_credential_in_the_config_is_refused_naming_the_variable(root: Path, tokens: dict) -> None:
    (key,) = _secret_findings([f"+model.token={tokens['key']}"])
    assert key.severity == "error" and key.message.startswith("model.token holds a Hugging Face token")
    assert "HF_TOKEN environment variable" in key.message and "hf auth login" in key.message
    (prompt,) = _secret_findings([f"data.system_prompt='Answer in JSON. {tokens['prompt']}'"])
    assert prompt.message.startswith("data.system_prompt holds a Hugging Face token")
    (uri,) = _secret_findings(["tracking.uri=http://alice:pa55word-x@mlflow.example.com"])
    assert "tracking.uri holds a password inside a URI" in uri.message
    assert "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD" in uri.message
    (named,) = _secret_findings(["+tracking.password=plain-but-secret"])
    assert named.message.startswith("tracking.password holds a credential (by its key's name)")
    for finding in (key, prompt, uri, named):
        assert not any(v in finding.message for v in (*tokens.values(), "pa55word-x", "plain-but-secret"))
    # Read from the environment by interpolation: the value never sits in a file.
    assert _secret_findings(["+model.token=${oc.env:HF_TOKEN}"]) == []
    assert _secret_findings([]) == []  # the shipped configs hold no credential


# ---- end to end ----------------------------------------------------------------------------------------------


def written_without(root: Path, secrets: dict[str, str]) -> list[Path]:
    """Every file the runs wrote under root's mlruns/ and sweeps/, each checked to hold none of `secrets` (name ->
    value); the files, for what a test expects among them."""
    files = [p for top in ("mlruns", "sweeps") for p in (root / top).rglob("*") if p.is_file()]
    for path in files:
        data = path.read_bytes()
        for name, secret in secrets.items():
            assert secret.encode() not in data, f"the {name} secret leaked into {path.relative_to(root)}"
    return files


def _start(root: Path, env: dict[str, str], *overrides: str) -> subprocess.Popen:
    """`python -m src.train ...` as run_cli runs it, started without waiting (the two trials run at once)."""
    return subprocess.Popen(
        [sys.executable, "-m", "src.train", *overrides],
        cwd=PROJECT_DIR,
        env={**os.environ, "QLORA_ROOT": str(root), **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow(seconds=17)
def test_planted_tokens_reach_neither_mlflow_nor_sweeps_nor_logs(root: Path, tokens: dict, mlflow_client) -> None:
    """A token in the environment and two in overrides (by key, and inside a prompt); a trial that trains and
    one that preflight refuses. Then every byte under mlruns/ (the SQLite store and the artifacts) and
    sweeps/ (Hydra's saved config and overrides, the job logs, results) is searched, and the console too."""
    mlflow_client.search_experiments()  # the store's schema once, before two processes open it at once
    env = {"HF_TOKEN": tokens["env"]}
    common = ["model=tiny_llama", "trainer=probe", "trainer.max_steps=2", "measure.profile_attention=false"]
    secret_overrides = [f"+model.token={tokens['key']}", f"data.system_prompt='Answer in JSON. {tokens['prompt']}'"]
    # Each its own run dir: the default one is named by the second, which two trials started at once share.
    trials = {
        name: _start(root, env, *common, *extra, f"hydra.run.dir={root / 'sweeps' / 'single' / name}")
        for name, extra in (("ok", []), ("refused", secret_overrides))
    }
    out = {name: proc.communicate(timeout=300) for name, proc in trials.items()}
    assert trials["ok"].returncode == 0, out["ok"][1][-3000:]
    assert trials["refused"].returncode == 1, out["refused"][1][-3000:]

    files = written_without(root, tokens)
    assert any(p.name == "mlflow.db" for p in files) and any(p.name == "overrides.yaml" for p in files)
    for trial, streams in out.items():
        for name, token in tokens.items():
            assert token not in streams[0] + streams[1], f"the {name} token reached the {trial} trial's console"

    # Refused for the right reason and recorded; the secrets visibly redacted, not merely never written.
    db = sqlite3.connect(root / "mlruns" / "mlflow.db")
    assert sorted(s for (s,) in db.execute("SELECT status FROM runs")) == ["FAILED", "FINISHED"]
    assert {v for (v,) in db.execute("SELECT value FROM tags WHERE key = 'failure.kind'")} == {"config_error"}
    (message,) = [v for (v,) in db.execute("SELECT value FROM tags WHERE key = 'failure.message'")]
    assert "model.token holds a Hugging Face token" in message and "HF_TOKEN" in message
    assert ("model.token", "***") in db.execute("SELECT key, value FROM params").fetchall()
    db.close()
    saved = "\n".join(p.read_text() for p in files if p.name == "overrides.yaml")
    assert "+model.token=***" in saved and "data.system_prompt='Answer in JSON. ***'" in saved


# ---- a credential in a search space (issue 17, item 1) -----------------------------------------------------------


@pytest.mark.parametrize(
    "overrides, arguments, key",
    [
        ([], ["data.system_prompt=choice(plain,{t})"], "data.system_prompt"),
        (["+hydra.sweeper.params={{data.system_prompt:'choice(plain,{t})'}}"], [], "data.system_prompt"),
        (["+hydra.sweeper.default_params={{data.system_prompt:'choice(plain,{t})'}}"], [], "data.system_prompt"),
        (
            ["hydra.sweeper.enqueue_trials=[{{lora.r:8}},{{data.system_prompt:'{t}'}}]"],
            [],
            "data.system_prompt (hydra.sweeper.enqueue_trials[1])",
        ),
    ],
    ids=["choice", "params", "default_params", "enqueue_trials"],
)
def test_a_credential_in_a_search_space_is_refused_naming_the_key(
    root: Path, tokens: dict, overrides: list[str], arguments: list[str], key: str
) -> None:
    """Optuna stores a space's choices and the enqueued values in clear; the engine refuses them when built."""
    from src.sweep.engine import SweepEngine
    from src.sweep.space import SpaceError

    token = tokens["key"]
    cfg = compose_cfg(
        ["hydra/sweeper=optuna", "trainer.output_dir=/tmp/unused", *(o.format(t=token) for o in overrides)]
    )
    with pytest.raises(SpaceError) as refused:
        SweepEngine(cfg, [a.format(t=token) for a in arguments])
    message = str(refused.value)
    assert message.startswith(f"{key} holds a Hugging Face token: Optuna keeps"), message
    assert token not in message


def test_a_token_in_a_swept_value_is_refused_before_anything_is_stored(root: Path, tokens: dict) -> None:
    """The issue's command: a token as one choice of the system prompt. Refused in one line naming the key, before
    an Optuna study or an MLflow run exists; then every byte under sweeps/ and mlruns/ (the SQLite databases
    included) and the terminal of the sweep and of the report are searched for the token."""
    token = "hf_" + tokens["key"][3:] + "abcd"  # the shape: hf_ and 34 letters
    sweep = subprocess.run(
        [sys.executable, "-m", *sweep_argv(f"data.system_prompt=choice(plain,{token})", study="leaky")]
        + ["hydra.sweeper.enqueue_trials=[]", "hydra.sweeper.n_trials=1"]
        + ["hydra.sweeper.trial_overrides=['trainer.max_steps=1']"],
        cwd=PROJECT_DIR,
        env={**os.environ, "QLORA_ROOT": str(root)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    report = subprocess.run(
        [sys.executable, "-m", "src.report", "leaky"],
        cwd=PROJECT_DIR,
        env={**os.environ, "QLORA_ROOT": str(root)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert sweep.returncode != 0 and "Traceback" not in sweep.stderr, sweep.stderr[-3000:]
    (line,) = [line for line in sweep.stderr.splitlines() if line.startswith("error: ")]
    assert line.startswith("error: data.system_prompt holds a Hugging Face token"), line
    assert not (root / "sweeps" / "leaky").exists() and not (root / "mlruns").exists()
    written_without(root, {"token": token})
    for done in (sweep, report):
        assert token not in done.stdout + done.stderr
