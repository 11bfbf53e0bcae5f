"""Credentials: how they are recognised (by a key's name, by their shape, or as values this process holds), what a
refusal says (where the credential belongs instead), and how they are redacted from every text the project writes:
MLflow params and tags, logs, saved configs, reports. The Hydra callback that redacts a run's saved config and its
log records lives here too.
"""

from __future__ import annotations

import functools
import logging
import os
import re
import traceback
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback

REDACTED = "***"

# A key names a secret when its last dotted segment is one of these words or ends in `_<word>` (hf_token,
# use_auth_token, mlflow.password). `tokens_per_s`, `max_tokens` and `tokenizer` do not; special-token keys
# (pad_token, eos_token, ...) hold vocabulary entries, not credentials.
_SECRET_WORDS = r"token|secret|password|passwd|passphrase|api[_-]?key|access[_-]?key|private[_-]?key|credentials?|auth"
_SECRET_KEY = re.compile(rf"(?:^|[_-])(?:{_SECRET_WORDS})$", re.IGNORECASE)
_SPECIAL_TOKEN_KEY = re.compile(r"^(?:bos|eos|pad|unk|sep|cls|mask|additional_special)_tokens?$", re.IGNORECASE)
# Values that look like credentials wherever they appear (a config value, a log line, a traceback).
SECRET_VALUE_PATTERNS = {
    "a Hugging Face token": re.compile(r"\bhf_[A-Za-z0-9]{20,}"),
    "a password inside a URI": re.compile(r"(?<=://)[^/\s:@'\"]+:[^/\s@'\"]+(?=@)"),
    "a password in a query string": re.compile(r"(?i)(?<=[?&;\s]password=)(?:[^&\s'\"\\]|\\[^&\s'\"])+"),
    "an API token": re.compile(r"\b(?:sk|ghp|gho|ghs|github_pat|glpat|xox[abprs])[-_][A-Za-z0-9_-]{16,}"),
    "an HTTP authorization credential": re.compile(
        r"(?i)(?<=\bbasic )[A-Za-z0-9+/]{12,}={0,2}|(?<=\bbearer )[A-Za-z0-9._~+/-]{12,}=*"
    ),
}
# `key: value`, `key=value`, `"key": "value"`, `'key': 'value'` with a secret key, in any text (YAML, JSON,
# a Hydra override, a repr): the value is replaced whatever its shape. A key is looked for only from the first
# character of a run of key characters (the lookbehind), so each run is read once: linear in the text. (Looked for
# from every character of a long run, each start read the rest of the run: a 100,000-character prompt took minutes.)
# Text that is itself inside a JSON string (run.json, written as JSON and then redacted) escapes its quotes: `\"` is a
# quote, and a value ends before an escaped quote, never taking its backslash (that left the JSON unreadable). A
# quoted value left open (a line quoted up to a length) runs to the next quote or the line's end; a quote followed
# by JSON's punctuation closes a string that ended with the key, and opens no value.
_KEY_VALUE = re.compile(
    rf"(?<![A-Za-z0-9_.-])(?P<key>[A-Za-z0-9_.-]*?(?:{_SECRET_WORDS}))"
    r"(?P<sep>(?:\\?[\"'])?[ \t]*+[:=][ \t]*+)"
    r"(?:(?P<quote>\\?[\"'])(?![ \t]*[,:}\]])(?P<quoted>(?:[^\"'\\\n]|\\[^\"'\n])*+)"
    r"(?P<close>(?P=quote)|(?=\\?(?:[\"'\n]|\Z)))"
    r"|(?P<value>(?:[^\s\"'`,}\]\\]|\\[^\s\"'])++))",
    re.IGNORECASE,
)
_NOT_SECRET_VALUES = {"null", "none", "true", "false", "''", '""', REDACTED}
# Environment variables whose values are secrets even when they look like nothing in particular.
# PGPASSWORD has no "_" before its secret word.
_ENV_SECRET_NAME = re.compile(rf"(?:^|_|^PG)(?:{_SECRET_WORDS}|key)$", re.IGNORECASE)
_MIN_SECRET_LEN = 8  # shorter values ("1", "true") would redact half the text and protect nothing


def is_secret_key(key: str) -> bool:
    """Whether a config key (dotted or not) names a credential."""
    last = str(key).rsplit(".", 1)[-1].lstrip("+~")
    return bool(_SECRET_KEY.search(last)) and not _SPECIAL_TOKEN_KEY.match(last)


def secret_values() -> list[str]:
    """The credentials this process holds: secret-named environment variables and the user's HF login."""
    values = [v for k, v in os.environ.items() if v and len(v) >= _MIN_SECRET_LEN and _ENV_SECRET_NAME.search(k)]
    login = _hf_login_token()
    if login:
        values.append(login)
    # Longest first, so a token that contains another is replaced whole.
    return sorted(set(values), key=len, reverse=True)


def _hf_login_token() -> str | None:
    """The token `hf auth login` stored (found the way huggingface_hub finds it, without importing it)."""
    home = Path(os.environ.get("HF_HOME") or Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")) / "huggingface")
    path = Path(os.environ.get("HF_TOKEN_PATH") or home / "token").expanduser()
    try:
        return _read_token(str(path), path.stat().st_mtime_ns)
    except OSError:
        return None


@functools.lru_cache(maxsize=4)
def _read_token(path: str, mtime_ns: int) -> str | None:
    # Cached by modification time: every log record is redacted, and the file changes only on (re)login.
    token = Path(path).read_text().strip()
    return token if len(token) >= _MIN_SECRET_LEN else None


def credential_in(value: str, held: list[str] | None = None) -> str | None:
    """What credential `value` holds, by its shape ("a Hugging Face token", "a password inside a URI") or as one of
    the values this process holds (`held`, default secret_values()); None when it holds none."""
    what = next((name for name, pattern in SECRET_VALUE_PATTERNS.items() if pattern.search(value)), None)
    if what is None and any(secret in value for secret in (secret_values() if held is None else held)):
        what = "a credential this process also holds in its environment"
    return what


def refusal(key: str, value: Any, held: list[str] | None = None) -> str | None:
    """Why the value at `key` (a config key, or a command-line option such as --storage) must not be there, and where
    the credential belongs instead; None when it holds none. Read before interpolation: `${oc.env:HF_TOKEN}` is the
    environment's and allowed. The message never repeats the value."""
    if not isinstance(value, str) or not value or value.startswith("${"):
        return None
    what = credential_in(value, held)
    if what is None and is_secret_key(key) and value.lower() not in ("none", "null"):
        what = "a credential (by its key's name)"
    return f"{key} holds {what}. {_advice(key, what)}" if what else None


def _advice(key: str, what: str) -> str:
    if key.startswith("-"):
        where = f"take it out of {key}"
    elif is_secret_key(key):
        where = f"delete {key} from the config file or the command line"
    else:
        where = f"take it out of {key} (in the config file or on the command line)"
    if "URI" in what or key.startswith(("tracking.", "hydra.sweeper", "--")):
        return (
            f"Credentials never go in a config or an override: {where} and hand them to the service through "
            "the environment (MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD for an MLflow server; "
            "PGPASSWORD, or ~/.pgpass, for a PostgreSQL database)."
        )
    return (
        f"Tokens never go in a config or an override: {where} and export the token as the HF_TOKEN "
        "environment variable (or run `hf auth login` once); transformers and huggingface_hub read it there."
    )


def _redact_key_value(match: re.Match[str]) -> str:
    value = match["quoted"] if match["quote"] else match["value"]
    if not is_secret_key(match["key"]) or value.lower() in _NOT_SECRET_VALUES or value.startswith("${") or not value:
        return match[0]
    return f"{match['key']}{match['sep']}{match['quote'] or ''}{REDACTED}{match['close'] or ''}"


def redact_text(text: str) -> str:
    """`text` with every credential replaced by ***: known values first, then anything shaped like one."""
    for value in secret_values():
        text = text.replace(value, REDACTED)
    for pattern in SECRET_VALUE_PATTERNS.values():
        text = pattern.sub(REDACTED, text)
    return _KEY_VALUE.sub(_redact_key_value, text)


def redact_file(path: Path) -> bool:
    """Redact a text file in place (a log, a saved config); True if it held a secret."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    clean = redact_text(text)
    if clean == text:
        return False
    tmp = path.with_name(path.name + ".redacting")
    tmp.write_text(clean, encoding="utf-8")
    tmp.replace(path)
    return True


class RedactingFilter(logging.Filter):
    """On a handler: the record's message and traceback are redacted before any formatter writes them."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            record.msg, record.args = redact_text(record.getMessage()), None
        except Exception:  # a malformed record: let logging report it, but never with the raw arguments
            record.msg, record.args = redact_text(str(record.msg)), None
        if record.exc_info and not record.exc_text:
            record.exc_text = "".join(traceback.format_exception(*record.exc_info)).rstrip("\n")
        if record.exc_text:
            record.exc_text = redact_text(record.exc_text)
        if record.stack_info:
            record.stack_info = redact_text(record.stack_info)
        return True


def redact_logging() -> None:
    """Put a RedactingFilter on every handler of the root logger (where Hydra's console and job-log file
    handlers live): records from any library pass through it, whichever logger emitted them."""
    for handler in logging.getLogger().handlers:
        if not any(isinstance(f, RedactingFilter) for f in handler.filters):
            handler.addFilter(RedactingFilter())


class RedactSecrets(Callback):
    """Hydra callback (hydra.callbacks.redact_secrets, set in conf/preflight/default.yaml).

    Hydra writes the composed config, its own config and the command-line overrides to
    `<run dir>/.hydra/*.yaml` before the task starts, so an override that carries a token would sit there in
    clear text even though preflight then refuses the run. This rewrites those files redacted as soon as
    Hydra has written them, and redacts every log record from then on.
    """

    def on_job_start(self, config: Any, **kwargs: Any) -> None:
        redact_logging()
        hydra_cfg = config.hydra
        if hydra_cfg.output_subdir is not None:
            for path in (Path(hydra_cfg.runtime.output_dir) / str(hydra_cfg.output_subdir)).glob("*.yaml"):
                redact_file(path)

    def on_multirun_start(self, config: Any, **kwargs: Any) -> None:
        redact_logging()

    def on_job_end(self, config: Any, job_return: Any, **kwargs: Any) -> None:
        """A job that raised: Hydra itself writes its overrides and its exception to stderr, past the logging
        filter ("Error executing job with overrides: [...]", then the traceback); both are redacted first."""
        from hydra.core.utils import JobStatus

        job_return.overrides = [redact_text(str(o)) for o in job_return.overrides or []]
        if job_return.status != JobStatus.FAILED:
            return
        job_return.status = JobStatus.COMPLETED  # read the exception without Hydra's printing of it
        exc, job_return.status = job_return.return_value, JobStatus.FAILED
        seen: set[int] = set()
        while isinstance(exc, BaseException) and id(exc) not in seen:  # it, and what it was raised from
            seen.add(id(exc))
            exc.args = tuple(redact_text(a) if isinstance(a, str) else a for a in exc.args)
            exc = exc.__cause__ or exc.__context__
