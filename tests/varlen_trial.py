"""`python -m tests.varlen_trial [overrides]`: a whole trial with model.attn_implementation=varlen on a CPU, the
CUDA-only kernel replaced by tests.test_attention's reference; prints one line per call of the kernel wrapper
("varlen: <tokens> tokens in <n> sequences"), so a test can see trl's sequence boundaries reach the attention."""

from __future__ import annotations

import inspect
import runpy
import sys

from src import attention
from tests.test_attention import _new

attention.available = lambda: None
attention._kernel = lambda: (_new, set(inspect.signature(_new).parameters))
_run = attention._run


def _spy(q, k, v, cu, max_len, scale):  # noqa: ANN001, ANN202
    print(f"varlen: {q.shape[0]} tokens in {cu.numel() - 1} sequences", flush=True)
    return _run(q, k, v, cu, max_len, scale)


attention._run = _spy
sys.argv = ["src.train", *sys.argv[1:]]
runpy.run_module("src.train", run_name="__main__")
