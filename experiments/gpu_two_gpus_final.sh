#!/usr/bin/env bash
# Two GPUs, the transformer at batch 256 with the final calibration: fixed part
# from gradient-only steps, the peer link measured at pipeline sizes
# (probe_peer.py -> profile_2gpu_h200x2_peer.json); planner pipelines M = 2, 4, 8 (1F1B).
set -uo pipefail
source experiments/_gpu_setup.sh
cd experiments
timeout 230 python3 bench_two_gpus.py --out "$OUT/two_gpus_transformer_b256_final" --budget_s 150 \
  --steps 10 --model transformer --batch 256 --microbatches 2,4,8 --schedules 1f1b --nohalf \
  --nochoice --profiles results/profile_2gpu_h200x2_peer.json 2>&1 \
  | grep -v "^I1\|^W1" | grep "^| [a-z]\|^calibrated\|Error\|error" | cut -c1-300
