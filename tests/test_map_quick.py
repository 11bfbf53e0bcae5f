"""The cheaper speed maps (issue 31; `python -m benchmarks run speed_map sweep=speed_map_quick|speed_map_verdict`):
each sweeps the full map's space with a shorter probe, in a study of its own."""

from __future__ import annotations

from src.config import compose


def test_the_quick_map_sweeps_the_full_map_s_space_with_a_third_of_its_micro_steps() -> None:
    full = compose(["sweep=speed_map", "model=llama3_8b_synthetic"], hydra_config=True).hydra.sweeper
    fast = compose(["sweep=speed_map_quick", "model=llama3_8b_synthetic"], hydra_config=True).hydra.sweeper
    assert dict(fast.params) == dict(full.params) and fast.n_trials == full.n_trials == 96
    assert fast.sampler._target_ == full.sampler._target_ == "optuna.samplers.GridSampler"

    def micro_steps(sweeper) -> int:
        o = dict(x.split("=", 1) for x in sweeper.trial_overrides)
        acc = int(o.get("trainer.gradient_accumulation_steps", 2))  # the seed's accumulation: 2
        return int(o["trainer.max_steps"]) * acc

    assert micro_steps(full) == 6 and micro_steps(fast) == 2
    assert fast.study_name != full.study_name  # a quick map never resumes a full map's study


def test_the_verdict_map_runs_one_micro_step_of_the_same_space_and_keeps_its_own_file() -> None:
    quick_map = compose(["sweep=speed_map_quick", "model=llama3_8b_synthetic"], hydra_config=True).hydra.sweeper
    verdict = compose(["sweep=speed_map_verdict", "model=llama3_8b_synthetic"], hydra_config=True).hydra.sweeper
    assert dict(verdict.params) == dict(quick_map.params) and verdict.study_name != quick_map.study_name
    o = dict(x.split("=", 1) for x in verdict.trial_overrides)
    assert (o["trainer.max_steps"], o["trainer.gradient_accumulation_steps"], o["measure.warmup_steps"]) == (
        "1",
        "1",
        "0",
    )
