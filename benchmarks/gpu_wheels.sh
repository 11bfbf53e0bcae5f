#!/usr/bin/env bash
# gpu_wheels.sh -- fill .whl/ with the wheels the OFFLINE remote GPU machine lacks.
#
# The GPU machine (Python 3.12, x86_64 manylinux, torch 2.11 / CUDA 13,
# transformers 5.17, accelerate 1.15, numpy, pandas, pyarrow, huggingface_hub,
# pyyaml, requests, protobuf, click, anyio, h11, typing-extensions, zipp, ... see
# the device's KINDS.md "Python packages already there") cannot reach any
# package index.  This script downloads, on a machine that can, exactly one
# wheel per package that our trial process needs and that the GPU image lacks:
# bitsandbytes, trl, peft, datasets (+dill, multiprocess), hydra-core,
# omegaconf, antlr4-python3-runtime, optuna (+alembic, sqlalchemy, colorlog,
# Mako), mlflow-skinny (client only, with its declared dependencies so that the
# SQLite tracking store and model registry work), openpyxl (+et-xmlfile).
# Packages already on the GPU machine are NOT carried, except certifi, which
# databricks-sdk requires newer than the GPU image's (see PINS).
#
# Everything is fetched with --no-deps, so every dependency is named below.
# The bitsandbytes wheel is slimmed to the CUDA 13.0 and CPU native libraries
# (bitsandbytes falls back to the nearest same-major CUDA library, so cuda130
# also serves any CUDA 13.x runtime); the result must stay below 40 MiB.
#
# Usage (from the repo root; idempotent, re-running skips what is present):
#     bash benchmarks/gpu_wheels.sh
#
# On the GPU machine, install into a private target dir and put it on the path:
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
#         --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site
#
# .whl/ is git-ignored (line "/.whl/" in .git/info/exclude).
set -euo pipefail

cd "$(dirname "$0")/.."
WHL=.whl
mkdir -p "$WHL"
PY=${PYTHON:-python3}

# name==version, one line each; the version is pinned for reproducibility.
PINS=(
  # --- trial process: training stack ---
  bitsandbytes==0.50.2
  trl==1.16.0
  peft==0.21.2
  datasets==5.2.0
  liger-kernel==0.8.5                # trainer.use_liger_kernel: fused RMSNorm, SwiGLU, RoPE (Triton, on the GPU image)
  dill==0.4.1                        # datasets: dill<0.4.2
  multiprocess==0.70.19              # datasets: multiprocess<0.70.20 (py312 wheel)
  # --- config ---
  hydra-core==1.3.8
  omegaconf==2.3.1
  antlr4-python3-runtime==4.9.3      # sdist only on PyPI: built into a pure wheel below
  # --- optuna + its SQL storage ---
  optuna==5.1.0
  alembic==1.20.1
  sqlalchemy==2.1.9
  colorlog==6.12.0
  mako==1.4.3
  # --- mlflow client (skinny) and its declared dependencies ---
  mlflow-skinny==3.17.2
  cachetools==7.3.3
  databricks-sdk==0.167.0            # mlflow imports databricks.sdk at import time
  certifi==2026.10.19.post1          # NEWER than the GPU's certifi 2026.7.22: databricks-sdk
                                     # (every recent release) requires certifi>=2026.10.19
  google-auth==2.63.0
  pyasn1==0.6.5
  pyasn1-modules==0.4.2
  cryptography==50.0.2               # needed by mlflow's SQLite store path (tested)
  cffi==2.1.1
  pycparser==3.12
  fastapi==0.165.0
  starlette==1.10.0
  uvicorn==0.55.0
  gitpython==3.2.1
  gitdb==4.0.12
  smmap==5.0.3
  importlib-metadata==9.1.0
  opentelemetry-api==1.45.2
  opentelemetry-sdk==1.45.2
  opentelemetry-proto==1.45.2
  opentelemetry-semantic-conventions==0.66b2
  pydantic==2.14.4
  pydantic-core==2.50.5
  annotated-types==0.8.0
  typing-inspection==0.4.5
  python-dotenv==1.2.4
  sqlparse==0.6.1
  # --- reporting ---
  plotly==7.1.0                      # src.report's page (report.html); without it src.report cannot write
  narwhals==2.29.0                   # plotly: narwhals>=1.15.1
  openpyxl==3.1.5
  et-xmlfile==2.0.0
)

BASE_PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64
                manylinux2014_x86_64 manylinux1_x86_64)
EXTRA_PLATFORMS=(manylinux_2_24_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64
                 manylinux_2_35_x86_64)

plat_args() {
  local p
  for p in "$@"; do printf -- '--platform\n%s\n' "$p"; done
}

download() {  # download NAME==VERSION (binary wheel for cp312 / manylinux x86_64)
  local common=(-m pip download -q --no-deps --only-binary=:all: --python-version 3.12
                --implementation cp -d "$WHL")
  local base extra
  mapfile -t base < <(plat_args "${BASE_PLATFORMS[@]}")
  mapfile -t extra < <(plat_args "${BASE_PLATFORMS[@]}" "${EXTRA_PLATFORMS[@]}")
  "$PY" "${common[@]}" "${base[@]}" "$1" 2>/dev/null \
    || "$PY" "${common[@]}" "${extra[@]}" "$1"
}

build_sdist_wheel() {  # pure-python package published only as an sdist
  "$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$WHL" "$1"
}

shopt -s nullglob nocaseglob nocasematch
for spec in "${PINS[@]}"; do
  name=${spec%%==*}; ver=${spec##*==}
  norm=$(tr 'A-Z.-' 'a-z__' <<<"$name")   # wheel file names use the normalized name
  # keep exactly one version: drop wheels of this package with another version
  for f in "$WHL/$norm"-*.whl; do
    [[ $(basename "$f") == "$norm-$ver-"* ]] || { echo "removing stale $f"; rm -f "$f"; }
  done
  have=("$WHL/$norm-$ver-"*.whl)
  if (( ${#have[@]} )); then
    echo "have   $spec"
    continue
  fi
  echo "fetch  $spec"
  if [[ $name == antlr4-python3-runtime ]]; then
    build_sdist_wheel "$spec"
  else
    download "$spec"
  fi
  have=("$WHL/$norm-$ver-"*.whl)
  (( ${#have[@]} == 1 )) || { echo "ERROR: no single wheel for $spec in $WHL" >&2; exit 1; }
done
shopt -u nocaseglob nocasematch

# Slim bitsandbytes: keep only the CUDA 13.0 and CPU native libraries, drop the
# others from the archive and from RECORD, rewrite under the same file name.
"$PY" - "$WHL" <<'EOF'
import glob, os, sys, zipfile

from benchmarks import wheels

keep = {"libbitsandbytes_cuda130.so", "libbitsandbytes_cpu.so"}
(whl,) = glob.glob(os.path.join(sys.argv[1], "bitsandbytes-*.whl"))
with zipfile.ZipFile(whl) as zin:
    names = zin.namelist()
drop = {n for n in names if n.endswith(".so") and os.path.basename(n) not in keep}
missing = keep - {os.path.basename(n) for n in names}
if missing:
    sys.exit(f"ERROR: {whl} lacks {sorted(missing)}")
if not drop:
    print(f"slim   {os.path.basename(whl)} already slimmed")
    sys.exit(0)
wheels.drop(whl, drop)
print(f"slim   {os.path.basename(whl)}: dropped {len(drop)} native libraries")
EOF

# Report: one version per package, sizes, total (must stay below 40 MiB).
"$PY" - "$WHL" <<'EOF'
import collections, os, re, sys

d = sys.argv[1]
wheels = sorted(f for f in os.listdir(d) if f.endswith(".whl"))
by_name = collections.defaultdict(list)
total = 0
for f in wheels:
    by_name[re.sub(r"[-_.]+", "_", f.split("-")[0]).lower()].append(f)
    size = os.path.getsize(os.path.join(d, f))
    total += size
    print(f"{size / 1024:10.1f} KiB  {f}")
dups = {k: v for k, v in by_name.items() if len(v) > 1}
print(f"{len(wheels)} wheels, total {total / 2**20:.2f} MiB in {d}/")
if dups:
    sys.exit(f"ERROR: more than one version of {dups}")
if total >= 40 * 2**20:
    sys.exit("ERROR: total size is not below 40 MiB")
EOF
