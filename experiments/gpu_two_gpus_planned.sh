#!/usr/bin/env bash
# Two GPUs, transformer batch 256: the planner's balanced pipelines (M = 4, 8,
# 1F1B) beside a repeat of one GPU, data parallel and the planner's own choice.
# Half/half split the layers by count and left the vocabulary head's stage twice
# as busy (two_gpus_transformer_b256_h200x2_timeline.png). Needs .whl/.
set -uo pipefail
source experiments/_gpu_setup.sh
cd experiments
timeout 330 python3 bench_two_gpus.py --out "$OUT/two_gpus_planned" --budget_s 270 --steps 10 \
  --model transformer --batch 256 --microbatches 4,8 --schedules 1f1b --nohalf \
  --profiles results/profile_2gpu_h200x2.json 2>&1 \
  | grep -v "^I1\|^W1" | grep "^| [a-z]\|^calibrated\|Error" | cut -c1-400
