# Sourced on the GPU machine from the repo root, before `python -m benchmarks run ...`: the stack as wheels where the
# image lacks it (carry .whl, filled here by benchmarks/gpu_wheels.sh), once per warm machine, and the paths and
# switches every trial there runs with (the model cache outlives a benchmark's own QLORA_ROOT).
if [ -d .whl ] && ! python3 -c "import trl, optuna, bitsandbytes, hydra" 2>/dev/null; then
  [ -d /tmp/site/trl ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site
fi
export QLORA_ROOT=${QLORA_ROOT:-/tmp/qlora} QLORA_CACHE=${QLORA_CACHE:-/tmp/qlora-cache} PYTHONUNBUFFERED=1 USE_JAX=0 USE_TF=0
