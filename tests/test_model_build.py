"""A trial that has to build its random model first (a fresh cache) measures the trial, not the build: the build
runs in a process of its own (src/models.py prepare_apart), says so in one line, and the trial records the same
peak as a trial that finds the model built."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import run_cli

# A random Llama a few times the tiny one (~40M parameters, ~80 MB in bf16 while it is made): large enough that
# making it inside the trial would show in the trial's peak host memory, small enough to build in seconds.
BIGGER = [
    "model=tiny_llama",
    "model.name=built_apart",
    "model.path=${paths.cache_dir}/built_apart",
    "model.build.hidden_size=768",
    "model.build.intermediate_size=3072",
    "model.build.num_hidden_layers=4",
    "model.build.num_attention_heads=12",
    "model.build.num_key_value_heads=4",
    "trainer.max_steps=1",
    "data.max_rows=8",
]


def _trial(root: Path, cache: Path, name: str) -> tuple[dict, str]:
    done = run_cli("src.train", *BIGGER, f"hydra.run.dir={root / name}", root=root, env={"QLORA_CACHE": str(cache)})
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads((root / name / "result.json").read_text()), done.stderr


def test_a_trial_that_builds_the_model_records_the_same_peak_as_one_that_finds_it_built(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first, first_err = _trial(tmp_path, cache, "builds")
    second, second_err = _trial(tmp_path, cache, "finds")
    assert "building the random model" in first_err and "in a process of its own" in first_err
    assert "building" not in second_err
    assert (cache / "built_apart" / "config.json").exists()
    built, found = first["metrics"], second["metrics"]
    for key in ("peak_rss_gib", "peak_vram_reserved_gib"):
        # measured bytes, so not bit-equal: a build inside the trial adds ~0.1 GiB to both
        assert abs(built[key] - found[key]) < 0.04, (key, built[key], found[key])
