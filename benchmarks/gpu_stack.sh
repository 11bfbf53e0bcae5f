# Sourced by the device scripts (from the repo root): the stack as wheels where the GPU machine lacks it
# (benchmarks/gpu_wheels.sh fills .whl/), and the paths and switches every trial there runs with.
if [ -d .whl ] && ! python3 -c "import trl, optuna, bitsandbytes, hydra" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site
fi
export QLORA_ROOT=${QLORA_ROOT:-/tmp/qlora} QLORA_CACHE=${QLORA_CACHE:-/tmp/qlora-cache} PYTHONUNBUFFERED=1 USE_JAX=0 USE_TF=0
