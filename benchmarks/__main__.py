"""python -m benchmarks: the one entry point of every benchmark (benchmarks/harness.py, benchmarks/README.md)."""

import sys

from benchmarks.harness import main

sys.exit(main())
