"""Preflight: each data defect found and counted with the sheet's row numbers (xlsx and csv), the default
policy refusing answers that max_seq_length would cut, every configuration guard's message, the environment
report and the cited known-bad table."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch
from packaging.requirements import Requirement

from src import preflight
from src.failures import ConfigError, DataError
from tests.conftest import compose_cfg, run_cli

PROMPT = "Answer only with a JSON object."
LIMIT = 128  # tokens: the short rows render to ~40 with the tiny tokenizer, the long ones to several hundred


def _answer(finding: str, **extra: str) -> str:
    return json.dumps({"finding": finding, "negated": False, **extra})


def _clean_rows() -> list[tuple[str | None, str | None]]:
    return [
        ("Patient reports mild chest pain.", _answer("chest pain")),
        ("Complains of cough since yesterday.", _answer("cough")),
        ("No evidence of rash on examination.", _answer("rash")),
        ("Reports intermittent dizziness.", _answer("dizziness")),
    ]


def _write(rows: list[tuple[str | None, str | None]], path: Path) -> Path:
    df = pd.DataFrame(rows, columns=["Sentence", "Description"])
    if path.suffix == ".xlsx":
        df.to_excel(path, index=False)
    elif path.suffix == ".jsonl":
        df.to_json(path, orient="records", lines=True)
    elif path.suffix == ".parquet":
        df.to_parquet(path, index=False)
    else:
        df.to_csv(path, index=False)
    return path


def _cfg(path: Path, *overrides: str):
    return compose_cfg(
        [
            "model=tiny_llama",
            f"data.path={path}",
            f"data.max_seq_length={LIMIT}",
            f"data.system_prompt='{PROMPT}'",
            *overrides,
        ]
    )


def _by_check(report: preflight.Report) -> dict[str, preflight.Finding]:
    return {f.check: f for f in report.findings}


# ---- data lint -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix", [".xlsx", ".csv", ".jsonl", ".parquet"])
def test_each_data_defect_is_found_and_counted_with_sheet_rows(suffix: str, root: Path) -> None:
    clean = _clean_rows()
    rows = [
        clean[0],  # row 2
        clean[1],  # row 3
        ("", _answer("fever")),  # row 4: empty input
        ("Patient denies fever.", None),  # row 5: missing answer
        clean[0],  # row 6: repeats row 2
        ("Reports rash.", "finding: rash"),  # row 7: not JSON
        ("Reports headache.", _answer("headache", note="worse at night " * 120)),  # row 8: answer cut
        ("Long history. " * 300, _answer("fatigue")),  # row 9: the prompt alone passes the limit
        clean[2],  # row 10
    ]
    cfg = _cfg(_write(rows, root / f"defects{suffix}"))
    report = preflight.Report()
    preflight.check_data(cfg, report)
    found = _by_check(report)

    assert found["empty_cells"].rows == [4, 5]
    assert found["empty_cells"].severity == "error"  # default: no empty cell is accepted
    assert "1 in input column 'Sentence', 1 in output column 'Description'" in found["empty_cells"].message
    assert found["duplicates"].rows == [6] and found["duplicates"].severity == "warning"
    assert "row 6 repeats row 2" in found["duplicates"].message
    assert found["json_output"].rows == [7]  # the missing answer (row 5) counts as empty, not as bad JSON
    truncated = found["truncated_answers"]
    assert truncated.rows == [8, 9] and truncated.severity == "error"
    assert truncated.message.startswith("2 rows longer than data.max_seq_length=128")
    assert "1 lose the whole answer" in truncated.message
    assert f"({2 / 9:.1%} of rows" in truncated.message
    # the length distribution of the rendered chats
    stats = report.stats
    assert stats["tokens_min"] < LIMIT < stats["tokens_max"]
    assert stats["tokens_min"] <= stats["tokens_median"] <= stats["tokens_p95"] <= stats["tokens_max"]
    assert "2 of 9 rows (22.2%) longer than data.max_seq_length=128" in found["lengths"].message
    # every defect with its rows in the text that the trial records
    text = report.to_text()
    assert "[ERROR  ] truncated_answers" in text and "rows 8, 9" in text and "rows 4, 5" in text


def _refused_data(cfg) -> str:
    with pytest.raises(DataError) as refused:
        preflight.check_data(cfg, preflight.Report())
    return str(refused.value)


def test_a_directory_as_data_path_says_so_and_names_its_data_files(root: Path) -> None:
    folder = root / "exports"
    folder.mkdir()
    _write(_clean_rows(), folder / "notes.csv")
    (folder / "README.txt").write_text("not a data file")
    refused = _refused_data(compose_cfg(["model=tiny_llama", f"data.path={folder}"]))  # the CLI says it so too
    assert refused == (
        f"data.path: {folder} is a directory, not a data file; it holds notes.csv: set data.path={folder / 'notes.csv'}"
    )
    (folder / "notes.csv").unlink()
    assert _refused_data(_cfg(folder)) == (
        f"data.path: {folder} is a directory with no xlsx, xls, csv, jsonl or parquet file in it; "
        "set data.path=/path/to/file.xlsx|csv|jsonl|parquet"
    )


def test_an_xlsx_whose_columns_are_on_another_sheet_names_that_sheet(root: Path) -> None:
    path = root / "book.xlsx"
    with pd.ExcelWriter(path) as book:
        pd.DataFrame({"Title": ["Notes export, March"]}).to_excel(book, sheet_name="Cover", index=False)
        pd.DataFrame(_clean_rows(), columns=["Sentence", "Description"]).to_excel(book, sheet_name="Notes", index=False)
    assert _refused_data(_cfg(path)) == (
        "data.input_column: column 'Sentence' is not on the first sheet ('Cover') of book.xlsx (its columns: "
        "['Title']); sheet 'Notes' has both columns ('Sentence', 'Description'): set data.sheet=Notes"
    )
    assert _refused_data(_cfg(path, "data.sheet=Data")) == (
        "data.sheet: book.xlsx has no sheet 'Data' (its sheets: 'Cover', 'Notes'); set data.sheet=<one of them>"
    )
    report = preflight.Report()
    preflight.check_data(_cfg(path, "data.sheet=Notes"), report)
    assert report.errors == [] and len(report.stats) == 4


def test_a_malformed_jsonl_line_is_named_by_its_line_number(root: Path) -> None:
    path = root / "notes.jsonl"
    lines = [json.dumps({"Sentence": s, "Description": d}) for s, d in _clean_rows()]
    lines[2] = '{"Sentence": "Reports rash." "Description": "{}"}'
    path.write_text("\n".join(lines) + "\n")
    message = _refused_data(_cfg(path))
    assert message == (
        "data.path: line 3 of notes.jsonl is not valid JSON (Expecting ',' delimiter, column 30): "
        '{"Sentence": "Reports rash." "Description": "{}"}'
    )
    lines[2] = '["Reports rash.", "{}"]'
    path.write_text("\n".join(lines) + "\n")
    assert _refused_data(_cfg(path)).startswith(
        "data.path: line 3 of notes.jsonl is a JSON list, not an object of column: value"
    )


@pytest.mark.parametrize("suffix", [".xlsx", ".csv", ".jsonl"])
def test_cells_that_read_na_null_or_none_are_text_not_missing(suffix: str, root: Path) -> None:
    """`null` is a valid JSON answer and `NA` a valid sentence: only a cell with nothing in it is missing."""
    from src.data import cell, load_table

    rows = [("NA", "null"), ("N/A", "None"), ("null", "NA"), _clean_rows()[0], ("Reports cough.", "")]
    path = _write(rows, root / f"texts{suffix}")
    df = load_table(_cfg(path).data)
    assert [cell(v) for v in df["Sentence"]] == ["NA", "N/A", "null", rows[3][0], "Reports cough."]
    assert [cell(v) for v in df["Description"]] == ["null", "None", "NA", rows[3][1], ""]
    report = preflight.Report()
    preflight.check_data(_cfg(path), report)
    found = _by_check(report)
    assert found["empty_cells"].rows == [6], "the one truly empty cell, and only it"
    assert found["json_output"].rows == [3, 4], "the answer null is valid JSON; None and NA are not"


@pytest.mark.parametrize("suffix", [".xlsx", ".csv"])
def test_default_policy_refuses_truncating_data_and_accepts_a_clean_file(suffix: str, root: Path) -> None:
    clean = _clean_rows()
    long_answer = ("Reports fatigue.", _answer("fatigue", note="for several months " * 100))
    truncating = _write([*clean[:2], long_answer, *clean[2:]], root / f"truncating{suffix}")
    with pytest.raises(DataError) as refused:
        preflight.run(_cfg(truncating))
    message = str(refused.value)
    assert "1 rows longer than data.max_seq_length=128" in message and "(rows 4)" in message
    assert "Set data.max_seq_length=" in message  # the key to change, and to what

    report = preflight.run(_cfg(_write(clean, root / f"clean{suffix}")))
    assert report.errors == [] and report.tags()["preflight.errors"] == "0"
    assert {f.check for f in report.findings} & preflight.DATA_CHECKS == set()
    assert report.stats["tokens_max"] < LIMIT


@pytest.mark.slow(seconds=9)
def test_cli_refuses_truncating_csv_and_names_the_rows(root: Path) -> None:
    rows = [*_clean_rows(), ("Reports nausea.", _answer("nausea", note="after meals " * 150))]
    path = _write(rows, root / "notes.csv")
    done = run_cli(
        "src.preflight",
        "model=tiny_llama",
        f"data.path={path}",
        f"data.max_seq_length={LIMIT}",
        f"data.system_prompt='{PROMPT}'",
        root=root,
        timeout=120,
    )
    assert done.returncode == 1, done.stderr[-2000:]
    assert "[ERROR  ] truncated_answers: 1 rows longer than data.max_seq_length=128" in done.stdout
    assert "rows 6" in done.stdout and "REFUSED: preflight refused training" in done.stdout
    assert "Environment:" in done.stdout and "version.transformers" in done.stdout


# ---- configuration guards ----------------------------------------------------------------------------------


def _refusal(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as refused:
        preflight.run(compose_cfg(overrides), data=False)
    return str(refused.value)


def test_max_seq_length_beyond_context_names_the_limit(root: Path) -> None:
    message = _refusal(["model=tiny_llama", "data.max_seq_length=4096"])
    assert "data.max_seq_length=4096 exceeds the model's context of 2048 tokens" in message
    assert "set data.max_seq_length<=2048" in message


def test_per_step_empty_cache_is_refused(root: Path) -> None:
    message = _refusal(["trainer.torch_empty_cache_steps=1"])
    assert "fragments memory" in message and "set trainer.torch_empty_cache_steps=null" in message


def test_device_map_across_gpus_with_data_parallel_is_refused(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")  # as torchrun sets it
    message = _refusal(["hardware.parallelism=model_parallel"])
    assert "a device map across GPUs (hardware.parallelism=model_parallel (device_map=auto))" in message
    assert "WORLD_SIZE=2" in message and "Set hardware.parallelism=data_parallel" in message
    monkeypatch.delenv("WORLD_SIZE")
    # a device map key (not in the schema today) that spreads the model, with data-parallel training
    message = _refusal(["hardware.parallelism=data_parallel", "model.device_map=auto"])
    assert "model.device_map=auto" in message and "remove model.device_map" in message


@pytest.mark.parametrize(
    "override,expected",
    [
        ("trainer.per_device_train_batch_size=0", "trainer.per_device_train_batch_size=0: must be at least 1"),
        ("trainer.gradient_accumulation_steps=-1", "trainer.gradient_accumulation_steps=-1: must be at least 1"),
        ("lora.r=0", "lora.r=0: must be at least 1"),
        ("data.max_seq_length=0", "data.max_seq_length=0: must be at least 1"),
        ("hardware.vram_budget_gib=0", "hardware.vram_budget_gib=0"),
        ("trainer.learning_rate=-1", "trainer.learning_rate=-1.0: must be more than 0, e.g. 2e-5"),
    ],
)
def test_sizes_that_cannot_train_are_refused_by_name(override: str, expected: str, root: Path) -> None:
    assert expected in _refusal([override])


def test_a_run_too_short_to_measure_is_warned_about(root: Path) -> None:
    report = preflight.run(compose_cfg(["trainer=probe", "trainer.max_steps=2", "measure.warmup_steps=2"]), data=False)
    (finding,) = [f for f in report.findings if f.check == "measured_steps"]
    assert finding.severity == "warning" and "raise trainer.max_steps or lower measure.warmup_steps" in finding.message
    report = preflight.run(compose_cfg(["trainer=probe", "trainer.max_steps=3", "measure.warmup_steps=2"]), data=False)
    assert not [f for f in report.findings if f.check == "measured_steps"]


def test_padding_free_without_packing_is_refused_and_packing_accepted(root: Path) -> None:
    message = _refusal(["trainer.padding_free=true", "trainer.per_device_train_batch_size=4"])
    assert "trainer.padding_free=true without packing" in message and "Set trainer.packing=true" in message
    report = preflight.run(compose_cfg(["trainer.packing=true", "trainer.per_device_train_batch_size=4"]), data=False)
    assert not [f for f in report.findings if f.check == "padding_free"]


@pytest.mark.parametrize("word", ["selective", "no_down"])
def test_a_recompute_choice_needs_checkpointing_and_a_known_word(word: str, root: Path) -> None:
    message = _refusal([f"trainer.recompute={word}", "trainer.gradient_checkpointing=false"])
    lines = [line for line in message.splitlines() if f"trainer.recompute={word}" in line]
    assert lines and all("set trainer.gradient_checkpointing=true" in line for line in lines)  # each in one line
    assert "trainer.recompute=some is not one of full, no_down, selective" in _refusal(["trainer.recompute=some"])
    for ok in ([f"trainer.recompute={word}", "trainer.gradient_checkpointing=true"], ["trainer.recompute=full"]):
        report = preflight.run(compose_cfg(ok), data=False)
        assert not [f for f in report.findings if f.check == "recompute"]


def test_no_down_with_compiled_layers_is_warned_about_where_the_compile_gain_is_lost(root: Path) -> None:
    """transformers 5.23 checkpoints inside the compiled layer, whose graph recomputes the product as full does:
    no_down gains nothing there, and says so. Where the checkpoint sits around the compiled layer (5.17-5.22), no
    warning."""
    from src import recompute

    cfg = compose_cfg(
        ["trainer.gradient_checkpointing=true", "trainer.recompute=no_down", "trainer.torch_compile=layers"]
    )
    found = [f for f in preflight.run(cfg, data=False).findings if f.check == "recompute"]
    if recompute.checkpoint_inside_forward():
        assert [f.severity for f in found] == ["warning"] and "no_down gains nothing here" in found[0].message
    else:
        assert not found


@pytest.mark.parametrize(
    "overrides,expected",
    [
        (["model.sdpa_backends=[flash,fast]", "model.attn_implementation=sdpa"], "unknown fast"),
        (["model.sdpa_backends=[]", "model.attn_implementation=sdpa"], "empty"),
        (["model.sdpa_backends=[flash]", "model.attn_implementation=eager"], "does not use SDPA"),
    ],
)
def test_bad_sdpa_backends_are_refused_by_name(overrides: list[str], expected: str, root: Path) -> None:
    message = _refusal(overrides)
    assert "model.sdpa_backends" in message and expected in message
    report = preflight.run(
        compose_cfg(["model.sdpa_backends=[cudnn,flash]", "model.attn_implementation=sdpa"]), data=False
    )
    assert not [f for f in report.findings if f.check == "sdpa_backends"]


def test_varlen_attention_is_refused_where_it_cannot_run(root: Path) -> None:
    from src import attention

    if attention.available() is None:
        pytest.skip("this machine can run torch's varlen flash kernel")
    message = _refusal(["model.attn_implementation=varlen"])
    assert "model.attn_implementation=varlen" in message and "CUDA" in message
    assert "model.attn_implementation=sdpa" in message


def test_liger_kernel_without_the_package_is_refused(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else real(name, *a)
    )
    message = _refusal(["trainer.use_liger_kernel=true"])
    assert "liger-kernel package is not installed" in message and "trainer.use_liger_kernel=false" in message


def test_a_data_parallel_trial_s_parent_is_not_warned_that_it_was_not_launched_by_torchrun(root: Path) -> None:
    # The parent (WORLD_SIZE unset) launches the ranks itself; a warning there refused every data-parallel
    # trial under preflight.fail_on_warnings=true.
    report = preflight.run(compose_cfg(["hardware.parallelism=data_parallel", "model.device_map=null"]), data=False)
    assert not [f for f in report.findings if f.check == "parallelism"]


def test_moving_a_4bit_model_is_refused_and_training_still_runs(root: Path) -> None:
    """The runtime guards the trial installs: `.to()` on the loaded 4-bit model (or through the PEFT model
    around it) raises ConfigError naming hardware.parallelism; a real training step passes both guards."""
    from hydra.utils import instantiate
    from peft import get_peft_model, prepare_model_for_kbit_training
    from trl import SFTConfig, SFTTrainer

    from src import models
    from src.config import sft_kwargs
    from src.trial.single import _dataset

    cfg = compose_cfg(
        ["model=tiny_llama", "trainer=probe", "trainer.max_steps=1", f"trainer.output_dir={root / 'trainer'}"]
        + ["trainer.gradient_checkpointing=true"]  # as prepared below
    )
    model, tokenizer = models.load(cfg)
    assert preflight.guard_device_moves(model) is model
    for move in (lambda: model.to("meta"), lambda: model.to(torch.float16), lambda: model.cuda()):
        with pytest.raises(ConfigError) as refused:
            move()
        assert "on a 4-bit quantized model" in str(refused.value)
        assert "hardware.parallelism=single" in str(refused.value)
        assert "hardware.parallelism=model_parallel" in str(refused.value)
    assert model.to("cpu") is model  # a move that changes nothing passes (the Trainer makes them)

    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
    wrapped = get_peft_model(model, instantiate(cfg.lora, _convert_="all"))
    with pytest.raises(ConfigError, match="on a wrapper"):
        wrapped.to("meta")

    dataset, _ = _dataset(cfg, tokenizer, world_size=1)
    trainer = SFTTrainer(
        model=wrapped,
        args=SFTConfig(**sft_kwargs(cfg, use_cpu=True)),
        train_dataset=dataset,
        processing_class=tokenizer,
    )
    trainer.add_callback(preflight.CheckpointingGuard(cfg.trainer.gradient_checkpointing))
    result = trainer.train()
    assert result.global_step == 1


def _tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return LlamaForCausalLM(config)


def _first_forward(model: torch.nn.Module, guard: preflight.CheckpointingGuard) -> None:
    guard.on_train_begin(None, None, None, model=model)
    with torch.no_grad():
        model(torch.ones(1, 4, dtype=torch.long))  # evaluation: not checked, the hook stays
    model(torch.ones(1, 4, dtype=torch.long))


def test_checkpointing_without_training_mode_is_refused_at_the_first_step() -> None:
    model = _tiny_llama()
    model.gradient_checkpointing_enable()
    model.eval()
    with pytest.raises(ConfigError) as refused:
        _first_forward(model, preflight.CheckpointingGuard(True))
    assert "2 checkpointed layers are in eval mode" in str(refused.value)
    assert "trainer.gradient_checkpointing=false" in str(refused.value) and "model.train()" in str(refused.value)

    model.train()
    _first_forward(model, preflight.CheckpointingGuard(True))  # training mode: checkpointing really on


def test_checkpointing_that_differs_from_the_config_is_refused() -> None:
    plain = _tiny_llama().train()
    with pytest.raises(ConfigError, match="no layer of the model being trained checkpoints"):
        _first_forward(plain, preflight.CheckpointingGuard(True))
    checkpointing = _tiny_llama().train()
    checkpointing.gradient_checkpointing_enable()
    with pytest.raises(ConfigError, match="Set trainer.gradient_checkpointing=true"):
        _first_forward(checkpointing, preflight.CheckpointingGuard(False))


# ---- environment --------------------------------------------------------------------------------------------


def test_environment_report_versions_bitsandbytes_and_tags(root: Path) -> None:
    report = preflight.run(compose_cfg([]), data=False)
    env = report.environment
    for package in ("torch", "transformers", "trl", "peft", "bitsandbytes", "accelerate"):
        assert env[f"version.{package}"]
    assert env["bitsandbytes.native"].startswith("libbitsandbytes_")
    assert env["known_bad"] == "none"  # this machine's own combination is not a known-bad one
    tags = report.tags()
    assert tags["preflight.errors"] == "0" and tags["bitsandbytes.native"] == env["bitsandbytes.native"]
    assert tags["preflight.known_bad"] == "none" and "bf16.supported" in tags
    text = report.to_text()
    assert "Environment:" in text and f"version.torch: {env['version.torch']}" in text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_facts_and_a_cuda_bitsandbytes_library(root: Path) -> None:
    env = preflight.run(compose_cfg([]), data=False).environment
    assert env["gpu.name"] != "none (cpu)" and env["gpu.capability"] and env["cuda.runtime"] == torch.version.cuda
    assert env["gpu.driver"] != "unknown" and env["cuda.driver_max"]
    assert "cuda" in env["bitsandbytes.native"]
    assert env["bf16.supported"] in ("true", "false")


def test_known_bad_table_rows_each_cite_a_source() -> None:
    table = preflight.load_known_bad()
    assert len(table) >= 5
    assert len({row["id"] for row in table}) == len(table)
    known = {*preflight.STACK, "python", "cuda"}
    for row in table:
        assert row["severity"] in ("error", "warning"), row["id"]
        assert row["problem"].strip() and row["fix"].strip(), row["id"]
        sources = row["source"].split()
        assert sources and all(s.startswith("https://github.com/") for s in sources), row["id"]
        assert {Requirement(c.strip()).name for c in row["when"].split(";")} <= known, row["id"]


def test_known_bad_combination_is_reported_with_its_source() -> None:
    def known_bad(facts: dict[str, str]) -> list[preflight.Finding]:
        report = preflight.Report()
        preflight.check_versions(facts, report)
        return [f for f in report.findings if f.check == "known_bad"]

    (found,) = known_bad({"peft": "0.17.1", "transformers": "5.2.0"})
    assert found.severity == "error" and found.message.startswith("peft-hybridcache (peft 0.17.1, transformers 5.2.0)")
    assert "pip install 'peft>=0.18.0'" in found.message
    assert "https://github.com/huggingface/transformers/pull/41889" in found.message
    assert known_bad({"peft": "0.18.0", "transformers": "5.2.0"}) == []
    # a CUDA clause holds only where torch runs CUDA
    assert known_bad({"bitsandbytes": "0.46.0"}) == []
    (found,) = known_bad({"bitsandbytes": "0.46.0", "cuda": "12.9"})
    assert found.message.startswith("bnb-no-cuda129-library") and "bitsandbytes>=0.47.0" in found.message


def test_the_checks_tokenizer_is_the_one_autotokenizer_loads(root: Path, tmp_path: Path) -> None:
    """The sweep's checks and the trial load the fast tokenizer class that tokenizer_config.json names without
    AutoTokenizer's detour through the model's config: the same class, the same tokens, the same chat template. A tokenizer
    config that names another class is still loaded by AutoTokenizer."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from src import models
    from src.models import tokenizer_class

    cfg = compose_cfg()
    models.ensure_built(cfg.model)
    path = Path(cfg.model.path)
    assert tokenizer_class(path) is PreTrainedTokenizerFast
    fast, auto = PreTrainedTokenizerFast.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    assert type(fast) is type(auto)
    chats = [[{"role": "system", "content": PROMPT}, {"role": "user", "content": s}, {"role": "assistant", "content": a}]
             for s, a in _clean_rows()]  # fmt: skip
    for chat in chats:
        assert fast.apply_chat_template(chat, tokenize=False) == auto.apply_chat_template(chat, tokenize=False)
        text = auto.apply_chat_template(chat, tokenize=False)
        assert fast(text)["input_ids"] == auto(text)["input_ids"]
    assert (fast.pad_token, fast.eos_token, fast.bos_token) == (auto.pad_token, auto.eos_token, auto.bos_token)
    other = tmp_path / "other"
    other.mkdir()
    (other / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    (other / "tokenizer.json").write_text((path / "tokenizer.json").read_text())
    assert tokenizer_class(other) is AutoTokenizer


@pytest.mark.parametrize(
    "torch_v,transformers_v,warned",
    [("2.13.0+cpu", "5.17.0", True), ("2.11.0", "5.17.0", False), ("2.13.0", "5.23.0", False)],
)
def test_compiled_layers_inside_an_eager_checkpoint_are_warned_about_where_they_break(
    torch_v: str, transformers_v: str, warned: bool, root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """torch 2.13 with transformers 5.17-5.22 (checkpoint around the compiled layer): warned, with the way out."""
    import importlib.metadata

    real = importlib.metadata.version
    fake = {"torch": torch_v, "transformers": transformers_v}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: fake.get(name) or real(name))
    cfg = compose_cfg(["trainer.gradient_checkpointing=true", "trainer.torch_compile=layers"])
    found = [f for f in preflight.run(cfg, data=False).findings if f.check == "torch_compile"]
    assert bool(found) == warned
    if warned:
        assert found[0].severity == "warning" and "pip install 'transformers>=5.23'" in found[0].message
