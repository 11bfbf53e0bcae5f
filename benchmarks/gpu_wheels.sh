#!/usr/bin/env bash
# gpu_wheels.sh -- fill .whl/ with the wheels the OFFLINE GPU machine lacks; `unsloth`: .whl_unsloth/ for the peers.
#
# The GPU machine (Python 3.12, manylinux x86_64, torch 2.11 / CUDA 13, transformers 5.17, accelerate 1.15, numpy,
# pandas, pyarrow, huggingface_hub, pyyaml, requests, protobuf, ...: the device's KINDS.md) reaches no package index.
# This downloads, here, exactly one wheel per package the trial process needs and the image lacks, each with
# --no-deps (so every dependency is named below), pinned. bitsandbytes is slimmed to its CUDA 13.0 and CPU native
# libraries; the folder must stay below 40 MiB. certifi is the one package the image has that is carried: databricks-sdk
# needs it newer.
#
# `unsloth`: Unsloth 2026.10.9 pins trl<=1.15.0 and datasets<5 (the project runs trl 1.16, datasets 5.2), so it gets
# an environment of its own there (benchmarks/peer_arm.py --wheels: installed into its own --target, first on the path,
# ahead of the project's; bitsandbytes, peft, pydantic come from .whl, torch/transformers/triton/... from the image).
# Left out, with what Unsloth does without them (its 2026.10.9 source): xformers (100+ MB; it falls back to torch's
# attention), torchao (fp8/QAT only, guarded imports), hf_transfer (Hub downloads), diffusers, and studio/ (its web UI,
# 25 of the wheel's 28 MB, never imported: removed from the wheel). Below 20 MiB.
#
#   bash benchmarks/gpu_wheels.sh [unsloth]        (from the repo root; idempotent: what is present is kept)
# On the GPU machine: source benchmarks/gpu_stack.sh (installs .whl into /tmp/site, on PYTHONPATH).
# .whl/ and .whl_unsloth/ are git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

PROJECT=(
  bitsandbytes==0.50.2 trl==1.16.0 peft==0.21.2 datasets==5.2.0
  liger-kernel==0.8.5                # trainer.use_liger_kernel (Triton is on the GPU image)
  dill==0.4.1 multiprocess==0.70.19  # datasets: dill<0.4.2, multiprocess<0.70.20 (py312 wheel)
  hydra-core==1.3.8 omegaconf==2.3.1
  antlr4-python3-runtime==4.9.3      # sdist only on PyPI: built into a pure wheel below
  optuna==5.1.0 alembic==1.20.1 sqlalchemy==2.1.9 colorlog==6.12.0 mako==1.4.3
  # mlflow's client (skinny) and its declared dependencies, so that the SQLite store and the registry work
  mlflow-skinny==3.17.2 cachetools==7.3.3 databricks-sdk==0.167.0 certifi==2026.10.19.post1 google-auth==2.63.0
  pyasn1==0.6.5 pyasn1-modules==0.4.2 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 fastapi==0.165.0
  starlette==1.10.0 uvicorn==0.55.0 gitpython==3.2.1 gitdb==4.0.12 smmap==5.0.3 importlib-metadata==9.1.0
  opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-proto==1.45.2
  opentelemetry-semantic-conventions==0.66b2 pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0
  typing-inspection==0.4.5 python-dotenv==1.2.4 sqlparse==0.6.1
  plotly==7.1.0 narwhals==2.29.0     # src.report's page (report.html)
  openpyxl==3.1.5 et-xmlfile==2.0.0
)
UNSLOTH=(
  unsloth==2026.10.9 unsloth-zoo==2026.10.9
  trl==1.15.0                        # unsloth: trl<=1.15.0
  datasets==4.8.5                    # unsloth: datasets<5.0.0; .whl's dill and multiprocess serve it too
  cut-cross-entropy==25.1.1 tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 msgspec==0.23.0 json5==0.17.3
  nest-asyncio==1.6.0 structlog==26.1.0
)
if [ "${1:-}" = unsloth ]; then WHL=.whl_unsloth PINS=("${UNSLOTH[@]}") LIMIT=20; else WHL=.whl PINS=("${PROJECT[@]}") LIMIT=40; fi
mkdir -p "$WHL"
BASE=() NEWER=()  # older glibc tags first: a wheel for a newer glibc only where a package has no other
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux1; do BASE+=(--platform "${p}_x86_64"); done
for p in manylinux_2_31 manylinux_2_34 manylinux_2_35; do NEWER+=(--platform "${p}_x86_64"); done

shopt -s nullglob nocaseglob nocasematch
for spec in "${PINS[@]}"; do
  name=${spec%%==*}; ver=${spec##*==}
  norm=$(tr 'A-Z.-' 'a-z__' <<<"$name")   # wheel file names use the normalized name
  for f in "$WHL/$norm"-*.whl; do          # one version: a wheel of another is stale
    [[ $(basename "$f") == "$norm-$ver-"* ]] || { echo "removing stale $f"; rm -f "$f"; }
  done
  have=("$WHL/$norm-$ver-"*.whl)
  if (( ${#have[@]} )); then echo "have   $spec"; continue; fi
  echo "fetch  $spec"
  if [[ $name == antlr4-python3-runtime ]]; then
    "$PY" -m pip wheel -q --no-deps --no-binary=:all: -w "$WHL" "$spec"
  else
    get=("$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp -d "$WHL")
    "${get[@]}" "${BASE[@]}" "$spec" 2>/dev/null || "${get[@]}" "${BASE[@]}" "${NEWER[@]}" "$spec"
  fi
  have=("$WHL/$norm-$ver-"*.whl)
  (( ${#have[@]} == 1 )) || { echo "ERROR: no single wheel for $spec in $WHL" >&2; exit 1; }
done
shopt -u nocaseglob nocasematch
"$PY" -m benchmarks.wheels slim "$WHL"
"$PY" -m benchmarks.wheels report "$WHL" "$LIMIT"
