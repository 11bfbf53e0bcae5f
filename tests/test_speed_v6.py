"""Speed v6, the peer side by side (benchmarks/speed_v6_h200.py, benchmarks/peer_arm.py): what runs on a CPU.

The GPU run itself is a benchmark; here: every arm's FLOPs are the project's own formula (src/measure/flops.py), the
figures are computed the same way for every arm, arm d's steps are read back from a real trial as the trial measured
them, the peer harness measures a real (tiny) training as a trial does, the summary says what issue 31 asks, and the
deadline keeps the arms in their order of importance.
"""

from __future__ import annotations

import json
import logging
import statistics
from pathlib import Path

import pytest
import torch

from benchmarks import peer_arm
from benchmarks import speed_v6_h200 as v6
from tests.conftest import new_store, run_trial_here

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _tiny_lora_llama() -> torch.nn.Module:
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=300, max_position_embeddings=256)  # fmt: skip
    return get_peft_model(LlamaForCausalLM(config), LoraConfig(r=8, lora_alpha=16, target_modules=TARGETS))


def test_every_arm_counts_flops_with_the_project_s_own_formula() -> None:
    from src.measure.flops import FlopCounter

    model = _tiny_lora_llama()
    counter = FlopCounter(model)
    params = v6.matmul_params(model.config, 8, TARGETS)
    assert params == counter.params, "P from the architecture equals the project's count over the Linear modules"
    width = model.config.num_attention_heads * (model.config.hidden_size // model.config.num_attention_heads)
    padded = {"input_ids": torch.ones(2, 10, dtype=torch.long),
              "attention_mask": torch.tensor([[1] * 10, [1] * 6 + [0] * 4])}  # fmt: skip
    packed = {"input_ids": torch.ones(1, 12, dtype=torch.long),
              "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])}  # fmt: skip
    for batch, lengths in ((padded, [10, 6]), (packed, [5, 3, 4])):
        with torch.no_grad():
            torch.set_grad_enabled(True)  # the counter counts training forwards only
            model(**batch)
        ours, _ = counter.take()
        assert v6.row_lengths(batch) == lengths
        assert v6.useful_flops(params, model.config.num_hidden_layers, width, lengths) == pytest.approx(ours)
    # A packed row that also carries an all-ones mask (as some libraries pass it) is still three sequences, and
    # Unsloth's explicit boundaries win: a packed row never counts as one long sequence.
    assert v6.row_lengths({**packed, "attention_mask": torch.ones(1, 12, dtype=torch.long)}) == [5, 3, 4]
    assert v6.row_lengths({**packed, "packed_seq_lengths": torch.tensor([5, 3, 4], dtype=torch.int32)}) == [5, 3, 4]
    one_long = v6.useful_flops(params, 2, width, [12])
    assert one_long > v6.useful_flops(params, 2, width, [5, 3, 4]), "attention grows with each sequence's length"


def _steps(rates: list[float], tokens: float = 1000.0) -> list[dict]:
    return [{"step": i + 1, "time_s": tokens / r, "tokens": tokens} for i, r in enumerate(rates)]


def test_figures_are_the_median_of_whole_windows_after_warm_up_the_same_for_every_arm() -> None:
    rates = [50.0, 60.0, 1000, 1000, 2000, 2000, 3000, 3000, 9999]  # two warm-up steps, three windows, one step over
    project = {"steps": _steps(rates), "warmup_steps": 2, "window_steps": 2, "flops_per_token": 6e10}
    peer = {**project, "steps": [{**s, "flops": 6e13} for s in project["steps"]], "stack": "unsloth"}
    fig = v6.figures(project, peak_tflops=800.0)
    assert [w["first_step"] for w in fig["windows"]] == [3, 5, 7]
    assert [round(w["tokens_per_s"]) for w in fig["windows"]] == [1000, 2000, 3000]
    assert fig["tokens_per_s"] == pytest.approx(2000) and fig["tokens_per_s_range"] == [1000, 3000]
    assert fig["windows_ok"] and fig["measured_steps"] == 7 and fig["tokens_per_optimizer_step"] == 1000
    assert fig["mfu"] == pytest.approx(2000 * 6e10 / 800e12)
    assert v6.figures(peer, peak_tflops=800.0) == fig, "one computation, whichever arm measured the steps"
    short = v6.figures({**project, "steps": project["steps"][:6]}, peak_tflops=800.0)
    assert len(short["windows"]) == 2 and not short["windows_ok"], "fewer than 3 windows is said, not hidden"
    assert v6.figures({**project, "flops_per_token": None}, 800.0)["mfu"] is None
    assert v6.figures({"steps": [], "warmup_steps": 2, "window_steps": 2}, 800.0) == {
        "windows": [],
        "measured_steps": 0,
    }


def _arm(rate: float | None, peak: float = 15.8, status: str = "ok", failure: dict | None = None) -> dict:
    figures = {"tokens_per_s": rate, "mfu": rate / 25_000 if rate else None, "windows_ok": True} if rate else {}
    return {"status": status, "failure": failure, "peak_vram_reserved_gib": peak, "figures": figures}


def test_the_summary_holds_the_issue_s_keys_and_compares_this_project_s_best_with_unsloth() -> None:
    arms = {
        "d": _arm(10_000),
        "b": _arm(8_000, peak=11.0),
        "c": _arm(4_000),
        "a": _arm(None, 23.4, "failed", {"kind": "oom", "step": 1, "message": "OutOfMemoryError: CUDA out of memory"}),
        "d_nodrop": _arm(11_000),
    }
    s = v6.summary(arms)
    for key in ("best_setting", "best_tokens_per_s", "best_mfu", "best_peak_vram_reserved_gib", "unsloth_tokens_per_s",
                "vs_unsloth", "map_settings", "map_gpu_minutes", "map_verdict_agreement", "fixed_cost_s"):  # fmt: skip
        assert key in s, key
    assert s["best_arm"] == "d", "d_nodrop drops the recipe's dropout: compared, never the best setting"
    assert (
        s["best_setting"] == v6.BEST and s["best_tokens_per_s"] == 10_000 and s["best_peak_vram_reserved_gib"] == 15.8
    )
    assert s["vs_unsloth"] == pytest.approx(1.25) and s["vs_unsloth_same_adapter"] == pytest.approx(11 / 8)
    assert s["vs_plain_peft_trl"] == pytest.approx(2.5) and "unsloth_error" not in s
    assert s["recipe_outcome"] == "failed: oom at step 1"
    assert s["best_headroom_frac"] == pytest.approx(1 - 15.8 / 24), "stable: more than 10% of the budget left"
    assert s["selective_vs_full_recompute"] is None and s["selective_extra_reserved_gib"] is None, "not run"
    sel = v6.summary({**arms, "d_selective": _arm(10_700, peak=19.8)})
    assert sel["best_arm"] == "d_selective" and sel["best_setting"] == [*v6.BEST, "trainer.recompute=selective"]
    assert sel["selective_vs_full_recompute"] == pytest.approx(1.07)
    assert sel["selective_extra_reserved_gib"] == pytest.approx(4.0)
    # no_down beside full recompute, compiled and eager: the same memory, a faster step
    nd = v6.summary({**arms, "d_no_down": _arm(10_400, peak=15.8), "e": _arm(7_300), "e_no_down": _arm(7_600)})
    assert nd["best_arm"] == "d_no_down" and nd["best_setting"] == [*v6.BEST, "trainer.recompute=no_down"]
    assert nd["no_down_vs_full_recompute"] == pytest.approx(1.04) and nd["no_down_extra_reserved_gib"] == 0
    assert nd["no_down_vs_full_recompute_eager_layers"] == pytest.approx(7_600 / 7_300)
    assert s["no_down_vs_full_recompute"] is None, "not run"
    cut = v6.summary({**arms, "c": {**_arm(4_000), "status": "failed", "failure": {"kind": "timeout"}}})
    assert cut["vs_plain_peft_trl"] is None, "an arm cut short keeps its steps in the file, not in the comparison"
    assert s["map_settings"] is None and "map_settings" in s["not_measured"]
    assert s["targets"]["best_tokens_per_s"] == {"goal": ">= 12000", "value": 10_000, "met": False, "missed_by": 2000}
    assert s["targets"]["vs_unsloth"]["met"] is True and s["targets"]["best_peak_vram_reserved_gib"]["met"] is True
    json.dumps(s)  # the result file is JSON

    why = "import: ImportError: cannot import name 'X' from 'trl'"
    failed = v6.summary({**arms, "b": _arm(None, status="failed", failure={"kind": "import", "message": why[8:]})})
    assert failed["unsloth_tokens_per_s"] is None and failed["vs_unsloth"] is None
    assert failed["unsloth_error"] == why, "the reason, as the arm wrote it"
    not_run = v6.summary({**arms, "b": {"status": "not_run", "why": "out of time (deadline)"}})
    assert not_run["unsloth_error"] == "not run: out of time (deadline)"
    assert v6.summary({})["best_setting"] is None and v6.summary({})["unsloth_error"] == "not run"


def test_the_deadline_runs_the_arms_in_their_order_of_importance_and_skips_what_does_not_fit() -> None:
    assert [a.name for a in v6.ARMS] == [
        *("d", "b", "c", "a", "d_nodrop", "d_selective", "e", "e_selective", "d_no_down", "e_no_down")
    ]
    assert [a.name for a in v6.select(["d_selective", "d"])] == ["d", "d_selective"], "beside d, after it"
    assert [a.name for a in v6.select(["a", "b", "d"])] == ["d", "b", "a"], "importance, not the order asked"
    d, b = v6.ARMS[0], v6.ARMS[1]
    assert v6.plan(d, elapsed_s=0, deadline_s=1000) == d.limit_s, "never more than its limit"
    assert v6.plan(d, elapsed_s=400, deadline_s=480) is None, "not started without its estimate left"
    assert v6.plan(b, elapsed_s=300, deadline_s=480) == 180, "the rest of the deadline, when under its limit"

    def simulate(slow: str | None) -> list[str]:
        clock, ran = 80.0, []  # after the matmul rate and the build
        for arm in v6.select(None):
            budget = v6.plan(arm, clock, 480)
            if budget is not None:
                ran.append(arm.name)
                clock += budget if arm.name == slow else arm.estimate_s  # `slow` takes all it may
        return ran

    assert simulate(None) == ["d", "b", "c", "a"], "as expected: the comparisons (d_nodrop, d_selective) are left out"
    assert simulate("b") == ["d", "b", "a"], "Unsloth slow: c no longer fits, the recipe's short arm still does"
    assert simulate("d") == ["d", "b", "a"]
    assert all(a.max_steps >= a.warmup_steps + 3 * a.window_steps for a in v6.ARMS), "three windows at least"


def test_arm_d_s_steps_are_read_back_from_a_real_trial_as_it_measured_them(root: Path, empty_store: Path) -> None:
    new_store(root, empty_store)
    (root / "trial").mkdir()
    log = logging.FileHandler(root / "trial" / "train.log")  # what Hydra's job logging gives `python -m src.train`
    logging.getLogger().addHandler(log)
    try:
        result = run_trial_here(root, ["trainer.max_steps=4", "measure.warmup_steps=1", "trainer.packing=true",
                                       "data.max_seq_length=128", "trainer.per_device_train_batch_size=2",
                                       *v6.PROBE])  # fmt: skip
    finally:
        logging.getLogger().removeHandler(log)
        log.close()
    assert result["status"] == "ok", result
    steps = v6.steps_of_trial(root / "trial", root / "mlruns" / "mlflow.db", result["run_id"])
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    fig = v6.figures({"steps": steps, "warmup_steps": 1, "window_steps": 3}, None)
    m = result["metrics"]
    assert fig["tokens_per_s"] == pytest.approx(m["tokens_per_s"]), "one window of the measured steps: the trial's"
    assert fig["tokens_per_optimizer_step"] == pytest.approx(m["tokens_per_optimizer_step"])
    assert all(s["tokens"] > 0 for s in steps)


def test_the_peer_harness_measures_a_real_training_as_a_trial_does(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "TOKENIZERS_PARALLELISM"):
        monkeypatch.setenv(name, "1")  # the harness sets these: restored after the test
    out = root / "c.json"
    argv = ["--stack", "peft", "--model", "tiny_llama", "--out", str(out), "--max-seq-length", "128", "--batch", "2",
            "--accumulation", "2", "--max-steps", "3", "--warmup-steps", "1", "--output-dir", str(root / "t")]  # fmt: skip
    assert peer_arm.main(argv) == 0
    record = json.loads(out.read_text())
    assert record["status"] == "ok" and record["versions"]["trl"] != "absent"
    assert [s["step"] for s in record["steps"]] == [1, 2, 3]
    for s in record["steps"]:
        assert s["tokens"] == s["trainer_tokens"] == s["hook_tokens"] > 0, "the trainer's tokens, seen by the hook"
        assert s["flops"] == pytest.approx(s["flops_src_counter"]), "the project's FlopCounter counts the same"
        assert s["micro_batches"] == 2 and s["lengths_from"] == 0, "counted once, at the outermost forward"
    measured = record["steps"][1:]
    assert record["flops_per_token"] == pytest.approx(sum(s["flops"] for s in measured) / sum(s["tokens"] for s in
                                                                                               measured))  # fmt: skip
    assert v6.figures({**record, "window_steps": 1}, 1.0)["mfu"] > 0


def test_no_down_pooled_over_repeated_runs_goes_into_the_whole_run_s_summary(tmp_path: Path) -> None:
    """`pooled`: per run the arm beside its baseline, over the runs the ratio of the medians of every window; `--into`
    puts it in the whole run's summary, and `summarize` keeps it there (its own arms leave the keys empty)."""

    def arm(windows: list[float], peak: float) -> dict:
        rec = _arm(statistics.median(windows), peak=peak)
        rec["figures"]["windows"] = [{"tokens_per_s": w} for w in windows]
        return rec

    files = []
    for i, (base, fast) in enumerate([([100, 102, 98], [103, 104, 102]), ([101, 99, 100], [106, 105, 104])]):
        f = tmp_path / f"run{i}.json"
        f.write_text(json.dumps({"arms": {"d": arm(base, 15.8), "d_no_down": arm(fast, 15.6)}, "machine": {}}))
        files.append(f)
    found = v6.pooled(files)
    block = found["d_no_down_vs_d"]
    assert [r["ratio"] for r in block["runs"]] == pytest.approx([103 / 100, 105 / 100])
    assert block["ratio_of_pooled_medians"] == pytest.approx(statistics.median([103, 104, 102, 106, 105, 104]) / 100)
    assert block["windows"] == {"d": 6, "d_no_down": 6} and block["max_extra_reserved_gib"] == pytest.approx(-0.2)
    assert "e_no_down_vs_e" not in found, "no eager arms in these runs"

    whole = tmp_path / "speed_v6_h200.json"
    whole.write_text(json.dumps({"arms": {"d": _arm(10_000)}, "summary": v6.summary({"d": _arm(10_000)})}))
    v6.into(whole, found, files)
    v6.resummarize(whole)
    s = json.loads(whole.read_text())["summary"]
    assert s["no_down_vs_full_recompute"] == pytest.approx(block["ratio_of_pooled_medians"])
    assert s["no_down_vs_full_recompute_eager_layers"] is None and "pooled" in s["no_down_source"]
