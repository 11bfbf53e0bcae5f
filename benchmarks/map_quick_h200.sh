#!/usr/bin/env bash
# benchmarks/map_quick_h200.py `run` (the cheaper speed map, issue 31) as one run that may outlive a device call,
# through memory_h200.sh (a session of its own, waits up to WAIT seconds; `... collect`, the next call on the same
# still-warm machine, waits for the rest). What it wrote comes back through $OUT.
#   device run (carry .whl, see gpu_wheels.sh):  WAIT=560 bash benchmarks/map_quick_h200.sh --slots N
#   then, at once:                               WAIT=560 bash benchmarks/map_quick_h200.sh collect
#   here, after:  python -m benchmarks.map_quick_h200 summarize <files_at>/map_quick_raw.json
MODULE=benchmarks.map_quick_h200 COPY=/tmp/map_quick_run COLLECT='map_quick_raw.json' \
  LOGS='logs sweeps/*/sweep.log' exec bash "$(dirname "$0")/memory_h200.sh" "$@"
