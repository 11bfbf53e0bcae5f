#!/usr/bin/env bash
# The user's recipe (eager, no checkpointing, batch 1 x accumulation 2, 1024 tokens) on a 24 GiB card under each
# allocator: the default one (as a plain script runs it; it OOMed at step 1 there, README) and expandable segments
# (the default since 0.10, whose cache is given back when the card presses). One trial each, one after the other,
# alone on the card, 3 steps; each trial's result.json comes back as recipe_<allocator>.json in $OUT.
#   device run: bash benchmarks/recipe_allocator_h200.sh     (carry .whl; see benchmarks/gpu_wheels.sh)
#   then here:  copy <files_at>/recipe_*.json to benchmarks/results/recipe_allocator_<card>/
set -uo pipefail
cd "$(dirname "$0")/.."
source benchmarks/gpu_stack.sh  # the stack as wheels, QLORA_ROOT, QLORA_CACHE
OUT=${OUT:-$QLORA_ROOT/out}
mkdir -p "$OUT"
python3 -m src.models model=llama3_8b_synthetic || exit 4
for expandable in false true; do
  dir=$QLORA_ROOT/recipe_allocator/$expandable
  python3 -m src.train model=llama3_8b_synthetic data=clinical_notes hardware.vram_budget_gib=24 \
    hardware.expandable_segments=$expandable trainer.max_steps=3 preflight.max_truncated_answer_frac=1.0 "hydra.run.dir=$dir" > "$OUT/recipe_$expandable.log" 2>&1
  name=$([ "$expandable" = true ] && echo expandable_segments || echo default)
  cp "$dir/result.json" "$OUT/recipe_$name.json" 2>/dev/null
  python3 -c "import json,sys; r=json.load(open(sys.argv[1])); m=r.get('metrics',{}); print(sys.argv[2], r.get('status'), \
(r.get('failure') or {}).get('kind'), (r.get('failure') or {}).get('step'), m.get('peak_vram_reserved_gib'), \
m.get('peak_vram_allocated_gib'), m.get('oom_request_gib'))" "$dir/result.json" "$name" 2>/dev/null || tail -5 "$OUT/recipe_$expandable.log"
done
