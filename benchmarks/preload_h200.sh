#!/usr/bin/env bash
# benchmarks/preload_h200.py on the device machine, in one call (a few minutes; carry .whl, see gpu_wheels.sh):
#   bash benchmarks/preload_h200.sh          -> $OUT/preload_h200.json (commit it under benchmarks/results/)
set -uo pipefail
export QLORA_ROOT=${QLORA_ROOT:-/tmp/qlora-preload} QLORA_CACHE=${QLORA_CACHE:-/tmp/qlora-cache} PYTHONUNBUFFERED=1 USE_JAX=0 USE_TF=0
if [ -d .whl ] && ! python3 -c "import trl, optuna, bitsandbytes, hydra" 2>/dev/null; then  # the stack, as wheels
  [ -d /tmp/site/trl ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site
fi
rm -rf "$QLORA_ROOT"
python3 -m benchmarks.preload_h200 --out "${OUT:-benchmarks/results}/preload_h200.json"
rc=$?
[ -n "${OUT:-}" ] && tar czf "$OUT/preload_logs.tgz" -C "$QLORA_ROOT" sweeps 2>/dev/null --exclude='*.db'
exit $rc
