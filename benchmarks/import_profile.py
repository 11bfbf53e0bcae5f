"""Where a trial's start-up goes before any GPU work: import time of the trial's libraries, per top-level
package, in fresh interpreters (`python -X importtime`), with the environment as the engine gives it and with
the optional frameworks (JAX, TensorFlow) switched off for the libraries that probe for them.

python -m benchmarks.import_profile [OUT.json]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

IMPORTS = {
    "mlflow": "import mlflow",
    "torch": "import torch",
    "trl": "import trl; from trl import SFTTrainer, SFTConfig",
    "trial_all": "import src.trial, src.models, src.preflight, src.measure, mlflow; from trl import SFTTrainer; "
    "import peft",
}
VARIANTS = {"as_is": {}, "no_jax_tf": {"USE_JAX": "0", "USE_TF": "0", "USE_FLAX": "0"}}


def profile(code: str, extra_env: dict[str, str]) -> dict:
    env = {**os.environ, **extra_env}
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", code], env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    top: dict[str, int] = {}
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        parts = line.removeprefix("import time:").split("|")
        try:
            cumulative = int(parts[1])
        except ValueError:
            continue
        raw = parts[2]  # nesting shows as indentation: one space before a module the statement imported itself
        name = raw.strip()
        if raw.startswith(" ") and not raw.startswith("  ") and "." not in name:
            top[name] = max(top.get(name, 0), cumulative)
    heaviest = sorted(top.items(), key=lambda kv: -kv[1])[:15]
    # Each figure is that package's cumulative import time: what it imported first is inside it.
    return {"wall_s": wall, "rc": proc.returncode, "top_level_s": {k: v / 1e6 for k, v in heaviest}}


def main() -> int:
    out = {}
    for variant, extra in VARIANTS.items():
        for name, code in IMPORTS.items():
            out[f"{variant}:{name}"] = r = profile(code, extra)
            top = ", ".join(f"{k} {v:.1f}" for k, v in list(r["top_level_s"].items())[:6])
            print(f"{variant:10} {name:12} {r['wall_s']:5.1f}s  {top}", flush=True)
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
