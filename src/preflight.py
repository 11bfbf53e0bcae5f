"""Everything that can be checked before training, checked before training.

    python -m src.preflight [overrides]      # alone: prints the report, exits 1 if training would be refused

Four parts, each finding an error (training is refused) or a warning by the policy in `conf/preflight/`:
- secrets: a credential in the config (a token, a password in a URI) is refused; it belongs in the
  environment (HF_TOKEN, MLFLOW_TRACKING_PASSWORD) or the user's `hf auth login`;
- configuration guards: combinations that cannot work, each naming the key to change and to what;
- environment: versions, GPUs, driver and CUDA, the bitsandbytes native library, bf16, and the cited
  known-bad version combinations in `src/known_bad.csv`;
- data lint, on the chats as the model's own tokenizer renders them: empty cells, duplicates, answers that
  are not JSON when JSON is asked for, rows whose answer `max_seq_length` would cut, the length distribution.
`src.train` runs the same checks first in every trial and records the report with the run. Two guards can
only act at run time and are called by the trial: `guard_device_moves` (no `.to()` on a 4-bit or
dispatched model) and `CheckpointingGuard` (checkpointing really on, in training mode, at the first step).
"""

from __future__ import annotations

import csv
import json
import os
import platform
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf
from packaging.requirements import InvalidRequirement, Requirement
from packaging.version import InvalidVersion, Version
from transformers import TrainerCallback
from transformers.modeling_layers import GradientCheckpointingLayer

from src import tracking
from src.failures import ConfigError, DataError

ROWS_SHOWN = 10
KNOWN_BAD = Path(__file__).with_name("known_bad.csv")
# The stack whose versions must agree with each other (what versions() reports, minus the tracking tools).
STACK = ("torch", "transformers", "trl", "peft", "bitsandbytes", "accelerate", "datasets")
DATA_CHECKS = {"empty_data", "empty_cells", "duplicates", "json_output", "truncated_answers"}


@dataclass
class Finding:
    check: str
    severity: str  # "error" | "warning" | "info"
    message: str
    rows: list[int] = field(default_factory=list)


@dataclass
class Report:
    findings: list[Finding] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)
    environment: dict[str, str] = field(default_factory=dict)

    def add(self, check: str, severity: str, message: str, rows: list[int] | None = None) -> None:
        self.findings.append(Finding(check, severity, message, [int(r) for r in rows or []]))

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.severity == "warning"]

    def to_text(self) -> str:
        lines = ["# Preflight", ""]
        for f in self.findings:
            rows = f" rows {_rows(f.rows)}" if f.rows else ""
            lines.append(f"[{f.severity.upper():7}] {f.check}: {f.message}{rows}")
        if not self.findings:
            lines.append("no findings")
        if self.environment:
            lines += ["", "Environment:"] + [f"  {k}: {v}" for k, v in self.environment.items()]
        # Whatever a message quotes (a path, a prompt) passes the same redaction as everything MLflow gets.
        return tracking.redact_text("\n".join(lines))

    def tags(self) -> dict[str, str]:
        """What a trial records as MLflow tags: counts, the failed checks, and the environment's verdicts."""
        tags = {
            "preflight.errors": str(len(self.errors)),
            "preflight.warnings": str(len(self.warnings)),
        }
        failed = sorted({f.check for f in self.findings if f.severity in ("error", "warning")})
        if failed:
            tags["preflight.checks"] = ",".join(failed)
        for key in ("bitsandbytes.native", "bf16.supported", "known_bad", "cuda.driver_max", "torch.cuda_build"):
            if key in self.environment:
                tags[key if "." in key else f"preflight.{key}"] = self.environment[key]
        return tags


def _rows(rows: list[int]) -> str:
    shown = ", ".join(map(str, rows[:ROWS_SHOWN]))
    return shown + (f" (+{len(rows) - ROWS_SHOWN} more)" if len(rows) > ROWS_SHOWN else "")


# ---- secrets -------------------------------------------------------------------------------------------


def check_secrets(cfg: DictConfig, report: Report) -> None:
    """Refuse any config value that is, or looks like, a credential. Values are read before interpolation:
    `${oc.env:HF_TOKEN}` is the environment's and allowed; a literal token is the config file's (or the
    command line's, which Hydra saves with the run) and is not. The message never repeats the value."""
    tree = OmegaConf.to_container(cfg, resolve=False)
    hydra_cfg = tree.pop("hydra", None) if isinstance(tree, dict) else None
    if isinstance(hydra_cfg, dict) and "sweeper" in hydra_cfg:  # e.g. an Optuna storage URL with a password
        tree["hydra"] = {"sweeper": hydra_cfg["sweeper"]}  # (overrides are checked where they landed)
    held = tracking.secret_values()
    for key, value in _leaves(tree):
        if not isinstance(value, str) or not value or value.startswith("${"):
            continue
        what = next((name for name, p in tracking.SECRET_VALUE_PATTERNS.items() if p.search(value)), None)
        if what is None and any(secret in value for secret in held):
            what = "a credential this process also holds in its environment"
        if what is None and tracking.is_secret_key(key) and value.lower() not in ("none", "null"):
            what = "a credential (by its key's name)"
        if what is None:
            continue
        report.add("secrets", "error", f"{key} holds {what}. {_secret_advice(key, what)}")


def _secret_advice(key: str, what: str) -> str:
    if tracking.is_secret_key(key):
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


def _leaves(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(node, dict):
        return [leaf for k, v in node.items() for leaf in _leaves(v, f"{prefix}.{k}" if prefix else str(k))]
    if isinstance(node, list):
        return [leaf for i, v in enumerate(node) for leaf in _leaves(v, f"{prefix}[{i}]")]
    return [(prefix, node)]


# ---- configuration guards ------------------------------------------------------------------------------

# device_map values that spread a model over every visible GPU.
_SPREADING_MAPS = ("auto", "balanced", "balanced_low_0", "sequential")


def check_config(cfg: DictConfig, report: Report) -> None:
    from src.faults import FAULT_KINDS
    from src.models import context_length

    for key, value in (
        ("data.max_seq_length", cfg.data.max_seq_length),
        ("trainer.per_device_train_batch_size", cfg.trainer.per_device_train_batch_size),
        ("trainer.gradient_accumulation_steps", cfg.trainer.gradient_accumulation_steps),
        ("lora.r", cfg.lora.r),
    ):
        if value < 1:
            report.add("positive", "error", f"{key}={value}: must be at least 1")
    if not cfg.hardware.vram_budget_gib > 0:
        report.add(
            "vram_budget",
            "error",
            f"hardware.vram_budget_gib={cfg.hardware.vram_budget_gib}: the card's memory in GiB, e.g. 24",
        )
    if 0 < cfg.trainer.max_steps <= cfg.measure.warmup_steps:
        # A warning: a two-step smoke test is fine alone; in a sweep the trial gets no throughput to tell Optuna.
        report.add(
            "measured_steps",
            "warning",
            f"trainer.max_steps={cfg.trainer.max_steps} leaves no step to measure: the first "
            f"measure.warmup_steps={cfg.measure.warmup_steps} are left out of tokens/s and step time, so the trial "
            "records no throughput; raise trainer.max_steps or lower measure.warmup_steps",
        )
    context = context_length(cfg)
    if context and cfg.data.max_seq_length > context:
        report.add(
            "max_seq_length",
            "error",
            f"data.max_seq_length={cfg.data.max_seq_length} exceeds the model's context of {context} tokens "
            f"(positions past it were never trained); set data.max_seq_length<={context}",
        )
    if cfg.trainer.torch_empty_cache_steps:
        report.add(
            "empty_cache",
            "error",
            f"trainer.torch_empty_cache_steps={cfg.trainer.torch_empty_cache_steps} empties the CUDA cache every "
            "few steps: it fragments memory and slows every step without lowering the peak; "
            "set trainer.torch_empty_cache_steps=null",
        )
    _check_parallelism(cfg, report)
    # Padding-free batches are correct with sdpa and eager too: transformers 5 turns the collator's restarting
    # position_ids into a block-diagonal mask (masking_utils.find_packed_sequence_indices).
    if cfg.trainer.padding_free and not cfg.trainer.packing:
        report.add(
            "padding_free",
            "error",
            "trainer.padding_free=true without packing: trl 1.16 cannot enforce data.max_seq_length on unpacked "
            "padding-free batches and refuses them. Set trainer.packing=true (best-fit packing, padding-free, "
            "rows kept apart by their position ids) or trainer.padding_free=false",
        )
    if cfg.trainer.use_liger_kernel:
        import importlib.util

        if importlib.util.find_spec("liger_kernel") is None:
            report.add(
                "liger_kernel",
                "error",
                "trainer.use_liger_kernel=true, but the liger-kernel package is not installed: "
                "pip install 'liger-kernel>=0.8' (needs a CUDA GPU with Triton), or set trainer.use_liger_kernel=false",
            )
    if cfg.trainer.torch_compile not in (False, True, "layers"):
        report.add(
            "torch_compile",
            "error",
            f"trainer.torch_compile={cfg.trainer.torch_compile} is not one of false, true (the whole model) or "
            "layers (each decoder layer, compiled once for all of them)",
        )
    backends = cfg.model.sdpa_backends
    if backends is not None:
        unknown = [b for b in backends if b not in SDPA_BACKENDS]
        if unknown or not backends:
            report.add(
                "sdpa_backends",
                "error",
                f"model.sdpa_backends={list(backends)}: "
                + (f"unknown {', '.join(map(str, unknown))}; " if unknown else "empty; ")
                + f"list some of {', '.join(SDPA_BACKENDS)} in order of preference, or set model.sdpa_backends=null",
            )
        elif cfg.model.attn_implementation != "sdpa":
            report.add(
                "sdpa_backends",
                "error",
                f"model.sdpa_backends is set but model.attn_implementation={cfg.model.attn_implementation} does not "
                "use SDPA; set model.attn_implementation=sdpa or model.sdpa_backends=null",
            )
    if cfg.model.attn_implementation == "varlen":
        from src import attention

        why = attention.available()
        if why:
            report.add(
                "attn_implementation",
                "error",
                f"model.attn_implementation=varlen: {why}; use model.attn_implementation=sdpa on this machine",
            )
    if cfg.fault.kind not in FAULT_KINDS:
        report.add("fault", "error", f"fault.kind={cfg.fault.kind} is not one of {', '.join(FAULT_KINDS)}")


# model.sdpa_backends' words for torch.nn.attention.SDPBackend members
SDPA_BACKENDS = {
    "flash": "FLASH_ATTENTION",
    "efficient": "EFFICIENT_ATTENTION",
    "cudnn": "CUDNN_ATTENTION",
    "math": "MATH",
}


def _check_parallelism(cfg: DictConfig, report: Report) -> None:
    """A model spread over GPUs by a device map cannot also be trained data-parallel: every data-parallel
    rank needs a whole copy on its own GPU (accelerate refuses a 4-bit model on several devices in any
    distributed mode)."""
    parallelism = cfg.hardware.parallelism
    if parallelism not in ("single", "model_parallel", "data_parallel"):
        report.add(
            "parallelism",
            "error",
            f"hardware.parallelism={parallelism} is not one of single, model_parallel, data_parallel",
        )
        return
    world = int(os.environ.get("WORLD_SIZE", "1") or 1)
    # model.device_map is not in the schema today; a config (or `+model.device_map=...`) that sets it is read.
    device_map = OmegaConf.select(cfg, "model.device_map", default=None)
    if isinstance(device_map, DictConfig):
        device_map = OmegaConf.to_container(device_map)
    spread_by = None
    if parallelism == "model_parallel":
        spread_by = "hardware.parallelism=model_parallel (device_map=auto)"
    elif device_map in _SPREADING_MAPS or (isinstance(device_map, dict) and len(set(device_map.values())) > 1):
        spread_by = f"model.device_map={device_map}"
    data_parallel = "hardware.parallelism=data_parallel" if parallelism == "data_parallel" else None
    if world > 1:
        data_parallel = f"a distributed launch (WORLD_SIZE={world}, torchrun / accelerate launch)"
    if spread_by and data_parallel:
        report.add(
            "device_map",
            "error",
            f"a device map across GPUs ({spread_by}) together with data-parallel training ({data_parallel}): "
            "each data-parallel rank must hold a whole 4-bit copy on its own GPU. Set hardware.parallelism="
            "data_parallel and remove model.device_map (one copy per GPU), or set hardware.parallelism="
            "model_parallel and launch one process (python -m src.train, not torchrun) to split the model",
        )
    # data_parallel with WORLD_SIZE unset is the trial's parent, which launches the ranks itself
    # (trial.run_data_parallel through torch.distributed.run): nothing to warn about.
    elif parallelism == "single" and torch.cuda.is_available() and torch.cuda.device_count() > 1:
        report.add(
            "parallelism",
            "warning",
            f"hardware.parallelism=single with {torch.cuda.device_count()} visible GPUs: only one is used; set "
            "hardware.parallelism=model_parallel to split the model, or make one GPU visible (CUDA_VISIBLE_DEVICES)",
        )
    elif parallelism == "model_parallel" and torch.cuda.is_available() and torch.cuda.device_count() < 2:
        report.add(
            "parallelism",
            "warning",
            f"hardware.parallelism=model_parallel with {torch.cuda.device_count()} visible GPU: nothing to "
            "split; set hardware.parallelism=single (or make more GPUs visible: CUDA_VISIBLE_DEVICES)",
        )


# ---- environment -----------------------------------------------------------------------------------------


def environment(cfg: DictConfig, report: Report) -> None:
    """The machine's facts (the tags every trial carries, and more) and the checks that depend on them."""
    env = report.environment
    env.update(tracking.system_tags())
    env["torch.cuda_build"] = str(torch.version.cuda or "none (CPU build)")
    gpus, driver_cuda = _nvml()
    if driver_cuda:
        env["cuda.driver_max"] = driver_cuda
    if gpus and not torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES") != "":
        report.add(
            "cuda",
            "error",
            f"the driver shows {gpus} GPU(s) but torch cannot use them: torch {torch.__version__} is built for "
            f"CUDA {torch.version.cuda or 'none (a CPU build)'} and the driver supports CUDA up to "
            f"{driver_cuda or 'unknown'}. Install a torch build for CUDA <= {driver_cuda or 'the driver'} "
            "(pip install torch --index-url https://download.pytorch.org/whl/cu<version>) or update the driver",
        )
    wants_bf16 = cfg.trainer.bf16 or "bfloat16" in (cfg.model.quantization.bnb_4bit_compute_dtype, cfg.model.dtype)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        names = sorted({torch.cuda.get_device_properties(i).name for i in range(torch.cuda.device_count())})
        if len(names) > 1:
            env["gpu.names"] = ", ".join(names)
        env["bf16.supported"] = str(torch.cuda.is_bf16_supported()).lower()
        if wants_bf16 and not torch.cuda.is_bf16_supported():
            report.add(
                "bf16",
                "error",
                f"{props.name} (compute capability {props.major}.{props.minor}) has no bf16; set trainer.bf16=false "
                "model.quantization.bnb_4bit_compute_dtype=float16 model.dtype=float16",
            )
    else:
        env["bf16.supported"] = "cpu"  # CPU autocast runs bf16 everywhere torch does
    env["bitsandbytes.native"] = _bnb_native(report)
    check_versions(_version_facts(), report)


def _nvml() -> tuple[int, str | None]:
    """GPUs the driver shows and the newest CUDA it supports, independently of torch."""
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
        version = pynvml.nvmlSystemGetCudaDriverVersion_v2()
        return count, f"{version // 1000}.{version % 1000 // 10}"
    except Exception:  # no driver, no library: nothing to compare
        return 0, None


def _bnb_native(report: Report) -> str:
    """Which native bitsandbytes library serves this process (a CPU-only or missing library silently breaks
    4-bit on a GPU: bitsandbytes only warns and falls back)."""
    try:
        from bitsandbytes import cextension
    except Exception as exc:
        report.add("bitsandbytes", "error", f"bitsandbytes failed to import: {type(exc).__name__}: {exc}")
        return "missing"
    lib = cextension.lib
    mock = getattr(cextension, "ErrorHandlerMockBNBNativeLibrary", None)
    if mock is not None and isinstance(lib, mock):
        name, with_cuda = "none (failed to load)", False
    else:
        name = Path(str(getattr(getattr(lib, "_lib", None), "_name", "") or "")).name or "unknown"
        with_cuda = bool(getattr(lib, "compiled_with_cuda", "cuda" in name))
    if torch.cuda.is_available() and not with_cuda:
        report.add(
            "bitsandbytes",
            "error",
            f"bitsandbytes {_installed('bitsandbytes')} loaded '{name}' on a CUDA {torch.version.cuda} machine: "
            "4-bit layers would fail or run on the CPU. Install a bitsandbytes build that ships a library for "
            f"CUDA {torch.version.cuda} (see the known-bad table), or set BNB_CUDA_VERSION to one it has",
        )
    elif torch.cuda.is_available() and os.environ.get("BNB_CUDA_VERSION"):
        report.add(
            "bitsandbytes",
            "warning",
            f"BNB_CUDA_VERSION={os.environ['BNB_CUDA_VERSION']} makes bitsandbytes load '{name}' although torch "
            f"runs CUDA {torch.version.cuda}; unset BNB_CUDA_VERSION unless that mismatch is intended",
        )
    return name


def _installed(dist: str) -> str:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return "not installed"


def _version_facts() -> dict[str, str]:
    """Installed versions, plus `python` and (where a GPU is usable) the `cuda` runtime torch uses."""
    facts = dict(tracking.versions())
    facts["python"] = platform.python_version()
    if torch.cuda.is_available() and torch.version.cuda:
        facts["cuda"] = str(torch.version.cuda)
    return facts


def load_known_bad(path: Path = KNOWN_BAD) -> list[dict[str, str]]:
    """The table of known-bad combinations: one row per combination, each with the source that shows it."""
    with path.open(newline="") as f:
        lines = [line for line in f if not line.startswith("#")]  # the file's header explains the columns
    return [row for row in csv.DictReader(lines, skipinitialspace=True) if row.get("id", "").strip()]


def _matches(when: str, facts: dict[str, str]) -> bool:
    """Whether every clause (`peft<0.18.0; transformers>=5.0.0`) holds for the installed versions; a clause
    about something not installed (or no GPU for `cuda`) does not hold."""
    for clause in when.split(";"):
        req = Requirement(clause.strip())
        have = facts.get(req.name.lower())
        if have is None:
            return False
        try:
            if not req.specifier.contains(Version(have), prereleases=True):
                return False
        except InvalidVersion:
            return False
    return True


def check_versions(facts: dict[str, str], report: Report) -> None:
    """The installed versions against the known-bad table, the stack's own declared requirements, and the
    PEFT version transformers' integration asks for."""
    matched = []
    for row in load_known_bad():
        if not _matches(row["when"], facts):
            continue
        matched.append(row["id"])
        names = [Requirement(clause.strip()).name.lower() for clause in row["when"].split(";")]
        have = ", ".join(f"{name} {facts[name]}" for name in names)
        report.add(
            "known_bad",
            row["severity"].strip(),
            f"{row['id']} ({have}): {row['problem']} Fix: {row['fix']} Source: {row['source']}",
        )
    report.environment["known_bad"] = ",".join(matched) or "none"
    _check_declared_requirements(facts, report)
    _check_transformers_peft(facts, report)


def _check_declared_requirements(facts: dict[str, str], report: Report) -> None:
    """What each package of the stack declares it needs from the others (pip would enforce it, but GPU images
    are often assembled with --no-deps or a torch wheel installed on its own)."""
    for dist in STACK:
        if dist not in facts:
            continue
        try:
            declared = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            continue
        for text in declared:
            try:
                req = Requirement(text)
            except InvalidRequirement:
                continue
            name = req.name.lower()
            if name not in STACK or name not in facts or (req.marker and not req.marker.evaluate({"extra": ""})):
                continue
            try:
                ok = req.specifier.contains(Version(facts[name]), prereleases=True)
            except InvalidVersion:
                continue
            if not ok:
                report.add(
                    "requirements",
                    "error",
                    f"{dist} {facts[dist]} requires {name}{req.specifier} but {name} {facts[name]} is installed; "
                    f"pip install '{name}{req.specifier}' (or a {dist} release made for {name} {facts[name]})",
                )


def _check_transformers_peft(facts: dict[str, str], report: Report) -> None:
    """transformers' PEFT integration (model.load_adapter / add_adapter, used to load a trained adapter back)
    checks its own minimum PEFT version at call time, long after training; say so now."""
    try:
        from transformers.integrations.peft import MIN_PEFT_VERSION
    except Exception:
        return
    if "peft" in facts and Version(facts["peft"]) < Version(MIN_PEFT_VERSION):
        report.add(
            "requirements",
            "warning",
            f"transformers {facts.get('transformers')} asks for peft>={MIN_PEFT_VERSION} in its PEFT integration "
            f"(transformers.integrations.peft.MIN_PEFT_VERSION); peft {facts['peft']} is installed. Training "
            "(trl + peft) works, but loading the saved adapter with model.load_adapter() will refuse: "
            f"pip install 'peft>={MIN_PEFT_VERSION}' when that is allowed by pyproject's pin",
        )


# ---- data lint -----------------------------------------------------------------------------------------

_TOKENIZERS: dict[str, Any] = {}


def _load_tokenizer(cfg: DictConfig) -> Any:
    """The model's own tokenizer, without loading weights (a random model's is built as it would be).
    Kept per model path: building the tiny model's tokenizer trains a BPE, a second each time."""
    from transformers import AutoTokenizer

    from src.models import build_tokenizer

    path = Path(cfg.model.path)
    if str(path) in _TOKENIZERS:
        return _TOKENIZERS[str(path)]
    if (path / "tokenizer_config.json").exists() or (path / "tokenizer.json").exists():
        tokenizer = AutoTokenizer.from_pretrained(path)
    elif cfg.model.build is not None:
        tokenizer = build_tokenizer()
    else:
        raise ConfigError(
            f"model.path: no tokenizer in {path}; point model.path at the local model directory "
            "(model.path=/models/Meta-Llama-3-8B-Instruct)"
        )
    _TOKENIZERS[str(path)] = tokenizer
    return tokenizer


def check_data(cfg: DictConfig, report: Report) -> None:
    """Lint the data set as training will see it. Row numbers are the sheet's: the header is row 1."""
    from src.data import cell, length_stats, load_table, to_messages, token_lengths
    from src.models import context_length

    df = load_table(cfg.data)  # a missing file or column raises DataError naming the key
    policy = cfg.preflight
    if len(df) == 0:
        report.add("empty_data", "error", f"data.path={cfg.data.path} has no data rows; point it at the training set")
        return
    rows = df.index.to_numpy()
    in_col, out_col = cfg.data.input_column, cfg.data.output_column
    inputs = [cell(v) for v in df[in_col]]
    outputs = [cell(v) for v in df[out_col]]

    empty_in = np.array([not x for x in inputs])
    empty_out = np.array([not x for x in outputs])
    _judge(
        report,
        "empty_cells",
        empty_in | empty_out,
        rows,
        policy,
        "max_empty_frac",
        f"rows with an empty or missing cell ({int(empty_in.sum())} in input column '{in_col}', "
        f"{int(empty_out.sum())} in output column '{out_col}'): they would train on an empty message. "
        "Fill or drop them",
    )

    first: dict[tuple[str, str], int] = {}
    pairs = []  # (duplicate row, the row it repeats)
    for row, key in zip(rows, zip(inputs, outputs, strict=True), strict=True):
        if key in first:
            pairs.append((int(row), first[key]))
        else:
            first[key] = int(row)
    dup = np.isin(rows, [p[0] for p in pairs])
    shown = ", ".join(f"row {a} repeats row {b}" for a, b in pairs[:3]) + (", ..." if len(pairs) > 3 else "")
    _judge(report, "duplicates", dup, rows, policy, "max_duplicate_frac", f"exact duplicate rows ({shown})")

    prompt_asks = "json" in cfg.data.system_prompt.lower()
    if policy.require_json_output == "always" or (policy.require_json_output == "auto" and prompt_asks):
        bad_json = np.array([bool(x) and _not_json(x) for x in outputs])
        _judge(
            report,
            "json_output",
            bad_json,
            rows,
            policy,
            "max_invalid_json_frac",
            f"answers in '{out_col}' that are not valid JSON although "
            + ("the system prompt asks for JSON" if prompt_asks else "preflight.require_json_output=always"),
        )

    tokenizer = _load_tokenizer(cfg)
    full, prompt = token_lengths(to_messages(df, cfg.data), tokenizer)
    limit = cfg.data.max_seq_length
    context = context_length(cfg)
    fits = int(full.max()) if not context or full.max() <= context else context
    over = full > limit
    lost = over & (prompt >= limit)
    report.stats = length_stats(full)
    report.add(
        "lengths",
        "info",
        "rendered chats, tokens: "
        + ", ".join(f"{k.removeprefix('tokens_')}={v:g}" for k, v in report.stats.items())
        + f"; {int(over.sum())} of {len(df)} rows ({over.mean():.1%}) longer than data.max_seq_length={limit}",
    )
    # Truncation keeps the start (trl's default), so the answer at the end of a long row is what gets cut.
    _judge(
        report,
        "truncated_answers",
        over,
        rows,
        policy,
        "max_truncated_answer_frac",
        f"rows longer than data.max_seq_length={limit} tokens, whose assistant answer would be cut (the model "
        f"would learn a broken target; {int(lost.sum())} lose the whole answer). Set data.max_seq_length={fits} "
        + ("(the longest row)" if fits == full.max() else "(the model's context) and shorten or drop the rest")
        + " or shorten or drop these rows",
    )


def _not_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return True
    return False


def _judge(report: Report, check: str, mask: np.ndarray, rows: np.ndarray, policy: Any, key: str, what: str) -> None:
    """An error when the share of flagged rows exceeds preflight.<key>, else a warning."""
    if not mask.any():
        return
    frac, allowed = float(mask.mean()), float(policy[key])
    severity = "error" if frac > allowed else "warning"
    report.add(
        check,
        severity,
        f"{int(mask.sum())} {what} ({frac:.1%} of rows; refused above preflight.{key}={allowed:g})",
        rows[mask].tolist(),
    )


# ---- run ------------------------------------------------------------------------------------------------


def run(cfg: DictConfig, *, data: bool = True) -> Report:
    """All checks; raises ConfigError / DataError (whose message lists the errors) if training is refused."""
    report = Report()
    check_secrets(cfg, report)
    check_config(cfg, report)
    environment(cfg, report)
    if data:
        check_data(cfg, report)
    errors = report.errors
    if errors or (cfg.preflight.fail_on_warnings and report.warnings):
        refused = errors or report.warnings
        summary = "; ".join(f"{f.message}" + (f" (rows {_rows(f.rows)})" if f.rows else "") for f in refused)
        error_type = DataError if all(f.check in DATA_CHECKS for f in refused) else ConfigError
        exc = error_type(tracking.redact_text(f"preflight refused training: {summary}\n\n{report.to_text()}"))
        exc.report = report  # type: ignore[attr-defined]  # the trial records it even when refused
        raise exc
    return report


# ---- run-time guards (called by the trial) ----------------------------------------------------------------


def guard_device_moves(model: Any) -> Any:
    """Make `.to()` / `.cuda()` / `.cpu()` / `.half()` on a 4-bit or dispatched model raise ConfigError
    (naming the config key that places the model) instead of breaking it; returns the model.

    The model is placed by `device_map` at load time, the only safe moment: bitsandbytes' packed weights and
    accelerate's dispatch hooks do not survive a later move or cast. Moves that change nothing (the Trainer
    moving the model to the device it is on) pass. `_apply` is guarded too, so a move through a wrapper
    (the PEFT model around it) is caught as well. A plain model on one device is returned untouched.
    """
    quantized = bool(
        getattr(model, "is_loaded_in_4bit", False)
        or getattr(model, "is_loaded_in_8bit", False)
        or getattr(model, "hf_quantizer", None) is not None
    )
    mapped = {str(d) for d in (getattr(model, "hf_device_map", None) or {}).values()}
    dispatched = len(mapped) > 1
    if not (quantized or dispatched):
        return model
    bits = "8-bit" if getattr(model, "is_loaded_in_8bit", False) else "4-bit"
    what = f"a {bits} quantized model" if quantized else f"a model dispatched across {', '.join(sorted(mapped))}"
    if quantized and dispatched:
        what += f" dispatched across {', '.join(sorted(mapped))}"
    here = {_normal(p.device) for p in model.parameters()}
    probes = {}  # one floating-point dtype per device, to probe what an _apply function would do
    for p in model.parameters():
        if p.is_floating_point():
            probes.setdefault(_normal(p.device), p.dtype)

    def refuse(call: str) -> NoReturn:
        raise ConfigError(
            f"{call} on {what}: bitsandbytes 4-bit weights and accelerate's dispatch hooks are placed once, by "
            "device_map, when the model loads; moving or casting the model afterwards breaks them or leaves "
            "them on the old device. Remove the call and choose the placement in the config: "
            "hardware.parallelism=single (the whole model on one GPU; pick which with CUDA_VISIBLE_DEVICES) or "
            "hardware.parallelism=model_parallel (device_map=auto across the visible GPUs); the compute dtype "
            "is model.quantization.bnb_4bit_compute_dtype"
        )

    def moves(device: Any, dtype: Any) -> bool:
        if device is not None and (len(here) > 1 or _normal(torch.device(device)) not in here):
            return True
        return dtype is not None and quantized

    original_to, original_cuda, original_apply = model.to, model.cuda, model._apply

    def to(*args: Any, **kwargs: Any) -> Any:
        device, dtype, *_ = torch._C._nn._parse_to(*args, **kwargs)
        if moves(device, dtype):
            shown = ", ".join([*map(str, args), *(f"{k}={v}" for k, v in kwargs.items())])
            refuse(f"model.to({shown})")
        return original_to(*args, **kwargs)

    def cuda(device: Any = None) -> Any:
        target = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        if moves(target, None):
            refuse(f"model.cuda({device if device is not None else ''})")
        return original_cuda(device)

    def _apply(fn: Any, *args: Any, **kwargs: Any) -> Any:
        for device, dtype in probes.items():
            probe = torch.empty(0, device=device, dtype=dtype)
            try:
                out = fn(probe)
            except Exception:  # it would move to a device this process cannot even reach
                refuse("moving the model (.to() / .cuda() / .cpu() on it or on a wrapper such as the PEFT model)")
            if _normal(out.device) != _normal(probe.device) or (quantized and out.dtype != probe.dtype):
                refuse("moving or casting the model (.to() / .cuda() / .cpu() / .half() on it or on a wrapper)")
        return original_apply(fn, *args, **kwargs)

    model.to, model.cuda, model._apply = to, cuda, _apply
    return model


def _normal(device: torch.device) -> torch.device:
    """cuda means the current CUDA device, as torch places it."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device


class CheckpointingGuard(TrainerCallback):
    """Raise ConfigError at the first training forward when the model does not checkpoint the way
    `trainer.gradient_checkpointing` says.

    transformers recomputes a layer's activations only when the layer's `gradient_checkpointing` flag is on
    AND the layer is in training mode; otherwise the step silently keeps every activation (the memory of
    gradient_checkpointing=false) and the trial would record that under the wrong setting. Checked on the
    first forward with gradients enabled (evaluation runs without), then the hook removes itself.
    """

    def __init__(self, gradient_checkpointing: bool) -> None:
        self.wanted = bool(gradient_checkpointing)
        self._handle: Any = None

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
        if model is not None:
            self._handle = model.register_forward_pre_hook(self._check)

    def _check(self, module: torch.nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            return
        self._handle.remove()
        # transformers sets the flag on each repeated layer and on the stack that holds them; the layers are
        # what recompute, so they are what is counted.
        flagged = [m for m in module.modules() if getattr(m, "gradient_checkpointing", None) is True]
        layers = [m for m in flagged if isinstance(m, GradientCheckpointingLayer)] or flagged
        idle = [m for m in layers if not m.training]
        if self.wanted and not flagged:
            raise ConfigError(
                "trainer.gradient_checkpointing=true, but no layer of the model being trained checkpoints at the "
                "first step (gradient_checkpointing_enable() was not applied to this model), so the step keeps "
                "every activation. Enable it on this model (prepare_model_for_kbit_training(use_gradient_"
                "checkpointing=True) or SFTConfig(gradient_checkpointing=True)), or set "
                "trainer.gradient_checkpointing=false to measure without it"
            )
        if self.wanted and idle:
            raise ConfigError(
                f"trainer.gradient_checkpointing=true, but {len(idle)} checkpointed layers are in eval mode at "
                "the first training step: transformers only recomputes activations in training mode, so "
                "checkpointing is silently off and the step keeps every activation. Put the model in training "
                "mode (model.train(); remove a model.eval() before the step) or set "
                "trainer.gradient_checkpointing=false to measure without it"
            )
        if not self.wanted and any(m.training for m in layers):
            raise ConfigError(
                f"trainer.gradient_checkpointing=false, but {len(layers)} layers of the model checkpoint: memory "
                "and speed would be recorded under the wrong setting. Set trainer.gradient_checkpointing=true, "
                "or do not enable checkpointing on the model outside the config"
            )


# ---- command line ------------------------------------------------------------------------------------------


def main() -> None:
    import hydra

    from src.config import register_configs

    register_configs()

    @hydra.main(version_base="1.3", config_path="../conf", config_name="train")
    def _main(cfg: DictConfig) -> None:
        try:
            report = run(cfg)
        except (ConfigError, DataError) as exc:
            report = getattr(exc, "report", None)
            print(report.to_text() if report else tracking.redact_text(str(exc)))
            print(f"\nREFUSED: {tracking.redact_text(str(exc)).splitlines()[0]}")
            raise SystemExit(1) from None
        print(report.to_text())
        print("\nOK: training would start.")

    _main()


if __name__ == "__main__":
    main()
