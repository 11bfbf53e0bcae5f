#!/usr/bin/env bash
# The benchmark (benchmarks/map_h200.py) as one run that may outlive a device call: it starts in a session of
# its own from a copy of the checkout, and this script waits up to WAIT seconds for it; `map_h200.sh collect`
# (a later call on the same, still warm machine) waits for the rest. Results: benchmarks/results/ of the copy,
# also copied to $OUT (report and logs as .tgz) when OUT is set.
#   device run (carry .whl, see gpu_wheels.sh):  WAIT=570 bash benchmarks/map_h200.sh [map_h200 options]
#   then, at once:                               WAIT=570 bash benchmarks/map_h200.sh collect
# v3 (results/map_llama3_8b_24gib.json) ran with: --map-timeout-s 420 --solo-timeout-s 75 --compile-timeout-s 150
#   --candidates 1 --variants compile_layers liger no_lora_dropout --profile --extra model.upcast_non_quantized=false
set -uo pipefail
COPY=/tmp/map_h200_run
export QLORA_ROOT=${QLORA_ROOT:-/tmp/qlora} QLORA_CACHE=${QLORA_CACHE:-/tmp/qlora-cache} PYTHONUNBUFFERED=1 USE_JAX=0 USE_TF=0
if [ "${1:-}" != collect ]; then
  if [ -d .whl ] && ! python3 -c "import trl, optuna, bitsandbytes, hydra" 2>/dev/null; then  # the stack, as wheels
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/site
  fi
  rm -rf "$COPY" && mkdir -p "$COPY" "$QLORA_ROOT"
  (cd "$(dirname "$0")/.." && cp -r benchmarks conf data hydra_plugins src pyproject.toml "$COPY"/)
  TOTAL=${TOTAL:-1020}  # seconds for the whole run; solo trials stop starting 20 s before
  (cd "$COPY" && setsid nohup bash -c "timeout -s INT $TOTAL python3 -m benchmarks.map_h200 --slots 5 \
    --deadline-s $((TOTAL - 20)) $* > run.log 2>&1; echo rc=\$? >> run.log; touch done" >/dev/null 2>&1 </dev/null &)
fi
for _ in $(seq 1 "${WAIT:-570}"); do [ -f "$COPY/done" ] && break; sleep 1; done
if [ -n "${OUT:-}" ]; then
  cp "$COPY/run.log" "$COPY"/benchmarks/results/map_*gib.json "$OUT"/ 2>/dev/null
  tar czf "$OUT/report.tgz" -C "$COPY/benchmarks/results" $(cd "$COPY/benchmarks/results" && ls -d map_*gib 2>/dev/null)
  tar czf "$OUT/logs.tgz" -C "$QLORA_ROOT" benchmark_logs benchmark/solo 2>/dev/null
fi
[ -f "$COPY/done" ] && echo "done" || echo "still running: run '$0 collect' within 30 s"
grep -v "^ " "$COPY/run.log" | cut -c1-250 | tail -25
