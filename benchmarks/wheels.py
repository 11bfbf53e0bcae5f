"""The wheel folders carried to the GPU machine (benchmarks/gpu_wheels.sh fills them): a downloaded wheel rewritten
without some of its files, under the same file name (the archive, its RECORD and, optionally, a top-level package's
line in top_level.txt lose them), and each folder's size against what a device call carries (64 MiB in all).

    python -m benchmarks.wheels slim .whl            # bitsandbytes: only the CUDA 13.0 and CPU native libraries
    python -m benchmarks.wheels slim .whl_unsloth    # Unsloth: without studio/, its web UI (25 of its 28 MB)
    python -m benchmarks.wheels report .whl 40       # sizes, one version per package, below the limit in MiB
"""

from __future__ import annotations

import collections
import csv
import io
import os
import re
import sys
import zipfile
from pathlib import Path

KEEP_NATIVE = {"libbitsandbytes_cuda130.so", "libbitsandbytes_cpu.so"}  # cuda130 serves any CUDA 13.x runtime


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


def slim(folder: Path) -> None:
    """bitsandbytes without the native libraries of other CUDA versions (43 MB -> ~7), Unsloth without studio/."""
    for whl in folder.glob("bitsandbytes-*.whl"):
        names = zipfile.ZipFile(whl).namelist()
        missing = KEEP_NATIVE - {os.path.basename(n) for n in names}
        if missing:
            sys.exit(f"ERROR: {whl} lacks {sorted(missing)}")
        gone = {n for n in names if n.endswith(".so") and os.path.basename(n) not in KEEP_NATIVE}
        if not gone:
            continue  # slimmed before
        drop(str(whl), gone)
        print(f"slim   {whl.name}: dropped {len(gone)} native libraries")
    for whl in folder.glob("unsloth-2*.whl"):
        gone = {n for n in zipfile.ZipFile(whl).namelist() if n.startswith("studio/")}
        if not gone:
            continue
        drop(str(whl), gone, top_level="studio")
        print(f"slim   {whl.name}: dropped {len(gone)} files of studio/")


def report(folder: Path, limit_mib: float) -> None:
    """Each wheel's size and the folder's total; an error for two versions of a package or a folder past the limit."""
    sizes = {f.name: f.stat().st_size for f in sorted(folder.glob("*.whl"))}
    by_name = collections.defaultdict(list)
    for name, size in sizes.items():
        by_name[re.sub(r"[-_.]+", "_", name.split("-")[0]).lower()].append(name)
        print(f"{size / 1024:10.1f} KiB  {name}")
    total = sum(sizes.values()) / 2**20
    print(
        f"{len(sizes)} wheels, total {total:.2f} MiB in {folder}/ (limit {limit_mib:g} MiB; a device call carries 64)"
    )
    twice = {k: v for k, v in by_name.items() if len(v) > 1}
    if twice or total >= limit_mib:
        sys.exit(
            f"ERROR: more than one version of {twice}" if twice else f"ERROR: {folder}/ is not below {limit_mib:g} MiB"
        )


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(prog="python -m benchmarks.wheels", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("what", choices=["slim", "report"])
    p.add_argument("folder", type=Path)
    p.add_argument("limit_mib", type=float, nargs="?", default=40.0, help="report: the folder's limit (default 40)")
    args = p.parse_args()
    slim(args.folder) if args.what == "slim" else report(args.folder, args.limit_mib)
