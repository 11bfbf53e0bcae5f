"""A command run while nvidia-smi reads, every `--interval-s`, how much memory each process holds on the card: the most
it saw of each, beside what the command's trial recorded (its result.json), so a trial's device peak can be set
against the card's own figure (issue 47, finding 10: an OOM's device peak).

    python -m benchmarks.device_peak --out peak.json --result RUN/result.json -- src.train [overrides]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

MIB_PER_GIB = 1024


def sample(seen: dict[str, float], halt: threading.Event, interval_s: float) -> None:
    query = ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"]
    while not halt.is_set():
        done = subprocess.run(query, capture_output=True, text=True, check=False)
        for line in done.stdout.strip().splitlines():
            pid, _, used = (part.strip() for part in line.partition(","))
            if used.isdigit():
                seen[pid] = max(seen.get(pid, 0.0), int(used) / MIB_PER_GIB)
        halt.wait(interval_s)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.device_peak", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True, help="the JSON this writes")
    p.add_argument("--result", type=Path, default=None, help="the command's result.json, copied in")
    p.add_argument("--interval-s", type=float, default=0.05)
    p.add_argument("command", nargs="+", help="what `python -m` runs (after --)")
    args = p.parse_args(argv)
    seen: dict[str, float] = {}
    halt = threading.Event()
    reader = threading.Thread(target=sample, args=(seen, halt, args.interval_s), daemon=True)
    reader.start()
    started = time.time()
    rc = subprocess.run([sys.executable, "-m", *args.command], check=False).returncode
    halt.set()
    reader.join(timeout=5)
    record = {
        "exit_code": rc,
        "seconds": round(time.time() - started, 1),
        "interval_s": args.interval_s,
        "nvidia_smi_max_gib_by_pid": seen,
        "nvidia_smi_max_gib": max(seen.values(), default=None),
    }
    if args.result is not None and args.result.exists():
        record["result"] = json.loads(args.result.read_text())
    args.out.write_text(json.dumps(record, indent=2))
    print(json.dumps({k: v for k, v in record.items() if k != "result"}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
