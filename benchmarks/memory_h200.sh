#!/usr/bin/env bash
# benchmarks/memory_h200.py `run` as one run that may outlive a device call: it starts in a session of its own from a
# copy of the checkout, and this script waits up to WAIT seconds for it; `memory_h200.sh collect` (the next call, on
# the same still-warm machine, within 30 s) waits for the rest. What it wrote comes back through $OUT.
#   here, first:  python -m benchmarks.memory_h200 calibrate    (its file is committed)
#   device run (carry .whl, see gpu_wheels.sh):  WAIT=570 bash benchmarks/memory_h200.sh [run options]
#   then, at once:                               WAIT=570 bash benchmarks/memory_h200.sh collect
#   here, after:  python -m benchmarks.memory_h200 summarize <files_at>/memory_stores.tgz
# FOREGROUND=1: the run in the call itself, writing into $OUT (no collect): where the device time left may end the
# call before the run does, a module that writes its raw file after each trial (memory_random_h200) keeps its rows.
# Other benchmarks run the same way through it (benchmarks/memory_random_h200.sh): MODULE is what runs, COPY where,
# COLLECT the files of $QLORA_ROOT it brings back, LOGS the paths under $QLORA_ROOT packed into logs.tgz.
set -uo pipefail
SRC=${SRC:-$(cd "$(dirname "$0")/.." && pwd)}
MODULE=${MODULE:-benchmarks.memory_h200} COPY=${COPY:-/tmp/memory_h200_run}
COLLECT=${COLLECT:-memory_stores.tgz} LOGS=${LOGS:-sweeps}
export QLORA_ROOT=${QLORA_ROOT:-/tmp/qlora} QLORA_CACHE=${QLORA_CACHE:-/tmp/qlora-cache} PYTHONUNBUFFERED=1 USE_JAX=0 USE_TF=0
if [ -d .whl ] && ! python3 -c "import trl, optuna, bitsandbytes, hydra" 2>/dev/null; then  # the stack, as wheels
  [ -d /tmp/site/trl ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site
fi
if [ -n "${FOREGROUND:-}" ]; then  # in this call, writing into $OUT as it goes: a call cut short keeps its rows
  OUT="${OUT:-$QLORA_ROOT}"; mkdir -p "$OUT"
  OUT="$OUT" python3 -m $MODULE run "$@" 2>&1 | tee "$OUT/run.log" | tail -40 | cut -c1-250
  exit "${PIPESTATUS[0]}"
fi
if [ "${1:-}" != collect ]; then
  rm -rf "$COPY" && mkdir -p "$COPY" "$QLORA_ROOT"
  (cd "$SRC" && cp -r benchmarks conf data hydra_plugins src pyproject.toml "$COPY"/)
  (cd "$COPY" && PYTHONPATH="${PYTHONPATH:-}" OUT="$QLORA_ROOT" setsid nohup bash -c "python3 -m $MODULE run $* \
    > run.log 2>&1; echo rc=\$? >> run.log; touch done" >/dev/null 2>&1 </dev/null &)
fi
for _ in $(seq 1 "${WAIT:-570}"); do [ -f "$COPY/done" ] && break; sleep 1; done
if [ -n "${OUT:-}" ]; then
  cp "$COPY/run.log" "$OUT"/ 2>/dev/null
  (cd "$QLORA_ROOT" && cp $COLLECT "$OUT"/ 2>/dev/null)
  (cd "$QLORA_ROOT" && tar czf "$OUT/logs.tgz" --exclude='*.db' --exclude='*adapter*' --exclude='*.safetensors' \
    $(ls -d $LOGS 2>/dev/null) 2>/dev/null)
fi
[ -f "$COPY/done" ] && echo "done" || echo "still running: run '$0 collect' within 30 s"
tail -30 "$COPY/run.log" | cut -c1-250
