#!/usr/bin/env bash
# benchmarks/memory_random_h200.py `run` as one run that may outlive a device call: it starts in a session of its own
# from a copy of the checkout, and this script waits up to WAIT seconds for it; `memory_random_h200.sh collect` (the
# next call, on the same still-warm machine) waits for the rest. What it wrote comes back through $OUT.
#   here, first:  python -m benchmarks.memory_random_h200 design    (its file is committed)
#   device run (carry .whl, see gpu_wheels.sh):  WAIT=570 bash benchmarks/memory_random_h200.sh [run options]
#   then, at once:                               WAIT=570 bash benchmarks/memory_random_h200.sh collect
#   the same with the allocator's expandable segments: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True WAIT=570 \
#     bash benchmarks/memory_random_h200.sh --tag _expandable
#   here, after:  python -m benchmarks.memory_random_h200 summarize <files_at>/memory_random_raw.json
set -uo pipefail
SRC=${SRC:-$(cd "$(dirname "$0")/.." && pwd)}
COPY=/tmp/memory_random_run
export QLORA_ROOT=${QLORA_ROOT:-/tmp/qlora} QLORA_CACHE=${QLORA_CACHE:-/tmp/qlora-cache} PYTHONUNBUFFERED=1 USE_JAX=0 USE_TF=0
if [ -d .whl ] && ! python3 -c "import trl, optuna, bitsandbytes, hydra" 2>/dev/null; then  # the stack, as wheels
  [ -d /tmp/site/trl ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site
fi
if [ "${1:-}" != collect ]; then
  rm -rf "$COPY" && mkdir -p "$COPY" "$QLORA_ROOT"
  (cd "$SRC" && cp -r benchmarks conf data hydra_plugins src pyproject.toml "$COPY"/)
  (cd "$COPY" && PYTHONPATH="${PYTHONPATH:-}" OUT="$QLORA_ROOT" setsid nohup bash -c "python3 -m benchmarks.memory_random_h200 run $* \
    > run.log 2>&1; echo rc=\$? >> run.log; touch done" >/dev/null 2>&1 </dev/null &)
fi
for _ in $(seq 1 "${WAIT:-570}"); do [ -f "$COPY/done" ] && break; sleep 1; done
if [ -n "${OUT:-}" ]; then
  cp "$COPY/run.log" "$QLORA_ROOT"/memory_random_raw*.json "$OUT"/ 2>/dev/null
  tar czf "$OUT/logs.tgz" -C "$QLORA_ROOT" --exclude='*.db' --exclude='*adapter*' --exclude='*.safetensors' \
    $(cd "$QLORA_ROOT" && ls -d build.log calibration*.log held_out*.log 2>/dev/null) 2>/dev/null
fi
[ -f "$COPY/done" ] && echo "done" || echo "still running: run '$0 collect' within 30 s"
tail -25 "$COPY/run.log" | cut -c1-250
