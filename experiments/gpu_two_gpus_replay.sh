#!/usr/bin/env bash
# Two GPUs, after the planner learned to replay its schedule: the transformer
# at batch 256 (planner pipelines for M = 1..8, GPipe and 1F1B) and the
# too-large-for-one-GPU case (batch 16 under 0.6x the memory it needs).
set -uo pipefail
source experiments/_gpu_setup.sh
bash experiments/gpu_two_gpus_sweep.sh transformer 256 1,2,4,8 330 two_gpus_transformer_b256_replay
bash experiments/gpu_two_gpus_sweep.sh transformer 16 4 120 two_gpus_transformer_memory_replay \
  --memory_only --memory_fraction 0.6
