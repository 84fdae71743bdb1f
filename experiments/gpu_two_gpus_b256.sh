#!/usr/bin/env bash
# Two GPUs, the transformer at batch 256: one GPU, data parallel, the planner's
# choice on a table calibrated to the measured one-GPU step (it may replicate),
# half/half pipelines with M = 4, 8 under GPipe and 1F1B, and a per-GPU memory
# budget of 0.7x what the step needs (too large for one GPU). Needs .whl/.
set -uo pipefail
source experiments/_gpu_setup.sh
cd experiments
timeout 560 python3 bench_two_gpus.py --out "$OUT/two_gpus_b256" --budget_s 440 --steps 10 \
  --model transformer --batch 256 --microbatches 4,8 --schedules gpipe,1f1b \
  --memory_fraction 0.7 --profiles results/profile_2gpu_h200x2.json 2>&1 \
  | grep -v "^I1\|^W1" | grep "^| [a-z]\|^calibrated\|Error\|error" | cut -c1-400
