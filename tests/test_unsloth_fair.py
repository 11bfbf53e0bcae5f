"""benchmarks/suites/unsloth_fair.yaml (issue 46): the project beside Unsloth at both optimisations, each arm's
repeats in alternating order, both attention backends recorded, and `vs_unsloth` at each optimisation."""

from __future__ import annotations

from pathlib import Path

from benchmarks import harness, summaries


def _trial(arm: str, rate: float, kernel: str) -> dict:
    return {"name": arm, "arm": arm, "wall_s": 60.0,
            "result": {"status": "ok", "metrics": {"tokens_per_s": rate}, "attention_kernel": kernel}}  # fmt: skip


def _peer(arm: str, rate: float) -> dict:
    steps = [{"time_s": 1.0, "tokens": rate} for _ in range(8)]  # 2 warm-up steps, then 6 measured at `rate`
    attention = {"attn_implementation": "sdpa", "HAS_FLASH_ATTENTION": False, "kernels_run": ["efficient"]}
    return {"name": arm, "arm": arm, "wall_s": 90.0,
            "result": {"status": "ok", "steps": steps, "warmup_steps": 2, "attention": attention}}  # fmt: skip


def test_the_definition_alternates_the_arms_and_measures_at_least_30_steps() -> None:
    suite = harness.load("unsloth_fair")
    variables = {k: str(v) for k, v in suite["vars"].items()}
    assert int(variables["steps"]) - int(variables["warmup"]) >= 30
    run = harness.Run("unsloth_fair", suite, variables, Path("/r"), Path("/o/unsloth_fair_h100.json"), {"card": "h100"})
    names = [item["name"] for group in harness.plan(run) for item in group]
    recipe = [n.split("_")[0] for n in names if "recipe" in n]
    assert recipe == ["project", "unsloth", "unsloth", "project", "project", "unsloth"], "ABBA: neither always first"
    assert sum("packed" in n for n in names) == 6
    for item in (i for g in harness.plan(run) for i in g):
        words = " ".join(item["argv"])
        assert "dropout" in words and ("lora.lora_dropout=0" in words or "--lora-dropout 0" in words), "one adapter"


def test_vs_unsloth_at_each_optimisation_and_both_backends_said() -> None:
    rows = [_trial("project_recipe", r, "efficient") for r in (2000.0, 2100.0, 1900.0)]
    rows += [_peer("unsloth_recipe", r) for r in (1000.0, 1100.0, 900.0)]
    rows += [_trial("project_packed", r, "flash_varlen") for r in (9000.0, 9100.0, 8900.0)]
    rows += [_peer("unsloth_packed", r) for r in (8000.0, 8200.0, 7800.0)]
    run = harness.Run("unsloth_fair", {}, {}, Path("/r"), Path("/o/x.json"))
    s = summaries.unsloth_fair({"rows": rows}, run)
    assert s["vs_unsloth"] == {"recipe": 2.0, "packed": 9000.0 / 8000.0}
    assert s["settings"]["unsloth_recipe"]["tokens_per_s"] == {"median": 1000.0, "min": 900.0, "max": 1100.0}
    assert s["attention"]["project_packed"] == ["flash_varlen"]
    assert s["attention"]["unsloth_recipe"][0]["kernels_run"] == ["efficient"]
    assert s["gpu_minutes"] == 15.0
