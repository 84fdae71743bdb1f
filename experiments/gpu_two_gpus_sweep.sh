#!/usr/bin/env bash
# Two GPUs: one model's sweep of the planner's pipelines over M and schedules,
# beside one GPU's jax.jit and data parallelism, with replayed predictions.
# Usage: bash experiments/gpu_two_gpus_sweep.sh MODEL BATCH MICROBATCHES BUDGET_S NAME [flags]
# e.g.   bash experiments/gpu_two_gpus_sweep.sh vgg16 128 1,2,4,8,16 300 two_gpus_vgg16_b128
# Needs .whl/ (pulp) and experiments/_gpu_setup.sh sourced first.
set -uo pipefail
model=$1 batch=$2 mbs=$3 budget=$4 name=$5
shift 5
cd experiments
timeout $((budget + 90)) python3 bench_two_gpus.py --out "$OUT/$name" --budget_s "$budget" \
  --steps 10 --model "$model" --batch "$batch" --microbatches "$mbs" --schedules gpipe,1f1b \
  --nohalf --profiles results/profile_2gpu_h200x2.json "$@" 2>&1 \
  | grep -v "^I1\|^W1" | grep "^| [a-z]\|^calibrated\|Error\|error" | cut -c1-300
cd ..
