"""The card's dense bf16 matrix-multiply rate, measured (the denominator of MFU).

python -m benchmarks.matmul_rate   ->  one JSON line: {"bf16_tflops": ..., "n": 8192, "gpu": ...}

Best of several timed runs of an n x n x n bf16 product (2 n^3 FLOPs), after warm-up, with CUDA events.
"""

from __future__ import annotations

import json
import sys

import torch


def measure(n: int = 8192, repeats: int = 20, rounds: int = 5) -> float:
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(5):
        a @ b
    best = 0.0
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            a @ b
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1000 / repeats
        best = max(best, 2 * n**3 / seconds / 1e12)
    return best


def main() -> int:
    if not torch.cuda.is_available():
        print("error: the matmul rate needs a CUDA GPU", file=sys.stderr)
        return 2
    n = 8192
    print(json.dumps({"bf16_tflops": measure(n), "n": n, "gpu": torch.cuda.get_device_name(0)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
