"""A downloaded wheel rewritten without some of its files, under the same file name: the archive, its RECORD and
(optionally) a top-level package's line in top_level.txt lose them. The wheel folders carried to the GPU machine must
stay small (benchmarks/gpu_wheels.sh slims bitsandbytes' native libraries, benchmarks/unsloth_wheels.sh Unsloth's
web UI); both scripts call `drop`."""

from __future__ import annotations

import csv
import io
import os
import zipfile


def drop(whl: str, names: set[str], top_level: str | None = None) -> None:
    """Rewrite `whl` without the archive members `names` (and their RECORD rows); `top_level`: a package name to
    take out of top_level.txt too."""
    tmp = whl + ".tmp"
    with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if info.filename in names:
                continue
            data = zin.read(info.filename)
            if info.filename.endswith(".dist-info/RECORD"):
                rows = [r for r in csv.reader(io.StringIO(data.decode())) if r and r[0] not in names]
                buf = io.StringIO()
                csv.writer(buf, lineterminator="\n").writerows(rows)
                data = buf.getvalue().encode()
            elif top_level and info.filename.endswith(".dist-info/top_level.txt"):
                kept = [line for line in data.splitlines(keepends=True) if line.strip() != top_level.encode()]
                data = b"".join(kept)
            info.compress_type = zipfile.ZIP_DEFLATED
            zout.writestr(info, data)
    os.replace(tmp, whl)
