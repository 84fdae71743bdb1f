#!/usr/bin/env bash
# Next GPU session's checks for issues 6 and 7 (written when device time ran
# out; not yet run). One-GPU machine (H200 host, to compare with run 3):
#   bash experiments/gpu_next.sh one
# Two-GPU machine:
#   bash experiments/gpu_next.sh two
# Needs the pulp wheel in .whl/ (carried). Results go to $OUT.
set -uo pipefail
source experiments/_gpu_setup.sh
cd experiments
if [ "${1:-one}" = one ]; then
  # jit-first one-device path against jax.jit, interleaved (goal <= 1.03).
  timeout 150 python3 probe_overhead.py 2>&1 | grep -v "^I1\|^W1" | tee "$OUT/probe_overhead.txt"
  # The missing VGG16 row, and lm_embed/cnn_preprocess under the new spec-sheet link
  # latency (no --profiles: what hetpar.auto sees by default).
  timeout 300 python3 bench_baselines.py --out "$OUT/baselines_vgg16" --models vgg16 \
    --memory_model "" --profiles results/profile_gpu_h200.json 2>&1 | tail -3
  timeout 120 python3 bench_baselines.py --out "$OUT/baselines_spec" \
    --models lm_embed,cnn_preprocess --memory_model "" 2>&1 | tail -3
else
  # Launch-bound microbatches: bigger batches, few microbatches.
  timeout 280 python3 bench_two_gpus.py --out "$OUT/two_gpus_b256" --budget_s 230 --steps 10 \
    --noplanner --model transformer --batch 256 --microbatches 1,2,4 --schedules 1f1b \
    2>&1 | grep "^| [a-z]"
fi
