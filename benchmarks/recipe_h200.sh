#!/usr/bin/env bash
# benchmarks/recipe_h200.py `run` as one run that may outlive a device call: it starts in a session of its own from a
# copy of the checkout, and this script waits up to WAIT seconds for it; `recipe_h200.sh collect` (the next call, on
# the same still-warm machine, within 30 s) waits for the rest. What it wrote comes back through $OUT.
#   device run (carry .whl, see gpu_wheels.sh):  WAIT=570 bash benchmarks/recipe_h200.sh [run options]
#   then, at once:                               WAIT=570 bash benchmarks/recipe_h200.sh collect
#   here, after:  python -m benchmarks.recipe_h200 summarize <files_at>/recipe_map_h200_stores.tgz <files_at>/recipe_speed_h200.json
set -uo pipefail
COPY=/tmp/recipe_h200_run
export QLORA_ROOT=${QLORA_ROOT:-/tmp/qlora} QLORA_CACHE=${QLORA_CACHE:-/tmp/qlora-cache} PYTHONUNBUFFERED=1 USE_JAX=0 USE_TF=0
if [ -d .whl ] && ! python3 -c "import trl, optuna, bitsandbytes, hydra" 2>/dev/null; then  # the stack, as wheels
  [ -d /tmp/site/trl ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site
fi
if [ "${1:-}" != collect ]; then
  rm -rf "$COPY" && mkdir -p "$COPY" "$QLORA_ROOT"
  (cd "$(dirname "$0")/.." && cp -r benchmarks conf data hydra_plugins src pyproject.toml "$COPY"/)
  (cd "$COPY" && PYTHONPATH="${PYTHONPATH:-}" setsid nohup bash -c "python3 -m benchmarks.recipe_h200 run $* \
    > run.log 2>&1; echo rc=\$? >> run.log; touch done" >/dev/null 2>&1 </dev/null &)
fi
for _ in $(seq 1 "${WAIT:-570}"); do [ -f "$COPY/done" ] && break; sleep 1; done
if [ -n "${OUT:-}" ]; then
  cp "$COPY/run.log" "$COPY"/benchmarks/results/recipe_speed_h200.json "$COPY"/benchmarks/results/recipe_map_h200_stores.tgz "$OUT"/ 2>/dev/null
  tar czf "$OUT/logs.tgz" -C "$QLORA_ROOT" recipe_logs 2>/dev/null
fi
[ -f "$COPY/done" ] && echo "done" || echo "still running: run '$0 collect' within 30 s"
tail -30 "$COPY/run.log" | cut -c1-250
