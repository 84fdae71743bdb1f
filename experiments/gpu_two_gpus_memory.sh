#!/usr/bin/env bash
# Two GPUs: the transformer too large for one GPU. A per-GPU memory budget of
# 0.6x what the step needs at batch 16 (5.5 GB): one GPU cannot run, nor can a
# data-parallel replica (full state + half the activations, 3.7 GB); hetpar's
# planner pipelines it over both GPUs (M = 4, 1F1B). Needs .whl/.
set -uo pipefail
source experiments/_gpu_setup.sh
cd experiments
timeout 300 python3 bench_two_gpus.py --out "$OUT/two_gpus_memory" --budget_s 250 --steps 10 \
  --model transformer --batch 16 --microbatches 4 --schedules 1f1b --memory_only \
  --memory_fraction 0.6 --profiles results/profile_2gpu_h200x2.json 2>&1 \
  | grep -v "^I1\|^W1" | grep "^| [a-z]\|Error\|error" | cut -c1-600
