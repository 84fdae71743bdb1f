#!/usr/bin/env bash
# Issue "several accelerators" on the two-GPU machine: the hand-off probe (per-array
# vs batched transfers), then two GPUs against one. Needs .whl/ (carried). Results: $OUT.
set -uo pipefail
source experiments/_gpu_setup.sh
cd experiments
timeout 120 python3 probe_handoff.py 2>&1 | grep -v "^I1\|^W1" | tee "$OUT/probe_handoff_2gpu.txt"
timeout 400 python3 bench_two_gpus.py --out "$OUT/two_gpus" --budget_s 330 \
  --profiles results/profile_2gpu_h200x2.json 2>&1 | grep -v "^I1\|^W1" | tail -30
