"""The wheel folders carried to the GPU machine are slimmed by rewriting wheels without some of their files
(benchmarks/wheels.py, called by benchmarks/gpu_wheels.sh for .whl and .whl_unsloth): the archive, its RECORD and
top_level.txt lose them, and the rest is kept byte for byte; bitsandbytes keeps only the CUDA 13.0 and CPU libraries."""

from __future__ import annotations

import zipfile
from pathlib import Path

from benchmarks import wheels


def test_a_slimmed_wheel_loses_the_files_and_their_record_rows_and_keeps_the_rest(tmp_path: Path) -> None:
    whl = tmp_path / "pkg-1.0-py3-none-any.whl"
    record = (
        "pkg/__init__.py,sha256=a,1\nstudio/app.py,sha256=b,2\nstudio/ui.js,sha256=c,3\npkg-1.0.dist-info/RECORD,,\n"
    )
    files = {
        "pkg/__init__.py": b"x = 1\n",
        "studio/app.py": b"app\n",
        "studio/ui.js": b"ui\n",
        "pkg-1.0.dist-info/top_level.txt": b"pkg\nstudio\n",
        "pkg-1.0.dist-info/RECORD": record.encode(),
    }
    with zipfile.ZipFile(whl, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)

    wheels.drop(str(whl), {"studio/app.py", "studio/ui.js"}, top_level="studio")

    with zipfile.ZipFile(whl) as z:
        assert z.namelist() == ["pkg/__init__.py", "pkg-1.0.dist-info/top_level.txt", "pkg-1.0.dist-info/RECORD"]
        assert z.read("pkg/__init__.py") == b"x = 1\n"
        assert z.read("pkg-1.0.dist-info/top_level.txt") == b"pkg\n"
        assert z.read("pkg-1.0.dist-info/RECORD") == b"pkg/__init__.py,sha256=a,1\npkg-1.0.dist-info/RECORD,,\n"
        assert z.testzip() is None
    assert not (tmp_path / f"{whl.name}.tmp").exists()


def test_bitsandbytes_keeps_only_its_cuda_13_and_cpu_libraries_once(tmp_path: Path) -> None:
    whl = tmp_path / "bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl"
    libs = ["libbitsandbytes_cuda121.so", "libbitsandbytes_cuda130.so", "libbitsandbytes_cpu.so"]
    with zipfile.ZipFile(whl, "w") as z:
        for lib in libs:
            z.writestr(f"bitsandbytes/{lib}", b"so")
        z.writestr("bitsandbytes-0.50.2.dist-info/RECORD", "".join(f"bitsandbytes/{lib},sha256=x,2\n" for lib in libs))
    wheels.slim(tmp_path)
    kept = zipfile.ZipFile(whl).namelist()
    assert kept == ["bitsandbytes/libbitsandbytes_cuda130.so", "bitsandbytes/libbitsandbytes_cpu.so",
                    "bitsandbytes-0.50.2.dist-info/RECORD"]  # fmt: skip
    before = whl.read_bytes()
    wheels.slim(tmp_path)
    assert whl.read_bytes() == before, "slimmed once: a second run leaves it as it is"
