#!/usr/bin/env bash
# unsloth_wheels.sh -- fill .whl_unsloth/ with what Unsloth needs on the OFFLINE GPU machine, beside .whl/.
#
# Unsloth 2026.10.9 pins trl<=1.15.0 and datasets<5, while this project runs trl 1.16 and datasets 5.2
# (gpu_wheels.sh). So Unsloth gets an environment of its own there: these wheels go into their own --target dir,
# put FIRST on PYTHONPATH, ahead of the project's /tmp/site (gpu_wheels.sh), so that `trl` and `datasets` resolve to
# Unsloth's pins while bitsandbytes 0.50.2, peft 0.21.2, pydantic and the rest come from /tmp/site, and torch 2.11
# (CUDA 13.0), transformers 5.17 (Unsloth allows <=5.17.0), accelerate, triton, torchvision, sentencepiece,
# sentence-transformers, typer, rich, einops, pillow, regex come from the GPU image (the device's KINDS.md list).
# Unsloth supports that torch exactly: its own extra `cu130-torch2110` is torch 2.11.0+cu130.
#
# Left out on purpose, with what Unsloth does without them (checked in its 2026.10.9 source):
#   xformers     a CUDA build of 100+ MB: too large to carry. Unsloth catches its ModuleNotFoundError and uses torch's
#                attention; for packed (padding-free) batches it prefers torch's varlen/SDPA kernels anyway
#                (unsloth/utils/attention_dispatch.py select_attention_backend).
#   torchao      fp8 and QAT only; every import is guarded (find_spec / try).
#   hf_transfer  Hub downloads only (find_spec); nothing is downloaded there.
#   diffusers    diffusion models only; not imported on the language-model path.
#   studio/      Unsloth's web UI: 25 of the wheel's 28 MB; a top-level package of its own that `unsloth` never
#                imports. Removed from the wheel (files and RECORD lines), rewritten under the same name.
#
# Usage (from the repo root; idempotent):   bash benchmarks/unsloth_wheels.sh
# On the GPU machine (benchmarks/speed_v6_h200.sh does this):
#     python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
#         --target /tmp/site_unsloth .whl_unsloth/*.whl
#     PYTHONPATH=/tmp/site_unsloth:/tmp/site python3 -c 'import unsloth'
#
# .whl_unsloth/ is git-ignored. What travels with a device call (the working tree, .whl and this) must stay under
# 64 MiB: this folder must stay below LIMIT_MIB (the project's .whl is ~37 MiB, the tree ~4 MiB).
set -euo pipefail

cd "$(dirname "$0")/.."
WHL=.whl_unsloth
LIMIT_MIB=${LIMIT_MIB:-20}
mkdir -p "$WHL"
PY=${PYTHON:-python3}

PINS=(
  unsloth==2026.10.9
  unsloth-zoo==2026.10.9
  trl==1.15.0                 # unsloth: trl<=1.15.0 (the project's is 1.16.0)
  datasets==4.8.5             # unsloth: datasets<5.0.0, not 4.0.*/4.1.0/4.4.*/4.5.0; trl 1.15: >=4.7.0
  cut-cross-entropy==25.1.1   # unsloth_zoo's fused linear + cross-entropy (loss_utils.py)
  tyro==1.0.17                # unsloth and unsloth_zoo import it
  docstring-parser==0.18.0    # tyro
  typeguard==4.6.1            # tyro
  msgspec==0.23.0             # unsloth_zoo
  json5==0.17.3               # unsloth
  nest-asyncio==1.6.0         # unsloth
  structlog==26.1.0           # unsloth
)
# datasets 4.8.5 also needs dill<0.4.2 and multiprocess<0.70.20: .whl's dill 0.4.1 and multiprocess 0.70.19 do.

PLATFORMS=(manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64
           manylinux2014_x86_64 manylinux1_x86_64)

download() {  # download NAME==VERSION: one wheel for cp312 / manylinux x86_64, no dependencies
  local args=(-m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d "$WHL")
  local p
  for p in "${PLATFORMS[@]}"; do args+=(--platform "$p"); done
  "$PY" "${args[@]}" "$1"
}

shopt -s nullglob nocaseglob nocasematch
for spec in "${PINS[@]}"; do
  name=${spec%%==*}; ver=${spec##*==}
  norm=$(tr 'A-Z.-' 'a-z__' <<<"$name")   # wheel file names use the normalized name
  for f in "$WHL/$norm"-*.whl; do
    [[ $(basename "$f") == "$norm-$ver-"* ]] || { echo "removing stale $f"; rm -f "$f"; }
  done
  have=("$WHL/$norm-$ver-"*.whl)
  if (( ${#have[@]} )); then echo "have   $spec"; continue; fi
  echo "fetch  $spec"
  download "$spec"
  have=("$WHL/$norm-$ver-"*.whl)
  (( ${#have[@]} == 1 )) || { echo "ERROR: no single wheel for $spec in $WHL" >&2; exit 1; }
done
shopt -u nocaseglob nocasematch

# Strip Unsloth's studio/ (its web UI) from the wheel, files and RECORD lines, under the same file name.
"$PY" - "$WHL" <<'EOF'
import glob, os, sys, zipfile

from benchmarks import wheels

(whl,) = glob.glob(os.path.join(sys.argv[1], "unsloth-2026*.whl"))
with zipfile.ZipFile(whl) as zin:
    drop = {n for n in zin.namelist() if n.startswith("studio/")}
if not drop:
    print(f"slim   {os.path.basename(whl)} already slimmed")
    sys.exit(0)
wheels.drop(whl, drop, top_level="studio")
print(f"slim   {os.path.basename(whl)}: dropped {len(drop)} files of studio/")
EOF

# Report: sizes, total against the limit, and with .whl beside it against the device call's 64 MiB.
"$PY" - "$WHL" "$LIMIT_MIB" <<'EOF'
import os, sys

d, limit = sys.argv[1], float(sys.argv[2])
size = lambda folder: sum(os.path.getsize(os.path.join(folder, f)) for f in os.listdir(folder) if f.endswith(".whl"))
for f in sorted(os.listdir(d)):
    if f.endswith(".whl"):
        print(f"{os.path.getsize(os.path.join(d, f)) / 1024:10.1f} KiB  {f}")
total = size(d) / 2**20
print(f"total {total:.2f} MiB in {d}/ (limit {limit:g} MiB)")
if os.path.isdir(".whl"):
    both = total + size(".whl") / 2**20
    print(f"with .whl/: {both:.2f} MiB of the 64 MiB a device call carries (the working tree comes on top)")
if total >= limit:
    sys.exit(f"ERROR: {d}/ is not below {limit:g} MiB")
EOF
