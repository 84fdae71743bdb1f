#!/usr/bin/env bash
# Two GPUs: is the microbatched pipeline launch-bound? Each run adds "one GPU,
# whole step at batch/M, xM" beside hetpar's M-microbatch pipeline. Needs .whl/.
set -uo pipefail
source experiments/_gpu_setup.sh
cd experiments
run() {  # out budget args...
  local out=$1 budget=$2; shift 2
  timeout $((budget + 45)) python3 bench_two_gpus.py --out "$OUT/$out" --budget_s "$budget" \
    --steps 10 --noplanner "$@" 2>&1 | grep "^| [a-z]"
}
run two_gpus_transformer_b32_m16 45 --model transformer --batch 32 --microbatches 16 --schedules gpipe
run two_gpus_alexnet_b128 45 --model alexnet --batch 128 --microbatches 1,4 --schedules gpipe
run two_gpus_transformer_b128 60 --model transformer --batch 128 --microbatches 1,4 --schedules gpipe,1f1b
